"""vLLM V1's design (vLLM 0.33.0, ``vllm/v1/core/``): ``block_pool.py`` (free-block queue,
hashed blocks) and ``kv_cache_manager.py`` (``KVCacheManager``)."""
