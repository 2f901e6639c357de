"""What one layer's KV cache looks like to the KV-cache manager: vLLM 0.33.0's layer specs
(``vllm/v1/kv_cache_interface.py``), at the course's size.

A hybrid model (gpt-oss: sliding window 128 and full attention alternating; Gemma 3: five
local layers of window 1,024 per global one; Llama 4: chunked local attention) has layers
that need different blocks: a full-attention layer needs every token's K/V for the whole
request, a sliding-window layer only the last ``sliding_window - 1`` tokens' (and the one
being computed), a chunked-local layer only its current chunk's. vLLM describes each layer
with a *spec* (frozen, hashable: equal specs go into one group) and gives each group of
layers with one spec its own block table over one shared pool
(:mod:`~course_lib.memory.v1.kv_cache_groups` does the grouping).

* :class:`FullAttentionSpec`, :class:`SlidingWindowSpec` (``sliding_window``),
  :class:`ChunkedLocalAttentionSpec` (``attention_chunk_size``): ``block_size`` tokens a
  block, ``num_kv_heads``, ``head_size``, ``dtype_bytes`` (vLLM's spec holds a torch dtype;
  the course the size of one element, which is all the sizes need), and
  ``page_size_bytes``: one layer's bytes for one block, K and V,
  ``2 * block_size * num_kv_heads * head_size * dtype_bytes`` (vLLM's
  ``AttentionSpec.page_size_bytes`` with ``head_size_v == head_size``, no padding, no
  quantisation).
* :class:`KVCacheGroupSpec` (``layer_names``, ``kv_cache_spec``): layers that share one block
  table. :class:`KVCacheConfig` (``num_blocks``, ``kv_cache_groups``): the pool's size and
  its groups (vLLM's also lists the tensors the model runner allocates; the course's model
  runner sizes its own).

Left out, and said so: vLLM's other specs (``MLAAttentionSpec``, ``MambaSpec`` for
linear-attention state, ``CrossAttentionSpec``, ``SinkFullAttentionSpec``, ``RSWASpec``,
``CircularBufferSpec``, the HiSparse specs, ``UniformTypeKVCacheSpecs``), DCP sharding, page
padding, KV quantisation, and ``max_memory_usage_bytes`` (chapter 01's sizing does that).
Kept: ``max_admission_blocks_per_request``, the most blocks one request of a group can hold
at once, which the scheduler reads to refuse a request the pool can never hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AttentionSpec:
    """What every attention layer's spec has (vLLM's ``AttentionSpec``): ``block_size``
    tokens a block, ``num_kv_heads`` heads of ``head_size`` elements of ``dtype_bytes``."""

    block_size: int
    num_kv_heads: int = 1
    head_size: int = 1
    dtype_bytes: int = 2

    @property
    def page_size_bytes(self) -> int:
        """One layer's bytes for one block: K and V of ``block_size`` tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int,
                                         max_model_len: int) -> int:
        """The most blocks one request of at most ``max_model_len`` tokens holds at once, when
        a step computes at most ``max_in_flight_tokens`` of them (vLLM 0.33.0's method of the
        same name): every block of its tokens, for full attention."""
        return -(-max_model_len // self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """A full-attention layer: every token attends to every earlier one, so a request keeps
    all its blocks until it finishes (vLLM's ``FullAttentionSpec``)."""


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """A sliding-window layer: token ``t`` attends to tokens ``t - sliding_window + 1 .. t``
    (vLLM's ``SlidingWindowSpec``). Blocks wholly before the window of the next token are
    never read again: the manager frees them (``SlidingWindowManager``)."""

    sliding_window: int = field(kw_only=True)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int,
                                         max_model_len: int) -> int:
        """The last ``sliding_window - 1`` computed tokens and a step's tokens, +1 block
        because the window need not start at a block's start (vLLM 0.33.0), and never more
        than the request's own blocks (``remove_skipped_blocks`` runs before each step's
        allocation, so what a request holds plateaus here)."""
        tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return min(-(-tokens // self.block_size) + 1, -(-max_model_len // self.block_size))


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """A chunked-local layer (Llama 4): the sequence is cut into chunks of
    ``attention_chunk_size`` tokens and a token attends only within its own chunk (vLLM's
    ``ChunkedLocalAttentionSpec``). Blocks of earlier chunks are never read again."""

    attention_chunk_size: int = field(kw_only=True)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int,
                                         max_model_len: int) -> int:
        """A chunk and a step's tokens (vLLM 0.33.0), at most the request's own blocks."""
        tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return -(-tokens // self.block_size)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table (vLLM's ``KVCacheGroupSpec``): the model runner
    applies the group's table to each of its layers."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The pool and its groups (vLLM's ``KVCacheConfig``, without ``kv_cache_tensors``):
    ``num_blocks`` blocks of one page size each, shared by every group."""

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
