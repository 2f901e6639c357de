"""What one ``Scheduler.schedule()`` call decides: plain data for the engine (or the simulator).

Everything the model runner needs travels here, block ids included: the runner builds its
inputs and attention metadata from a :class:`SchedulerOutput` alone and never asks the block
manager (vLLM V1's ``SchedulerOutput`` carries block ids to the workers the same way).

The engine executes it in this order: ``blocks_to_swap_out`` (before anything else: the GPU
blocks they free may be handed out again in the same step), ``blocks_to_swap_in``,
``blocks_to_copy`` (copy-on-write), then the forward pass over ``scheduled``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sequence import Request, Sequence


@dataclass
class ScheduledSeq:
    """One sequence's work in a step."""

    request: Request
    seq: Sequence
    num_tokens: int       # tokens fed: a prefill chunk, or 1 for a decode
    is_prefill: bool
    num_candidates: int   # (token, logprob) pairs the sampler must return (0: samples nothing)
    block_ids: list[int]  # the sequence's block table once this step's slots are reserved;
                          # maybe the manager's own list (no copy: V0's decode, V1), so
                          # read it within the step (later steps extend it in place)
    # a hybrid model's (chapter 14): every KV-cache group's block table, group 0's first
    # (equal to block_ids), the null block where a window has passed
    # (KVCacheManager.get_block_tables); empty for a model of one group: block_ids is it
    block_tables: tuple[list[int], ...] = ()


@dataclass
class KVConnectorMetadata:
    """One step's transfers, built by the scheduler side, read by the worker side (plain data:
    in vLLM it crosses a process boundary). Subclasses add their fields."""


@dataclass
class SchedulerOutput:
    """Everything the engine needs for one step (plain data)."""

    step: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)      # (src, dst) CoW
    preempted: list[tuple[int, str]] = field(default_factory=list)  # (request_id, mode)
    ignored: list[Request] = field(default_factory=list)   # finished without running
    # the KV connector's transfers for this step (V1 with a connector: build_connector_meta)
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_tokens for e in self.scheduled if e.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(e.num_tokens for e in self.scheduled if not e.is_prefill)

    @property
    def num_batched_tokens(self) -> int:
        return sum(e.num_tokens for e in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.ignored
