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

**With a KV connector** (``kv_connector``: :mod:`course_lib.scheduler.kv_connector` is the part the
scheduler calls, :mod:`course_lib.engine.kv_connector` the whole interface; None: none of
this happens), as vLLM 0.33.0's scheduler (``Scheduler.schedule`` in
``vllm/v1/core/sched/scheduler.py``): after the local prefix-cache hit of a waiting
sequence, the connector is asked for more (``get_num_new_matched_tokens``); blocks are
allocated for those external tokens too (they count as computed, not against the token
budget) and the connector told which (``update_state_after_alloc``). Each ``schedule()`` ends
with ``build_connector_meta``, carried by the output. In vLLM's terms:

* **Waiting for remote K/V is waiting.** A sequence whose external tokens load
  asynchronously holds its blocks in ``waiting_for_remote`` (status
  ``WAITING_FOR_REMOTE_KVS``; vLLM's ``kv_holding_waiting`` queue), which does not count
  against ``max_num_seqs``, until the worker side reports the load done (``get_finished``,
  handed in by :meth:`SchedulerV1.update_from_kv_xfer_finished`).
* **A loaded sequence comes back through the waiting loop.** The waiting loop drains
  ``waiting_for_remote`` before ``waiting`` (vLLM: "requests holding KV blocks are always
  drained first"); a loaded sequence goes back to WAITING there, holding its blocks, and is
  admitted in the same pass if the budget, ``max_num_seqs`` and the pool allow
  (``_handle_blocked_waiting_request``, ``_update_waiting_for_remote_kv``): after the running
  sequences, never first in line for preemption.
* **A load that failed from its first block** (``get_block_ids_with_load_errors`` named it:
  vLLM's ``_update_requests_with_invalid_blocks``, policy ``recompute``) frees the blocks
  when it is reported, and the sequence is looked up again, local prefix cache and connector.
* **``None`` skips one sequence.** A connector that does not know yet answers ``None``: that
  sequence keeps its place and the ones behind it are admitted (vLLM's ``skip_request``).
  The sequences a pass skips, and those whose load it starts, go back to the front of their
  queue in the order it visited them.
* **A whole-prompt answer is taken.** vLLM's NIXL decode side and its offloading connector
  may report every prompt token; the last one is then computed again, for the logits: vLLM
  backs ``num_computed_tokens`` off by one once an asynchronous load is done
  (``_update_waiting_for_remote_kv``), and so does the course; loaded synchronously, vLLM
  asserts (``num_new_tokens > 0``: its connectors never answer so) and the course backs off
  the same way.
* **``request_finished`` once per finished sequence,** whether it holds blocks or not (vLLM's
  ``_free_request`` calls ``_connector_finished`` for every finished request): a sequence
  aborted before it was admitted tells the connector at once, with no blocks; it is given
  the blocks of the computed tokens (``get_block_ids_for_computed_tokens``: a load that
  failed leaves blocks past them). A finishing
  sequence's blocks are kept while the connector says a transfer still reads them (through
  the manager's ``free_delay``), until ``get_finished`` reports it done sending.

* **Blocks reserved for loads in flight.** An asynchronous load is admitted only if it fits
  in the free blocks less what every prefill in flight (a load waiting, or a prompt admitted
  and not yet computed) still needs to hold its whole sequence (vLLM's
  ``_inflight_prefill_reserved_blocks``, ``reserved_blocks`` in ``allocate_slots``): a load
  holds its blocks without progress, and two must not starve each other.

**What differs from vLLM 0.33.0, declared.** The reservation is checked by the scheduler
before ``allocate_slots``, for one KV-cache group (the course's ``allocate_slots`` takes no
``reserved_blocks``). A failed load is always recomputed: vLLM's
default ``kv_load_failure_policy`` is ``"fail"`` (``vllm/config/kv_transfer.py``), which
fails the request instead. A sequence aborted while its load is in flight is freed as the
connector's ``request_finished`` says (vLLM keeps the blocks until the load reports done,
whatever the connector answers: ``finish_requests``). ``update_state_after_alloc`` is called
once per lookup (vLLM calls it again, with no external tokens, when it admits a sequence whose
load is done: every admission does). A one-token prompt loaded whole backs off to no token
computed and frees its block before it is looked up again (vLLM keeps the block through that
lookup). Only asynchronous loads are redone when they fail (vLLM also rewinds a running
request whose synchronous load failed, ``_handle_invalid_blocks``: the course's synchronous
loads are copies inside the step). ``tests/fidelity/test_scheduler_declared_differences.py``
shows each against vLLM's own scheduler; ``tests/fidelity/test_vllm_scheduler_fidelity.py``
runs the two step by step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING

from ..config import CacheConfig, SchedulerConfig, config_or_default
from ..memory.radix.kv_cache_manager import RadixKVCacheManager
from ..memory.v1.kv_cache_interface import KVCacheGroupSpec
from ..memory.v1.kv_cache_manager import KVCacheManager
from ..sequence import Request, SamplingParams, Sequence, SequenceStatus
from ..sizing.units import cdiv
from .output import ScheduledSeq, SchedulerOutput
from .output_processor import apply_step

if TYPE_CHECKING:
    from .kv_connector import KVConnectorScheduler

S = SequenceStatus


class SchedulerV1:
    """Continuous batching over a
    :class:`~course_lib.memory.v1.kv_cache_manager.KVCacheManager` (see above), or over
    SGLang's radix tree with ``CacheConfig(prefix_cache="radix")``."""

    def __init__(self, scheduler_config: SchedulerConfig | None = None,
                 cache_config: CacheConfig | None = None,
                 kv_connector: KVConnectorScheduler | None = None,
                 kv_cache_groups: SequenceABC[KVCacheGroupSpec] | None = None) -> None:
        self.config = config_or_default(scheduler_config, SchedulerConfig, "scheduler_config")
        self.cache_config = cc = config_or_default(cache_config, CacheConfig, "cache_config")
        # a hybrid model's KV-cache groups (chapter 14: TinyLlamaConfig.kv_cache_groups); None
        # or one group: one block table a sequence, as every chapter before
        self.hybrid = kv_cache_groups is not None and len(kv_cache_groups) > 1
        if cc.prefix_cache == "radix":
            assert not self.hybrid, "the radix tree has one kind of layer in this course"
            self.kv_cache_manager = RadixKVCacheManager(
                cc.block_size, cc.num_gpu_blocks, cc.enable_prefix_caching, cc.watermark)
        else:
            self.kv_cache_manager = KVCacheManager(
                cc.block_size, cc.num_gpu_blocks, cc.enable_prefix_caching, cc.watermark,
                kv_cache_groups=kv_cache_groups)
        self.block_manager = self.kv_cache_manager   # the name the engine and metrics read
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []            # V1 never swaps: always empty
        self.requests: dict[int, Request] = {}       # seq_id -> its request
        self.num_steps = self.num_preemptions = 0
        self.num_prompt_tokens = self.num_generated_tokens = 0
        self.next_seq_id = 0                         # the id the next new sequence gets
        self.preempted: set[int] = set()             # seq ids preempted since admitted
        # the KV connector (module docstring)
        self.kv_connector = kv_connector
        self.waiting_for_remote: list[Sequence] = []   # WAITING_FOR_REMOTE_KVS, blocks held
        #                               (vLLM's kv_holding_waiting; counted as waiting)
        self.finished_recving_kv_req_ids: set[int] = set()   # their loads, reported done
        self.inflight_prefills: dict[int, Sequence] = {}   # loading, or admitted mid-prompt
        #                               (vLLM's _inflight_prefills: their blocks are reserved)
        if kv_connector is not None:
            if cc.prefix_cache != "hash":
                raise ValueError("a KV connector works with V1's KVCacheManager: use "
                                 "CacheConfig(prefix_cache='hash') (the radix tree has no "
                                 "connector in this course)")
            kv_connector.bind_kv_cache_manager(self.kv_cache_manager)
            self.kv_cache_manager.free_delay = self._delay_free

    # ------------------------------------------------------------------------ requests
    def check_prompt_len(self, prompt_len: int) -> None:
        """Refuse, at the door, a prompt the model cannot continue: longer than
        ``max_model_len``, or exactly as long (no room for one generated token). vLLM 0.33.0's
        input processor does this before a request reaches the scheduler
        (``InputProcessor._validate_prompt_len`` in ``vllm/v1/engine/input_processor.py``,
        whose messages these are); the V0 design (vLLM 0.6.3) queued such a prompt and
        finished it as ignored at scheduling."""
        max_len = self.config.max_model_len
        suggestion = "Make sure that `max_model_len` is no smaller than the number of text tokens"
        if prompt_len > max_len:
            raise ValueError(f"The decoder prompt (length {prompt_len}) is longer than the "
                             f"maximum model length of {max_len}. {suggestion}.")
        if prompt_len == max_len:
            raise ValueError(f"The decoder prompt (length {prompt_len}) plus the number of "
                             f"requested output tokens (at least 1) is longer than the maximum "
                             f"model length of {max_len}. {suggestion} (prompt + requested "
                             f"output tokens).")

    def check_request(self, params: SamplingParams, kv_transfer_params: dict | None) -> None:
        """Refuse, at the door, what this core cannot run: beam search (vLLM runs it outside
        the core, as ``LLM.beam_search``), or ``kv_transfer_params`` without a KV connector or
        for a request of several sequences."""
        if kv_transfer_params is not None:
            if self.kv_connector is None:
                raise ValueError("kv_transfer_params were given but the engine has no KV "
                                 "connector: pass kv_connector=... to the engine")
            if not isinstance(kv_transfer_params, dict) or params.n != 1:
                raise ValueError("kv_transfer_params must be a dict, for a request with n=1 "
                                 f"(got {type(kv_transfer_params).__name__}, n={params.n})")
        if params.use_beam_search:
            raise ValueError("the V1 core runs no beam search (vLLM runs it outside, as "
                             "LLM.beam_search): use course_lib.engine.beam_search.beam_search, "
                             "or the V0 design")

    def add_request(self, request_id: int, prompt_token_ids: SequenceABC[int],
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float = 0.0, cache_salt: str | None = None,
                    kv_transfer_params: dict | None = None) -> Request:
        """Queue a request as ``n`` child sequences (``ValueError`` changes nothing; a prompt
        too long for the model is refused here, see :meth:`check_prompt_len`).
        ``kv_transfer_params``: the KV connector's parameters for this request (vLLM's
        ``Request.kv_transfer_params``), for a request of one sequence."""
        params = sampling_params or SamplingParams()
        self.check_prompt_len(len(prompt_token_ids))
        self.check_request(params, kv_transfer_params)
        req = Request(request_id, tuple(prompt_token_ids), params, arrival_time,
                      cache_salt=cache_salt)
        for index in range(params.n):
            seq = Sequence(self.next_seq_id + index, req.prompt_token_ids, index)
            seq.kv_transfer_params = kv_transfer_params
            req.seqs.append(seq)
            self.requests[seq.seq_id] = req
            self.waiting.append(seq)
        self.next_seq_id += params.n
        return req

    def new_seq_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id - 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_remote)

    def abort_request(self, request_id: int) -> bool:
        return self.finish_request(request_id, S.FINISHED_ABORTED, "aborted by the user")

    def finish_request(self, request_id: int, status: SequenceStatus, detail: str) -> bool:
        """Finish every live sequence of the request (freeing their blocks)."""
        seqs = [s for s in (*self.waiting, *self.running, *self.waiting_for_remote)
                if self.requests[s.seq_id].request_id == request_id]
        if not seqs:
            return False
        req = self.requests[seqs[0].seq_id]
        for seq in seqs:
            self._finish_seq(seq, status)
        req.finish_reason, req.finish_detail = status.finish_reason, detail
        return True

    def _finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        was_running = seq in self.running       # (apply_samples freed its blocks already)
        if was_running:
            self.running.remove(seq)
        elif seq in self.waiting_for_remote:
            self.waiting_for_remote.remove(seq)
        elif self.waiting and self.waiting[0] is seq:
            self.waiting.popleft()                  # ignored at the head of the queue
        elif seq in self.waiting:                   # finished from the queue between steps
            self.waiting.remove(seq)
        if self.kv_connector is not None:
            seq.status = status                     # request_finished is asked when it frees
            self.finished_recving_kv_req_ids.discard(seq.seq_id)
            if not was_running and not self.kv_cache_manager.has_seq(seq.seq_id):
                self._connector_finished(seq, [])   # no blocks to free: asked here
        self.kv_cache_manager.forget(seq.seq_id)
        self.requests.pop(seq.seq_id, None)
        self.preempted.discard(seq.seq_id)
        self.inflight_prefills.pop(seq.seq_id, None)
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
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta(out)
        return out

    def _add_entry(self, out: SchedulerOutput, seq: Sequence, num_new: int,
                   block_ids: list[int]) -> None:
        req = self.requests[seq.seq_id]
        done = seq.num_computed_tokens + num_new == len(seq)      # it samples the next token
        if done:                                # its prefill is over (vLLM's is_prefill_chunk)
            self.inflight_prefills.pop(seq.seq_id, None)
        decode = done and num_new == 1 and bool(seq.output_token_ids)
        tables = self.kv_cache_manager.get_block_tables(seq.seq_id) if self.hybrid else ()
        out.scheduled.append(ScheduledSeq(req, seq, num_new, not decode,
                                          1 if done else 0, block_ids, tables))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.kv_cache_manager.free(seq.seq_id)
        self.inflight_prefills.pop(seq.seq_id, None)
        seq.num_computed_tokens = 0
        seq.status = S.WAITING
        req = self.requests[seq.seq_id]
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted.add(seq.seq_id)
        self.waiting.appendleft(seq)
        out.preempted.append((req.request_id, "recompute"))

    def _never_fits(self, seq: Sequence) -> str | None:
        kvm = self.kv_cache_manager                 # (too-long prompts never got in)
        need, pool = cdiv(len(seq), kvm.block_size), kvm.num_gpu_blocks
        if self.hybrid:            # every group's table, at its most (a window's plateaus)
            need = sum(g.kv_cache_spec.max_admission_blocks_per_request(
                self.config.max_num_batched_tokens, len(seq))
                for g in kvm.coordinator.kv_cache_config.kv_cache_groups)
            pool = kvm.block_pool.num_usable_blocks  # (less the null block)
        if need > pool:                              # alone, no watermark holds (vLLM's rule)
            if seq.output_token_ids:
                return (f"cannot grow: sequence {seq.seq_id} needs {need} of the "
                        f"{pool} GPU blocks; its output stops here")
            return f"needs {need} GPU blocks, the pool has {pool}"
        return None

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> None:
        """Admit waiting sequences while the budget and ``max_num_seqs`` allow, as vLLM 0.33.0's
        waiting loop (``Scheduler.schedule`` in ``vllm/v1/core/sched/scheduler.py``): the
        sequences holding blocks for a connector's load (``waiting_for_remote``, vLLM's
        ``kv_holding_waiting``) are drained first, then ``waiting``. A sequence that cannot run
        yet (its load not reported done, or the connector's lookup answered ``None``) is
        skipped, alone (vLLM's ``skip_request``), and keeps its place for the next step; a
        sequence the pool cannot hold stops the admissions."""
        skipped_holding: list[Sequence] = []
        skipped_waiting: list[Sequence] = []
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            holding = bool(self.waiting_for_remote)
            if not holding and not self.waiting:
                break
            seq = self.waiting_for_remote[0] if holding else self.waiting[0]
            if seq.status == S.WAITING_FOR_REMOTE_KVS:
                if seq.seq_id not in self.finished_recving_kv_req_ids:
                    skipped_holding.append(self.waiting_for_remote.pop(0))   # still loading
                    continue
                self._update_waiting_for_remote_kv(seq)      # loaded: WAITING, admitted now
            admitted = self._admit(seq, budget, out, holding)
            if admitted is None:                             # the pool is short
                break
            if admitted < 0:                                 # the connector asks again later
                skipped_waiting.append(self.waiting_for_remote.pop(0) if holding
                                       else self.waiting.popleft())
                continue
            if seq.status == S.WAITING_FOR_REMOTE_KVS:       # its load starts: it waits,
                skipped_holding.append(seq)                  # in the order it was visited
                continue
            budget -= admitted
        self.waiting_for_remote[:0] = skipped_holding
        self.waiting.extendleft(reversed(skipped_waiting))

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput, holding: bool
               ) -> int | None:
        """Admit ``seq``, the head of ``waiting_for_remote`` (``holding``) or of ``waiting``:
        the tokens it is scheduled (0 for an asynchronous load, which holds its blocks in
        ``waiting_for_remote`` until the load is reported: the caller queues it there, taken
        from its queue here), -1 when the connector's lookup
        answered ``None`` (skip it), None when it does not fit (stop admitting). A sequence
        that never fits is finished here (0)."""
        kvm, conn = self.kv_cache_manager, self.kv_connector
        req = self.requests[seq.seq_id]
        if seq.num_computed_tokens > 0:        # its K/V loaded: no lookup (vLLM's else branch)
            hits, num_hit, num_external, load_async = [], 0, 0, False
            num_computed = seq.num_computed_tokens
        else:
            reason = self._never_fits(seq)
            if reason is not None:
                status = S.FINISHED_LENGTH_CAPPED if seq.output_token_ids else S.FINISHED_IGNORED
                self._finish_seq(seq, status)
                if req.is_finished:
                    req.finish_reason, req.finish_detail = status.finish_reason, reason
                    out.ignored.append(req)
                return 0
            hits, num_hit = kvm.get_computed_blocks(seq.seq_id, seq.token_ids, req.cache_salt)
            num_external, load_async = 0, False
            if conn is not None:                  # external hits, after the local ones
                num_external, load_async = conn.get_num_new_matched_tokens(seq, num_hit)
                if num_external is None:          # not known yet: this sequence alone waits
                    return -1
                load_async = load_async and num_external > 0
            num_computed = num_hit + num_external
            if not load_async and num_computed == len(seq):
                # the whole prompt from the connector, loaded now: its last token is computed
                # again, for the logits (vLLM 0.33.0 asserts here; it backs off by one only
                # after an asynchronous load, in _update_waiting_for_remote_kv: see the
                # module docstring)
                num_computed -= 1
        num_new = 0 if load_async else len(seq) - num_computed
        if not self.config.enable_chunked_prefill and num_new > budget:
            return None
        num_new = min(num_new, budget)
        if load_async and self._reserved_blocks_short(hits, num_hit + num_external):
            return None
        # the watermark holds only while some request runs (vLLM's has_scheduled_reqs)
        # K/V loaded between steps: its blocks enter the cache once they are loaded
        ids = kvm.allocate_slots(seq.seq_id, seq.token_ids, seq.num_computed_tokens,
                                 num_computed - num_hit - seq.num_computed_tokens + num_new,
                                 hits, admission=bool(self.running),
                                 delay_cache_blocks=load_async)
        if ids is None:
            return None
        if holding:
            self.waiting_for_remote.pop(0)
        else:
            self.waiting.popleft()
        if seq.num_computed_tokens == 0:
            # vLLM counts a re-admission after a preemption apart (PrefixCacheStats.record)
            kvm.record_prefix_cache_stats(len(seq), num_hit,
                                          preempted=seq.seq_id in self.preempted)
            if conn is not None:
                conn.update_state_after_alloc(seq, ids, num_external)
            if req.first_scheduled_time is None and seq.index == 0:
                req.num_cached_tokens = num_computed
            seq.num_computed_tokens = num_computed
            if load_async:                        # runs once the worker reports the load
                seq.status = S.WAITING_FOR_REMOTE_KVS
                self.inflight_prefills[seq.seq_id] = seq
                return 0
        seq.status = S.RUNNING
        self.running.append(seq)
        if seq.num_computed_tokens + num_new < len(seq):   # still prefilling after this step
            self.inflight_prefills[seq.seq_id] = seq
        self._add_entry(out, seq, num_new, ids)
        return num_new

    def _reserved_blocks_short(self, hits: list, num_tokens: int) -> bool:
        """Whether an asynchronous load of ``num_tokens`` tokens (``hits``: its local prefix
        hit, blocks) would take blocks the prefills in flight still need: vLLM 0.33.0 admits
        such a load only if it fits in the free blocks less every in-flight prefill's
        remaining blocks (``_inflight_prefill_reserved_blocks`` in
        ``vllm/v1/core/sched/scheduler.py``, ``reserved_blocks`` in ``allocate_slots``): a
        load holds its blocks without progress and cannot be preempted, so two of them must
        not starve each other. The course's ``allocate_slots`` takes no reservation, so the
        scheduler checks it first, counting as ``allocate_slots`` does (the new blocks, and
        the hit's blocks that are free: touching them takes them from the free queue; one
        KV-cache group)."""
        kvm = self.kv_cache_manager
        bs = kvm.block_size
        reserved = 0
        for seq_id, seq in self.inflight_prefills.items():
            held = len(kvm.req_to_block_ids.get(seq_id, ()))
            reserved += max(0, cdiv(min(len(seq), self.config.max_model_len), bs) - held)
        needed = max(0, cdiv(num_tokens, bs) - len(hits)) + \
            sum(1 for b in hits if b.ref_cnt == 0)
        watermark = kvm.watermark_blocks if self.running else 0
        return needed + watermark > kvm.num_free_gpu_blocks - reserved

    # --------------------------------------------------------------------------- update
    def update(self, out: SchedulerOutput,
               samples: Mapping[int, SequenceABC[tuple[int, float]]],
               now: float = 0.0) -> list[Request]:
        """Apply a step's results (as ``Scheduler.update``): advance the computed tokens,
        append the sampled ones, finish sequences that stopped; returns the requests that
        finished now (ignored ones included). The loop is ``output_processor.apply_step``,
        shared with the V0 scheduler; it takes each finished sequence out of its queues. Over
        the hash chain nothing is cached here (``allocate_slots`` caches full blocks as it
        hands them out, as vLLM does); over the radix tree each sequence's computed blocks
        enter the tree now, after the step ran (:meth:`_cache_computed`)."""
        radix = self.cache_config.prefix_cache == "radix"
        return apply_step(self, out, samples, now,
                          on_computed=self._cache_computed if radix else None,
                          on_sampled=self._drop_finished)

    # ------------------------------------------------------------------ the KV connector
    def update_from_kv_xfer_finished(self, finished_sending: set[int] | None,
                                     finished_recving: set[int] | None,
                                     invalid_block_ids: set[int] | None = None) -> None:
        """The worker side's ``get_finished``, after a step (vLLM's
        ``_update_from_kv_xfer_finished``): the blocks of sequences done sending are freed
        now; sequences done receiving run from the next ``schedule()``.
        ``invalid_block_ids``: blocks whose load failed (the connector's
        ``get_block_ids_with_load_errors``): a sequence holding one computes again from its
        first such block (vLLM's ``_update_requests_with_invalid_blocks``, policy
        ``recompute``; vLLM's default policy is ``"fail"``: module docstring)."""
        for seq_id in finished_sending or ():
            self.kv_cache_manager.free_delayed(seq_id)
        if invalid_block_ids:
            self._recompute_invalid_blocks(invalid_block_ids)
        if finished_recving:                    # (not those aborted meanwhile)
            self.finished_recving_kv_req_ids |= {
                s.seq_id for s in self.waiting_for_remote
                if s.seq_id in finished_recving and s.status == S.WAITING_FOR_REMOTE_KVS}

    def _recompute_invalid_blocks(self, invalid_block_ids: set[int]) -> None:
        """Each waiting-for-remote sequence holding a block whose load failed keeps only the
        tokens before that block as computed; the rest are computed again when it runs."""
        bs, kvm = self.cache_config.block_size, self.kv_cache_manager
        for seq in self.waiting_for_remote:
            if seq.status != S.WAITING_FOR_REMOTE_KVS:
                continue
            ids = kvm.req_to_block_ids[seq.seq_id]
            bad = next((i for i, b in enumerate(ids) if b in invalid_block_ids), None)
            if bad is not None and bad * bs < seq.num_computed_tokens:
                seq.num_computed_tokens = bad * bs

    def _update_waiting_for_remote_kv(self, seq: Sequence) -> None:
        """``seq``'s load was reported done: it goes back to WAITING, holding its blocks, and
        the waiting loop admits it now (vLLM 0.33.0's ``_update_waiting_for_remote_kv``,
        called from ``_handle_blocked_waiting_request``). The blocks that arrived enter the
        prefix cache (``allocate_slots`` delayed it: they held nothing yet), as many as its
        computed tokens say (a failed load cut them back); a load that failed from its first
        block frees them all, and the sequence is looked up again, local prefix cache and
        connector. A whole prompt loaded backs off by one token: the last one is computed
        again, for the logits."""
        kvm = self.kv_cache_manager
        if seq.num_computed_tokens:
            kvm.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if seq.num_computed_tokens == len(seq):
            seq.num_computed_tokens -= 1
        if not seq.num_computed_tokens:     # none (or a one-token prompt, backed off): looked
            kvm.free(seq.seq_id)            # up again (not finished: no request_finished)
        self.finished_recving_kv_req_ids.discard(seq.seq_id)
        seq.status = S.WAITING

    def _connector_finished(self, seq: Sequence, block_ids: list[int]) -> bool:
        """Tell the connector ``seq`` finished (``request_finished``, once per finished
        sequence, whether it holds blocks or not: vLLM 0.33.0's ``_connector_finished``, called
        by ``_free_request`` for every finished request); its transfer parameters go to the
        request's output. True: a transfer still reads the blocks."""
        delay, params = self.kv_connector.request_finished(seq, block_ids)
        if params is not None:                  # for the request's output (vLLM's too)
            self.requests[seq.seq_id].kv_transfer_output = params
        return delay

    def _delay_free(self, seq_id: int, block_ids: list[int]) -> bool:
        """The manager's ``free_delay``: a finished sequence's blocks are kept when the
        connector's ``request_finished`` says a transfer still reads them (a preempted
        sequence's are not: it is not finished)."""
        req = self.requests.get(seq_id)
        seq = next((s for s in req.seqs if s.seq_id == seq_id), None) if req else None
        if seq is None or not seq.status.is_finished:
            return False
        # the blocks of its computed tokens (vLLM's get_block_ids_for_computed_tokens): a load
        # that failed left blocks that hold nothing
        return self._connector_finished(
            seq, block_ids[:cdiv(seq.num_computed_tokens, self.cache_config.block_size)])

    def _cache_computed(self, e: ScheduledSeq) -> None:
        """The radix design, after the step: a sequence whose step completed a block tells the
        tree what it has computed (SGLang's ``checkpoint_kv_cache``), which inserts the full
        blocks, frees the sequence's duplicates of blocks it held already and switches its
        table onto the tree's copies: the next step's ``block_ids`` are the switched ones."""
        seq, bs = e.seq, self.cache_config.block_size
        if seq.num_computed_tokens // bs > (seq.num_computed_tokens - e.num_tokens) // bs:
            self.kv_cache_manager.cache_computed(seq.seq_id, seq.token_ids,
                                                 seq.num_computed_tokens,
                                                 len(seq.prompt_token_ids))

    def _drop_finished(self, entries: list[ScheduledSeq]) -> None:
        """Take the sequences of one request that finished in this step out of ``running``
        (``apply_step`` calls it right after the request's samples are applied)."""
        for e in entries:
            if e.seq.is_finished:                     # apply_samples freed its blocks
                self._finish_seq(e.seq, e.seq.status)

    # --------------------------------------------------------------------------- checks
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
        for seq in self.waiting_for_remote:     # loading, or loaded and not yet admitted
            assert seq.status in (S.WAITING_FOR_REMOTE_KVS, S.WAITING), \
                f"seq {seq.seq_id}: {seq.status}"
            holds = seq.status == S.WAITING_FOR_REMOTE_KVS or seq.num_computed_tokens > 0
            assert kvm.has_seq(seq.seq_id) == holds, \
                f"seq {seq.seq_id} ({seq.status}, {seq.num_computed_tokens} computed): blocks " \
                f"{kvm.has_seq(seq.seq_id)}"
        assert set(kvm.seq_ids()) == {s.seq_id for s in (*self.running,
                                                         *self.waiting_for_remote)
                                      if kvm.has_seq(s.seq_id)}, \
            "block tables of sequences no queue holds"
        assert self.finished_recving_kv_req_ids <= {
            s.seq_id for s in self.waiting_for_remote if s.status == S.WAITING_FOR_REMOTE_KVS}
        # (a load failed from its first block leaves its sequence waiting, still reserved:
        # vLLM 0.33.0 keeps it in _inflight_prefills too)
        assert self.inflight_prefills.keys() <= {s.seq_id for s in (
            *self.running, *self.waiting_for_remote, *self.waiting)}
        if self.kv_connector is not None and hasattr(self.kv_connector, "check_invariants"):
            self.kv_connector.check_invariants()
        assert len(self.running) <= self.config.max_num_seqs
