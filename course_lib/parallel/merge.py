"""Attention over a split set of keys, and the log-sum-exp merge that glues the pieces back.

Context parallelism ("Block Manager tutorial" §8) cuts one sequence's cached tokens into
pieces on different ranks. For one decode query ``q`` and the keys of one piece ``P``::

    s_j   = scale * q . k_j                       (j in P)
    lse_P = log(sum_j exp(s_j))                   (-inf when P is empty)
    out_P = sum_j exp(s_j - lse_P) * v_j          (softmax over P alone; zeros when P is empty)

Full attention over the union of disjoint pieces is then an exact weighted sum::

    lse = log(sum_P exp(lse_P))                   out = sum_P exp(lse_P - lse) * out_P

because ``exp(lse_P - lse)`` is exactly the share of the softmax mass that falls in piece P.
Only ``out_P`` (one row per head) and ``lse_P`` (one number per head) cross the network: this
is why "move Q" is cheap and "move KV" is not. The merge is associative and order-independent,
so a tree, a ring or an all-reduce can compute it. Pure torch; no process group here. The same
merge of two pieces (what split-K decode does) is ``merge_attn_states`` in
``kernels/reference.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query over a piece of the keys, with its log-sum-exp.

    ``q [num_heads, head_dim]``; ``k [n, num_kv_heads, head_dim]``, ``v [n, num_kv_heads,
    v_dim]`` (``n`` may be 0; query head ``h`` reads KV head ``h // (num_heads //
    num_kv_heads)``, GQA/MQA; ``v_dim`` may differ from ``head_dim``, as in MLA's latent form).
    Returns ``out [num_heads, v_dim]`` and ``lse [num_heads]`` (natural log), both in
    float64 if ``q`` is float64 and float32 otherwise. An empty piece gives zeros and ``-inf``:
    it weighs nothing in :func:`merge_partials`.
    """
    if q.dim() != 2 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"need q [heads, d], k [n, kv_heads, d], v [n, kv_heads, dv]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    num_heads, num_kv_heads = q.shape[0], k.shape[1]
    if num_kv_heads == 0 or k.shape[:2] != v.shape[:2] or k.shape[2] != q.shape[1] \
            or num_heads % num_kv_heads:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (heads must be a multiple of KV heads)")
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if scale is None:
        scale = q.shape[1] ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    n = k.shape[0]
    if n == 0:
        return (torch.zeros(num_heads, v.shape[2], dtype=dtype, device=q.device),
                torch.full((num_heads,), float("-inf"), dtype=dtype, device=q.device))
    group = num_heads // num_kv_heads
    kf = k.to(dtype).repeat_interleave(group, dim=1)                 # [n, H, d]
    vf = v.to(dtype).repeat_interleave(group, dim=1)                 # [n, H, dv]
    scores = torch.einsum("hd,nhd->hn", q.to(dtype), kf) * scale     # [H, n]
    lse = torch.logsumexp(scores, dim=-1)                            # [H]
    probs = torch.exp(scores - lse[:, None])                         # softmax over the piece
    return torch.einsum("hn,nhd->hd", probs, vf), lse


def merge_partials(outs: torch.Tensor | Sequence[torch.Tensor],
                   lses: torch.Tensor | Sequence[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge R partial results into attention over the union of their (disjoint) key sets.

    ``outs [R, ..., dv]`` and ``lses [R, ...]`` (or sequences of R tensors). Returns ``out [...,
    dv]`` and ``lse [...]``. Pieces with ``lse = -inf`` (empty) weigh 0; if every piece is
    empty the result is zeros with ``lse = -inf`` (not NaN).
    """
    if not isinstance(outs, torch.Tensor) and not len(outs):
        raise ValueError("merge_partials needs at least one partial result, got none")
    outs = torch.stack(list(outs)) if not isinstance(outs, torch.Tensor) else outs
    lses = torch.stack(list(lses)) if not isinstance(lses, torch.Tensor) else lses
    if outs.dim() < 2 or outs.shape[:-1] != lses.shape:
        raise ValueError(f"outs must be [R, ..., dv] and lses [R, ...]; got "
                         f"{tuple(outs.shape)} and {tuple(lses.shape)}")
    lse = torch.logsumexp(lses, dim=0)                               # [...]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(lses - safe)                                 # [R, ...], sums to 1
    return (weights.unsqueeze(-1) * outs).sum(dim=0), lse


def split_ranges(num_tokens: int, cp_size: int) -> list[tuple[int, int]]:
    """The layout of the "Block Manager tutorial" (§5.3): rank r owns tokens
    ``[r*N//cp, (r+1)*N//cp)`` (balanced, contiguous; a range is empty when N < cp)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an integer >= 1, got {cp_size!r}")
    bounds = [r * num_tokens // cp_size for r in range(cp_size + 1)]
    return list(zip(bounds, bounds[1:], strict=False))
