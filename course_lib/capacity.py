"""How much KV cache fits on one GPU: a model's bytes per token and block on one rank, the memory
budget and the block pool vLLM builds from it, concurrency and context-parallel capacity.

Pure integer arithmetic, no torch, so a notebook can answer "how many tokens fit?" before it
owns a GPU. Every memory figure is per GPU (per rank), as vLLM computes it on each worker.
Names follow vLLM (block_size, num_gpu_blocks, gpu_memory_utilization, swap_space,
tensor_parallel_size). Built on ``course_lib.sizing``: import the units and checks from
``sizing/units.py``, ``ModelSpec`` and the presets from ``sizing/models.py`` and the model-free
block counting (``num_blocks_for_tokens``, ``num_gpu_blocks``, ...) from ``sizing/blocks.py``;
this module holds what needs a model's shapes on a rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.sizing.blocks import (
    check_block_size,
    num_blocks_for_tokens,
    num_cpu_blocks,
    num_full_blocks,
    num_gpu_blocks,
    tokens_that_fit,
)
from course_lib.sizing.models import ModelSpec
from course_lib.sizing.units import GiB, check_int, check_nonneg, format_bytes


def valid_tp_sizes(spec: ModelSpec) -> list[int]:
    """Tensor-parallel sizes vLLM accepts for this model: the attention heads divide evenly,
    and the KV heads either divide evenly or are replicated (``tp`` a multiple of them); MLA
    has one latent head per rank, any ``tp`` that divides the heads."""
    def ok(tp: int) -> bool:
        if spec.num_attention_heads % tp:
            return False
        kv = spec.num_kv_heads
        return spec.is_mla or (kv % tp == 0 if tp <= kv else tp % kv == 0)
    return [tp for tp in range(1, spec.num_attention_heads + 1) if ok(tp)]


def kv_heads_per_rank(spec: ModelSpec, tensor_parallel_size: int = 1) -> int:
    """KV heads one tensor-parallel rank stores.

    MHA/GQA split their KV heads over the ranks: num_kv_heads // tp. When tp exceeds
    num_kv_heads, vLLM replicates each KV head on tp // num_kv_heads ranks, so every rank
    still holds one head: max(1, num_kv_heads // tp), and the per-rank cache stops
    shrinking. MLA's latent has no head dimension: every rank keeps all of it (returns 1).
    Like vLLM, tp must divide num_attention_heads, and tp and num_kv_heads must divide one
    another; otherwise ValueError lists the sizes that work.
    """
    check_int("tensor_parallel_size", tensor_parallel_size, 1)
    if tensor_parallel_size not in valid_tp_sizes(spec):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} does not split {spec.name} "
            f"({spec.num_attention_heads} query heads, {spec.num_kv_heads} KV heads); "
            f"valid sizes: {valid_tp_sizes(spec)}")
    if spec.is_mla:
        return 1
    return max(1, spec.num_kv_heads // tensor_parallel_size)


def kv_bytes_per_token_per_layer(spec: ModelSpec, tensor_parallel_size: int = 1) -> int:
    """Cache bytes one token adds in one layer on one rank.

    MHA/GQA: K and V, each heads_per_rank x head_dim values. MLA: one latent of
    kv_lora_rank + qk_rope_head_dim values, the same on every rank (TP does not shrink it).
    """
    heads = kv_heads_per_rank(spec, tensor_parallel_size)
    if spec.is_mla:
        return (spec.kv_lora_rank + spec.qk_rope_head_dim) * spec.dtype_bytes
    return 2 * heads * spec.head_dim * spec.dtype_bytes


def kv_bytes_per_token(spec: ModelSpec, tensor_parallel_size: int = 1) -> int:
    """Cache bytes one token adds over all layers on one rank."""
    return spec.num_layers * kv_bytes_per_token_per_layer(spec, tensor_parallel_size)


def k_block_bytes_per_layer(spec: ModelSpec, block_size: int = 16,
                            tensor_parallel_size: int = 1) -> int:
    """Bytes of the K half of one block in one layer: [block_size, heads, head_dim] values."""
    check_block_size(block_size)
    if spec.is_mla:
        raise ValueError(f"{spec.name} uses MLA: its cache holds one latent per token, with no "
                         "separate K and V blocks; use block_bytes_per_layer instead")
    heads = kv_heads_per_rank(spec, tensor_parallel_size)
    return block_size * heads * spec.head_dim * spec.dtype_bytes


def block_bytes_per_layer(spec: ModelSpec, block_size: int = 16,
                          tensor_parallel_size: int = 1) -> int:
    """Bytes of one block (K and V, or the MLA latent) in one layer on one rank."""
    check_block_size(block_size)
    return block_size * kv_bytes_per_token_per_layer(spec, tensor_parallel_size)


def block_bytes(spec: ModelSpec, block_size: int = 16, tensor_parallel_size: int = 1) -> int:
    """Bytes of one block over all layers on one rank: the unit the block pool divides by."""
    return spec.num_layers * block_bytes_per_layer(spec, block_size, tensor_parallel_size)


def contiguous_kv_bytes(spec: ModelSpec, num_tokens: int, tensor_parallel_size: int = 1) -> int:
    """Exact cache bytes of num_tokens tokens, as one contiguous tensor would hold them."""
    check_int("num_tokens", num_tokens, 0)
    return num_tokens * kv_bytes_per_token(spec, tensor_parallel_size)


def paged_kv_bytes(spec: ModelSpec, num_tokens: int, block_size: int = 16,
                   tensor_parallel_size: int = 1) -> int:
    """Cache bytes a paged sequence holds: whole blocks, so the last one may be part empty."""
    blocks = num_blocks_for_tokens(num_tokens, block_size)
    return blocks * block_bytes(spec, block_size, tensor_parallel_size)


def blocks_with_shared_prefix(num_requests: int, num_tokens: int, shared_prefix_len: int,
                              block_size: int = 16) -> int:
    """Blocks num_requests sequences of num_tokens hold when they share a prefix.

    Prefix caching shares only the full blocks of the common prefix; each request keeps
    its own copy of everything after them, including a part-filled last prefix block.
    """
    check_int("num_requests", num_requests, 0)
    if not 0 <= shared_prefix_len <= num_tokens:
        raise ValueError(f"shared_prefix_len must be in [0, num_tokens={num_tokens}], "
                         f"got {shared_prefix_len}")
    shared = num_full_blocks(shared_prefix_len, block_size)
    private = num_blocks_for_tokens(num_tokens, block_size) - shared
    return (shared if num_requests else 0) + num_requests * private


def available_kv_bytes(total_gpu_memory_bytes: int, gpu_memory_utilization: float,
                       weight_bytes: int, activation_bytes: int = 0,
                       overhead_bytes: int = 0) -> int:
    """KV-cache budget of one GPU, as vLLM profiles it at startup.

    total x gpu_memory_utilization - weights - peak activations - overhead (CUDA context,
    non-torch buffers); rounded to whole bytes. Raises when the result is negative, naming
    the biggest term, because a negative budget means the model does not fit at all.
    """
    check_nonneg("total_gpu_memory_bytes", total_gpu_memory_bytes)
    if isinstance(gpu_memory_utilization, bool) \
            or not isinstance(gpu_memory_utilization, (int, float)) \
            or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    terms = {"weight_bytes": weight_bytes, "activation_bytes": activation_bytes,
             "overhead_bytes": overhead_bytes}
    for name, value in terms.items():
        check_nonneg(name, value)
    usable = round(total_gpu_memory_bytes * gpu_memory_utilization)
    available = round(usable - sum(terms.values()))
    if available < 0:
        big = max(terms, key=lambda k: terms[k])
        raise ValueError(
            f"KV cache budget is negative ({format_bytes(available)}): weights + activations + "
            f"overhead = {format_bytes(sum(terms.values()))} exceed total_gpu_memory x "
            f"gpu_memory_utilization = {format_bytes(usable)}; the largest term is "
            f"{big}={format_bytes(terms[big])}. Shrink it (more GPUs, quantization) or raise "
            f"gpu_memory_utilization (now {gpu_memory_utilization}, at most 1)")
    return available


def max_concurrency(num_gpu_blocks: int, block_size: int, max_model_len: int) -> float:
    """How many requests of max_model_len tokens the pool holds at once.

    num_gpu_blocks x block_size / max_model_len, the figure vLLM logs as "Maximum
    concurrency for N tokens per request: 3.45x". (vLLM V1 rounds each request up to whole
    blocks first; the two agree whenever max_model_len is a multiple of block_size.)
    """
    check_int("max_model_len", max_model_len, 1)
    return tokens_that_fit(num_gpu_blocks, block_size) / max_model_len


def context_parallel_capacity(num_gpu_blocks: int, block_size: int,
                              context_parallel_size: int) -> int:
    """Tokens one request can hold when context parallelism splits its sequence over ranks.

    Each of the context_parallel_size ranks stores a different slice of the tokens in its own
    num_gpu_blocks blocks, so one request's ceiling grows linearly with cp size.
    """
    check_int("context_parallel_size", context_parallel_size, 1)
    return tokens_that_fit(num_gpu_blocks, block_size) * context_parallel_size


@dataclass(frozen=True)
class DecodeCommBytes:
    """Bytes one layer moves per decode step of one token under context parallelism.

    query_bytes: the new token's query sent to every rank holding KV; partial_output_bytes:
    one rank's partial attention output plus its log-sum-exp, to be merged; move_kv_bytes:
    the alternative of shipping the other ranks' cached KV to the query's rank.
    """

    query_bytes: int
    partial_output_bytes: int
    move_kv_bytes: int

    @property
    def kv_to_query_ratio(self) -> float:
        return self.move_kv_bytes / self.query_bytes


def decode_comm_bytes(spec: ModelSpec, context_len: int, context_parallel_size: int,
                      lse_bytes: int = 4) -> DecodeCommBytes:
    """Per-layer traffic of "move Q" vs "move KV" for one decode step (whole model, TP=1).

    MHA/GQA queries are num_attention_heads x head_dim values. MLA decode attends in the
    compressed space, so each head's query is kv_lora_rank + qk_rope_head_dim wide and its
    output kv_lora_rank wide. Tokens are spread round-robin, so the query's rank holds
    ceil(context_len / cp) of them and the rest are remote. lse_bytes: float32 per head.
    """
    check_int("context_len", context_len, 0)
    check_int("context_parallel_size", context_parallel_size, 1)
    if spec.is_mla:
        q_width, out_width = spec.kv_lora_rank + spec.qk_rope_head_dim, spec.kv_lora_rank
    else:
        q_width = out_width = spec.head_dim
    heads = spec.num_attention_heads
    remote = context_len - math.ceil(context_len / context_parallel_size)
    return DecodeCommBytes(
        query_bytes=heads * q_width * spec.dtype_bytes,
        partial_output_bytes=heads * (out_width * spec.dtype_bytes + lse_bytes),
        move_kv_bytes=remote * kv_bytes_per_token_per_layer(spec))


@dataclass(frozen=True)
class KVBudget:
    """One GPU's KV-cache sizing, inputs and results together, as vLLM logs it at startup."""

    model: ModelSpec
    total_gpu_memory_bytes: int
    gpu_memory_utilization: float
    weight_bytes: int
    activation_bytes: int
    overhead_bytes: int
    block_size: int
    tensor_parallel_size: int
    context_parallel_size: int
    swap_space_bytes: int
    available_kv_bytes: int
    block_bytes: int
    num_gpu_blocks: int
    num_cpu_blocks: int

    @property
    def num_gpu_tokens(self) -> int:
        return tokens_that_fit(self.num_gpu_blocks, self.block_size)

    @property
    def context_capacity_tokens(self) -> int:
        return context_parallel_capacity(self.num_gpu_blocks, self.block_size,
                                         self.context_parallel_size)

    def max_concurrency(self, max_model_len: int) -> float:
        return max_concurrency(self.num_gpu_blocks, self.block_size, max_model_len)

    def summary(self, max_model_len: int | None = None) -> str:
        """Human-readable lines, the last ones worded like vLLM's startup log."""
        usable = round(self.total_gpu_memory_bytes * self.gpu_memory_utilization)
        lines = [
            f"{self.model.name} ({self.model.attention_type}), TP={self.tensor_parallel_size}, "
            f"CP={self.context_parallel_size}, block_size={self.block_size}",
            f"usable {format_bytes(usable)} = {format_bytes(self.total_gpu_memory_bytes)} x "
            f"{self.gpu_memory_utilization}; "
            f"weights {format_bytes(self.weight_bytes)}, activations "
            f"{format_bytes(self.activation_bytes)}, overhead {format_bytes(self.overhead_bytes)}",
            f"Available KV cache memory: {format_bytes(self.available_kv_bytes)}; "
            f"block {format_bytes(self.block_bytes)}",
            f"# GPU blocks: {self.num_gpu_blocks}, # CPU blocks: {self.num_cpu_blocks}",
            f"GPU KV cache size: {self.num_gpu_tokens:,} tokens",
        ]
        if self.context_parallel_size > 1:
            lines.append(f"One request can hold {self.context_capacity_tokens:,} tokens over "
                         f"{self.context_parallel_size} context-parallel ranks")
        if max_model_len is not None:
            lines.append(f"Maximum concurrency for {max_model_len:,} tokens per request: "
                         f"{self.max_concurrency(max_model_len):.2f}x")
        return "\n".join(lines)


def plan_kv_cache(spec: ModelSpec, total_gpu_memory_gib: float, *,
                  gpu_memory_utilization: float = 0.9, block_size: int = 16,
                  tensor_parallel_size: int = 1, context_parallel_size: int = 1,
                  weight_gib: float | None = None, activation_gib: float = 0.0,
                  overhead_gib: float = 0.0, swap_space: float = 4.0) -> KVBudget:
    """Size one GPU's block pool. weight_gib defaults to the weights split evenly over TP.

    Memory arguments are GiB per GPU (swap_space too, as in vLLM); the result holds bytes.
    Every layer is counted as full attention, so a hybrid model (``spec.is_hybrid``) is refused:
    its blocks and concurrency are :func:`course_lib.sizing.hybrid.hybrid_capacity`'s (the
    functions above, which size one block or one token, give a hybrid's all-full baseline).
    """
    if spec.is_hybrid:
        raise ValueError(f"{spec.name} is a hybrid model (layer types "
                         f"{sorted(set(spec.layer_types))}): plan_kv_cache counts every layer as "
                         f"full attention; size it with course_lib.sizing.hybrid.hybrid_capacity")
    check_int("context_parallel_size", context_parallel_size, 1)
    blk = block_bytes(spec, block_size, tensor_parallel_size)  # validates block_size and TP
    for name, value in (("total_gpu_memory_gib", total_gpu_memory_gib),
                        ("activation_gib", activation_gib), ("overhead_gib", overhead_gib),
                        ("weight_gib", 0 if weight_gib is None else weight_gib)):
        check_nonneg(name, value)
    if weight_gib is None:
        weights = round(spec.weight_bytes / tensor_parallel_size)
    else:
        weights = round(weight_gib * GiB)
    total, act, over = (round(x * GiB) for x in (total_gpu_memory_gib, activation_gib,
                                                 overhead_gib))
    avail = available_kv_bytes(total, gpu_memory_utilization, weights, act, over)
    return KVBudget(spec, total, gpu_memory_utilization, weights, act, over, block_size,
                    tensor_parallel_size, context_parallel_size, round(swap_space * GiB),
                    avail, blk, num_gpu_blocks(avail, blk), num_cpu_blocks(swap_space, blk))
