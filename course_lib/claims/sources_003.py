"""The "PagedAttention explained" article's (source 003) capacity numbers, recomputed.

:func:`source_003_claims`, in the article's order: the 4K-token KV of a 70B and an 8B model, the
waste of static reservation, block counts and utilization, the §4.2 and §7.3 pool sizing, the
shared system prompt's blocks and the MLA saving, whose MHA baseline
:func:`mha_equivalent_kv_bytes_per_token` computes. :func:`course_lib.claims.sources.audit`
gathers it with the other articles'.
"""

from __future__ import annotations

import math
from dataclasses import replace

from course_lib import capacity as cap
from course_lib.claims.sources_claim import NO_NUMBER, Sheet, SourceClaim
from course_lib.sizing.blocks import (
    expected_internal_waste_tokens,
    max_internal_waste_tokens,
    num_blocks_for_tokens,
    num_full_blocks,
    paged_utilization,
    static_utilization,
)
from course_lib.sizing.models import ModelSpec, get_preset
from course_lib.sizing.units import GiB, MiB
from course_lib.sizing.units import format_bytes as fb


def source_003_claims() -> list[SourceClaim]:
    s = Sheet("003")
    m70 = get_preset("llama-2-70b")
    kv70 = cap.contiguous_kv_bytes(m70, 4096)
    kv70_32 = cap.contiguous_kv_bytes(replace(m70, num_kv_heads=32), 4096)
    kv70_mha = cap.contiguous_kv_bytes(replace(m70, num_kv_heads=64), 4096)
    mha70 = f"MHA ({m70.num_attention_heads} KV heads, one per query head) gives {fb(kv70_mha)}"
    s.add("003-intro-70b", "intro", "a 70B model's 4K-token request can take over 5 GB of KV",
          5, "GiB", kv70 / GiB, "wrong",
          f"Llama-2-70B uses GQA with 8 KV heads: 4096 tokens take {fb(kv70)}. 5 GiB is what 32 "
          f"KV heads give ({fb(kv70_32)}), which is not MHA for this model: {mha70}.")
    s.add("003-1-70b-printed", "§1 code", "kv_cache_size(80, 4096, 8, 128) prints "
          "'KV Cache size: 5.00 GB'", 5.0, "GiB", kv70 / GiB, "wrong",
          f"The function shown returns {kv70:,} B = {kv70 / GiB:.2f} GiB. The printed value is "
          f"4x that, what 32 KV heads give ({kv70_32 / GiB:.2f}); the code shown did not print "
          f"it. Not MHA either: {mha70}.")
    m8 = get_preset("llama-3-8b")
    kv8 = cap.contiguous_kv_bytes(m8, 4096)
    kv8_32 = cap.contiguous_kv_bytes(replace(m8, num_kv_heads=32), 4096)
    s.add("003-1-8b-printed", "§1 code", "kv_cache_size(32, 4096, 8, 128) prints "
          "'Llama-3-8B KV Cache: 2.00 GB'", 2.0, "GiB", kv8 / GiB, "wrong",
          f"The formula gives {kv8:,} B = {kv8 / GiB:.2f} GiB; {kv8_32 / GiB:.2f} is what 32 "
          f"KV heads give: this model under MHA ({m8.num_attention_heads} query heads, each with "
          "its own KV head), not its 8 GQA KV heads.")
    b8 = cap.plan_kv_cache(m8, 80, gpu_memory_utilization=0.9, weight_gib=16)
    waste = b8.available_kv_bytes * (1 - 0.40)
    s.add("003-1-waste", "§1", "at 20-40% utilization an 80 GB A100 may waste 48 GB or more",
          48, "GiB", waste / GiB, "wrong",
          "80 x 60% treats the whole card as KV cache, but weights never fragment. With §4.2's "
          f"own {fb(b8.available_kv_bytes)} of KV, 40% utilization wastes {fb(waste)} and even "
          f"20% wastes {fb(b8.available_kv_bytes * 0.8)}.")
    s.add("003-3-blocks", "§3", "50 generated tokens need 4 blocks (50/16 ~ 4)", 4, "blocks",
          num_blocks_for_tokens(50, 16), "ok",
          "ceil(50 / 16) = 4: the count rounds up, the 4th block being part-filled.")
    s.add("003-3-reserved", "§3", "pre-allocating 4096 tokens takes 4096/16 = 256 blocks", 256,
          "blocks", num_blocks_for_tokens(4096, 16), "ok", "Exact: 4096 is 256 x 16.")
    st = 100 * static_utilization([50], 4096)
    s.add("003-3-static-util", "§3", "utilization of that reservation: 1.2%", 1.2, "%", st, "ok",
          f"50 / 4096 = {st:.2f}%.")
    pg = 100 * paged_utilization([50], 16)
    s.add("003-3-paged-util", "§3", "with paging, utilization rises to nearly 100%", 100, "%",
          pg, "approx", f"50 tokens in 4 blocks = 64 slots: {pg:.1f}%. The last block is part "
          "empty; only long sequences come near 100%.")
    e = {bs: expected_internal_waste_tokens(bs) for bs in (8, 16, 32)}
    s.add("003-4.1-waste", "§4.1", "block_size 32: the last block may waste 31 tokens", 31,
          "tokens", max_internal_waste_tokens(32), "ok",
          "At most block_size - 1 slots per sequence are empty; on average (block_size - 1)/2: "
          f"{e[8]} for 8, {e[16]} for 16, {e[32]} for 32.")
    usable = round(b8.total_gpu_memory_bytes * b8.gpu_memory_utilization)
    s.add("003-4.2-usable", "§4.2", "80 GB x 0.90 = 72 GB usable", 72, "GiB", usable / GiB, "ok",
          f"{fb(usable)}.")
    s.add("003-4.2-weights", "§4.2", "Llama-3-8B FP16 weights ~16 GB", 16, "GB",
          m8.weight_bytes / 1e9, "ok", f"{m8.num_params:,} x 2 B = {m8.weight_bytes / 1e9:.2f} "
          f"GB = {fb(m8.weight_bytes)}; the example subtracts 16 from 72 as GiB, as we do.")
    s.add("003-4.2-kv", "§4.2", "KV cache memory ~56 GB", 56, "GiB",
          b8.available_kv_bytes / GiB, "ok", f"72 - 16 = {fb(b8.available_kv_bytes)}.")
    s.add("003-4.2-block", "§4.2", "each block ~0.125 MB (32 layers, 8 KV heads, 128, FP16)",
          0.125, "MiB", b8.block_bytes / MiB, "wrong",
          f"0.125 MiB = {cap.kv_bytes_per_token(m8):,} B is one token; a 16-token block over all "
          f"layers is {fb(b8.block_bytes)}. The next three lines inherit this slip.")
    s.add("003-4.2-blocks", "§4.2", "~448,000 blocks", 448_000, "blocks", b8.num_gpu_blocks,
          "wrong", f"56 GiB / 2 MiB = {b8.num_gpu_blocks:,}. 448,000 = 56,000 / 0.125 counts "
          "tokens (in decimal MB) and calls them blocks.")
    s.add("003-4.2-tokens", "§4.2", "max concurrent tokens ~7,168,000", 7_168_000, "tokens",
          b8.num_gpu_tokens, "wrong", f"{b8.num_gpu_blocks:,} x 16 = {b8.num_gpu_tokens:,}; the "
          "article multiplies its token count by 16 again.")
    c = b8.max_concurrency(4096)
    s.add("003-4.2-concurrency", "§4.2", "~1700 concurrent requests at 4K context", 1700,
          "requests", c, "wrong", f"{b8.num_gpu_tokens:,} / 4096 = {c:.0f}; vLLM would log "
          f"'Maximum concurrency for 4,096 tokens per request: {c:.2f}x'.")
    s.add("003-5-shared", "§5", "a 500-token system prompt shared as Phys#0-31 (32 blocks)", 32,
          "blocks", num_full_blocks(500, 16), "wrong",
          "500 tokens fill 31 blocks and 4 slots of a 32nd. That 32nd block also holds the start "
          "of each user's question, so it differs per request: only 31 blocks are shared.")
    own = cap.blocks_with_shared_prefix(1, 700, 500, 16) - num_full_blocks(500, 16)
    s.add("003-5-private", "§5", "request B (500 + 200 tokens) owns 3 blocks, Phys#200-202", 3,
          "blocks", own, "wrong",
          f"700 tokens need {num_blocks_for_tokens(700, 16)} blocks, 31 shared, so {own} "
          "are B's own; 3 blocks hold only 48 tokens.")
    m3 = get_preset("llama-3-70b")
    pool = cap.plan_kv_cache(m3, 320, gpu_memory_utilization=0.9, weight_gib=140)
    s.add("003-7.3-available", "§7.3", "Llama-3-70B on 4 x A100-80GB: KV available 148.0 GB",
          148, "GiB", pool.available_kv_bytes / GiB, "ok",
          "320 x 0.9 - 140, the function treating the 4 GPUs as one pool.")
    s.add("003-7.3-block", "§7.3", "printed 'Block size: 16 tokens (0.313 MB/block)'", 0.313,
          "MiB", pool.block_bytes / MiB, "wrong",
          f"The function's own block_bytes = 2 x 80 x 16 x 8 x 128 x 2 = {pool.block_bytes:,} B "
          f"= {fb(pool.block_bytes)}; 0.3125 MiB is one token. Every printed line matches a "
          "block_bytes without the block_size factor.")
    slip = int(pool.available_kv_bytes / cap.kv_bytes_per_token(m3))  # what was printed
    s.add("003-7.3-blocks", "§7.3", "printed 'Block count: 484,966'", 484_966, "blocks",
          pool.num_gpu_blocks, "wrong",
          f"int(148 GiB / 5 MiB) = int({pool.available_kv_bytes / pool.block_bytes:,.1f}) = "
          f"{pool.num_gpu_blocks:,}. int(148 GiB / {cap.kv_bytes_per_token(m3):,} B per token) "
          f"= {slip:,}: the printed count is tokens.")
    s.add("003-7.3-tokens", "§7.3", "printed 'max concurrent tokens: 7,759,456'", 7_759_456,
          "tokens", pool.num_gpu_tokens, "wrong",
          f"{pool.num_gpu_blocks:,} x 16 = {pool.num_gpu_tokens:,}; {slip:,} x 16 = "
          f"{slip * 16:,} applies block_size a second time.")
    seqs = math.floor(pool.max_concurrency(2048))
    s.add("003-7.3-seqs", "§7.3", "printed 'recommended sequences: 3788' (2048 tokens each)",
          3788, "sequences", seqs, "wrong", f"{pool.num_gpu_tokens:,} // 2048 = {seqs}.")
    rank = cap.plan_kv_cache(m3, 80, gpu_memory_utilization=0.9, weight_gib=35,
                             tensor_parallel_size=4)
    s.add("003-7.3-per-rank", "§7.3", "sizing the 4 GPUs as one pool", NO_NUMBER, "blocks",
          rank.num_gpu_blocks, "ok",
          f"vLLM sizes each rank: TP=4 leaves {cap.kv_heads_per_rank(m3, 4)} KV heads, "
          f"{fb(rank.block_bytes)} blocks and {fb(rank.available_kv_bytes)} per rank, so "
          f"{rank.num_gpu_blocks:,} blocks per rank: the same count, since heads split evenly.")
    v3 = get_preset("deepseek-v3")
    mla, mha = cap.kv_bytes_per_token(v3), mha_equivalent_kv_bytes_per_token(v3)
    gqa = cap.kv_bytes_per_token(m3)
    s.add("003-summary-mla", "summary", "MLA's low-rank compression shrinks each block's KV "
          "data to 1/10 (10x less)", 10, "x less", mha / mla, "wrong",
          f"DeepSeek-V3 caching plain MHA K/V ({v3.num_attention_heads} heads, K "
          f"{v3.head_dim} + {v3.qk_rope_head_dim} wide, V {v3.head_dim} wide) would take {mha:,} B "
          f"per token; its MLA latent takes {mla:,} B: 1/{mha / mla:.1f}. Against a GQA 70B "
          f"(Llama-3-70B, {gqa:,} B) it is 1/{gqa / mla:.1f}. Neither baseline gives 1/10.")
    return s.claims


def mha_equivalent_kv_bytes_per_token(spec: ModelSpec) -> int:
    """Bytes per token an MLA model would cache with plain per-head K and V (MHA), all layers.

    Each of its num_attention_heads heads would store a key of head_dim + qk_rope_head_dim
    values (DeepSeek's keys have a no-RoPE part, qk_nope_head_dim, and a RoPE part) and a
    value of head_dim values; for DeepSeek-V2/V3 qk_nope_head_dim = v_head_dim = head_dim = 128.
    ValueError for a model that is not MLA (its own cache is already per-head K and V).
    """
    if not spec.is_mla:
        raise ValueError(f"{spec.name} is not an MLA model: use capacity.kv_bytes_per_token")
    per_head = (spec.head_dim + spec.qk_rope_head_dim) + spec.head_dim
    return spec.num_layers * spec.num_attention_heads * per_head * spec.dtype_bytes
