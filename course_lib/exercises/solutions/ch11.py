"""Solutions of chapter 11's exercises (the capstone)."""

from __future__ import annotations


def append_slots(bm, seq_id, token_ids):
    table = bm.get_table(seq_id)
    blocks = table.blocks
    bs, n = bm.block_size, len(table.token_ids)
    copies = []
    if n % bs != 0 and bm.gpu.ref_counts[blocks[-1]] > 1:   # shared and partial: copy it
        src = blocks[-1]
        blocks[-1] = bm.gpu.allocate()
        bm.gpu.release([src])                               # one sharer fewer
        copies.append((src, blocks[-1]))
    while len(blocks) * bs < n + len(token_ids):            # full: a fresh block
        blocks.append(bm.gpu.allocate())
    table.token_ids.extend(token_ids)
    return copies


def cache_ops(eng, out):
    # swap-out first: the GPU blocks it empties may be the swap-in's or a copy's destination
    for (gk, gv), (ck, cv) in zip(eng.gpu_caches, eng.cpu_caches, strict=False):
        for gpu, cpu in out.blocks_to_swap_out:
            ck[cpu], cv[cpu] = gk[gpu], gv[gpu]
    # then swap-in: a copy may read a block that just came back
    for (gk, gv), (ck, cv) in zip(eng.gpu_caches, eng.cpu_caches, strict=False):
        for cpu, gpu in out.blocks_to_swap_in:
            gk[gpu], gv[gpu] = ck[cpu], cv[cpu]
    for k, v in eng.gpu_caches:
        for src, dst in out.blocks_to_copy:
            k[dst], v[dst] = k[src], v[src]


def serving_metrics(records, percentile):
    import numpy as np

    ttfts, tpots, itls, e2els = [], [], [], []
    for sent, times in records:
        ttfts.append(times[0] - sent)                 # first token, from when it was sent
        e2els.append(times[-1] - sent)                # last token
        if len(times) > 1:                            # one token: no TPOT
            tpots.append((times[-1] - times[0]) / (len(times) - 1))
        itls += [times[i + 1] - times[i] for i in range(len(times) - 1)]   # all gaps, pooled

    def stats(xs):
        xs = xs or [0]                                # vLLM: np.mean(xs or 0)
        return np.mean(xs) * 1000, np.percentile(xs, percentile) * 1000

    return {"ttft": stats(ttfts), "tpot": stats(tpots), "itl": stats(itls),
            "e2el": stats(e2els)}
