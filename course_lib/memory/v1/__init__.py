"""vLLM V1's design (vLLM 0.33.0, ``vllm/v1/core/`` and ``vllm/v1/kv_cache_interface.py``):
``block_pool.py`` (free-block queue, hashed blocks, the null block), ``kv_cache_interface.py``
(layer specs, KV-cache groups), ``kv_cache_groups.py`` (grouping a hybrid model's layers over
one pool), ``single_type_kv_cache_manager.py`` (one group's tables: full attention, sliding
window, chunked local), ``kv_cache_coordinator.py`` (every group at once, the hit's fixed
point) and ``kv_cache_manager.py`` (``KVCacheManager``)."""
