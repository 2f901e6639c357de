"""The scheduler's questions to the block manager: is there room, and can this ever fit?

* :func:`can_allocate`: can a waiting request's sequences get their blocks (now, later, never)?
* :func:`never_fits`: why a request can never run (a sentence), or None.
* :func:`too_big_to_grow`, :func:`too_big_to_swap_in`: why a running or swapped request must
  be given up.

Room for a decode step or a swap-in is the block manager's own answer
(``num_blocks_to_append``, ``can_swap_in``); only the request-level reasons live here.
"""

from __future__ import annotations

from ..config import SchedulerConfig
from ..memory.common import AllocStatus
from ..memory.v0.manager import BlockManager
from ..sequence import Request, Sequence


def prefill_tokens(seqs: list[Sequence]) -> list[list[int]]:
    """The tokens each sequence's next prefill gives a slot to (``prefill_target`` each)."""
    return [s.token_ids[:s.prefill_target] for s in seqs]


def salt(req: Request) -> tuple | str:
    """The request's prefix-cache key (``()``: the shared, unsalted namespace)."""
    return () if req.cache_salt is None else req.cache_salt


def can_allocate(bm: BlockManager, req: Request, seqs: list[Sequence]) -> AllocStatus:
    """Room for the blocks of ``seqs``' next prefill? Several sequences (samples or beams
    prefilled again after a recompute preemption) share their common prefixes' blocks."""
    return bm.can_allocate_group(prefill_tokens(seqs), salt(req))


def never_fits(cfg: SchedulerConfig, bm: BlockManager, req: Request,
               status: AllocStatus) -> str | None:
    """The reason a waiting request can never be scheduled, or None if it can."""
    if len(req.prompt_token_ids) > cfg.max_model_len:
        return (f"prompt of {len(req.prompt_token_ids)} tokens is longer than "
                f"max_model_len={cfg.max_model_len}")
    num_seqs = req.sampling_params.num_seqs
    if num_seqs > min(cfg.max_num_seqs, cfg.max_num_batched_tokens):
        return (f"needs {num_seqs} sequences at once, max_num_seqs={cfg.max_num_seqs} "
                f"and max_num_batched_tokens={cfg.max_num_batched_tokens}")
    if status == AllocStatus.NEVER:
        need = bm.group_blocks_needed(prefill_tokens(req.unfinished_seqs))
        return (f"needs {need} GPU blocks, the pool has {bm.num_gpu_blocks} "
                f"minus a watermark of {bm.watermark_blocks}")
    return None


def too_big_to_grow(bm: BlockManager, req: Request) -> str:
    held = len({b for s in req.unfinished_seqs for b in bm.get_block_table(s.seq_id)})
    return (f"cannot grow: request {req.request_id} holds {held} of the "
            f"{bm.num_gpu_blocks} GPU blocks alone and needs more; its output stops here "
            f"(raise num_gpu_blocks or lower max_model_len / max_tokens)")


def too_big_to_swap_in(bm: BlockManager, req: Request) -> str:
    need = bm.swap_in_need(s.seq_id for s in req.unfinished_seqs)
    return (f"request {req.request_id} needs {need} GPU blocks to come back, the pool has "
            f"{bm.num_gpu_blocks} (watermark {bm.watermark_blocks})")
