"""The block manager: pure Python, no torch. See ``manager.BlockManager``."""

from .block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from .block_table import BlockTable, cdiv
from .kv_cache_manager import KVCacheManager
from .manager import AllocStatus, BlockManager, BlockUsage, ManagerSnapshot, PrefixCacheStats
from .pool import BlockAllocator, NoFreeBlocksError
from .prefix_cache import ROOT_HASH, BlockKey, PrefixCache
from .radix_kv_cache_manager import RadixKVCacheManager

__all__ = ["AllocStatus", "BlockAllocator", "BlockKey", "BlockManager", "BlockPool",
           "BlockTable", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheManager",
           "BlockUsage", "ManagerSnapshot", "NoFreeBlocksError", "PrefixCache",
           "PrefixCacheStats", "ROOT_HASH", "RadixKVCacheManager", "cdiv"]
