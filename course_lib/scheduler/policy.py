"""The scheduler's per-step budget and its victim policies.

* :class:`SchedulingBudget`: what is left of one step's token and sequence budgets.
* Victim policies: which running request to preempt when blocks run out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..sequence import Request


@dataclass
class SchedulingBudget:
    """What is left of one step's budgets (vLLM v0's ``SchedulingBudget``)."""

    token_budget: int
    max_num_seqs: int
    num_batched_tokens: int = 0
    num_seqs: int = 0

    @property
    def remaining_tokens(self) -> int:
        return self.token_budget - self.num_batched_tokens

    @property
    def remaining_seqs(self) -> int:
        return self.max_num_seqs - self.num_seqs

    def can_schedule(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.remaining_tokens and num_seqs <= self.remaining_seqs

    def add(self, num_tokens: int, num_seqs: int) -> None:
        self.num_batched_tokens += num_tokens
        self.num_seqs += num_seqs


# A victim policy picks, among the running requests not yet scheduled in this step (the one
# being scheduled included), the request to preempt.
VictimPolicy = Callable[[list[Request]], Request]


def last_arrived_first(candidates: list[Request]) -> Request:
    """vLLM's default (first come, first served): preempt the request that arrived last."""
    return max(candidates, key=lambda r: (r.arrival_time, r.request_id))


def longest_first(candidates: list[Request]) -> Request:
    """Preempt the request holding the most tokens: frees the most blocks at once, but
    throws away the most work under recompute."""
    return max(candidates, key=lambda r: (sum(len(s) for s in r.unfinished_seqs),
                                          r.arrival_time, r.request_id))


VICTIM_POLICIES: dict[str, VictimPolicy] = {
    "last_arrived_first": last_arrived_first,
    "longest_first": longest_first,
}
