"""The KV-connector interface, watched: a CPU offload tier that records every call the V1
scheduler and the model runner make to it, in order, with its arguments (chapter 13).

:class:`TracingConnector` is :class:`~course_lib.engine.cpu_offload.CPUOffloadConnector`
unchanged but for a record: each interface method appends a :class:`ConnectorCall` (the engine
step, the side that called it, the method, what it was given and what it answered) to
``calls``, then does what the tier does. :func:`format_calls` prints them step by step, the
scheduler side on the left and the worker side on the right, with the per-layer calls of one
step folded into one line.

Which side calls what (vLLM 0.33.0's ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``):

* scheduler side, inside ``SchedulerV1.schedule()``: ``get_num_new_matched_tokens``,
  ``update_state_after_alloc``, ``build_connector_meta``; inside ``update()``:
  ``request_finished``;
* worker side, inside the engine's forward: ``bind_connector_metadata``, ``start_load_kv``,
  ``wait_for_layer_load`` per layer, ``save_kv_layer`` per layer, ``wait_for_save``,
  ``clear_connector_metadata``; after ``update()``: ``get_finished``, whose answer the engine
  hands back to the scheduler (``update_from_kv_xfer_finished``).

That is the course's order, which the record shows; vLLM 0.33.0's worker side differs where
:mod:`course_lib.engine.kv_connector` declares it: ``handle_preemptions`` first,
``start_load_kv`` after the forward is launched unless the step has synchronous loads, the
per-layer calls from inside each attention layer, and ``get_finished`` /
``get_block_ids_with_load_errors`` before ``clear_connector_metadata``
(``vllm/v1/worker/gpu/kv_connector.py``). The scheduler side's order is vLLM's.

The step number counts ``get_finished`` calls: the engine makes one at the end of every step,
so the calls between two of them are one step's. A step that fails keeps the calls it made,
and the recovery's ``reset_cache`` (recorded on the scheduler side, as vLLM's scheduler calls
it) ends that step too: the record shows what was tried, then that it was forgotten.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING, Any, NamedTuple

from .cpu_offload import CPUOffloadConnector, CPUOffloadMetadata

if TYPE_CHECKING:
    from ..model.attention import AttentionMetadata
    from ..model.llama import KVCache
    from ..scheduler.output import KVConnectorMetadata, SchedulerOutput
    from ..sequence import Sequence

SCHEDULER, WORKER = "scheduler", "worker"


class ConnectorCall(NamedTuple):
    """One call of the connector interface: in engine ``step`` (from 0), by ``side``
    (``"scheduler"`` or ``"worker"``), ``method``'s name, and ``detail``, its arguments and
    answer in words."""
    step: int
    side: str
    method: str
    detail: str


def _meta_text(meta: CPUOffloadMetadata) -> str:
    return (f"loads (cpu->gpu) {meta.loads}, stores (gpu->cpu) {meta.stores}"
            + (f", async seqs {meta.async_seq_ids}" if meta.async_seq_ids else ""))


class TracingConnector(CPUOffloadConnector):
    """A CPU offload tier that records each interface call (module docstring); takes
    :class:`~course_lib.engine.cpu_offload.CPUOffloadConnector`'s arguments."""

    def __init__(self, num_cpu_blocks: int, *, load_async: bool = False) -> None:
        super().__init__(num_cpu_blocks, load_async=load_async)
        self.calls: list[ConnectorCall] = []
        self.step = 0

    def _record(self, side: str, method: str, detail: str = "") -> None:
        self.calls.append(ConnectorCall(self.step, side, method, detail))

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        n, is_async = super().get_num_new_matched_tokens(seq, num_computed_tokens)
        self._record(SCHEDULER, "get_num_new_matched_tokens",
                     f"seq {seq.seq_id} ({len(seq)} tokens), GPU hit {num_computed_tokens} "
                     f"-> {n} more from the tier, async {is_async}")
        return n, is_async

    def update_state_after_alloc(self, seq: Sequence, block_ids: SequenceABC[int],
                                 num_external_tokens: int) -> None:
        self._record(SCHEDULER, "update_state_after_alloc",
                     f"seq {seq.seq_id}, blocks {list(block_ids)}, external tokens "
                     f"{num_external_tokens}")
        super().update_state_after_alloc(seq, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CPUOffloadMetadata:
        meta = super().build_connector_meta(scheduler_output)
        self._record(SCHEDULER, "build_connector_meta", _meta_text(meta))
        return meta

    def request_finished(self, seq: Sequence, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(seq, block_ids)
        self._record(SCHEDULER, "request_finished",
                     f"seq {seq.seq_id}, blocks {list(block_ids)} -> keep them {delay}")
        return delay, params

    # --------------------------------------------------------------- worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._record(WORKER, "bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._record(WORKER, "clear_connector_metadata")
        super().clear_connector_metadata()

    def start_load_kv(self, **kwargs: Any) -> None:
        self._record(WORKER, "start_load_kv")
        super().start_load_kv(**kwargs)

    def wait_for_layer_load(self, layer: int) -> None:
        self._record(WORKER, "wait_for_layer_load", f"layer {layer}")
        super().wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, kv_layer: KVCache, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        self._record(WORKER, "save_kv_layer", f"layer {layer}")
        super().save_kv_layer(layer, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._record(WORKER, "wait_for_save")
        super().wait_for_save()

    def get_finished(self, finished_req_ids: set[int]
                     ) -> tuple[set[int] | None, set[int] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        self._record(WORKER, "get_finished",
                     f"finished seqs {sorted(finished_req_ids)} -> done sending "
                     f"{sorted(sending or ())}, done loading {sorted(recving or ())}")
        self.step += 1                       # the engine's last connector call of a step
        return sending, recving

    # ------------------------------------------------------------------ recovery
    def reset_cache(self) -> None:
        self._record(SCHEDULER, "reset_cache",
                     f"after a failed step: the tier's {len(self.cpu_pool.hash_to_block)} "
                     "blocks and every transfer forgotten")
        super().reset_cache()
        self.step += 1                       # the failed step ends here


def _seq_of(call: ConnectorCall) -> int | None:
    """The sequence a scheduler-side call names (its detail starts ``seq N``), else None."""
    words = call.detail.split()
    return int(words[1].rstrip(",")) if call.side == SCHEDULER and words[:1] == ["seq"] \
        else None


def steps_of(calls: SequenceABC[ConnectorCall], seq_id: int) -> list[int]:
    """The steps of sequence ``seq_id``'s life, as the connector saw it: from the first call
    that names it (``get_num_new_matched_tokens``) to its ``request_finished``, or to the last
    step recorded while it has not finished."""
    mine = [c for c in calls if _seq_of(c) == seq_id]
    if not mine:
        named = sorted({n for c in calls if (n := _seq_of(c)) is not None})
        raise ValueError(f"no call names seq {seq_id}; the calls name seqs {named}")
    done = [c.step for c in mine if c.method == "request_finished"]
    return list(range(mine[0].step, (done[-1] if done else calls[-1].step) + 1))


def fold_layers(calls: SequenceABC[ConnectorCall]) -> list[ConnectorCall]:
    """``calls`` with each run of one per-layer method (``wait_for_layer_load``,
    ``save_kv_layer``) in one step folded into one call whose detail names the layers."""
    out: list[ConnectorCall] = []
    for c in calls:
        last = out[-1] if out else None
        if last is not None and c.method == last.method and c.step == last.step and \
                c.detail.startswith("layer ") and last.detail.startswith("layer"):
            first = last.detail.split()[1].split("..")[0]
            out[-1] = last._replace(detail=f"layers {first}..{c.detail.split()[1]}")
        else:
            out.append(c)
    return out


def format_calls(calls: SequenceABC[ConnectorCall], steps: SequenceABC[int] | None = None,
                 width: int = 44) -> str:
    """The calls of ``steps`` (all by default) as a timeline: one line per call, in order,
    the scheduler side's in the left column and the worker side's in the right, details
    below each call; per-layer calls folded (:func:`fold_layers`)."""
    wanted = None if steps is None else set(steps)
    lines = [f"{'step':>4}  {'scheduler side':<{width}}  worker side"]
    current = None
    for c in fold_layers([c for c in calls if wanted is None or c.step in wanted]):
        label = f"{c.step:>4}" if c.step != current else " " * 4
        current = c.step
        if c.side == SCHEDULER:
            lines.append(f"{label}  {c.method:<{width}}")
        else:
            lines.append(f"{label}  {'':<{width}}  {c.method}")
        if c.detail:
            pad = 6 if c.side == SCHEDULER else 8 + width
            lines.append(" " * pad + "  " + c.detail)
    return "\n".join(line.rstrip() for line in lines)
