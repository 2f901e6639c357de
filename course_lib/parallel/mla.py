"""Multi-head Latent Attention (DeepSeek-V2/V3): a latent KV cache, and weight absorption.

The "Block Manager tutorial", §6. Per token and layer, MLA caches one compressed vector ``c_kv``
(``kv_lora_rank`` values) and one RoPE key ``k_rope`` (``qk_rope_head_dim`` values) shared by
all heads -- not per-head K and V. Head ``h``'s key and value are linear images of the latent::

    k_h = [c_kv @ W_uk[:, h]  ;  k_rope]          v_h = c_kv @ W_uv[:, h]

so attention can be computed two ways with the same result:

* **expanded** (prefill-style): materialise every head's K and V from the cache, run MHA;
* **absorbed** (decode): fold ``W_uk`` into the query (``q_lat_h = W_uk[:, h] @ q_nope_h``)
  and ``W_uv`` into the output, and attend directly over the cached latents: an MQA whose one
  KV "head" is the 576-wide ``[c_kv ; k_rope]`` and whose value is the 512-wide ``c_kv``.

Why TP cannot shrink this cache: the latent has no head axis. TP splits *heads* (each rank
gets some columns of ``W_uk``/``W_uv``), but every head reads the whole ``c_kv``, so every TP
rank must keep all of it. Only splitting the *tokens* (context parallelism) divides it.
The RoPE part stays separate because a position-dependent rotation cannot be absorbed into
a fixed weight; that is why it is cached beside the latent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib import capacity as cap
from course_lib.parallel.merge import partial_attention
from course_lib.sizing.models import ModelSpec
from course_lib.sizing.units import check_int


def latent_bytes_per_token(spec: ModelSpec, tensor_parallel_size: int = 1) -> int:
    """MLA cache bytes per token over all layers on one rank: layers x (d_c + d_rope) x bytes.

    The formula of the "Block Manager tutorial" (§10), checked against
    :func:`course_lib.capacity.kv_bytes_per_token` (the library's single source of truth) so the
    two can never drift apart.
    """
    if not spec.is_mla:
        raise ValueError(f"{spec.name} is {spec.attention_type}, not MLA: it has no latent; "
                         "use capacity.kv_bytes_per_token")
    cap.kv_heads_per_rank(spec, tensor_parallel_size)          # validates the TP size
    value = spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim) * spec.dtype_bytes
    assert value == cap.kv_bytes_per_token(spec, tensor_parallel_size)
    return value


def expanded_mha_bytes_per_token(spec: ModelSpec) -> int:
    """What the same model would cache if it stored per-head K (nope + rope) and V, like MHA."""
    k = spec.num_attention_heads * (spec.head_dim + spec.qk_rope_head_dim)
    v = spec.num_attention_heads * spec.head_dim
    return spec.num_layers * (k + v) * spec.dtype_bytes


def cache_bytes_by_tp(spec: ModelSpec, tp_sizes: list[int]) -> dict[int, int]:
    """Per-rank cache bytes per token for each TP size: flat for MLA, falling for MHA/GQA."""
    return {tp: cap.kv_bytes_per_token(spec, tp) for tp in tp_sizes}


@dataclass(frozen=True)
class MLAConfig:
    """A small MLA layer (DeepSeek-V3 is 7168 / 128 / 512 / 64 / 128 / 128)."""

    hidden_size: int = 32
    num_heads: int = 4
    kv_lora_rank: int = 16        # d_c
    qk_rope_head_dim: int = 4     # d_rope (even: RoPE rotates pairs)
    qk_nope_head_dim: int = 8     # d_nope
    v_head_dim: int = 8

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "kv_lora_rank", "qk_rope_head_dim",
                     "qk_nope_head_dim", "v_head_dim"):
            check_int(name, getattr(self, name), 1)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got "
                             f"{self.qk_rope_head_dim}")

    @property
    def scale(self) -> float:
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5


@dataclass(frozen=True)
class MLAWeights:
    """Weights of one MLA layer (no query compression, no norms: only what attention needs)."""

    w_q: torch.Tensor     # [hidden, H, d_nope + d_rope]
    w_dkv: torch.Tensor   # [hidden, d_c]        down-projection to the latent
    w_kr: torch.Tensor    # [hidden, d_rope]     the shared RoPE key
    w_uk: torch.Tensor    # [d_c, H, d_nope]     up-projection latent -> per-head key
    w_uv: torch.Tensor    # [d_c, H, d_v]        up-projection latent -> per-head value
    w_o: torch.Tensor     # [H, d_v, hidden]

    @staticmethod
    def random(cfg: MLAConfig, seed: int = 0, dtype: torch.dtype = torch.float64) -> MLAWeights:
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, dtype=torch.float64)
                    / shape[0] ** 0.5).to(dtype)
        h, n = cfg.hidden_size, cfg.num_heads
        return MLAWeights(w(h, n, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
                          w(h, cfg.kv_lora_rank), w(h, cfg.qk_rope_head_dim),
                          w(cfg.kv_lora_rank, n, cfg.qk_nope_head_dim),
                          w(cfg.kv_lora_rank, n, cfg.v_head_dim), w(n, cfg.v_head_dim, h))


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x [n, ..., d]`` (d even) at ``positions [n]`` (rotate pairs)."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)          # [d/2]
    ang = positions.to(torch.float64)[:, None] * inv[None]                   # [n, d/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = ang.cos().reshape(shape).to(x), ang.sin().reshape(shape).to(x)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def latent_cache(w: MLAWeights, hidden: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """What MLA caches for tokens ``hidden [n, hidden]``: ``c_kv [n, d_c]`` and ``k_rope [n,
    d_rope]`` (already rotated to each token's position)."""
    return hidden @ w.w_dkv, rope(hidden @ w.w_kr, positions)


def query(cfg: MLAConfig, w: MLAWeights, hidden: torch.Tensor, position: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The new token's ``q_nope [H, d_nope]`` and rotated ``q_rope [H, d_rope]``."""
    q = torch.einsum("c,chd->hd", hidden, w.w_q)
    q_nope, q_rope = q[:, :cfg.qk_nope_head_dim], q[:, cfg.qk_nope_head_dim:]
    return q_nope, rope(q_rope[None], torch.tensor([position]))[0]


def attend_expanded(cfg: MLAConfig, w: MLAWeights, q_nope: torch.Tensor, q_rope: torch.Tensor,
                    c_kv: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """Materialise per-head K ``[n, H, d_nope + d_rope]`` and V ``[n, H, d_v]``, then MHA.
    Returns the layer output ``[hidden]``."""
    n, heads = c_kv.shape[0], cfg.num_heads
    k_nope = torch.einsum("nc,chd->nhd", c_kv, w.w_uk)                       # [n, H, d_nope]
    k = torch.cat([k_nope, k_rope[:, None].expand(n, heads, -1)], dim=-1)    # [n, H, d_qk]
    v = torch.einsum("nc,chd->nhd", c_kv, w.w_uv)                            # [n, H, d_v]
    out, _ = partial_attention(torch.cat([q_nope, q_rope], -1), k, v, cfg.scale)  # [H, d_v]
    return torch.einsum("hd,hdc->c", out, w.w_o)


def absorbed_query(w: MLAWeights, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
    """``[H, d_c + d_rope]``: W_uk folded into the query, the RoPE part appended."""
    return torch.cat([torch.einsum("hd,chd->hc", q_nope, w.w_uk), q_rope], dim=-1)


def attend_absorbed(cfg: MLAConfig, w: MLAWeights, q_nope: torch.Tensor, q_rope: torch.Tensor,
                    c_kv: torch.Tensor, k_rope: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attend over the cache as it is: one shared KV head ``[c_kv ; k_rope]`` (MQA).

    Returns the layer output ``[hidden]`` and the latent partial result ``(o_lat [H, d_c],
    lse [H])``, the pieces a context-parallel rank would send to be merged.
    """
    q = absorbed_query(w, q_nope, q_rope)                                    # [H, d_c + d_r]
    k = torch.cat([c_kv, k_rope], dim=-1)[:, None]                           # [n, 1, d_c + d_r]
    o_lat, lse = partial_attention(q, k, c_kv[:, None], cfg.scale)           # [H, d_c], [H]
    out = torch.einsum("hc,chd->hd", o_lat, w.w_uv)                          # W_uv absorbed
    return torch.einsum("hd,hdc->c", out, w.w_o), o_lat, lse


def output_from_latent(w: MLAWeights, o_lat: torch.Tensor) -> torch.Tensor:
    """Finish an absorbed attention from a (merged) latent output ``o_lat [H, d_c]``."""
    return torch.einsum("hd,hdc->c", torch.einsum("hc,chd->hd", o_lat, w.w_uv), w.w_o)


@dataclass(frozen=True)
class MLADemo:
    """Both computations on one random problem, for a notebook to print."""

    expanded: torch.Tensor
    absorbed: torch.Tensor
    cached_values_per_token: int       # d_c + d_rope
    expanded_values_per_token: int     # H x (d_nope + d_rope + d_v)

    @property
    def max_abs_diff(self) -> float:
        return float((self.expanded - self.absorbed).abs().max())


def demo(cfg: MLAConfig = MLAConfig(), num_tokens: int = 10, seed: int = 0,
         dtype: torch.dtype = torch.float64) -> MLADemo:
    """A decode step of a random MLA layer, expanded and absorbed: ``num_tokens`` cached
    tokens (``>= 0``) before the new one."""
    check_int("num_tokens", num_tokens, 0)
    w = MLAWeights.random(cfg, seed, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(num_tokens + 1, cfg.hidden_size, generator=g,
                         dtype=torch.float64).to(dtype)
    positions = torch.arange(num_tokens + 1)
    c_kv, k_rope = latent_cache(w, hidden, positions)   # the new token is cached too
    q_nope, q_rope = query(cfg, w, hidden[-1], num_tokens)
    exp = attend_expanded(cfg, w, q_nope, q_rope, c_kv, k_rope)
    absd, _, _ = attend_absorbed(cfg, w, q_nope, q_rope, c_kv, k_rope)
    per_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    return MLADemo(exp, absd, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                   cfg.num_heads * per_head)
