"""SGLang's design (SGLang 0.5.23, ``python/sglang/srt/mem_cache/``): the algorithm of its
``RadixCache`` (``radix_cache.py``), which the ``UnifiedRadixCache`` its server builds
(``unified_radix_cache.py``) keeps. Here: ``radix_cache.py`` (the radix tree), ``allocator.py``
(where its slots come from) and ``kv_cache_manager.py`` (the V1 calls over the tree)."""
