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
from ..memory import AllocStatus, BlockManager, cdiv
from ..sequence import Request, Sequence


def can_allocate(bm: BlockManager, seqs: list[Sequence]) -> AllocStatus:
    """Room for the blocks of ``seqs``' next prefill (``prefill_target`` tokens each)?"""
    if len(seqs) == 1:
        return bm.can_allocate(seqs[0].token_ids[:seqs[0].prefill_target])
    # several sequences (a parallel-sampling request preempted by recompute): count their
    # blocks without prefix-cache hits, an upper bound of what they take.
    blocks = sum(cdiv(s.prefill_target, bm.block_size) for s in seqs)
    return bm.can_allocate(blocks * bm.block_size)


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
        need = sum(cdiv(s.prefill_target, bm.block_size) for s in req.unfinished_seqs)
        return (f"needs {need} GPU blocks, the pool has {bm.num_gpu_blocks} "
                f"minus a watermark of {bm.watermark_blocks}")
    return None


def too_big_to_grow(bm: BlockManager, req: Request) -> str:
    held = len({b for s in req.unfinished_seqs for b in bm.get_block_table(s.seq_id)})
    return (f"request {req.request_id} cannot grow: it holds {held} of the "
            f"{bm.num_gpu_blocks} GPU blocks alone and needs more "
            f"(raise num_gpu_blocks or lower max_model_len / max_tokens)")


def too_big_to_swap_in(bm: BlockManager, req: Request) -> str:
    need = bm.swap_in_need(s.seq_id for s in req.unfinished_seqs)
    return (f"request {req.request_id} needs {need} GPU blocks to come back, the pool has "
            f"{bm.num_gpu_blocks} (watermark {bm.watermark_blocks})")
