"""The scheduler's knobs (vLLM's names), its per-step budget and its victim policies.

* :class:`SchedulerConfig`: ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
  ``enable_chunked_prefill``, ``preemption_mode``.
* :class:`CacheConfig`: ``block_size``, ``num_gpu_blocks``, ``num_cpu_blocks`` (the CPU swap
  pool; :meth:`CacheConfig.from_swap_space` turns vLLM's ``swap_space`` GiB into blocks),
  ``watermark``, ``enable_prefix_caching``.
* :class:`SchedulingBudget`: what is left of one step's token and sequence budgets.
* Victim policies: which running request to preempt when blocks run out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .capacity import num_cpu_blocks
from .sequence import Request

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one step may take.

    max_num_seqs: sequences in one batch (decode batch size cap; vLLM's default is 256).
    max_num_batched_tokens: tokens in one step (prefill chunks + one per decoding sequence).
    max_model_len: longest sequence (prompt + output); longer prompts are rejected and
        generation stops there.
    enable_chunked_prefill: split long prompts over several steps, so that decodes keep running.
        Without it a prompt is prefilled in one step, so max_num_batched_tokens must be
        >= max_model_len (vLLM checks the same).
    preemption_mode: "recompute" (free the blocks, prefill again later) or "swap" (copy the
        blocks to the CPU pool and back). Swap falls back to recompute when the CPU pool is
        full, and a request still in its prefill is always recomputed (it has little to save).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a prompt runs in one step: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})")


@dataclass(frozen=True)
class CacheConfig:
    """The KV-cache pools the block manager manages (see ``course_lib.capacity`` for sizing)."""

    block_size: int = 16
    num_gpu_blocks: int = 1024
    num_cpu_blocks: int = 0
    watermark: float = 0.01
    enable_prefix_caching: bool = False

    @staticmethod
    def from_swap_space(swap_space_gib: float, block_bytes: int, **kwargs) -> CacheConfig:
        """vLLM's ``swap_space`` (GiB of pinned CPU memory) -> ``num_cpu_blocks``."""
        return CacheConfig(num_cpu_blocks=num_cpu_blocks(swap_space_gib, block_bytes), **kwargs)


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
