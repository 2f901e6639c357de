"""Static (contiguous) KV reservation, as in serving systems before vLLM, against paging.

A memory-level simulation: no model, no timing beyond steps. Memory is ``total_slots`` token
slots. Each step, every resident request that finished its prefill generates one token; a
request admitted this step runs its prefill (its whole prompt gets KV). A request with prompt
``p`` and output ``o`` therefore holds ``p`` token states after its first step and ``p + o``
(its *final length* L) after ``o`` more steps, then frees its memory. (Simplification: the KV
of the last generated token is counted too.) Requests are admitted first come, first served.

Contiguous systems reserve, at admission, one contiguous range of slots per request, found
first-fit (``ContiguousAllocator``):

- ``"max"`` (Orca-Max): ``max_model_len`` slots;
- ``"pow2"`` (Orca-Pow2): the next power of two >= L (at most max_model_len);
- ``"oracle"`` (Orca-Oracle): exactly L.

Paging (``simulate_paged``) uses the real ``BlockManager``
(``course_lib/memory/v0/manager.py``): the prompt's
blocks at admission, ``append_slots`` one token per step, ``free`` at the end; when a block
cannot be found the latest admitted request is preempted and recomputed later (vLLM's default).

Every step is split, in slots, as the vLLM paper does (its Fig. 2):

- token states: KV of tokens already processed;
- reserved: slots held for tokens the request will still generate;
- internal fragmentation: held slots the request will never use (reservation beyond L, or
  the unused tail of a paged request's last block);
- external fragmentation: free slots that cannot hold the reservation of the request at the
  head of the queue (when one is waiting and blocked, all free slots are counted here, as the
  paper's "external fragmentation & others"; when nobody waits, nothing is);
- free: the rest. The five always sum to ``total_slots`` (``MemoryTimeline.check_invariants``).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from course_lib.memory.common import AllocStatus
from course_lib.memory.v0.manager import BlockManager
from course_lib.sim.traces import TraceRequest
from course_lib.sizing.units import next_power_of_two

POLICIES = ("max", "pow2", "oracle")
SYSTEM_NAMES = {"max": "Orca-Max", "pow2": "Orca-Pow2", "oracle": "Orca-Oracle",
                "paged": "paged (vLLM)"}
CATEGORIES = ("token_states", "reserved", "internal", "external", "free")


def reservation(policy: str, final_len: int, max_model_len: int = 2048) -> int:
    """Slots a contiguous system reserves for a request whose final length is final_len."""
    if not 1 <= final_len <= max_model_len:
        raise ValueError(f"final_len must be in [1, max_model_len={max_model_len}], "
                         f"got {final_len}")
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        return min(next_power_of_two(final_len), max_model_len)
    if policy == "oracle":
        return final_len
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


class ContiguousAllocator:
    """First-fit allocation of contiguous slot ranges in [0, num_slots).

    ``holes`` is the sorted list of free ranges (start, length); a free merges a range with
    its free neighbours, so two holes never touch.
    """

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self.holes: list[tuple[int, int]] = [(0, num_slots)]
        self.allocated: dict[int, int] = {}   # start -> length

    @property
    def free_slots(self) -> int:
        return sum(length for _, length in self.holes)

    @property
    def largest_hole(self) -> int:
        return max((length for _, length in self.holes), default=0)

    def allocate(self, size: int) -> int | None:
        """Start of the first hole that holds ``size`` slots (carved from its front), or None."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        for i, (start, length) in enumerate(self.holes):
            if length >= size:
                if length == size:
                    del self.holes[i]
                else:
                    self.holes[i] = (start + size, length - size)
                self.allocated[start] = size
                return start
        return None

    def free(self, start: int) -> None:
        if start not in self.allocated:
            raise ValueError(f"no allocation starts at slot {start}; allocated starts: "
                             f"{sorted(self.allocated)[:10]}")
        length = self.allocated.pop(start)
        i = bisect.bisect_left(self.holes, (start, 0))
        if i < len(self.holes) and self.holes[i][0] == start + length:   # merge right
            length += self.holes.pop(i)[1]
        if i > 0 and sum(self.holes[i - 1]) == start:                      # merge left
            start, length = self.holes[i - 1][0], self.holes[i - 1][1] + length
            del self.holes[i - 1]
            i -= 1
        self.holes.insert(i, (start, length))

    def regions(self) -> list[tuple[int, int, bool]]:
        """(start, length, is_free) over the whole range, in address order (for drawings)."""
        parts = [(s, n, False) for s, n in self.allocated.items()]
        parts += [(s, n, True) for s, n in self.holes]
        return sorted(parts)

    def check_invariants(self) -> None:
        pos = 0
        for start, length, _ in self.regions():
            assert start == pos and length >= 1, f"gap or overlap at slot {pos}"
            pos += length
        assert pos == self.num_slots, f"regions cover {pos} of {self.num_slots} slots"
        for (s1, n1), (s2, _) in zip(self.holes, self.holes[1:], strict=False):
            assert s1 + n1 < s2, f"holes at {s1} and {s2} touch: they should have merged"


@dataclass
class MemoryTimeline:
    """Per-step memory breakdown (slots) of one system over a trace; arrays are [num_steps]."""

    system: str
    total_slots: int
    token_states: np.ndarray
    reserved: np.ndarray
    internal: np.ndarray
    external: np.ndarray
    free: np.ndarray
    batch_size: np.ndarray      # requests resident after the step
    waiting: np.ndarray         # arrived requests not admitted after the step
    admitted: list[int]         # request ids in the order they were (first) admitted
    preemptions: int = 0
    rejected: int = 0           # requests that can never fit

    def check_invariants(self) -> None:
        parts = [getattr(self, c) for c in CATEGORIES]
        assert all((p >= 0).all() for p in parts), "a negative category"
        assert (sum(parts) == self.total_slots).all(), "categories do not sum to total_slots"

    def _steps(self, loaded_only: bool) -> np.ndarray | slice:
        if len(self.batch_size) == 0:
            raise ValueError(f"{self.system}: the trace was empty, there are no steps to average")
        return self.loaded() if loaded_only else slice(None)

    def loaded(self) -> np.ndarray:
        """Steps where some arrived request waits (memory is the limit); all steps if none."""
        mask = self.waiting > 0
        return mask if mask.any() else np.ones_like(mask, dtype=bool)

    def fractions(self, loaded_only: bool = True) -> dict[str, float]:
        """Mean share of memory per category (sums to 1), over loaded steps by default."""
        mask = self._steps(loaded_only)
        return {c: float(getattr(self, c)[mask].mean() / self.total_slots) for c in CATEGORIES}

    def mean_batch_size(self, loaded_only: bool = True) -> float:
        return float(self.batch_size[self._steps(loaded_only)].mean())


class _Req(NamedTuple):
    request_id: int
    arrival_step: int
    prompt_len: int
    final_len: int


def _requests(trace: Sequence[TraceRequest], step_time_s: float | None) -> list[_Req]:
    if step_time_s is not None and not step_time_s > 0:
        raise ValueError(f"step_time_s must be > 0 seconds or None, got {step_time_s!r}")
    reqs = []
    for r in trace:
        step = 0 if step_time_s is None else math.ceil(r.arrival_time / step_time_s)
        reqs.append(_Req(r.request_id, step, r.prompt_len, r.prompt_len + r.output_len))
    return sorted(reqs, key=lambda q: (q.arrival_step, q.request_id))


class _Recorder:
    def __init__(self) -> None:
        self.rows: list[tuple[int, ...]] = []

    def add(self, *row: int) -> None:
        self.rows.append(row)

    def timeline(self, system: str, total: int, admitted: list[int], preemptions: int = 0,
                 rejected: int = 0) -> MemoryTimeline:
        cols = np.array(self.rows, dtype=np.int64).reshape(-1, 7).T
        return MemoryTimeline(system, total, *cols, admitted=admitted, preemptions=preemptions,
                              rejected=rejected)


def simulate_static(trace: Sequence[TraceRequest], total_slots: int, policy: str, *,
                    max_model_len: int = 2048, step_time_s: float | None = None,
                    max_steps: int = 10_000_000) -> MemoryTimeline:
    """Replay a trace with contiguous first-fit reservation (see the module docstring).

    step_time_s: seconds per step, to turn arrival times into steps; None: all requests wait
    from step 0 (a saturated server). Requests with L > max_model_len are rejected.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    alloc = ContiguousAllocator(total_slots)
    pending = deque(_requests(trace, step_time_s))
    waiting: deque[_Req] = deque()
    ends: dict[int, list[tuple[int, _Req, int]]] = {}   # finish step -> [(start, req, R)]
    rec, admitted, rejected = _Recorder(), [], 0
    states = reserved = internal = resident = 0
    step = 0
    while pending or waiting or resident:
        if step >= max_steps:
            raise RuntimeError(f"simulation did not finish in {max_steps} steps")
        while pending and pending[0].arrival_step <= step:
            waiting.append(pending.popleft())
        states += resident                     # every resident request decodes one token
        reserved -= resident
        while waiting:                         # FCFS admission while the head fits
            req = waiting[0]
            size = reservation(policy, req.final_len, max_model_len) \
                if req.final_len <= max_model_len else total_slots + 1
            if size > total_slots:             # can never fit: reject, do not wait forever
                waiting.popleft()
                rejected += 1
                continue
            start = alloc.allocate(size)
            if start is None:
                break
            waiting.popleft()
            admitted.append(req.request_id)
            resident += 1
            states += req.prompt_len
            reserved += req.final_len - req.prompt_len
            internal += size - req.final_len
            ends.setdefault(step + req.final_len - req.prompt_len, []).append((start, req, size))
        free = total_slots - states - reserved - internal
        external = free if waiting else 0      # the head is blocked: no hole holds it
        rec.add(states, reserved, internal, external, free - external, resident, len(waiting))
        for start, req, size in ends.pop(step, []):
            alloc.free(start)
            resident -= 1
            states -= req.final_len
            internal -= size - req.final_len
        step += 1
    return rec.timeline(SYSTEM_NAMES[policy], total_slots, admitted, rejected=rejected)


def simulate_paged(trace: Sequence[TraceRequest], num_blocks: int, block_size: int = 16, *,
                   watermark: float = 0.01, step_time_s: float | None = None,
                   max_steps: int = 10_000_000, check_every_step: bool = False) -> MemoryTimeline:
    """Replay a trace with paging on the real BlockManager (see the module docstring).

    A request admitted again after a preemption re-allocates its prompt plus the tokens it
    had generated (recompute). The BlockManager's invariants are checked at the end, and
    after every step with ``check_every_step`` (slow; for tests).
    """
    bm = BlockManager(block_size, num_blocks, watermark=watermark)
    total = num_blocks * block_size
    pending = deque(_requests(trace, step_time_s))
    waiting: deque[_Req] = deque()
    running: list[_Req] = []                   # admission order: the last is preempted first
    rec, admitted, seen = _Recorder(), [], set()
    resume: dict[int, int] = {}                # preempted request -> tokens to recompute
    preemptions = rejected = 0
    step = 0
    while pending or waiting or running:
        if step >= max_steps:
            raise RuntimeError(f"simulation did not finish in {max_steps} steps")
        while pending and pending[0].arrival_step <= step:
            waiting.append(pending.popleft())
        i = 0
        while i < len(running):                # decode: one slot per running request
            req = running[i]
            while not bm.can_append_slots(req.request_id, 1):
                victim = running.pop()         # latest admitted; may be req itself
                resume[victim.request_id] = bm.get_table(victim.request_id).num_tokens
                bm.free(victim.request_id)
                waiting.appendleft(victim)
                preemptions += 1
                if victim is req:
                    break
            else:
                bm.append_slots(req.request_id, [0])
                i += 1
        while waiting:                         # FCFS admission while the head fits
            req = waiting[0]
            status = bm.can_allocate(req.final_len)
            if status is AllocStatus.NEVER:
                waiting.popleft()
                rejected += 1
                continue
            # after a preemption: its prompt plus the tokens it had generated (recompute)
            num_tokens = resume.pop(req.request_id, req.prompt_len)
            if bm.can_allocate(num_tokens) is not AllocStatus.OK:
                resume[req.request_id] = num_tokens
                break
            waiting.popleft()
            bm.allocate(req.request_id, [0] * num_tokens)
            running.append(req)
            if req.request_id not in seen:
                seen.add(req.request_id)
                admitted.append(req.request_id)
        states = reserved = internal = 0
        for req in running:
            n = bm.get_table(req.request_id).num_tokens
            empty = len(bm.get_table(req.request_id).blocks) * block_size - n
            future = min(empty, req.final_len - n)
            states += n
            reserved += future
            internal += empty - future
        free = bm.num_free_gpu_blocks * block_size
        rec.add(states, reserved, internal, 0, free, len(running), len(waiting))
        done = [r for r in running if bm.get_table(r.request_id).num_tokens == r.final_len]
        for req in done:
            bm.free(req.request_id)
            running.remove(req)
        if check_every_step:
            bm.check_invariants()
        step += 1
    bm.check_invariants()
    return rec.timeline(SYSTEM_NAMES["paged"], total, admitted, preemptions, rejected)
