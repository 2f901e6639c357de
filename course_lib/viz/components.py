"""The Block Manager tutorial's §3.1 components, then (vLLM 0.6.3) and now (vLLM 0.33.0)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import NamedTuple


class ComponentRow(NamedTuple):
    """One component of the Block Manager tutorial's §3.1 table, then (vLLM 0.6.3) and now."""
    component: str
    role: str
    course: str     # course_lib names (dotted paths under course_lib, checked by the tests)
    v0: str         # vLLM 0.6.3's (V0) class and file
    v1: str         # vLLM 0.33.0's (V1) class and file


ARTICLE_COMPONENTS = (
    ComponentRow("Block Allocator (GPU)", "hands out and takes back the GPU pool's blocks",
                 "memory.v0.pool.BlockAllocator (BlockManager.gpu); V1 twin: "
                 "memory.v1.block_pool.BlockPool",
                 "NaiveBlockAllocator / PrefixCachingBlockAllocator inside CpuGpuBlockAllocator "
                 "(vllm/core/block/cpu_gpu_block_allocator.py)",
                 "BlockPool (vllm/v1/core/block_pool.py) over FreeKVCacheBlockQueue "
                 "(vllm/v1/core/kv_cache_utils.py)"),
    ComponentRow("Block Allocator (CPU)", "a CPU pool that holds swapped-out blocks",
                 "memory.v0.pool.BlockAllocator (BlockManager.cpu, used by swap_out / swap_in)",
                 "the CPU half of CpuGpuBlockAllocator "
                 "(vllm/core/block/cpu_gpu_block_allocator.py)",
                 "none: V1 preempts by recompute, never swaps; an optional CPU offload of "
                 "cached blocks lives in vllm/v1/kv_offload/"),
    ComponentRow("Block Table", "maps a sequence's logical blocks to physical ones",
                 "memory.v0.block_table.BlockTable; V1 twin: the req_to_blocks of "
                 "memory.v1.kv_cache_manager.KVCacheManager",
                 "BlockTable (vllm/core/block/block_table.py)",
                 "req_to_blocks in SingleTypeKVCacheManager "
                 "(vllm/v1/core/single_type_kv_cache_manager.py); the GPU copy the kernels "
                 "read: BlockTable (vllm/v1/worker/block_table.py)"),
    ComponentRow("Evictor", "picks which cached free block to reuse first (LRU)",
                 "memory.v0.pool.BlockAllocator.evictable_block_ids (an LRU OrderedDict)",
                 "LRUEvictor (vllm/core/evictor_v2.py)",
                 "no separate object: FreeKVCacheBlockQueue's order is the LRU, and "
                 "BlockPool.get_new_blocks drops a reused block's hash "
                 "(vllm/v1/core/block_pool.py)"),
)


def component_table(rows: Sequence[ComponentRow] = ARTICLE_COMPONENTS) -> str:
    """The §3.1 components as text: role, course_lib name, vLLM 0.6.3 and vLLM 0.33.0."""
    lines = []
    for r in rows:
        lines.append(f"{r.component}: {r.role}")
        for name, text in (("course_lib", r.course), ("vLLM 0.6.3", r.v0), ("vLLM 0.33.0", r.v1)):
            lines += textwrap.wrap(text, 96, initial_indent=f"  {name:<12} ",
                                   subsequent_indent=" " * 15)
    return "\n".join(lines)
