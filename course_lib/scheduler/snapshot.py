"""Snapshot and restore of the V0 :class:`~course_lib.scheduler.Scheduler`: a copy of
everything a step can change (the queues, the counters, each queued request's fields and
sequences, the block manager), and putting it back.

``LLMEngine.step`` takes a snapshot before a step and restores it when the step fails, so that
a failed step leaves the scheduler exactly as it was (``engine/rollback.py``).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from ..memory import ManagerSnapshot
from ..sequence import Request


class SchedulerSnapshot(NamedTuple):
    """``Scheduler.snapshot()``: the queues, counters, request and sequence fields, blocks."""
    waiting: list[Request]
    running: list[Request]
    swapped: list[Request]
    counters: tuple[int, ...]
    requests: list[tuple]
    block_manager: ManagerSnapshot


class SnapshotRestore:
    """Mixed into ``Scheduler``: ``snapshot()`` and ``restore()``."""

    def snapshot(self) -> SchedulerSnapshot:
        """Everything a step can change: the queues, the counters, each queued request's
        fields and sequences, and the block manager (see ``LLMEngine.step``). A sequence's
        output list is only ever appended to, so its length is enough to restore it."""
        reqs = [(req, req.save()) for req in (*self.waiting, *self.running, *self.swapped)]
        return SchedulerSnapshot(
            list(self.waiting), list(self.running), list(self.swapped),
            (self.num_steps, self.num_preemptions, self.num_prompt_tokens,
             self.num_generated_tokens, self._next_seq_id),
            reqs, self.block_manager.snapshot())

    def restore(self, snap: SchedulerSnapshot) -> None:
        """Put the queues, requests, sequences, counters and blocks back as in ``snap``."""
        self.waiting = deque(snap.waiting)
        self.running, self.swapped = list(snap.running), list(snap.swapped)
        (self.num_steps, self.num_preemptions, self.num_prompt_tokens,
         self.num_generated_tokens, self._next_seq_id) = snap.counters
        for req, state in snap.requests:
            req.load(state)
        self.block_manager.restore(snap.block_manager)
