"""The pieces ``course_lib.capacity`` is built from, one job a module, torch-free.

``units`` (binary byte units, one GPU's memory figure, the shared argument checks), ``models``
(``ModelSpec``, the presets, the max_model_len vLLM accepts) and ``blocks`` (model-free block
counting). Import them through ``course_lib.capacity``, which re-exports every name.
"""
