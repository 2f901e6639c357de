"""The "Block Manager tutorial"'s (source 000) capacity numbers, recomputed with capacity.py.

One function, :func:`source_000_claims`, in the article's order: the 70B model's bytes per token and
per block, its per-rank pool at TP=8, DeepSeek-V3's decode traffic under context parallelism,
its MLA blocks and the 3,258-block metric, swap space and max_model_len.
:func:`course_lib.claims.sources.audit` gathers it with the other articles'.
"""

from __future__ import annotations

from course_lib import capacity as cap
from course_lib.claims.sources_claim import NO_NUMBER, Sheet, SourceClaim
from course_lib.sizing.blocks import num_cpu_blocks, num_gpu_blocks, tokens_that_fit
from course_lib.sizing.models import get_preset
from course_lib.sizing.units import GiB, KiB, MiB
from course_lib.sizing.units import format_bytes as fb


def source_000_claims() -> list[SourceClaim]:
    s = Sheet("000")
    m70 = get_preset("llama-3-70b")  # "a typical 70B": Llama-2/3-70B share this geometry
    tok = cap.kv_bytes_per_token(m70)
    s.add("000-1.2-per-token", "§1.2", "70B (80 layers, 8 KV heads, head_dim 128, FP16): "
          "80 x 2 x 8 x 128 x 2 = 327,680 B per token, ~320 KB", 327_680, "B", tok, "ok",
          f"{tok:,} B = {fb(tok)}: K and V, 8 heads of 128 values, 2 B each, in 80 layers.")
    kv = cap.contiguous_kv_bytes(m70, 200_000)
    s.add("000-1.2-200k", "§1.2", "200K tokens: 320 KB x 200,000 = 64 GB", 64, "GiB", kv / GiB,
          "unit", f"{tok:,} B x 200,000 = {kv / 1e9:.1f} GB = {fb(kv)}. The article multiplies "
          "binary KB (320 KiB) by 200,000 and reads the result, 64,000,000 KiB, as decimal GB; "
          "neither unit system gives 64.")
    k = cap.k_block_bytes_per_layer(m70, 16)
    s.add("000-2.3-k-block", "§2.3", "Key block [16, 8, 128] x 2 B = 32 KB", 32, "KiB", k / KiB,
          "ok", f"{k:,} B = {fb(k)}; the Value block is the same size.")
    layer = cap.block_bytes_per_layer(m70, 16)
    s.add("000-2.3-layer-block", "§2.3", "K + V per block per layer: 64 KB", 64, "KiB",
          layer / KiB, "ok", f"{layer:,} B = {fb(layer)}, i.e. 16 tokens x 4,096 B per layer.")
    blk = cap.block_bytes(m70, 16)
    s.add("000-2.3-block", "§2.3", "per block over all 80 layers: 5 MB", 5, "MiB", blk / MiB,
          "ok", f"{fb(layer)} x 80 = {blk:,} B = {fb(blk)} (binary MB); also 16 x {tok:,} B.")

    s.add("000-4.3-weights", "§4.3", "70B FP16 weights ~140 GB, 17.5 GB per GPU over 8",
          140, "GB", m70.weight_bytes / 1e9, "ok",
          f"{m70.num_params:,} parameters x 2 B = {m70.weight_bytes / 1e9:.1f} GB "
          f"({fb(m70.weight_bytes)}). Below we keep the article's 17.5 per GPU, read as GiB.")
    b = cap.plan_kv_cache(m70, 80, gpu_memory_utilization=0.9, tensor_parallel_size=8,
                          weight_gib=17.5, activation_gib=2, overhead_gib=1.5)
    s.add("000-4.3-available", "§4.3", "available = 80 x 0.9 - 17.5 - 2 - 1.5 = 51 GB", 51,
          "GiB", b.available_kv_bytes / GiB, "ok",
          f"{fb(b.available_kv_bytes)}, reading the article's GB as GiB the way vLLM counts.")
    s.add("000-4.3-block", "§4.3", "block per rank, TP=8 (1 KV head each): "
          "16 x 80 x 2 x 1 x 128 x 2 = 655,360 B ~ 640 KB", 655_360, "B", b.block_bytes, "ok",
          f"8 KV heads over 8 ranks leave {cap.kv_heads_per_rank(m70, 8)} per rank: "
          f"{b.block_bytes:,} B = {fb(b.block_bytes)}.")
    fifty = num_gpu_blocks(50 * GiB, b.block_bytes)
    decimal = num_gpu_blocks(51 * 10**9, b.block_bytes)
    s.add("000-4.3-num-blocks", "§4.3", "num_blocks = 51 GB / 640 KB ~ 81,920", 81_920, "blocks",
          b.num_gpu_blocks, "approx",
          f"51 GiB / 640 KiB = {b.available_kv_bytes / b.block_bytes:,.1f}, floored to "
          f"{b.num_gpu_blocks:,}. 50 GiB would give {fifty:,} and decimal 51 GB {decimal:,}: "
          "the article's figure is 50 GiB's, not its own 51.")
    s.add("000-4.3-tokens", "§4.3", "tokens = 81,920 x 16 ~ 1.3M", 81_920 * 16, "tokens",
          b.num_gpu_tokens, "approx", f"{b.num_gpu_blocks:,} x 16 = {b.num_gpu_tokens:,}; "
          "still about 1.3M, so rounding hides the 1 GiB slip above.")

    v3 = get_preset("deepseek-v3")
    ctx = cap.context_parallel_capacity(3258, 16, 4)
    comm = cap.decode_comm_bytes(v3, ctx, 4)
    plain_q = v3.num_attention_heads * v3.head_dim * v3.dtype_bytes
    s.add("000-8-query", "§8", "broadcasting one decode token's Q: ~32 KB", 32, "KiB",
          comm.query_bytes / KiB, "wrong",
          f"32 KiB = 128 heads x 128 x 2 B = {plain_q:,} B, a query as wide as a plain head. "
          "MLA decode attends in the compressed space, so each head's query is 512 + 64 = 576 "
          f"wide: {fb(comm.query_bytes)} per layer. The point stands: moving the KV is still "
          f"~{comm.kv_to_query_ratio:,.0f}x more.")
    s.add("000-8-output", "§8", "all-reduce of the attention output: ~32 KB", 32, "KiB",
          comm.partial_output_bytes / KiB, "wrong",
          "Each rank's partial output stays in the 512-wide latent space until after the merge, "
          f"plus one float32 log-sum-exp per head: {comm.partial_output_bytes:,} B = "
          f"{fb(comm.partial_output_bytes)} per layer; still tiny.")
    remote = comm.move_kv_bytes // cap.kv_bytes_per_token_per_layer(v3)
    s.add("000-8-move-kv", "§8", "moving the KV instead: ~200 MB", 200, "MB",
          comm.move_kv_bytes / 1e6, "approx",
          f"Per layer: of {ctx:,} tokens over CP=4 the query's rank lacks {remote:,}, x 1,152 B "
          f"= {comm.move_kv_bytes / 1e6:.0f} MB ({fb(comm.move_kv_bytes)}). The article's figure "
          f"is per layer; all {v3.num_layers} layers would move "
          f"{comm.move_kv_bytes * v3.num_layers / 1e9:.1f} GB per decode step.")

    blk3 = cap.block_bytes(v3, 16, tensor_parallel_size=2)
    lat = cap.kv_bytes_per_token_per_layer(v3, tensor_parallel_size=2)
    s.add("000-9-latent", "§9", "MLA cache per token per layer: 1152 B", 1152, "B", lat, "ok",
          f"(512 + 64) x 2 B = {lat:,} B, at TP=2 the same as at TP=1: the latent has no heads "
          "to split, so every TP rank stores all of it.")
    s.add("000-9-block", "§9", "MLA block: 16 x 61 x 1152 B ~ 1.07 MB", 1.07, "MiB", blk3 / MiB,
          "ok", f"{blk3:,} B = {fb(blk3)}.")
    s.add("000-9-tokens", "§9", "3,258 GPU KV blocks x 16 = 52,128 tokens", 52_128, "tokens",
          tokens_that_fit(3258, 16), "ok", "vLLM logs this as the GPU KV cache size.")
    s.add("000-9-cp", "§9", "52K x 4 (CP=4) = 208K tokens", 208_000, "tokens", ctx, "ok",
          f"3,258 x 16 x 4 = {ctx:,}: each context-parallel rank holds a different quarter "
          "of the sequence in its own pool.")
    fit = num_gpu_blocks(round(3.5 * GiB), blk3)
    fit_dec = num_gpu_blocks(round(3.5e9), blk3)
    s.add("000-9-num-blocks", "§9", "3.5 GB / 1.07 MB ~ 3,258 blocks, a perfect match", 3258,
          "blocks", fit, "approx",
          f"3.5 GiB / {blk3:,} B = {fit:,} blocks (decimal 3.5 GB: {fit_dec:,}). 3,258 blocks "
          f"take {fb(3258 * blk3)} ({3258 * blk3 / 1e9:.2f} GB): close, not a perfect match.")
    w = round(v3.weight_bytes / 8)
    left = cap.available_kv_bytes(80 * GiB, 1.0, w)
    s.add("000-9-weights", "§9", "671B parameters on 8 x H100 80G leave ~3.5 GB per GPU for KV",
          3.5, "GiB", left / GiB, "wrong",
          f"DeepSeek-V3 ships FP8 weights: 671e9 B / 8 = {fb(w)} per GPU even if spread "
          f"perfectly, leaving {fb(left)} of an 80 GiB card at gpu_memory_utilization=1.0, "
          "before activations and CUDA overhead; at 0.92 the budget is negative and vLLM "
          "refuses to start. The 3,258-block metric needs bigger GPUs (e.g. H200) or more.")
    s.add("000-10-mla-formula", "§10", "MLA KV per token = num_layers x (d_c + d_rope) x "
          "dtype_bytes", NO_NUMBER, "B", cap.kv_bytes_per_token(v3), "ok",
          f"For DeepSeek-V3: 61 x (512 + 64) x 2 = {cap.kv_bytes_per_token(v3):,} B per token, "
          f"{tok / cap.kv_bytes_per_token(v3):.1f}x less than the 70B GQA model's {tok:,} B.")
    cpu = num_cpu_blocks(4, b.block_bytes)
    s.add("000-12.4-swap", "§12.4", "swap_space=4 (GB): cpu_blocks = 4 GB / block bytes",
          NO_NUMBER, "blocks", cpu, "ok",
          f"vLLM's swap_space is GiB per GPU: for the §4.3 70B rank (640 KiB blocks) "
          f"4 GiB / 640 KiB = {cpu:,} CPU blocks ({tokens_that_fit(cpu, 16):,} tokens); "
          f"decimal 4 GB would give {num_cpu_blocks(4e9 / GiB, b.block_bytes):,}.")
    conc = cap.max_concurrency(3258, 16, 32768)
    s.add("000-13.1-max-model-len", "§13.1", "--max-model-len 32768 stops one request from "
          "filling the KV cache", NO_NUMBER, "x", conc, "ok",
          f"With §9's 3,258-block pool vLLM would log 'Maximum concurrency for 32,768 tokens "
          f"per request: {conc:.2f}x': one maximal request takes {100 / conc:.0f}% of a rank's "
          "pool (without CP).")
    return s.claims
