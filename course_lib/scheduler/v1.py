"""vLLM V1's scheduler, simplified (``vllm/v1/core/sched/scheduler.py``, vLLM 0.33.0).

There is no prefill phase and no decode phase: each running sequence has ``num_computed_tokens``
and ``len(seq)`` tokens, and every step the scheduler gives tokens to close the gap, within one
token budget (``max_num_batched_tokens``) and ``max_num_seqs``. A prompt longer than what is
left of the budget is computed in chunks: chunked prefill is the normal case. One step:

1. **Running** sequences, in order: ``allocate_slots`` for their tokens; when the pool is
   short, the last running sequence is preempted (recompute: its blocks are freed, it goes back
   to the front of the waiting queue) and the allocation is tried again.
2. **Waiting** sequences, if nothing was preempted: the prefix-cache hit is looked up
   (``get_computed_blocks``), then ``allocate_slots`` for the rest of the tokens, or the part
   the budget allows; a sequence that does not fit stops the admissions.

A request with ``n > 1`` runs as ``n`` *child* sequences, each scheduled on its own (vLLM's
``ParentRequest`` in ``vllm/v1/engine/parallel_sampling.py``); they share the prompt's full
blocks through the prefix cache. A preempted sequence recomputes all its tokens and samples
the next one at the end of that prefill. Beam search is not run by the core (vLLM runs it as a
loop over the engine: ``LLM.beam_search``; here ``course_lib.engine.beam_search``).

It produces the same :class:`SchedulerOutput` as the V0 scheduler (never any copy or swap),
takes the same ``update``, and keeps its queues of sequences in ``waiting`` and ``running``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from typing import NamedTuple

from ..config import CacheConfig, SchedulerConfig
from ..memory.radix.kv_cache_manager import RadixKVCacheManager
from ..memory.v1.kv_cache_manager import KVCacheManager
from ..memory.v1_interface import V1Snapshot
from ..sequence import Request, SamplingParams, Sequence, SequenceStatus
from ..sizing.units import cdiv
from .output import ScheduledSeq, SchedulerOutput
from .output_processor import apply_step

S = SequenceStatus


class SchedulerV1Snapshot(NamedTuple):
    waiting: list[Sequence]
    running: list[Sequence]
    requests: dict[int, Request]
    counters: tuple[int, ...]
    request_fields: list[tuple]
    block_manager: V1Snapshot
    preempted: frozenset[int] = frozenset()


class SchedulerV1:
    """Continuous batching over a
    :class:`~course_lib.memory.v1.kv_cache_manager.KVCacheManager` (see above), or over
    SGLang's radix tree with ``CacheConfig(prefix_cache="radix")``."""

    def __init__(self, scheduler_config: SchedulerConfig | None = None,
                 cache_config: CacheConfig | None = None) -> None:
        self.config = scheduler_config or SchedulerConfig()
        self.cache_config = cc = cache_config or CacheConfig()
        manager = RadixKVCacheManager if cc.prefix_cache == "radix" else KVCacheManager
        self.kv_cache_manager = manager(cc.block_size, cc.num_gpu_blocks,
                                        cc.enable_prefix_caching, cc.watermark)
        self.block_manager = self.kv_cache_manager   # the name the engine and metrics read
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []            # V1 never swaps: always empty
        self.requests: dict[int, Request] = {}       # seq_id -> its request
        self.num_steps = self.num_preemptions = 0
        self.num_prompt_tokens = self.num_generated_tokens = 0
        self._next_seq_id = 0
        self.preempted: set[int] = set()             # seq ids preempted since admitted

    # ------------------------------------------------------------------------ requests
    def add_request(self, request_id: int, prompt_token_ids: SequenceABC[int],
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float = 0.0, cache_salt: str | None = None) -> Request:
        """Queue a request as ``n`` child sequences (``ValueError`` changes nothing)."""
        params = sampling_params or SamplingParams()
        if params.use_beam_search:
            raise ValueError("the V1 core runs no beam search (vLLM runs it outside, as "
                             "LLM.beam_search): use course_lib.engine.beam_search.beam_search, "
                             "or the V0 design")
        req = Request(request_id, tuple(prompt_token_ids), params, arrival_time,
                      cache_salt=cache_salt)
        for index in range(params.n):
            seq = Sequence(self._next_seq_id + index, req.prompt_token_ids, index)
            req.seqs.append(seq)
            self.requests[seq.seq_id] = req
            self.waiting.append(seq)
        self._next_seq_id += params.n
        return req

    def new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_request(self, request_id: int) -> bool:
        return self.finish_request(request_id, S.FINISHED_ABORTED, "aborted by the user")

    def finish_request(self, request_id: int, status: SequenceStatus, detail: str) -> bool:
        """Finish every live sequence of the request (freeing their blocks)."""
        seqs = [s for s in (*self.waiting, *self.running)
                if self.requests[s.seq_id].request_id == request_id]
        if not seqs:
            return False
        req = self.requests[seqs[0].seq_id]
        for seq in seqs:
            self._finish_seq(seq, status)
        req.finish_reason, req.finish_detail = status.finish_reason, detail
        return True

    def _finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_cache_manager.forget(seq.seq_id)
        self.requests.pop(seq.seq_id, None)
        self.preempted.discard(seq.seq_id)
        seq.status = status

    # ------------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work; allocates, and preempts by recompute when short."""
        out = SchedulerOutput(self.num_steps)
        self.num_steps += 1
        budget, kvm = self.config.max_num_batched_tokens, self.kv_cache_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            while True:
                ids = kvm.allocate_slots(seq.seq_id, seq.token_ids, seq.num_computed_tokens,
                                         num_new)
                if ids is not None:
                    break
                victim = self.running.pop()               # the latest one admitted
                self._preempt(victim, out)
                if victim is seq:
                    break
            if ids is None:
                break
            self._add_entry(out, seq, num_new, ids)
            budget -= num_new
            i += 1
        if not out.preempted:
            self._schedule_waiting(budget, out)
        return out

    def _add_entry(self, out: SchedulerOutput, seq: Sequence, num_new: int,
                   block_ids: list[int]) -> None:
        req = self.requests[seq.seq_id]
        done = seq.num_computed_tokens + num_new == len(seq)      # it samples the next token
        decode = done and num_new == 1 and bool(seq.output_token_ids)
        out.scheduled.append(ScheduledSeq(req, seq, num_new, not decode,
                                          1 if done else 0, block_ids))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.kv_cache_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = S.WAITING
        req = self.requests[seq.seq_id]
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted.add(seq.seq_id)
        self.waiting.appendleft(seq)
        out.preempted.append((req.request_id, "recompute"))

    def _never_fits(self, seq: Sequence) -> str | None:
        cfg, kvm = self.config, self.kv_cache_manager
        if len(seq.prompt_token_ids) > cfg.max_model_len:
            return (f"prompt of {len(seq.prompt_token_ids)} tokens is longer than "
                    f"max_model_len={cfg.max_model_len}")
        need = cdiv(len(seq), kvm.block_size)
        if need > kvm.num_gpu_blocks - kvm.watermark_blocks:
            if seq.output_token_ids:
                return (f"cannot grow: sequence {seq.seq_id} needs {need} of the "
                        f"{kvm.num_gpu_blocks} GPU blocks; its output stops here")
            return (f"needs {need} GPU blocks, the pool has {kvm.num_gpu_blocks} "
                    f"minus a watermark of {kvm.watermark_blocks}")
        return None

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> None:
        kvm = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            req = self.requests[seq.seq_id]
            reason = self._never_fits(seq)
            if reason is not None:
                status = S.FINISHED_LENGTH_CAPPED if seq.output_token_ids else S.FINISHED_IGNORED
                self._finish_seq(seq, status)
                if req.is_finished:
                    req.finish_reason, req.finish_detail = status.finish_reason, reason
                    out.ignored.append(req)
                continue
            hits, num_hit = kvm.get_computed_blocks(seq.seq_id, seq.token_ids, req.cache_salt)
            num_new = len(seq) - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            ids = kvm.allocate_slots(seq.seq_id, seq.token_ids, 0, num_new, hits, admission=True)
            if ids is None:
                break
            self.waiting.popleft()
            # vLLM counts a re-admission after a preemption apart (PrefixCacheStats.record)
            kvm.record_prefix_cache_stats(len(seq), num_hit,
                                          preempted=seq.seq_id in self.preempted)
            if req.first_scheduled_time is None and seq.index == 0:
                req.num_cached_tokens = num_hit
            seq.num_computed_tokens, seq.status = num_hit, S.RUNNING
            self.running.append(seq)
            self._add_entry(out, seq, num_new, ids)
            budget -= num_new

    # --------------------------------------------------------------------------- update
    def update(self, out: SchedulerOutput,
               samples: Mapping[int, SequenceABC[tuple[int, float]]],
               now: float = 0.0) -> list[Request]:
        """Apply a step's results (as ``Scheduler.update``): advance the computed tokens,
        append the sampled ones, finish sequences that stopped; returns the requests that
        finished now (ignored ones included). The loop is ``output_processor.apply_step``,
        shared with the V0 scheduler; V1 marks no blocks here (``allocate_slots`` caches full
        blocks as it hands them out) and takes each finished sequence out of its queues."""
        return apply_step(self, out, samples, now, on_sampled=self._drop_finished)

    def _drop_finished(self, entries: list[ScheduledSeq]) -> None:
        """Take the sequences of one request that finished in this step out of ``running``
        (``apply_step`` calls it right after the request's samples are applied)."""
        for e in entries:
            if e.seq.is_finished:                     # apply_samples freed its blocks
                self._finish_seq(e.seq, e.seq.status)

    # ------------------------------------------------------------ snapshot / restore
    def snapshot(self) -> SchedulerV1Snapshot:
        fields = [(req, req.save())
                  for req in {id(r): r for r in self.requests.values()}.values()]
        return SchedulerV1Snapshot(
            list(self.waiting), list(self.running), dict(self.requests),
            (self.num_steps, self.num_preemptions, self.num_prompt_tokens,
             self.num_generated_tokens, self._next_seq_id),
            fields, self.kv_cache_manager.snapshot(), frozenset(self.preempted))

    def restore(self, snap: SchedulerV1Snapshot) -> None:
        self.waiting, self.running = deque(snap.waiting), list(snap.running)
        self.requests = dict(snap.requests)
        (self.num_steps, self.num_preemptions, self.num_prompt_tokens,
         self.num_generated_tokens, self._next_seq_id) = snap.counters
        for req, state in snap.request_fields:
            req.load(state)
        self.kv_cache_manager.restore(snap.block_manager)
        self.preempted = set(snap.preempted)

    def check_invariants(self) -> None:
        """Running sequences hold blocks for their computed tokens, waiting ones none, no
        table belongs to no queue; and the KV-cache manager's own invariants."""
        kvm = self.kv_cache_manager
        kvm.check_invariants()
        for seq in self.running:
            assert seq.status == S.RUNNING, f"seq {seq.seq_id}: {seq.status} in running"
            assert kvm.has_seq(seq.seq_id), f"running seq {seq.seq_id} holds no blocks"
            assert seq.num_computed_tokens <= kvm.num_slots[seq.seq_id] <= len(seq)
        for seq in self.waiting:
            assert seq.status == S.WAITING, f"seq {seq.seq_id}: {seq.status} in waiting"
            assert not kvm.has_seq(seq.seq_id), f"waiting seq {seq.seq_id} has blocks"
        assert set(kvm.seq_ids()) == {s.seq_id for s in self.running}, \
            "block tables of sequences no queue holds"
        assert len(self.running) <= self.config.max_num_seqs
