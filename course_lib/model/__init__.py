"""The tiny real model of the course: a Llama-style decoder over bytes, with shipped weights.

* ``config``     :class:`ModelConfig` (frozen dataclass)
* ``tokenizer``  :class:`ByteTokenizer` (256 bytes + BOS / EOS / PAD)
* ``attention``  :class:`AttentionMetadata` and the one adapter to the paged kernels
* ``llama``      :class:`TinyLlama`: paged ``forward`` and dense ``forward_contiguous``
* ``generate``   contiguous-cache generation, the reference for the paged engine
* ``loader``     :func:`load_tiny_model` (offline, from ``weights/``)
"""

from course_lib.model.attention import (
    AttentionMetadata,
    make_attention_metadata,
    paged_attention_layer,
)
from course_lib.model.config import ModelConfig
from course_lib.model.generate import generate_contiguous, sample_next
from course_lib.model.llama import TinyLlama, allocate_kv_caches
from course_lib.model.loader import heldout_text, load_metadata, load_tiny_model
from course_lib.model.tokenizer import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer

__all__ = [
    "AttentionMetadata", "make_attention_metadata", "paged_attention_layer", "ModelConfig",
    "generate_contiguous", "sample_next", "TinyLlama", "allocate_kv_caches", "heldout_text",
    "load_metadata", "load_tiny_model", "BOS_ID", "EOS_ID", "PAD_ID", "ByteTokenizer",
]
