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
this happens), as vLLM 0.33.0's scheduler: after the local prefix-cache hit of a waiting
sequence, the connector is asked for more (``get_num_new_matched_tokens``); blocks are
allocated for those external tokens too (they count as computed, not against the token
budget) and the connector told which (``update_state_after_alloc``). A sequence whose external
tokens load asynchronously waits in ``waiting_for_remote`` (status
``WAITING_FOR_REMOTE_KVS``; vLLM 0.33.0's ``kv_holding_waiting`` queue) until the worker side
reports the load done (``get_finished``, handed in by
:meth:`SchedulerV1.update_from_kv_xfer_finished`); then it runs. Each
``schedule()`` ends with ``build_connector_meta``, carried by the output. A finishing sequence's
blocks are kept while the connector says a transfer still reads them (``request_finished``,
through the manager's ``free_delay``), until ``get_finished`` reports it done sending.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING

from ..config import CacheConfig, SchedulerConfig, config_or_default
from ..memory.radix.kv_cache_manager import RadixKVCacheManager
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
                 kv_connector: KVConnectorScheduler | None = None) -> None:
        self.config = config_or_default(scheduler_config, SchedulerConfig, "scheduler_config")
        self.cache_config = cc = config_or_default(cache_config, CacheConfig, "cache_config")
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
        self.next_seq_id = 0                         # the id the next new sequence gets
        self.preempted: set[int] = set()             # seq ids preempted since admitted
        # the KV connector (module docstring)
        self.kv_connector = kv_connector
        self.waiting_for_remote: list[Sequence] = []   # WAITING_FOR_REMOTE_KVS, blocks held
        #                               (vLLM's kv_holding_waiting; counted as waiting)
        self.finished_recving_kv_req_ids: set[int] = set()   # their loads, reported done
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
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting_for_remote:
            self.waiting_for_remote.remove(seq)
        elif self.waiting and self.waiting[0] is seq:
            self.waiting.popleft()                  # ignored at the head of the queue
        elif seq in self.waiting:                   # finished from the queue between steps
            self.waiting.remove(seq)
        if self.kv_connector is not None:
            seq.status = status                     # request_finished is asked when it frees
        self.kv_cache_manager.forget(seq.seq_id)
        self.requests.pop(seq.seq_id, None)
        self.preempted.discard(seq.seq_id)
        seq.status = status

    # ------------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work; allocates, and preempts by recompute when short."""
        out = SchedulerOutput(self.num_steps)
        self.num_steps += 1
        if self.finished_recving_kv_req_ids:
            self._update_waiting_for_remote_kv()
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
        kvm = self.kv_cache_manager                 # (too-long prompts never got in)
        need = cdiv(len(seq), kvm.block_size)
        if need > kvm.num_gpu_blocks:                # alone, no watermark holds (vLLM's rule)
            if seq.output_token_ids:
                return (f"cannot grow: sequence {seq.seq_id} needs {need} of the "
                        f"{kvm.num_gpu_blocks} GPU blocks; its output stops here")
            return f"needs {need} GPU blocks, the pool has {kvm.num_gpu_blocks}"
        return None

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> None:
        kvm = self.kv_cache_manager
        conn = self.kv_connector
        while self.waiting and budget > 0 and \
                len(self.running) + len(self.waiting_for_remote) < self.config.max_num_seqs:
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
            num_external, load_async = 0, False
            if conn is not None:                  # external hits, after the local ones
                num_external, load_async = conn.get_num_new_matched_tokens(seq, num_hit)
                if num_external is None:          # the connector does not know yet
                    break
            num_computed = num_hit + num_external
            num_new = 0 if load_async else len(seq) - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            # the watermark holds only while some request runs (vLLM's has_scheduled_reqs)
            # K/V loaded between steps: its blocks enter the cache once they are loaded
            ids = kvm.allocate_slots(seq.seq_id, seq.token_ids, 0, num_external + num_new,
                                     hits, admission=bool(self.running),
                                     delay_cache_blocks=load_async)
            if ids is None:
                break
            self.waiting.popleft()
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
                self.waiting_for_remote.append(seq)
                continue
            seq.status = S.RUNNING
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
        ``recompute``)."""
        for seq_id in finished_sending or ():
            self.kv_cache_manager.free_delayed(seq_id)
        if invalid_block_ids:
            self._recompute_invalid_blocks(invalid_block_ids)
        if finished_recving:
            self.finished_recving_kv_req_ids |= finished_recving

    def _recompute_invalid_blocks(self, invalid_block_ids: set[int]) -> None:
        """Each waiting-for-remote sequence holding a block whose load failed keeps only the
        tokens before that block as computed; the rest are computed again when it runs."""
        bs, kvm = self.cache_config.block_size, self.kv_cache_manager
        for seq in self.waiting_for_remote:
            ids = kvm.req_to_block_ids[seq.seq_id]
            bad = next((i for i, b in enumerate(ids) if b in invalid_block_ids), None)
            if bad is not None and bad * bs < seq.num_computed_tokens:
                seq.num_computed_tokens = bad * bs

    def _update_waiting_for_remote_kv(self) -> None:
        """Sequences whose external K/V arrived run now: the blocks that arrived enter the
        prefix cache (``allocate_slots`` delayed it: they held nothing yet), and their computed
        tokens stay as set at admission, or as a failed load cut them back; the running loop
        gives them their remaining tokens."""
        done, kvm = self.finished_recving_kv_req_ids, self.kv_cache_manager
        for seq in [s for s in self.waiting_for_remote if s.seq_id in done]:
            kvm.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            self.waiting_for_remote.remove(seq)
            seq.status = S.RUNNING
            self.running.append(seq)
        self.finished_recving_kv_req_ids = set()    # (the others were aborted meanwhile)

    def _delay_free(self, seq_id: int, block_ids: list[int]) -> bool:
        """The manager's ``free_delay``: a finished sequence's blocks are kept when the
        connector's ``request_finished`` says a transfer still reads them (a preempted
        sequence's are not: it is not finished)."""
        req = self.requests.get(seq_id)
        seq = next((s for s in req.seqs if s.seq_id == seq_id), None) if req else None
        if seq is None or not seq.status.is_finished:
            return False
        delay, params = self.kv_connector.request_finished(seq, block_ids)
        if params is not None:                  # for the request's output (vLLM's too)
            req.kv_transfer_output = params
        return delay

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
        for seq in self.waiting_for_remote:
            assert seq.status == S.WAITING_FOR_REMOTE_KVS, f"seq {seq.seq_id}: {seq.status}"
            assert kvm.has_seq(seq.seq_id), f"seq {seq.seq_id} waits for K/V without blocks"
        assert set(kvm.seq_ids()) == {s.seq_id for s in (*self.running,
                                                         *self.waiting_for_remote)}, \
            "block tables of sequences no queue holds"
        if self.kv_connector is not None and hasattr(self.kv_connector, "check_invariants"):
            self.kv_connector.check_invariants()
        assert len(self.running) <= self.config.max_num_seqs
