"""All or nothing: what ``LLMEngine.step`` saves before a step and puts back if it fails.

A step mutates three kinds of state: the bookkeeping (scheduler queues, requests, sequences,
block tables, pools, prefix cache, counters), the contents of the KV-cache tensors, and the
metrics. The mechanism:

* **Bookkeeping: a snapshot.** ``Scheduler.snapshot()`` (which includes
  ``BlockManager.snapshot()``) copies it before the step; ``restore`` puts it back. O(blocks +
  tokens held) per step, small beside a forward pass; plain and hard to get wrong, where an
  undo log would have to mirror every mutation of every class.
* **Tensors: only the blocks at risk.** Most writes of a step land where nothing lived
  before it: new tokens' slots past a sequence's old end, blocks that were on the free stack.
  Those need no undo: after a rollback nothing points at them. A write is at risk only when a
  block allocated in this step held something at its start: a cached block evicted for the
  step, or a block freed by a preemption and handed out again in the same step. Those blocks
  (:func:`blocks_at_risk`) are copied before the cache operations run and copied back on
  failure.
* **Metrics** are updated last, once everything fallible before them has succeeded; the
  engine's own maps (its requests, their seeds) and its step counter change only at commit.

All of it belongs to one :class:`StepTransaction`, begun at the top of ``LLMEngine.step`` and
committed at its end or rolled back on failure, then closed: a step can never put back what
an earlier step saved. The step then either completes or raises with everything as it was;
the engine decides whom to blame (see ``LLMEngine.step``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..memory.common import FREE
from ..memory.v0.manager import ManagerSnapshot
from ..scheduler.output import SchedulerOutput
from ..scheduler.scheduler import SchedulerSnapshot


class StepFailed(RuntimeError):
    """A step failed and no single request's work was found to cause it. The engine is
    exactly as it was before the step: call ``step()`` again (a transient fault) or stop."""


class StepTransaction:
    """Everything one step may change, saved when the step begins (``LLMEngine._begin``):
    the scheduler's snapshot (its queues and counters, the requests it runs or touches, the
    block manager), the runner's counters, and the cache blocks at risk (``backup``, set once
    the schedule is known). Committed or rolled back exactly once, then closed: a later step
    begins its own, so nothing of an earlier step can ever be put back."""

    def __init__(self, scheduler: SchedulerSnapshot, runner_counters: tuple[int, int]) -> None:
        self.scheduler = scheduler
        self.runner_counters = runner_counters
        self.backup: CacheBackup | None = None      # the blocks at risk, once known
        self.last_output: SchedulerOutput | None = None
        self.closed = False

    def close(self) -> None:
        """Drop what was saved (committed, or put back)."""
        if self.closed:
            raise RuntimeError("this step's transaction was already committed or rolled back")
        self.closed = True
        self.scheduler = self.backup = None


def blocks_at_risk(out: SchedulerOutput, before: ManagerSnapshot,
                   block_size: int) -> tuple[list[int], list[int]]:
    """(GPU blocks, CPU blocks) this step writes whose contents mattered when it started:
    destinations of copy-on-write copies and swaps, and blocks the forward writes new tokens'
    K/V into, except those that were free then and, for the forward, a sequence's own blocks
    (it writes past its old end there, where nothing lived)."""
    gpu = {dst for _, dst in out.blocks_to_copy} | {dst for _, dst in out.blocks_to_swap_in}
    for e in out.scheduled:
        ctx = e.seq.num_computed_tokens              # before update() advances it
        first, last = ctx // block_size, (ctx + e.num_tokens - 1) // block_size
        own = before.tables.get(e.seq.seq_id)
        mine = set(own.blocks) if own is not None and own.device == "gpu" else set()
        gpu.update(b for b in e.block_ids[first:last + 1] if b not in mine)
    cpu = {dst for _, dst in out.blocks_to_swap_out}
    return (sorted(b for b in gpu if before.gpu.state[b] != FREE),
            sorted(b for b in cpu if before.cpu.state[b] != FREE))


class CacheBackup(NamedTuple):
    """Copies of some blocks of every layer's K and V caches."""
    gpu_blocks: list[int]
    gpu: list[tuple[torch.Tensor, torch.Tensor]]
    cpu_blocks: list[int]
    cpu: list[tuple[torch.Tensor, torch.Tensor]]


def back_up(gpu_caches, cpu_caches, gpu_blocks: list[int], cpu_blocks: list[int]) -> CacheBackup:
    """Copy ``gpu_blocks`` / ``cpu_blocks`` of each layer's caches (nothing when empty)."""
    def copy(caches, blocks):
        if not blocks:
            return []
        idx = torch.tensor(blocks, dtype=torch.int64, device=caches[0][0].device)
        return [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in caches]
    return CacheBackup(gpu_blocks, copy(gpu_caches, gpu_blocks), cpu_blocks,
                       copy(cpu_caches, cpu_blocks))


def put_back(gpu_caches, cpu_caches, backup: CacheBackup) -> None:
    """Write the saved blocks back into the caches."""
    for caches, blocks, saved in ((gpu_caches, backup.gpu_blocks, backup.gpu),
                                  (cpu_caches, backup.cpu_blocks, backup.cpu)):
        if not blocks:
            continue
        idx = torch.tensor(blocks, dtype=torch.int64, device=caches[0][0].device)
        for (k, v), (k_saved, v_saved) in zip(caches, saved, strict=True):
            k.index_copy_(0, idx, k_saved)
            v.index_copy_(0, idx, v_saved)
