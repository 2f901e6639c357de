"""The block manager: pure Python, no torch. See ``manager.BlockManager``."""

from .block_table import BlockTable, cdiv
from .manager import AllocStatus, BlockManager, BlockUsage, ManagerSnapshot, PrefixCacheStats
from .pool import BlockAllocator, NoFreeBlocksError
from .prefix_cache import ROOT_HASH, BlockKey, PrefixCache

__all__ = ["AllocStatus", "BlockAllocator", "BlockKey", "BlockManager", "BlockTable",
           "BlockUsage", "ManagerSnapshot", "NoFreeBlocksError", "PrefixCache",
           "PrefixCacheStats", "ROOT_HASH", "cdiv"]
