"""The tiny real model of the course: a Llama-style decoder over bytes, with shipped weights.

* ``config``     :class:`ModelConfig` (frozen dataclass; a hybrid model's per-layer attention
                 and KV-cache groups, chapter 14)
* ``tokenizer``  :class:`ByteTokenizer` (256 bytes + BOS / EOS / PAD)
* ``attention``  :class:`AttentionMetadata` and the one adapter to the paged kernels
* ``llama``      :class:`TinyLlama`: paged ``forward`` and dense ``forward_contiguous``
* ``generate``   contiguous-cache generation, the reference for the paged engine
* ``loader``     :func:`load_tiny_model` (offline, from ``weights/``)

Nothing is imported here: import the module that defines what you need
(``from course_lib.model.loader import load_tiny_model``).
"""
