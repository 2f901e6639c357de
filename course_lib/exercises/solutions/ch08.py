"""Solutions of chapter 08's exercises."""

from __future__ import annotations

from course_lib.sizing.units import cdiv


def smallest_tp(num_layers, num_attention_heads, num_kv_heads, head_dim, num_params,
                gpu_memory_gib, max_model_len, num_requests):
    blocks_per_request = cdiv(max_model_len, 16)             # whole blocks of 16 tokens
    for tp in range(1, num_attention_heads + 1):
        if num_attention_heads % tp:
            continue                                         # the query heads do not split
        if (num_kv_heads % tp if tp <= num_kv_heads else tp % num_kv_heads):
            continue                                         # nor do the KV heads
        heads = max(1, num_kv_heads // tp)                   # replicated beyond num_kv_heads
        block_bytes = 16 * num_layers * 2 * heads * head_dim * 2
        budget = 0.9 * gpu_memory_gib * 2**30 - 2 * num_params / tp
        if budget < 0:
            continue                                         # the weights do not fit
        if budget // block_bytes // blocks_per_request >= num_requests:
            return tp
    raise ValueError("no tensor-parallel size serves that many requests")


def kv_heads_per_rank(num_kv_heads, tensor_parallel_size):
    tp = tensor_parallel_size
    if tp < 1 or (num_kv_heads % tp if tp <= num_kv_heads else tp % num_kv_heads):
        raise ValueError(f"tensor_parallel_size={tp} cannot split {num_kv_heads} KV heads")
    return max(1, num_kv_heads // tp)


def max_num_requests(num_gpu_blocks, block_size, requests):
    need = []                  # need[s]: blocks the admitted requests hold in step s
    for admitted, (prompt_len, output_len) in enumerate(requests):
        need += [0] * (output_len - len(need))
        for s in range(output_len):                   # step s: prompt + s tokens cached
            need[s] += cdiv(prompt_len + s, block_size)
        if max(need) > num_gpu_blocks:
            return admitted                           # this one would overflow a step
    return len(requests)
