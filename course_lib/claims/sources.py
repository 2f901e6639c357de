"""The source articles' capacity numbers, recomputed with course_lib.capacity.

The course grew out of three Chinese articles on vLLM's KV cache, the *source articles*
(listed in :data:`SOURCES` by number and title; learners do not need them to follow the
course). Each worked number in them that concerns KV-cache capacity becomes a
:class:`SourceClaim`: the article's value, typed in as printed, beside the course's value,
computed here live by capacity.py, with a verdict and an explanation of any gap. Several of
the articles' numbers are wrong; the course shows the right one and where the article slipped,
so a learner trusts arithmetic over prose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from course_lib import capacity as cap
from course_lib.capacity import GiB, KiB, MiB
from course_lib.capacity import format_bytes as fb

# number -> (short title used in citations, full title translated from the Chinese)
SOURCES = {
    "000": ("Block Manager tutorial", "vLLM KV Cache Block Manager: an in-depth tutorial"),
    "001": ("Memory optimization", "Memory optimization: KV cache management, how "
            "PagedAttention works, and memory-pool settings"),
    "003": ("PagedAttention explained", "PagedAttention explained, with tuning parameters "
            "(blog post)"),
}


def cite(source: str, where: str = "") -> str:
    """A source article as the course cites it: ``cite("003", "§2.1")`` ->
    ``'"PagedAttention explained" §2.1'``."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {sorted(SOURCES)}, got {source!r}")
    return f'"{SOURCES[source][0]}"' + (f" {where}" if where else "")


VERDICTS = ("ok", "wrong", "approx", "unit")
NO_NUMBER = math.nan  # source_value when the article gives a formula or a claim, no number


@dataclass(frozen=True)
class SourceClaim:
    """One number from a source article, checked.

    verdict: 'ok' (right, up to the article's rounding), 'approx' (close, but the article's
    reasoning or rounding hides a real gap), 'wrong' (the number does not follow), 'unit'
    (binary and decimal units mixed). source_value is NO_NUMBER (nan) when the article states a
    formula or a qualitative claim and the course supplies the number. key: a stable id.
    """

    source: str
    where: str
    claim: str
    source_value: float
    unit: str
    course_value: float
    verdict: str
    explanation: str
    key: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {sorted(SOURCES)}, got {self.source!r}")


class _Sheet:
    """Collects one article's claims so each reads as a single add(...) call."""

    def __init__(self, source: str) -> None:
        self.source, self.claims = source, []

    def add(self, key: str, where: str, claim: str, source_value: float, unit: str,
            course_value: float, verdict: str, explanation: str) -> None:
        self.claims.append(SourceClaim(self.source, where, claim, float(source_value), unit,
                                     float(course_value), verdict, explanation, key))


def _source_000() -> list[SourceClaim]:
    s = _Sheet("000")
    m70 = cap.get_preset("llama-3-70b")  # "a typical 70B": Llama-2/3-70B share this geometry
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
    fifty = cap.num_gpu_blocks(50 * GiB, b.block_bytes)
    decimal = cap.num_gpu_blocks(51 * 10**9, b.block_bytes)
    s.add("000-4.3-num-blocks", "§4.3", "num_blocks = 51 GB / 640 KB ~ 81,920", 81_920, "blocks",
          b.num_gpu_blocks, "approx",
          f"51 GiB / 640 KiB = {b.available_kv_bytes / b.block_bytes:,.1f}, floored to "
          f"{b.num_gpu_blocks:,}. 50 GiB would give {fifty:,} and decimal 51 GB {decimal:,}: "
          "the article's figure is 50 GiB's, not its own 51.")
    s.add("000-4.3-tokens", "§4.3", "tokens = 81,920 x 16 ~ 1.3M", 81_920 * 16, "tokens",
          b.num_gpu_tokens, "approx", f"{b.num_gpu_blocks:,} x 16 = {b.num_gpu_tokens:,}; "
          "still about 1.3M, so rounding hides the 1 GiB slip above.")

    v3 = cap.get_preset("deepseek-v3")
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
          cap.tokens_that_fit(3258, 16), "ok", "vLLM logs this as the GPU KV cache size.")
    s.add("000-9-cp", "§9", "52K x 4 (CP=4) = 208K tokens", 208_000, "tokens", ctx, "ok",
          f"3,258 x 16 x 4 = {ctx:,}: each context-parallel rank holds a different quarter "
          "of the sequence in its own pool.")
    fit = cap.num_gpu_blocks(round(3.5 * GiB), blk3)
    fit_dec = cap.num_gpu_blocks(round(3.5e9), blk3)
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
    cpu = cap.num_cpu_blocks(4, b.block_bytes)
    s.add("000-12.4-swap", "§12.4", "swap_space=4 (GB): cpu_blocks = 4 GB / block bytes",
          NO_NUMBER, "blocks", cpu, "ok",
          f"vLLM's swap_space is GiB per GPU: for the §4.3 70B rank (640 KiB blocks) "
          f"4 GiB / 640 KiB = {cpu:,} CPU blocks ({cap.tokens_that_fit(cpu, 16):,} tokens); "
          f"decimal 4 GB would give {cap.num_cpu_blocks(4e9 / GiB, b.block_bytes):,}.")
    conc = cap.max_concurrency(3258, 16, 32768)
    s.add("000-13.1-max-model-len", "§13.1", "--max-model-len 32768 stops one request from "
          "filling the KV cache", NO_NUMBER, "x", conc, "ok",
          f"With §9's 3,258-block pool vLLM would log 'Maximum concurrency for 32,768 tokens "
          f"per request: {conc:.2f}x': one maximal request takes {100 / conc:.0f}% of a rank's "
          "pool (without CP).")
    return s.claims


def _source_001() -> list[SourceClaim]:
    s = _Sheet("001")
    m7 = cap.get_preset("llama-2-7b")
    kv = cap.contiguous_kv_bytes(m7, 1024)
    s.add("001-kv-7b", "key parameters", "7B (32 layers, 32 heads, head_dim 128, FP16), 1024 "
          "tokens: 2 x 32 x 32 x 128 x 1024 x 2 = 536 MB", 536, "MB", kv / 1e6, "ok",
          f"{kv:,} B = {kv / 1e6:.1f} MB (decimal) = {fb(kv)} in vLLM's binary units.")
    s.add("001-weights-7b", "key parameters", "7B FP16 weights ~14 GB", 14, "GB",
          m7.weight_bytes / 1e9, "ok", f"Llama-2-7B: {m7.num_params:,} x 2 B = "
          f"{m7.weight_bytes / 1e9:.2f} GB.")
    ratio = 100 * kv / m7.weight_bytes
    s.add("001-ratio", "key parameters", "that cache is close to 4% of the weights", 4, "%",
          ratio, "ok", f"{kv:,} / {m7.weight_bytes:,} = {ratio:.2f}%. From "
          f"{m7.weight_bytes // cap.kv_bytes_per_token(m7) + 1:,} tokens on, one request's cache "
          "outweighs the whole model.")
    used = [256, 512, 128]
    static = 100 * cap.static_utilization(used, 1024)
    s.add("001-static", "static vs paged figure", "static allocation: 1024 x 3 = 3072 slots "
          "reserved, 896 used", NO_NUMBER, "%", static, "ok",
          f"The counts are right (256 + 512 + 128 = 896 of 3,072): utilization {static:.1f}%, "
          "inside the 'often under 60%' the text mentions.")
    paged = 100 * cap.paged_utilization(used, 16)
    blocks = sum(cap.num_blocks_for_tokens(n, 16) for n in used)
    s.add("001-paged", "static vs paged figure", "paging allocates only what requests use",
          NO_NUMBER, "%", paged, "ok",
          f"With block_size 16 the three requests hold {blocks} blocks, {paged:.0f}% used, but "
          "only because 256, 512 and 128 are multiples of 16; usually each sequence's last "
          "block is part empty. The figure's 3/3/2 blocks are schematic.")
    m8 = cap.get_preset("llama-3-8b")
    blk = cap.block_bytes(m8, 16)
    off = cap.blocks_with_shared_prefix(64, 1000, 0, 16) * blk
    exact = cap.contiguous_kv_bytes(m8, 64 * 1000)
    s.add("001-prefix-off", "prefix caching case", "Llama-3-8B, 64 requests x 1000 tokens, "
          "no prefix cache: KV ~38 GB", 38, "GiB", off / GiB, "wrong",
          f"64 x 63 blocks x {fb(blk)} = {fb(off)} (exactly {exact / 1e9:.2f} GB before "
          f"rounding to blocks). 38 GB is the KV of ~{38e9 / cap.kv_bytes_per_token(m8):,.0f} "
          "tokens, 4.5x what the case holds; 8 GPUs split this total, they do not multiply it.")
    on = cap.blocks_with_shared_prefix(64, 1000, 500, 16) * blk
    s.add("001-prefix-on", "prefix caching case", "with prefix caching: KV ~15 GB", 15, "GiB",
          on / GiB, "wrong",
          "If each request's 1000 tokens begin with the shared 500-token system prompt, its "
          f"{cap.num_full_blocks(500, 16)} full blocks are stored once and each request keeps "
          f"the rest: {on // blk:,} blocks = {fb(on)}. 15 GB exceeds even the uncached total.")
    return s.claims


def _source_003() -> list[SourceClaim]:
    s = _Sheet("003")
    m70 = cap.get_preset("llama-2-70b")
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
    m8 = cap.get_preset("llama-3-8b")
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
          cap.num_blocks_for_tokens(50, 16), "ok",
          "ceil(50 / 16) = 4: the count rounds up, the 4th block being part-filled.")
    s.add("003-3-reserved", "§3", "pre-allocating 4096 tokens takes 4096/16 = 256 blocks", 256,
          "blocks", cap.num_blocks_for_tokens(4096, 16), "ok", "Exact: 4096 is 256 x 16.")
    st = 100 * cap.static_utilization([50], 4096)
    s.add("003-3-static-util", "§3", "utilization of that reservation: 1.2%", 1.2, "%", st, "ok",
          f"50 / 4096 = {st:.2f}%.")
    pg = 100 * cap.paged_utilization([50], 16)
    s.add("003-3-paged-util", "§3", "with paging, utilization rises to nearly 100%", 100, "%",
          pg, "approx", f"50 tokens in 4 blocks = 64 slots: {pg:.1f}%. The last block is part "
          "empty; only long sequences come near 100%.")
    e = {bs: cap.expected_internal_waste_tokens(bs) for bs in (8, 16, 32)}
    s.add("003-4.1-waste", "§4.1", "block_size 32: the last block may waste 31 tokens", 31,
          "tokens", cap.max_internal_waste_tokens(32), "ok",
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
          "blocks", cap.num_full_blocks(500, 16), "wrong",
          "500 tokens fill 31 blocks and 4 slots of a 32nd. That 32nd block also holds the start "
          "of each user's question, so it differs per request: only 31 blocks are shared.")
    own = cap.blocks_with_shared_prefix(1, 700, 500, 16) - cap.num_full_blocks(500, 16)
    s.add("003-5-private", "§5", "request B (500 + 200 tokens) owns 3 blocks, Phys#200-202", 3,
          "blocks", own, "wrong",
          f"700 tokens need {cap.num_blocks_for_tokens(700, 16)} blocks, 31 shared, so {own} "
          "are B's own; 3 blocks hold only 48 tokens.")
    m3 = cap.get_preset("llama-3-70b")
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
    v3 = cap.get_preset("deepseek-v3")
    mla, mha = cap.kv_bytes_per_token(v3), mha_equivalent_kv_bytes_per_token(v3)
    gqa = cap.kv_bytes_per_token(m3)
    s.add("003-summary-mla", "summary", "MLA's low-rank compression shrinks each block's KV "
          "data to 1/10 (10x less)", 10, "x less", mha / mla, "wrong",
          f"DeepSeek-V3 caching plain MHA K/V ({v3.num_attention_heads} heads, K "
          f"{v3.head_dim} + {v3.qk_rope_head_dim} wide, V {v3.head_dim} wide) would take {mha:,} B "
          f"per token; its MLA latent takes {mla:,} B: 1/{mha / mla:.1f}. Against a GQA 70B "
          f"(Llama-3-70B, {gqa:,} B) it is 1/{gqa / mla:.1f}. Neither baseline gives 1/10.")
    return s.claims


def mha_equivalent_kv_bytes_per_token(spec: cap.ModelSpec) -> int:
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


def audit() -> list[SourceClaim]:
    """Every audited claim, in article order, each course_value computed now."""
    return [*_source_000(), *_source_001(), *_source_003()]


def _show(value: float) -> str:
    if math.isnan(value):
        return "-"
    if value == int(value):
        return f"{int(value):,}"
    return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4g}"


def audit_table() -> list[dict[str, str]]:
    """The audit as display rows (e.g. pandas.DataFrame(audit_table()))."""
    return [{"source": cite(c.source), "where": c.where, "claim": c.claim,
             "source_value": _show(c.source_value), "course_value": _show(c.course_value),
             "unit": c.unit, "verdict": c.verdict} for c in audit()]
