"""A hybrid model's KV cache: what each layer keeps, how vLLM groups the layers over one block
pool, and how many blocks a request holds as its context grows.

A hybrid model (``ModelSpec.layer_types``) mixes layer types. A full-attention layer keeps every
token; a sliding-window layer only the last ``sliding_window``; a chunked-local layer the tokens
of its current chunk; a linear-attention layer (Gated DeltaNet, Mamba) one fixed-size state per
sequence. Three views, from the exact one to vLLM's:

* ``layer_kv_bytes``: the bytes each layer must keep for one sequence of n tokens, no blocks.
* ``kv_cache_groups``: vLLM 0.33.0's KV-cache groups (``HybridGrouping`` of ``HybridGroup``):
  the layers of one type split into groups of equal size, every layer's page (its share of a
  block) made the same size, so that one ``BlockPool`` of equal blocks serves all groups.
* ``blocks_held``, ``max_blocks_per_request`` and ``hybrid_capacity``: the blocks a request
  holds at n tokens, the blocks vLLM reserves per request when it sizes the pool, and the
  pool's maximum concurrency, each against the same model with every layer full attention.

Pure integer arithmetic, TP=1: one GPU holds every head (``capacity.py`` splits heads over
tensor-parallel ranks, for a model whose layers are all full attention). vLLM's names:
block_size, page_size_bytes, num_blocks, max_model_len, max_in_flight_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.sizing.blocks import check_block_size
from course_lib.sizing.models import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    ModelSpec,
)
from course_lib.sizing.units import cdiv, check_int, format_bytes

# Tokens in flight that a sliding-window or chunked-local group must still hold blocks for
# (vLLM's ``VllmConfig.max_in_flight_tokens`` = max_concurrent_batches x max_num_batched_tokens,
# vllm/config/vllm.py): one batch of 8,192 tokens, ``vllm serve``'s max_num_batched_tokens on an
# H100 or H200 (``EngineArgs`` defaults in vllm/engine/arg_utils.py). Async scheduling keeps two
# batches in flight and doubles it.
MAX_IN_FLIGHT_TOKENS = 8192


def token_bytes_per_layer(spec: ModelSpec) -> int:
    """Bytes one token adds to one attention layer at TP=1: K and V of every KV head, or MLA's
    latent. ``capacity.kv_bytes_per_token_per_layer(spec)`` with TP=1 gives the same number
    (``sizing/`` sits below ``capacity.py`` and cannot import it)."""
    if spec.is_mla:
        return (spec.kv_lora_rank + spec.qk_rope_head_dim) * spec.dtype_bytes
    return 2 * spec.num_kv_heads * spec.head_dim * spec.dtype_bytes


def window_of(spec: ModelSpec, layer_type: str) -> int:
    """The tokens a layer of this type looks back over: sliding_window, attention_chunk_size,
    or 0 for full and linear attention (no window)."""
    return {SLIDING_ATTENTION: spec.sliding_window,
            CHUNKED_ATTENTION: spec.attention_chunk_size}.get(layer_type, 0)


def tokens_kept(layer_type: str, window: int, num_tokens: int) -> int:
    """Tokens a layer keeps for a sequence of num_tokens, at the step that computes the last
    one: the tokens that token attends to. Full: all of them; sliding window: the last
    ``window``; chunked local: those of its chunk (chunks start at multiples of ``window``);
    linear attention: none (it keeps a state instead)."""
    if layer_type == FULL_ATTENTION:
        return num_tokens
    if layer_type == SLIDING_ATTENTION:
        return min(num_tokens, window)
    if layer_type == CHUNKED_ATTENTION:
        return 0 if num_tokens == 0 else (num_tokens - 1) % window + 1
    return 0


def layer_kv_bytes(spec: ModelSpec, num_tokens: int) -> list[int]:
    """Bytes each layer keeps for one sequence of num_tokens tokens, exactly (no blocks).

    Attention layers: ``tokens_kept`` x ``token_bytes_per_layer``. A linear-attention layer:
    its state, ``linear_state_bytes``, from the first token on, whatever the length.
    """
    check_int("num_tokens", num_tokens, 0)
    per_token = token_bytes_per_layer(spec)
    kept = []
    for layer_type in spec.per_layer_types:
        if layer_type == LINEAR_ATTENTION:
            kept.append(spec.linear_state_bytes if num_tokens else 0)
        else:
            kept.append(tokens_kept(layer_type, window_of(spec, layer_type), num_tokens)
                        * per_token)
    return kept


def all_full_kv_bytes(spec: ModelSpec, num_tokens: int) -> int:
    """The same sequence's bytes if every layer were full attention: what
    ``capacity.contiguous_kv_bytes(spec, num_tokens)`` counts."""
    check_int("num_tokens", num_tokens, 0)
    return spec.num_layers * num_tokens * token_bytes_per_layer(spec)


@dataclass(frozen=True)
class HybridGroup:
    """One KV-cache group: layers of one attention type that share one block table.

    A request gets one block table per group; block ``j`` of that table holds, in each layer of
    the group, that layer's page of tokens ``[j * block_size, (j + 1) * block_size)`` (a linear
    group's block holds one whole state). ``page_size_bytes`` is one layer's share of a block
    after padding to the common page; ``real_page_size_bytes`` what the layer uses of it.
    ``window``: sliding_window or attention_chunk_size, 0 for full and linear attention.
    """

    layer_type: str
    window: int
    layer_indices: tuple[int, ...]
    block_size: int
    page_size_bytes: int
    real_page_size_bytes: int


@dataclass(frozen=True)
class HybridGrouping:
    """A model's KV-cache groups as vLLM 0.33.0 builds them, with their common page size.

    ``block_size``: tokens per block of every attention group, raised from
    ``requested_block_size`` when a linear-attention state must fit in one page.
    ``layers_per_group``: vLLM's group size; a group with fewer layers leaves the rest of its
    block unused (vLLM's "padding layers"). One pool block is ``bytes_per_block`` =
    ``layers_per_group`` pages: every group takes its blocks from the same pool.
    """

    model: ModelSpec
    requested_block_size: int
    block_size: int
    layers_per_group: int
    groups: tuple[HybridGroup, ...]

    @property
    def page_size_bytes(self) -> int:
        return self.groups[0].page_size_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one pool block: the widest group's pages (vLLM's
        ``_get_kv_cache_bytes_per_block`` in vllm/v1/core/kv_cache_planning.py)."""
        return self.layers_per_group * self.page_size_bytes

    def describe(self) -> str:
        """The grouping and the page-size unification in numbers, one fact a line."""
        spec, per_token = self.model, token_bytes_per_layer(self.model)
        lines = [f"{spec.name}: {spec.num_layers} layers, one token is {per_token:,} B in one "
                 f"attention layer"]
        if LINEAR_ATTENTION in spec.per_layer_types and self.block_size != \
                self.requested_block_size:
            state, base = spec.linear_state_bytes, self.requested_block_size * per_token
            lines.append(
                f"linear state {state:,} B > attention page {self.requested_block_size} x "
                f"{per_token:,} = {base:,} B: block_size raised to {self.requested_block_size}"
                f" x cdiv({state:,}, {base:,}) = {self.block_size} tokens")
            lines.append(f"page {self.page_size_bytes:,} B; the state is padded by "
                         f"{self.page_size_bytes - state:,} B "
                         f"({(self.page_size_bytes - state) / state:.2%})")
        else:
            lines.append(f"page: {self.block_size} tokens x {per_token:,} B = "
                         f"{self.page_size_bytes:,} B in every layer")
        kinds: dict[str, list[HybridGroup]] = {}
        for group in self.groups:
            kinds.setdefault(group.layer_type, []).append(group)
        for layer_type, groups in kinds.items():
            sizes = [len(g.layer_indices) for g in groups]
            lines.append(f"{layer_type}: {sum(sizes)} layers in {len(groups)} group(s) of "
                         f"{', '.join(map(str, sizes))} layers")
        lines.append(f"{len(self.groups)} groups of up to {self.layers_per_group} layers share "
                     f"one pool; a block = {self.layers_per_group} pages = "
                     f"{format_bytes(self.bytes_per_block)}")
        return "\n".join(lines)


def kv_cache_groups(spec: ModelSpec, block_size: int = 16) -> HybridGrouping:
    """Group spec's layers into KV-cache groups of one page size, as vLLM 0.33.0 does.

    1. A linear-attention state must fit in one page: the attention block size becomes
       ``block_size x cdiv(state, block_size x token_bytes_per_layer)`` and the state's page
       is padded up to the attention page (``Platform._align_hybrid_block_size`` in
       vllm/platforms/interface.py). All attention layers share one head geometry here, so
       their pages are already equal (``unify_kv_cache_spec_page_size``, which would raise a
       smaller page's block size, has nothing to do).
    2. Layers of one type (and window) form a bucket, in the order of their first layer. The
       group size is the smallest bucket's layer count, or the largest's when that is less
       than 1.5 times the smallest; each bucket splits into ``cdiv(count, group size)``
       groups, group ``i`` taking the bucket's layers ``i, i + n, i + 2n, ...``
       (``_get_kv_cache_groups_uniform_page_size`` in vllm/v1/core/kv_cache_planning.py).
       gpt-oss-20b: 12 sliding + 12 full, two groups of 12. Gemma 3 27B: 52 sliding + 10
       full, groups of 10: six sliding groups (9, 9, 9, 9, 8, 8 layers) and one full one.

    An all-full model gets one group of every layer. Declared differences: step 1 aligns to
    ``block_size`` here; vLLM aligns to the larger of block_size and the attention kernel's
    smallest block (FlashAttention's 16 on an H100 or H200: the same with the default 16).
    vLLM 0.33.0 by default turns chunked-local layers into full attention for allocation
    (``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE``, vllm/config/vllm.py); the course
    keeps them as their own groups, as that variable does.
    """
    check_block_size(block_size)
    per_token = token_bytes_per_layer(spec)
    types = spec.per_layer_types
    attention = any(t != LINEAR_ATTENTION for t in types)
    tokens_per_block = block_size
    if LINEAR_ATTENTION in types and attention:
        tokens_per_block = block_size * cdiv(spec.linear_state_bytes, block_size * per_token)
    page = tokens_per_block * per_token if attention else spec.linear_state_bytes

    buckets: dict[str, list[int]] = {}
    for index, layer_type in enumerate(types):
        buckets.setdefault(layer_type, []).append(index)
    size = group_size([len(layers) for layers in buckets.values()])
    groups = []
    for layer_type, layers in buckets.items():
        real = spec.linear_state_bytes if layer_type == LINEAR_ATTENTION else page
        num_groups = cdiv(len(layers), size)
        groups.extend(HybridGroup(layer_type, window_of(spec, layer_type),
                                  tuple(layers[i::num_groups]), tokens_per_block, page, real)
                      for i in range(num_groups))
    return HybridGrouping(spec, block_size, tokens_per_block, size, tuple(groups))


def group_size(num_layers_per_kind: list[int]) -> int:
    """Layers per KV-cache group: the fewest layers of any kind (the "1" of an n:1 pattern),
    or the most when no kind has 1.5 times the fewest, padding the others up to it (vLLM
    0.33.0's ``_get_kv_cache_groups_uniform_page_size`` in vllm/v1/core/kv_cache_planning.py;
    :mod:`course_lib.memory.v1.kv_cache_groups` builds the manager's groups with it)."""
    fewest, most = min(num_layers_per_kind), max(num_layers_per_kind)
    return most if 2 * most < 3 * fewest else fewest


def blocks_held(group: HybridGroup, num_tokens: int) -> int:
    """Blocks of this group one request holds at the step computing its token num_tokens - 1,
    after ``remove_skipped_blocks`` gave back (to the null block) those wholly out of reach.

    Full attention: ``cdiv(num_tokens, block_size)``, every block. Sliding window: the same
    minus the blocks wholly before the ``window`` tokens the last token attends to; chunked
    local: minus those before its chunk (``get_num_skipped_tokens`` of ``SlidingWindowManager``
    and ``ChunkedLocalAttentionManager``, vllm/v1/core/single_type_kv_cache_manager.py).
    Linear attention: one block, the state (mamba_cache_mode "none").
    """
    check_int("num_tokens", num_tokens, 0)
    if num_tokens == 0:
        return 0
    if group.layer_type == LINEAR_ATTENTION:
        return 1
    held = cdiv(num_tokens, group.block_size)
    computed = num_tokens - 1                       # before this step
    if group.layer_type == SLIDING_ATTENTION:
        skipped = max(0, computed - group.window + 1)
    elif group.layer_type == CHUNKED_ATTENTION:
        skipped = computed // group.window * group.window
    else:
        skipped = 0
    return held - skipped // group.block_size


def max_blocks_per_request(group: HybridGroup, max_model_len: int,
                           max_in_flight_tokens: int = MAX_IN_FLIGHT_TOKENS) -> int:
    """Blocks vLLM reserves for one request of max_model_len tokens in this group when it sizes
    the pool (``max_memory_usage_bytes`` / ``page_size_bytes`` of the group's spec,
    vllm/v1/kv_cache_interface.py).

    Full: ``cdiv(max_model_len, block_size)``. Sliding window: the window's ``window - 1``
    tokens plus the tokens in flight, whose blocks are freed only once processed, at most
    max_model_len, one block more for a window that starts mid-block. Chunked local: a chunk
    plus the tokens in flight. Linear: one state (mamba_cache_mode "none", no speculative
    tokens).
    """
    check_int("max_model_len", max_model_len, 1)
    check_int("max_in_flight_tokens", max_in_flight_tokens, 0)
    bs = group.block_size
    if group.layer_type == SLIDING_ATTENTION:
        return cdiv(min(group.window - 1 + max_in_flight_tokens, max_model_len), bs) + 1
    if group.layer_type == CHUNKED_ATTENTION:
        return cdiv(min(group.window + max_in_flight_tokens, max_model_len), bs)
    if group.layer_type == LINEAR_ATTENTION:
        return 1
    return cdiv(max_model_len, bs)


def paged_kv_bytes_for_context(grouping: HybridGrouping, num_tokens: int) -> int:
    """Pool bytes one request holds at num_tokens tokens: its blocks in every group
    (``blocks_held``), each a whole pool block of ``bytes_per_block``."""
    held = sum(blocks_held(group, num_tokens) for group in grouping.groups)
    return held * grouping.bytes_per_block


@dataclass(frozen=True)
class HybridCapacity:
    """A pool for a hybrid model against the same budget with every layer full attention.

    ``num_blocks`` pool blocks of ``grouping.bytes_per_block``; a request of max_model_len
    tokens needs ``blocks_per_request`` of them over all groups (vLLM's
    ``get_max_concurrency_for_kv_cache_config`` in vllm/v1/core/kv_cache_utils.py). The
    all-full model has one group of every layer: blocks of ``all_full_bytes_per_block``,
    ``cdiv(max_model_len, block_size)`` per request.
    """

    grouping: HybridGrouping
    available_kv_bytes: int
    max_model_len: int
    max_in_flight_tokens: int
    num_blocks: int
    blocks_per_request: int
    all_full_bytes_per_block: int
    all_full_num_blocks: int
    all_full_blocks_per_request: int

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len the pool holds at once (vLLM logs "Maximum concurrency")."""
        return self.num_blocks / self.blocks_per_request

    @property
    def kv_cache_size_tokens(self) -> int:
        """vLLM 0.33.0's "GPU KV cache size: N tokens" for a hybrid model: max_concurrency x
        max_model_len (``get_kv_cache_capacity``), not blocks x block_size."""
        return int(self.max_concurrency * self.max_model_len)

    @property
    def all_full_max_concurrency(self) -> float:
        return self.all_full_num_blocks / self.all_full_blocks_per_request

    @property
    def gain(self) -> float:
        """How many times more requests the hybrid pool holds than the all-full one."""
        return self.max_concurrency / self.all_full_max_concurrency


def hybrid_capacity(spec: ModelSpec, available_kv_bytes: int, max_model_len: int, *,
                    block_size: int = 16,
                    max_in_flight_tokens: int = MAX_IN_FLIGHT_TOKENS) -> HybridCapacity:
    """Size one GPU's pool for spec (TP=1) from a KV budget, vLLM 0.33.0's way, and the same
    budget with every layer full attention.

    ``num_blocks = available_kv_bytes // bytes_per_block`` (``get_kv_cache_config_from_groups``
    in vllm/v1/core/kv_cache_planning.py); the per-request blocks are
    ``max_blocks_per_request`` summed over the groups.
    """
    check_int("available_kv_bytes", available_kv_bytes, 0)
    check_int("max_model_len", max_model_len, 1)
    check_int("max_in_flight_tokens", max_in_flight_tokens, 0)
    grouping = kv_cache_groups(spec, block_size)
    per_request = sum(max_blocks_per_request(g, max_model_len, max_in_flight_tokens)
                      for g in grouping.groups)
    full_block = spec.num_layers * block_size * token_bytes_per_layer(spec)
    return HybridCapacity(grouping, available_kv_bytes, max_model_len, max_in_flight_tokens,
                          available_kv_bytes // grouping.bytes_per_block, per_request,
                          full_block, available_kv_bytes // full_block,
                          cdiv(max_model_len, block_size))
