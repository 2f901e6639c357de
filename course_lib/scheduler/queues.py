"""The V0 scheduler's three request queues outside a step: requests come in, are finished
from wherever they are, and the queues agree with the block tables.

Mixed into :class:`~course_lib.scheduler.Scheduler`, which owns ``waiting`` / ``running`` /
``swapped`` and the ``block_manager``; what runs in a step is ``scheduler.py``'s job.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from ..sequence import Request, SamplingParams, Sequence, SequenceStatus

S = SequenceStatus


class RequestQueues:
    """Mixed into ``Scheduler``: adding, aborting and finishing requests, and the queues'
    invariants."""

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
        self._next_seq_id += 1
        return self._next_seq_id - 1

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
