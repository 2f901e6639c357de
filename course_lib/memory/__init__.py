"""KV-cache memory: block tables, pools, prefix caches. Pure Python, no torch.

Three designs, one folder each; none imports another's modules, all share the modules at
this level (``tests/test_layers.py`` checks it). The classes here hold the mechanism and trust
their caller (the scheduler, a chapter's helper): the public doors check input before it
reaches them (``CacheConfig``, ``LLMEngine``, the chapters' helpers and widgets).

``common.py``        what every design answers alike: ``AllocStatus``, ``BlockUsage``,
                     ``PrefixCacheStats``
``v1_interface.py``  ``V1ManagerBase``: the V1 calls that both ``v1/`` and ``radix/`` answer

``v0/``      the paper's design and vLLM V0's (chapters 03-07, 10, 11). Read in this order:
             ``block_table.py`` (``BlockTable``: logical -> physical blocks of one sequence),
             ``pool.py`` (``BlockAllocator``: reference counts, the free stack, the LRU of
             evictable cached blocks), ``prefix_cache.py`` (the chained block hash and
             ``PrefixCache``: verified lookups), ``manager.py`` (``BlockManager``, whole:
             allocate, append with copy-on-write, fork, free, mark computed, swap, groups,
             usage, invariants). ``fast.py``: ``FastBlockManager``, the scheduler's
             twin of ``BlockManager`` (fused decode, memoized matching), checked against it.
``v1/``      vLLM V1's design (0.33.0; chapter 12): ``block_pool.py`` (``KVCacheBlock``, the
             doubly linked ``FreeKVCacheBlockQueue``, ``BlockPool``, sha256 chained hashes),
             ``kv_cache_manager.py`` (``KVCacheManager``: ``get_computed_blocks``,
             ``allocate_slots``, ``free``).
``radix/``   SGLang's design (0.5.23; chapters 06, 12), as its ``RadixCache`` has it (the
             server's ``UnifiedRadixCache`` keeps the algorithm): ``radix_cache.py``
             (``RadixCache``: a radix tree over token ids, lock refs, LRU eviction of
             unlocked leaves), ``allocator.py`` (its slot pools), ``kv_cache_manager.py``
             (``RadixKVCacheManager``: the V1 calls over the tree).

Import each name from the module that defines it, e.g.
``from course_lib.memory.v0.manager import BlockManager``.
"""
