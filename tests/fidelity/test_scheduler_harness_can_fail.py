"""The scheduler harness can fail: broken variants of the course's ``SchedulerV1``, each one a
difference issue 34 found between the course and vLLM 0.33.0's ``Scheduler`` before it was fixed
(or one the harness found after), are each caught on the random traces of
test_vllm_scheduler_fidelity.py."""

from __future__ import annotations

import random
import types

import pytest
from harness import Mismatch, run_lockstep
from scheduler_twins import CourseTwin, RealTwin, random_trace

from course_lib.scheduler.v1 import SchedulerV1
from course_lib.sequence import SequenceStatus

S = SequenceStatus


class CountsLoadsAgainstMaxNumSeqs(SchedulerV1):
    """Requests waiting for remote K/V take seats of ``max_num_seqs`` (vLLM's
    ``kv_holding_waiting`` is a waiting queue)."""

    def _schedule_waiting(self, budget, out):
        config = self.config
        loading = sum(s.status == S.WAITING_FOR_REMOTE_KVS for s in self.waiting_for_remote)
        self.config = types.SimpleNamespace(**{**vars(config),
                                               "max_num_seqs": config.max_num_seqs - loading})
        try:
            super()._schedule_waiting(budget, out)
        finally:
            self.config = config


class LoadedStraightToRunning(SchedulerV1):
    """A loaded request goes to the end of ``running`` when its load is reported (vLLM sets it
    back to WAITING and its waiting loop admits it, if it fits)."""

    def update_from_kv_xfer_finished(self, finished_sending, finished_recving,
                                     invalid_block_ids=None):
        super().update_from_kv_xfer_finished(finished_sending, finished_recving,
                                             invalid_block_ids)
        for seq in [s for s in self.waiting_for_remote
                    if s.seq_id in self.finished_recving_kv_req_ids]:
            self._update_waiting_for_remote_kv(seq)
            if seq.num_computed_tokens:
                self.waiting_for_remote.remove(seq)
                seq.status = S.RUNNING
                self.running.append(seq)


class NoReservationForLoads(SchedulerV1):
    """An asynchronous load is admitted whatever the prefills in flight still need (vLLM's
    ``_inflight_prefill_reserved_blocks``)."""

    def _reserved_blocks_short(self, hits, num_tokens):
        return False


class NoLookupAfterAFirstBlockFailure(SchedulerV1):
    """A load failed from its first block: the request is computed from token 0, without
    asking the connector again (vLLM looks it up again, local prefix cache and connector)."""

    def _update_waiting_for_remote_kv(self, seq):
        super()._update_waiting_for_remote_kv(seq)
        if seq.num_computed_tokens == 0:
            self.__dict__.setdefault("no_lookup", set()).add(seq.seq_id)

    def _admit(self, seq, budget, out, holding):
        if seq.seq_id not in self.__dict__.get("no_lookup", ()):
            return super()._admit(seq, budget, out, holding)
        conn, self.kv_connector = self.kv_connector, None
        try:
            return super()._admit(seq, budget, out, holding)
        finally:
            self.kv_connector = conn
            self.no_lookup.discard(seq.seq_id)


class NoneStopsEveryAdmission(SchedulerV1):
    """A connector's ``None`` ("ask again") stops the admissions behind it (vLLM skips that
    request alone)."""

    def _admit(self, seq, budget, out, holding):
        admitted = super()._admit(seq, budget, out, holding)
        return None if admitted is not None and admitted < 0 else admitted


class NewLoadsQueueAtTheEnd(SchedulerV1):
    """A request whose load starts goes to the end of ``waiting_for_remote`` (vLLM re-queues the
    requests a pass skipped at the front, in the order it visited them)."""

    def _admit(self, seq, budget, out, holding):
        admitted = super()._admit(seq, budget, out, holding)
        if admitted == 0 and seq.status == S.WAITING_FOR_REMOTE_KVS:
            self.started.append(seq)
        return admitted

    def _schedule_waiting(self, budget, out):
        self.started = []
        super()._schedule_waiting(budget, out)
        self.waiting_for_remote[:] = [s for s in self.waiting_for_remote
                                      if s not in self.started] + self.started


class WholeTableToRequestFinished(SchedulerV1):
    """``request_finished`` gets the whole block table (vLLM: the blocks of the computed
    tokens, ``get_block_ids_for_computed_tokens``; a failed load leaves blocks past them)."""

    def _delay_free(self, seq_id, block_ids):
        req = self.requests.get(seq_id)
        seq = next((s for s in req.seqs if s.seq_id == seq_id), None) if req else None
        if seq is None or not seq.status.is_finished:
            return False
        return self._connector_finished(seq, block_ids)


VARIANTS = [CountsLoadsAgainstMaxNumSeqs, LoadedStraightToRunning, NoReservationForLoads,
            NoLookupAfterAFirstBlockFailure, NoneStopsEveryAdmission, NewLoadsQueueAtTheEnd,
            WholeTableToRequestFinished]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.__name__)
def test_the_harness_catches(vllm_scheduler, variant):
    for seed in range(1000):
        trace = random_trace(random.Random(seed))
        try:
            run_lockstep(f"trace {seed}", trace.ops, CourseTwin(trace, variant),
                         RealTwin(trace, vllm_scheduler))
        except Mismatch:
            return
    pytest.fail(f"{variant.__name__} passed 1000 traces")


def test_the_real_scheduler_passes_its_own_variant_free_traces(vllm_scheduler):
    """The same traces with the course's scheduler itself: no mismatch (so the variants'
    mismatches are theirs)."""
    for seed in range(200):
        trace = random_trace(random.Random(seed))
        run_lockstep(f"trace {seed}", trace.ops, CourseTwin(trace),
                     RealTwin(trace, vllm_scheduler))
