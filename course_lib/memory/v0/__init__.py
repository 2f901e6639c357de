"""The paper's design and vLLM V0's: block tables, a pool per device, the verified prefix
cache, and ``BlockManager`` (``manager.py``) with its scheduler twin (``fast.py``). Read
``block_table.py``, ``pool.py``, ``prefix_cache.py``, ``manager.py`` in that order."""
