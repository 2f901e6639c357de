"""The KV-connector interface: vLLM V1's ``KVConnectorBase_V1``
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``, vLLM 0.33.0), in the course's terms.

A *connector* moves K/V between this engine's paged GPU pool and somewhere else: a CPU tier
(:mod:`course_lib.engine.cpu_offload`), another engine's pool (prefill/decode
disaggregation), a remote store. vLLM splits every connector into two roles that run in
different processes and talk only through a piece of plain data per step:

* **Scheduler side** (``KVConnectorRole.SCHEDULER``), called by the V1 scheduler (its
  contract is :class:`~course_lib.scheduler.kv_connector.KVConnectorScheduler`, in the scheduler
  layer, which imports no torch; :class:`KVConnectorBase_V1` extends it):

  1. :meth:`~KVConnectorBase_V1.get_num_new_matched_tokens` once a waiting request's *local*
     prefix-cache hit is known: how many more tokens the connector can supply, and whether
     they arrive asynchronously (the request then waits in ``WAITING_FOR_REMOTE_KVS``);
  2. :meth:`~KVConnectorBase_V1.update_state_after_alloc` once blocks were allocated for
     them: the connector learns which GPU blocks to fill;
  3. :meth:`~KVConnectorBase_V1.build_connector_meta` at the end of ``schedule()``: this
     step's transfers, as plain data, carried by the
     :class:`~course_lib.scheduler.output.SchedulerOutput` (``kv_connector_metadata``);
  4. :meth:`~KVConnectorBase_V1.request_finished` when a request finishes, before its
     blocks are freed: ``True`` keeps them until the worker reports the transfer done.

* **Worker side** (``KVConnectorRole.WORKER``), called by the model runner around the
  forward. vLLM 0.33.0's order (``ActiveKVConnector.pre_forward`` / ``post_forward`` in
  ``vllm/v1/worker/gpu/kv_connector.py``; ``_get_kv_connector_output`` in
  ``vllm/v1/worker/kv_connector_model_runner_mixin.py`` for the older runner, whose
  ``gpu_model_runner.py`` calls ``handle_preemptions`` itself):

  1. ``handle_preemptions`` (the blocks of preempted requests, before they are overwritten);
  2. :meth:`~KVConnectorBase_V1.bind_connector_metadata`;
  3. :meth:`~KVConnectorBase_V1.start_load_kv`, before the forward only if the step has
     synchronous loads (``SchedulerOutput.has_sync_kv_loads``), otherwise right after the
     forward is launched (its submission cost off the critical path);
  4. inside each attention layer, :meth:`~KVConnectorBase_V1.wait_for_layer_load` (before the
     layer's attention reads its cache) and :meth:`~KVConnectorBase_V1.save_kv_layer` (after
     it wrote it);
  5. :meth:`~KVConnectorBase_V1.wait_for_save`;
  6. :meth:`~KVConnectorBase_V1.get_finished` (through ``get_transfer_results``: the requests
     whose asynchronous loads or saves completed), then
     :meth:`~KVConnectorBase_V1.get_block_ids_with_load_errors`;
  7. :meth:`~KVConnectorBase_V1.clear_connector_metadata`, last.

  What 6 reports goes back with the runner's output, and the scheduler applies it
  (``_update_from_kv_xfer_finished``; here ``SchedulerV1.update_from_kv_xfer_finished``).

What the course changes, and why:

* **One object plays both roles.** The course runs scheduler and runner in one process, so
  one connector instance is handed to both (vLLM builds two, one per role, and only the
  metadata crosses). The discipline is kept: the worker side reads only the metadata bound
  for the step, never the scheduler side's fields.
* **Requests are sequences.** vLLM passes a ``Request`` and string request ids; a V1
  request here is one :class:`~course_lib.sequence.Sequence`, named by its ``seq_id``.
* **The worker side's order.** The course's engine binds the metadata, runs the forward
  (``ModelRunner.execute_model``: ``start_load_kv`` and every layer's
  ``wait_for_layer_load`` before it, every ``save_kv_layer`` and ``wait_for_save`` after it),
  clears the metadata, applies the step's samples (``SchedulerV1.update``), and only then asks
  :meth:`~KVConnectorBase_V1.get_finished` and
  :meth:`~KVConnectorBase_V1.get_block_ids_with_load_errors` (``LLMEngine._step``): vLLM asks
  those two before ``clear_connector_metadata``. No answer changes: neither call reads the
  metadata. ``start_load_kv`` always comes before the forward (the copies run inside the
  step, never beside it), and there is no ``handle_preemptions``: the course's connectors copy
  a step's stores within that step, so no block is reused before it is saved.
* **Layers by index.** vLLM names layers (``"model.layers.0.self_attn.attn"``); the course's
  tiny Llama has a list of layers and one ``(key_cache, value_cache)`` pair per layer, so a
  layer is its index. vLLM calls ``wait_for_layer_load`` / ``save_kv_layer`` from inside
  each attention layer (``vllm/model_executor/layers/attention/kv_transfer_utils.py``); the
  course's model runs its layers inside one call, so
  :class:`~course_lib.engine.model_runner.ModelRunner` calls every layer's
  ``wait_for_layer_load`` before the forward and every ``save_kv_layer`` after it: the same
  contract (a layer's loads land before its attention reads, its saves read what its
  attention wrote), without the overlap of transfers with compute.
* **Recovery forgets.** A step that fails is recovered by recompute
  (``course_lib/engine/recovery.py``): the engine throws away all KV bookkeeping, calls
  :meth:`~KVConnectorBase_V1.reset_cache` (vLLM's name; the contract is on
  :meth:`~course_lib.scheduler.kv_connector.KVConnectorScheduler.reset_cache`) and builds a new
  scheduler over the same connector. A connector therefore holds no undo code: whatever a
  failed step left in it, the reset forgets, and the requests are computed again. The KV
  tensors (:meth:`~KVConnectorBase_V1.register_kv_caches`) stay registered.
"""

from __future__ import annotations

import enum
from abc import abstractmethod
from typing import TYPE_CHECKING, Any

from ..scheduler.kv_connector import KVConnectorScheduler
from ..scheduler.output import KVConnectorMetadata

if TYPE_CHECKING:
    from ..model.attention import AttentionMetadata
    from ..model.llama import KVCache


class KVConnectorRole(enum.Enum):
    """Which side of a connector an instance plays (vLLM's enum). The course hands one
    instance both roles (module docstring)."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorBase_V1(KVConnectorScheduler):  # noqa: N801  (vLLM's name)
    """vLLM V1's connector interface (module docstring): the scheduler side
    (:class:`~course_lib.scheduler.kv_connector.KVConnectorScheduler`: it lives in the
    scheduler layer, which imports no torch) and the worker side below. Subclasses implement
    the abstract methods; the defaults are ``base.py``'s (nothing asynchronous or delayed)."""

    def __init__(self, role: KVConnectorRole = KVConnectorRole.SCHEDULER) -> None:
        super().__init__()
        self._role = role
        self._connector_metadata: KVConnectorMetadata | None = None
        self.kv_caches: list[KVCache] = []

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    def register_kv_caches(self, kv_caches: list[KVCache]) -> None:
        """The runner's paged caches, one ``(key_cache, value_cache)`` per layer (vLLM's
        ``register_kv_caches``, a dict by layer name there). Called once, by the engine the
        connector serves: a connector serves one engine (``LLMEngine`` refuses a connector
        whose caches are registered, before it builds anything)."""
        assert not self.kv_caches, "a connector serves one engine"
        self.kv_caches = kv_caches

    def check_kv_transfer_params(self, kv_transfer_params: dict) -> dict:
        """A request's ``kv_transfer_params`` (a dict), checked at the engine's door
        (``LLMEngine.add_request``) field by field for the role this connector plays, before
        the request is queued; returns the copy the engine keeps (values converted to the
        plain types the connector computes with). ``ValueError`` names the field: a field the
        connector reads only in a step would otherwise fail that step, and every step after
        it (a recovery recomputes the request with the same parameters). The default reads no
        field and takes any dict."""
        return dict(kv_transfer_params)

    # --------------------------------------------------------------- worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's metadata, before the forward (vLLM's name)."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """After the forward: the metadata is the step's alone."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError("the connector has no metadata bound: the engine binds the "
                               "step's SchedulerOutput.kv_connector_metadata before the forward")
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Start the loads the bound metadata asks for (before the forward)."""

    @abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Return once ``layer``'s loads are in the paged cache (before its attention)."""

    @abstractmethod
    def save_kv_layer(self, layer: int, kv_layer: KVCache, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Start saving ``layer``'s blocks the metadata names (after its attention wrote
        them)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Once per step, after the forward: the saves are submitted; a synchronous
        connector returns once they are done."""

    def get_finished(self, finished_req_ids: set[int]
                     ) -> tuple[set[int] | None, set[int] | None]:
        """(seq ids done sending/saving, seq ids done receiving/loading) since the last call,
        for the asynchronous transfers: the sending ones among those whose
        :meth:`request_finished` returned True (``finished_req_ids``: the seqs that finished
        in this step)."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks whose asynchronous load failed since the last call (vLLM's name): the
        scheduler computes their tokens again (``SchedulerV1.update_from_kv_xfer_finished``).
        Called once per step, after :meth:`get_finished`."""
        return set()

    def reset_cache(self) -> None:
        """The scheduler side's contract
        (:meth:`~course_lib.scheduler.kv_connector.KVConnectorScheduler.reset_cache`); here,
        the metadata a failed step may have left bound. A connector with more state extends
        it (and calls this one)."""
        self._connector_metadata = None

