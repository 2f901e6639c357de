"""The "Memory optimization" article's (source 001) capacity numbers, recomputed.

One function, :func:`source_001_claims`: the 7B model's KV for 1,024 tokens against its weights, the
static-vs-paged figure's utilization, and the prefix-caching case's memory with and without the
shared system prompt. :func:`course_lib.claims.sources.audit` gathers it with the others'.
"""

from __future__ import annotations

from course_lib import capacity as cap
from course_lib.claims.sources_claim import NO_NUMBER, Sheet, SourceClaim
from course_lib.sizing.blocks import (
    num_blocks_for_tokens,
    num_full_blocks,
    paged_utilization,
    static_utilization,
)
from course_lib.sizing.models import get_preset
from course_lib.sizing.units import GiB
from course_lib.sizing.units import format_bytes as fb


def source_001_claims() -> list[SourceClaim]:
    s = Sheet("001")
    m7 = get_preset("llama-2-7b")
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
    static = 100 * static_utilization(used, 1024)
    s.add("001-static", "static vs paged figure", "static allocation: 1024 x 3 = 3072 slots "
          "reserved, 896 used", NO_NUMBER, "%", static, "ok",
          f"The counts are right (256 + 512 + 128 = 896 of 3,072): utilization {static:.1f}%, "
          "inside the 'often under 60%' the text mentions.")
    paged = 100 * paged_utilization(used, 16)
    blocks = sum(num_blocks_for_tokens(n, 16) for n in used)
    s.add("001-paged", "static vs paged figure", "paging allocates only what requests use",
          NO_NUMBER, "%", paged, "ok",
          f"With block_size 16 the three requests hold {blocks} blocks, {paged:.0f}% used, but "
          "only because 256, 512 and 128 are multiples of 16; usually each sequence's last "
          "block is part empty. The figure's 3/3/2 blocks are schematic.")
    m8 = get_preset("llama-3-8b")
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
          f"{num_full_blocks(500, 16)} full blocks are stored once and each request keeps "
          f"the rest: {on // blk:,} blocks = {fb(on)}. 15 GB exceeds even the uncached total.")
    return s.claims
