"""The pieces ``course_lib.capacity`` is built from, one job a module, torch-free.

* ``units``   binary byte units (``KiB``, ``MiB``, ``GiB``), one GPU's memory figure
              (``H200_MEMORY_GIB``), ``cdiv``, ``format_bytes`` and the shared argument checks
* ``models``  ``ModelSpec`` (with each layer's attention type for hybrid models), the presets
              (``PRESETS``, ``HYBRID_PRESETS``, ``get_preset``), the max_model_len vLLM accepts
              (``verify_max_model_len``)
* ``blocks``  model-free block counting (``num_blocks_for_tokens``, ``num_gpu_blocks``,
              ``num_cpu_blocks``, ``tokens_that_fit``, utilization and internal waste)
* ``hybrid``  a hybrid model's KV cache: bytes per layer, vLLM's KV-cache groups over one pool
              (``kv_cache_groups``), blocks by context length and ``hybrid_capacity``

Import a name from the module that defines it (``from course_lib.sizing.blocks import
num_gpu_blocks``): ``course_lib.capacity`` builds on them and does not re-export them.
"""
