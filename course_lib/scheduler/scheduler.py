"""The V0 scheduler: which sequences run in the next step, and what the step changed.

The shape of vLLM V0's ``Scheduler`` (``vllm/core/scheduler.py``: ``_schedule_running`` /
``_schedule_swapped`` / ``_schedule_prefills`` / ``_preempt``), simplified, in one class that
reads top to bottom: construction, :meth:`Scheduler.schedule` and its passes, preemption,
:meth:`Scheduler.update`, the request queues, ``check_invariants``.

One step is two calls. :meth:`Scheduler.schedule` decides the batch:

1. **Running** requests, decodes first, then prefill chunks, in arrival order. A decode needs
   a slot per sequence (maybe a new block, maybe a copy-on-write copy); when the GPU pool is
   short, a victim is preempted (default: the request that arrived last) until it fits.
2. **Swapped** requests come back (swap in) if nothing was preempted in this step.
3. **Waiting** requests are admitted (their whole prompt gets blocks, cache hits reused) if
   nothing was preempted and nothing is swapped out, within what is left of the budget.

Then the model runs, and :meth:`Scheduler.update` applies what it sampled: it marks the
computed blocks (prefix cache), appends tokens, forks samples and beams, and frees finished
sequences (the loop it shares with the V1 scheduler is ``output_processor.apply_step``).

Contract with the engine that executes a :class:`SchedulerOutput`: run
``blocks_to_swap_out`` first (the freed GPU blocks may be reused in the same step), then
``blocks_to_swap_in`` and ``blocks_to_copy``, then the forward pass; then call ``update`` with
the sampled tokens. The scheduler holds no recovery code: if a step fails, the engine throws
this scheduler away and builds a new one, every request recomputed (``engine/recovery.py``).

Collaborators, each in its own module: the knobs (``config.py``), the budget and the victim
policies (``policy.py``), room checks and never-fit reasons (``admission.py``), the plain
:class:`SchedulerOutput` (``output.py``), sampled tokens applied (``output_processor.py``), and
the block manager that owns the block tables (``FastBlockManager``, the twin of
:class:`~course_lib.memory.v0.manager.BlockManager` in ``memory/v0/fast.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC

from ..config import CacheConfig, SchedulerConfig, config_or_default
from ..memory.common import AllocStatus
from ..memory.v0.fast import FastBlockManager
from ..sequence import Request, SamplingParams, Sequence, SequenceStatus
from . import admission as checks
from .output import ScheduledSeq, SchedulerOutput
from .output_processor import apply_step
from .policy import SchedulingBudget, VictimPolicy, last_arrived_first

__all__ = ["Scheduler"]

S = SequenceStatus


def _fcfs(r: Request) -> tuple[float, int]:
    return (r.arrival_time, r.request_id)


class Scheduler:
    """Decides each step's batch and owns the :class:`BlockManager` (``self.block_manager``).

    Reading order: construction; ``schedule`` and its ``_schedule_*`` passes; ``_preempt``;
    ``update``; the queues (``add_request``, ``abort_request``, ``finish_request``, ``_finish``);
    ``check_invariants``."""

    def __init__(self, scheduler_config: SchedulerConfig | None = None,
                 cache_config: CacheConfig | None = None,
                 victim_policy: VictimPolicy = last_arrived_first) -> None:
        self.config = config_or_default(scheduler_config, SchedulerConfig, "scheduler_config")
        self.cache_config = cc = config_or_default(cache_config, CacheConfig, "cache_config")
        if cc.prefix_cache != "hash":
            raise ValueError(f"prefix_cache={cc.prefix_cache!r} is a V1-design option; the V0 "
                             "design keeps its own verified hash chain (use 'hash')")
        self.block_manager = FastBlockManager(cc.block_size, cc.num_gpu_blocks,
                                              cc.num_cpu_blocks, cc.watermark,
                                              cc.enable_prefix_caching)
        self.victim_policy = victim_policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.num_steps = 0
        self.num_preemptions = 0           # vllm:num_preemptions_total
        self.num_prompt_tokens = 0         # vllm:prompt_tokens_total (recomputed ones included)
        self.num_generated_tokens = 0      # vllm:generation_tokens_total
        self.next_seq_id = 0               # the id the next new sequence gets

    # ------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work; changes block tables (allocate, append, swap, free)."""
        out = SchedulerOutput(self.num_steps)
        self.num_steps += 1
        cfg, bm = self.config, self.block_manager
        budget = SchedulingBudget(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.running.sort(key=_fcfs)
        prefill = {id(r) for r in self.running if r.is_prefill}
        queue = deque([r for r in self.running if id(r) not in prefill]
                      + [r for r in self.running if id(r) in prefill])
        kept: list[Request] = []
        while queue:
            req = queue.popleft()
            if id(req) in prefill:
                self._schedule_prefill(req, budget, out)
                kept.append(req)
                continue
            seqs = req.unfinished_seqs
            if not budget.can_schedule(len(seqs), len(seqs)):
                kept.append(req)        # stays running, waits for a step with room
                continue
            ids, tokens = [s.seq_id for s in seqs], [s.last_token_id for s in seqs]
            while (grown := bm.append_decode(ids, tokens)) is None:    # no room: preempt
                victim = self.victim_policy([req, *queue])
                if victim is req and not queue and not kept:   # alone and still too big: its
                    # output stops here, like a length cap (vLLM V0 reports it as "length")
                    self._finish(req, S.FINISHED_LENGTH_CAPPED, checks.too_big_to_grow(bm, req))
                    out.ignored.append(req)
                    break
                if victim is not req:
                    queue.remove(victim)
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._schedule_decode(req, seqs, grown, budget, out)
                kept.append(req)
        self.running = kept
        if not out.preempted:
            self._schedule_swapped(budget, out)
        if not out.preempted and not self.swapped:
            self._schedule_waiting(budget, out)
        return out

    def _schedule_decode(self, req: Request, seqs: list[Sequence],
                         grown: tuple[list[tuple[int, int]], list[list[int]]],
                         budget: SchedulingBudget, out: SchedulerOutput) -> None:
        """``grown``: what ``BlockManager.append_decode`` returned for these sequences (the
        copy-on-write copies, each sequence's block table): vLLM V0 asks ``can_append_slots``,
        ``append_slots`` and ``get_block_table``, the course one fused call."""
        num_candidates = req.sampling_params.num_candidates(first_token=False)
        copies, tables = grown
        out.blocks_to_copy += copies
        for seq, block_ids in zip(seqs, tables, strict=True):
            out.scheduled.append(ScheduledSeq(req, seq, 1, False, num_candidates, block_ids))
        budget.add(len(seqs), len(seqs))

    def _schedule_prefill(self, req: Request, budget: SchedulingBudget,
                          out: SchedulerOutput) -> None:
        """Prefill chunks of the sequences that still need them (their blocks are there)."""
        seqs = req.unfinished_seqs
        # reserve the sequences the request will run once its prompt forks (vLLM v0's
        # get_max_num_running_seqs), so that its first decode finds room in the batch
        reserve = max(len(seqs), req.sampling_params.num_seqs)
        if reserve > budget.remaining_seqs:
            return
        # In sample order, and a sequence gets a chunk only once every earlier one's prefill
        # is complete in this step (a partial chunk uses up the budget, then we stop): so a
        # sequence re-admitted sharing an earlier one's first blocks (allocate_group) never
        # runs before the step that writes them (in one forward, each layer writes the whole
        # batch's K/V before it attends).
        left, entries = budget.remaining_tokens, []
        for seq in seqs:
            if not seq.needs_prefill:
                continue
            remaining = seq.prefill_target - seq.num_computed_tokens
            if self.config.enable_chunked_prefill:
                chunk = min(remaining, left)
            else:
                chunk = remaining if remaining <= left else 0
            if chunk == 0:
                break
            left -= chunk
            num_candidates = 0
            if chunk == remaining and not seq.output_token_ids:   # the prompt's last chunk
                num_candidates = req.sampling_params.num_candidates(first_token=True)
            entries.append(ScheduledSeq(req, seq, chunk, True, num_candidates,
                                        self.block_manager.get_block_table(seq.seq_id)))
        if entries:
            out.scheduled += entries
            budget.add(sum(e.num_tokens for e in entries), reserve)

    def _schedule_swapped(self, budget: SchedulingBudget, out: SchedulerOutput) -> None:
        bm = self.block_manager
        self.swapped.sort(key=_fcfs)
        while self.swapped:
            req = self.swapped[0]
            seqs = req.unfinished_seqs
            status = bm.can_swap_in(s.seq_id for s in seqs)
            if status is AllocStatus.NEVER:
                self.swapped.pop(0)
                self._finish(req, S.FINISHED_IGNORED, checks.too_big_to_swap_in(bm, req))
                out.ignored.append(req)
                continue
            if status is AllocStatus.LATER or not budget.can_schedule(len(seqs), len(seqs)):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in += bm.swap_in([s.seq_id for s in seqs])
            for seq in seqs:
                seq.status = S.RUNNING
            grown = bm.append_decode([s.seq_id for s in seqs], [s.last_token_id for s in seqs])
            if grown is None:       # can_swap_in counted the next decode: cannot happen
                raise RuntimeError(f"request {req.request_id}: no room to decode after swap-in")
            self._schedule_decode(req, seqs, grown, budget, out)
            self.running.append(req)

    def _schedule_waiting(self, budget: SchedulingBudget, out: SchedulerOutput) -> None:
        bm, cfg = self.block_manager, self.config
        while self.waiting:
            req = self.waiting[0]
            seqs = req.unfinished_seqs
            status = checks.can_allocate(bm, req, seqs)
            reason = checks.never_fits(cfg, bm, req, status)
            if reason is not None:
                self.waiting.popleft()
                self._finish(req, S.FINISHED_IGNORED, reason)
                out.ignored.append(req)
                continue
            if status == AllocStatus.LATER \
                    or max(len(seqs), req.sampling_params.num_seqs) > budget.remaining_seqs \
                    or budget.remaining_tokens == 0:
                break
            if not cfg.enable_chunked_prefill and \
                    seqs[0].prefill_target > budget.remaining_tokens:
                break
            self.waiting.popleft()
            shares = bm.allocate_group(
                [(s.seq_id, t) for s, t in zip(seqs, checks.prefill_tokens(seqs), strict=True)],
                checks.salt(req))
            if req.first_scheduled_time is None:
                req.num_cached_tokens = shares[0][0]
            for seq, (done, _) in zip(seqs, shares, strict=True):
                seq.num_computed_tokens = min(done, seq.prefill_target - 1)  # the last makes logits
                seq.status = S.RUNNING
            self._schedule_prefill(req, budget, out)
            self.running.append(req)

    # -------------------------------------------------------------------------- preempt
    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Take ``req``'s blocks away: swap them to the CPU pool (``preemption_mode="swap"``,
        a request past its prefill, room in the CPU pool), or free them and send the request
        to the front of ``waiting`` to be computed again (recompute)."""
        bm, ids = self.block_manager, [s.seq_id for s in req.unfinished_seqs]
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap" and not req.is_prefill and bm.can_swap_out(ids):
            out.blocks_to_swap_out += bm.swap_out(ids)
            for seq in req.unfinished_seqs:
                seq.status = S.SWAPPED
            self.swapped.append(req)
            out.preempted.append((req.request_id, "swap"))
            return
        for seq in req.unfinished_seqs:                 # recompute: forget the K/V
            bm.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = S.WAITING
        self.waiting.appendleft(req)                    # first in line when room comes back
        out.preempted.append((req.request_id, "recompute"))

    # --------------------------------------------------------------------------- update
    def update(self, out: SchedulerOutput,
               samples: Mapping[int, SequenceABC[tuple[int, float]]],
               now: float = 0.0) -> list[Request]:
        """Apply a step's results: ``samples[seq_id]`` holds the (token, logprob) candidates
        of each scheduled entry with ``num_candidates > 0``. Returns the requests finished now.
        Counts the prompt tokens computed and the tokens generated (``num_prompt_tokens``,
        ``num_generated_tokens``: what ``vllm:prompt_tokens`` / ``generation_tokens`` count).

        The loop is ``output_processor.apply_step``, shared with the V1 scheduler; the V0
        scheduler adds the prefix cache's marks (``_mark_computed``) and takes the finished
        requests out of ``running``."""
        finished = apply_step(self, out, samples, now, on_computed=self._mark_computed)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
        return finished

    def _mark_computed(self, e: ScheduledSeq) -> None:
        """Mark ``e``'s full computed blocks for the prefix cache, once its tokens count as
        computed: a decode token fills no block unless it is a block's last, so then there is
        nothing to mark."""
        seq = e.seq
        if e.is_prefill or seq.num_computed_tokens % self.cache_config.block_size == 0:
            self.block_manager.mark_blocks_as_computed(seq.seq_id, seq.num_computed_tokens)

    # --------------------------------------------------------------------------- queues
    # Outside a step: requests come in (``waiting``), are finished from wherever they are
    # (aborted, failed, ignored), and the three queues agree with the block tables.
    def add_request(self, request_id: int, prompt_token_ids: SequenceABC[int],
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float = 0.0, cache_salt: str | None = None) -> Request:
        """Queue a request (checked first: ``ValueError`` changes nothing). Requests with the
        same ``cache_salt`` (vLLM's name) share prefix-cache blocks, others never do."""
        req = Request(request_id, tuple(prompt_token_ids), sampling_params or SamplingParams(),
                      arrival_time, cache_salt=cache_salt)
        req.seqs.append(Sequence(self.new_seq_id(), req.prompt_token_ids, 0))
        self.waiting.append(req)
        return req

    def new_seq_id(self) -> int:
        """A fresh sequence id: a request's first sequence, a forked sample or beam."""
        self.next_seq_id += 1
        return self.next_seq_id - 1

    def abort_request(self, request_id: int) -> bool:
        """Finish a request wherever it is, freeing its blocks; False if it is not here."""
        return self.finish_request(request_id, S.FINISHED_ABORTED, "aborted by the user")

    def finish_request(self, request_id: int, status: SequenceStatus, detail: str) -> bool:
        """Take a request out of its queue and finish it with ``status`` (``detail``: why),
        freeing its blocks; False if it is not queued here."""
        for queue in (self.waiting, self.running, self.swapped):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._finish(req, status, detail)
                    return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.unfinished_seqs) for r in self.running)

    def _finish(self, req: Request, status: SequenceStatus, detail: str) -> None:
        """Finish every live sequence of ``req`` with ``status`` (its short code becomes the
        request's ``finish_reason``) and free their blocks; ``detail`` says why."""
        for seq in req.unfinished_seqs:
            if self.block_manager.has_seq(seq.seq_id):
                self.block_manager.free(seq.seq_id)
            seq.status = status
        req.finish_reason, req.finish_detail = status.finish_reason, detail

    # --------------------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Every queued sequence has the status of its queue; running ones hold GPU tables,
        swapped ones CPU tables, waiting ones none; no table belongs to no queue; and the
        block manager's own invariants. Call it after schedule() or update() (tests)."""
        bm = self.block_manager
        bm.check_invariants()
        held: set[int] = set()
        for queue, status, device in ((self.running, S.RUNNING, "gpu"),
                                      (self.swapped, S.SWAPPED, "cpu"),
                                      (self.waiting, S.WAITING, None)):
            for req in queue:
                assert not req.is_finished, f"request {req.request_id} finished but queued"
                for seq in req.unfinished_seqs:
                    assert seq.status == status, f"seq {seq.seq_id}: {seq.status} in {status}"
                    if device is None:
                        assert not bm.has_seq(seq.seq_id), f"waiting seq {seq.seq_id} has blocks"
                        continue
                    table = bm.get_table(seq.seq_id)
                    assert table.device == device, f"seq {seq.seq_id} on {table.device}"
                    assert seq.num_computed_tokens <= table.num_tokens <= len(seq), \
                        f"seq {seq.seq_id}: {seq.num_computed_tokens} computed, " \
                        f"{table.num_tokens} in its table, {len(seq)} tokens"
                    held.add(seq.seq_id)
        assert held == set(bm.seq_ids()), "block tables of sequences no queue holds"
