"""The scheduler side of a KV connector: the part of vLLM V1's ``KVConnectorBase_V1``
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``, role ``SCHEDULER``) that
:class:`~course_lib.scheduler.v1.SchedulerV1` calls, and the per-step metadata it hands on.

Why it lives here, apart from the worker side (``course_lib/engine/kv_connector.py``, where
the whole interface and its story are): the scheduler layer imports nothing above it and no
torch (``tests/test_layers.py``), as vLLM's scheduler process holds no tensors; the worker side
touches the KV-cache tensors. A connector is one class deriving from
:class:`~course_lib.engine.kv_connector.KVConnectorBase_V1`, which extends this one.

The calls, in the order one ``schedule()`` makes them:

1. :meth:`KVConnectorScheduler.get_num_new_matched_tokens`, once a waiting sequence's local
   prefix hit is known;
2. :meth:`KVConnectorScheduler.update_state_after_alloc`, once its blocks are allocated;
3. :meth:`KVConnectorScheduler.build_connector_meta`, at the end: the step's transfers, as
   plain data (:class:`~course_lib.scheduler.output.KVConnectorMetadata`), carried by
   ``SchedulerOutput``;
4. :meth:`KVConnectorScheduler.request_finished`, when a sequence finishes, before its
   blocks are freed.

And one call outside any step: :meth:`KVConnectorScheduler.reset_cache`, when the engine
recovers from a failed step (``course_lib/engine/recovery.py``): it throws away all KV
bookkeeping and builds a new scheduler, whose constructor binds the connector to its new
manager (:meth:`KVConnectorScheduler.bind_kv_cache_manager`, a second time).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..memory.v1.kv_cache_manager import KVCacheManager
    from ..sequence import Sequence
    from .output import KVConnectorMetadata, SchedulerOutput


class KVConnectorScheduler(ABC):
    """The scheduler side of vLLM's ``KVConnectorBase_V1`` (module docstring). A V1 request is
    one :class:`~course_lib.sequence.Sequence` here, named by its ``seq_id``."""

    def __init__(self) -> None:
        self.kv_cache_manager: KVCacheManager | None = None

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """The scheduler's manager (vLLM's ``bind_kv_cache_manager``): the scheduler side reads
        its block hashes. Called by each ``SchedulerV1`` built over the connector: once, and
        again after every :meth:`reset_cache` (the recovery's new scheduler, new manager)."""
        self.kv_cache_manager = kv_cache_manager

    # ------------------------------------------------------------------- the calls
    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens of ``seq`` past its ``num_computed_tokens`` local hit that the connector can
        supply, and whether they load asynchronously (between steps; ``False`` when 0); full
        blocks only. It may reach the whole prompt, as vLLM 0.33.0's NIXL decode side and
        offloading connector may: the scheduler then computes the last token again, for the
        logits. ``None``: not known yet, ask again next step (this sequence alone waits)."""

    @abstractmethod
    def update_state_after_alloc(self, seq: Sequence, block_ids: SequenceABC[int],
                                 num_external_tokens: int) -> None:
        """Blocks were allocated for ``seq`` (``block_ids``: its whole table); the
        ``num_external_tokens`` after its local hit are the connector's to load (0: none)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's transfers, as plain data for the worker side; resets the connector's
        per-step state. Must not change ``scheduler_output``."""

    def request_finished(self, seq: Sequence, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """``seq`` finished, its blocks not yet freed; called once for every finished
        sequence, with ``block_ids == []`` for one that never held blocks (aborted while
        waiting: vLLM's ``_free_request`` tells the connector about every request).
        ``(True, ...)``: a transfer still reads them; the scheduler keeps them until the
        worker side's ``get_finished`` names ``seq`` as done sending. The dict: transfer
        parameters for the request's output."""
        return False, None

    # ------------------------------------------------------------------ recovery
    def reset_cache(self) -> None:
        """Forget every request and every transfer: the engine's recovery after a failed step
        (``course_lib/engine/recovery.py``) throws away the scheduler, its manager and its
        blocks, and recomputes every unfinished request from its prompt and committed tokens.
        vLLM 0.33.0's name and place: ``KVConnectorBase_V1.reset_cache`` in
        ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``, called by
        ``Scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)``
        (``vllm/v1/core/sched/scheduler.py``), which preempts every running request to the
        waiting queue and resets the prefix cache, as the recovery does. (vLLM's returns
        ``False`` when it cannot reset; the course's always can.)

        The contract: every piece of per-request and per-step state goes (transfers planned or
        under way, bound metadata, delayed frees, answers ``get_finished`` has not given yet);
        the old manager is not called (it is being thrown away, perhaps half-changed by the
        failed step); called twice it does what it does once (a recovery interrupted by a second
        fault runs again); it never raises on state a step left half-done (a fault can land
        between any two calls of a step). Counters may keep their totals. The default:
        nothing to forget."""
        return None
