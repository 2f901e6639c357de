"""The knobs everything shares, with vLLM's names: what the scheduler, the model runner, the
metrics, the simulator and the command line all read.

* :class:`SchedulerConfig`: ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
  ``enable_chunked_prefill``, ``preemption_mode``.
* :class:`CacheConfig`: ``block_size``, ``num_gpu_blocks``, ``num_cpu_blocks`` (the CPU swap
  pool; :meth:`CacheConfig.from_swap_space` turns vLLM's ``swap_space`` GiB into blocks),
  ``watermark``, ``enable_prefix_caching``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from .sizing.blocks import check_block_size, num_cpu_blocks
from .sizing.units import check_int

PREEMPTION_MODES = ("recompute", "swap")
C = TypeVar("C")


def config_or_default(value: C | None, cls: type[C], name: str) -> C:
    """``value``, or ``cls()`` for None; ``ValueError`` naming ``name`` for anything else.
    A dict of knobs is the usual slip: ``{}`` is falsy and would silently mean the defaults,
    any other dict an ``AttributeError`` deep inside."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise ValueError(f"{name} must be None or a {cls.__name__} (e.g. "
                         f"{cls.__name__}(**knobs)), got {type(value).__name__} {value!r:.60}")
    return value


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
        if not isinstance(self.enable_chunked_prefill, bool):   # "no" or None is no switch
            raise ValueError(f"enable_chunked_prefill must be True or False, got "
                             f"{self.enable_chunked_prefill!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a prompt runs in one step: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})")


@dataclass(frozen=True)
class CacheConfig:
    """The KV-cache pools the block manager manages (see ``course_lib.capacity`` for sizing).

    ``prefix_cache`` (the course's switch, not a vLLM option) picks how the V1 design finds
    cached prefixes: ``"hash"`` (vLLM V1's chained block hashes) or ``"radix"`` (SGLang's radix
    tree,
    :class:`~course_lib.memory.radix.kv_cache_manager.RadixKVCacheManager`). The V0 design has
    its own verified hash chain and accepts only ``"hash"``.
    """

    block_size: int = 16
    num_gpu_blocks: int = 1024
    num_cpu_blocks: int = 0
    watermark: float = 0.01
    enable_prefix_caching: bool = False
    prefix_cache: str = "hash"
    #: vLLM 0.33.0's ``kv_offloading_size`` (GiB of CPU memory for a KV offload tier, V1 only:
    #: ``course_lib.engine.cpu_offload``); None: no tier. Not ``cpu_offload_gb`` (weights,
    #: ``vllm/config/offload.py``).
    kv_offloading_size: float | None = None

    def __post_init__(self) -> None:
        check_block_size(self.block_size)       # a power of two in [1, 256], as everywhere
        # Checked here, where the learner wrote them, not later in whichever block manager
        # reads them: a pool needs a block (vLLM refuses num_gpu_blocks <= 0: "No available
        # memory for the cache blocks"); a string is no switch ("no" is truthy).
        check_int("num_gpu_blocks", self.num_gpu_blocks, 1)
        check_int("num_cpu_blocks", self.num_cpu_blocks, 0)
        wm = self.watermark
        if isinstance(wm, bool) or not isinstance(wm, int | float) or not 0 <= wm < 1:
            raise ValueError(f"watermark must be a fraction of the GPU blocks in [0, 1), "
                             f"got {wm!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got "
                             f"{self.enable_prefix_caching!r}")
        if self.prefix_cache not in ("hash", "radix"):
            raise ValueError(f"prefix_cache must be 'hash' or 'radix', got {self.prefix_cache!r}")
        size = self.kv_offloading_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int | float)
                                 or not 0 < size < float("inf")):
            raise ValueError(f"kv_offloading_size is GiB of CPU memory for the KV offload tier, "
                             f"finite and > 0 (or None: no tier), got {size!r}")

    @staticmethod
    def from_swap_space(swap_space_gib: float, block_bytes: int, **kwargs) -> CacheConfig:
        """vLLM's ``swap_space`` (GiB of pinned CPU memory) -> ``num_cpu_blocks``."""
        return CacheConfig(num_cpu_blocks=num_cpu_blocks(swap_space_gib, block_bytes), **kwargs)
