"""A tiny Llama-style decoder whose attention reads and writes the paged KV cache.

Architecture (Llama's): token embedding -> ``num_layers`` x [RMSNorm -> attention with RoPE and
grouped-query heads -> residual; RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head.
Parameter names follow Hugging Face's ``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj``
...), so the same weights load into an independent implementation for cross-checking.

Two forward paths share every weight and every op except where K/V live:

* :meth:`TinyLlama.forward` — the serving path. Input is the packed new tokens of several
  sequences (``input_ids [num_tokens]``, ``positions [num_tokens]``) plus
  :class:`~course_lib.model.attention.AttentionMetadata` and one ``(key_cache, value_cache)``
  pair per layer. Each layer writes its new K/V into the paged cache and attends through the
  block tables (:func:`~course_lib.model.attention.paged_attention_layer`). Prefill, chunked
  prefill and decode are the same call.
* :meth:`TinyLlama.forward_contiguous` — the reference and training path: a rectangular batch
  ``[B, T]`` with a dense causal mask, optionally continuing a plain contiguous per-sequence
  cache (``past``), the way a textbook decoder does it.

A hybrid configuration (``ModelConfig.layer_types``, chapter 14) makes some layers
sliding-window layers: both paths give such a layer the same mask (causal, and the last
``sliding_window`` keys only), the paged one through its KV-cache group's block tables, whose
entries before the window may be the pool's null block. vLLM 0.33.0's gpt-oss gives its
even layers the window, ``config.sliding_window if self.layer_idx % 2 == 0 else None``, as
``per_layer_sliding_window`` of its ``Attention`` (``vllm/model_executor/models/gpt_oss.py``);
the course reads each layer's type from ``layer_types`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.kernels.backends import AttentionBackend, get_attn_backend
from course_lib.memory.v1.kv_cache_interface import KVCacheGroupSpec
from course_lib.model.attention import AttentionMetadata, paged_attention_layer
from course_lib.model.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache), one pair per layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [*positions.shape, head_dim]`` of rotary embedding (Llama's half-split layout:
    dimension ``i`` and ``i + head_dim/2`` form one rotated pair)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv_freq              # [..., head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)                      # [..., head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., heads, head_dim]``; ``cos, sin [..., head_dim]`` (broadcast over heads)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class Attention(nn.Module):
    """Layer ``layer``'s attention: full, or sliding-window when the config says so
    (``sliding_window``: None or ``W``), reading its KV-cache group's block tables
    (``kv_cache_group_id``) in the paged path."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.scale = cfg.head_dim ** -0.5
        self.sliding_window = cfg.layer_sliding_window(layer)
        self.kv_cache_group_id = cfg.kv_cache_group_ids[layer]
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [..., hidden]`` -> q ``[..., H, d]``, k, v ``[..., H_kv, d]`` (q, k rotated)."""
        c = self.cfg
        q = self.q_proj(x).unflatten(-1, (c.num_heads, c.head_dim))
        k = self.k_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = self.v_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        """Paged: ``x [num_tokens, hidden]`` -> ``[num_tokens, hidden]``."""
        q, k, v = self._qkv(x, cos, sin)
        out = paged_attention_layer(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, attn,
                                    self.kv_cache_group_id, self.sliding_window)
        return self.o_proj(out.flatten(-2))

    def forward_contiguous(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           past: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        """Dense: ``x [B, T, hidden]``; ``past`` = K, V ``[B, S, H_kv, d]`` of earlier tokens.
        Returns ``[B, T, hidden]`` and the grown cache ``[B, S + T, H_kv, d]``."""
        q, k, v = self._qkv(x, cos, sin)                          # [B, T, heads, d]
        if past is not None:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        g = self.cfg.gqa_ratio
        qh = q.transpose(1, 2)                                    # [B, H, T, d]
        kh = k.repeat_interleave(g, dim=2).transpose(1, 2)        # [B, H, S+T, d]
        vh = v.repeat_interleave(g, dim=2).transpose(1, 2)
        t, s, window = q.shape[1], k.shape[1], self.sliding_window
        if s == t and window is None:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        else:  # query i sits at position s - t + i and sees keys 0 .. s - t + i
            ones = torch.ones(t, s, dtype=torch.bool, device=x.device)
            mask = ones.tril(s - t)                                   # [T, S+T]
            if window is not None:              # ... and, windowed, only the last W of them
                mask &= ~ones.tril(s - t - window)                    # keys j > p - W
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).flatten(-2)), (k, v)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


class TinyLlama(nn.Module):
    """The course's model. See the module docstring for the two forward paths."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.num_kv_cache_groups = max(cfg.kv_cache_group_ids) + 1   # 1: full attention only
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def init_weights(self, seed: int) -> None:
        """GPT-2 style init: N(0, 0.02), residual outputs scaled by 1/sqrt(2 * num_layers)."""
        gen = torch.Generator().manual_seed(seed)
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
                continue
            s = std / (2 * self.config.num_layers) ** 0.5 if name.endswith(
                ("o_proj.weight", "down_proj.weight")) else std
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * s)

    def _check_ids(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        for name, t in (("input_ids", input_ids), ("positions", positions)):
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
        if not input_ids.numel():
            return
        # one host copy for the four bounds (each int() of a GPU tensor is a sync of its own)
        id_lo, id_hi, pos_lo, pos_hi = torch.stack(
            [t.long() for t in (input_ids.min(), input_ids.max(), positions.min(),
                                positions.max())]).tolist()
        if not (0 <= id_lo and id_hi < self.config.vocab_size):
            raise ValueError(f"token ids must be in 0..{self.config.vocab_size - 1}, got "
                             f"{id_lo}..{id_hi}")
        # a negative position is not an error to RoPE (cos/sin of any angle): refused here too
        if pos_lo < 0:
            raise ValueError(f"positions must be in 0..{self.config.max_position - 1}, got "
                             f"{pos_lo}")
        if pos_hi >= self.config.max_position:
            raise ValueError(f"position {pos_hi} is past the model's context "
                             f"(valid: 0..{self.config.max_position - 1})")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: AttentionMetadata,
                impl: str | AttentionBackend = "auto") -> torch.Tensor:
        """Paged forward of packed tokens: ``input_ids, positions [num_tokens]`` -> logits
        ``[num_tokens, vocab_size]`` (float32). Writes the new K/V into ``kv_caches`` (one
        ``(key_cache, value_cache)`` pair per layer, each ``[num_blocks, block_size,
        num_kv_heads, head_dim]``) at the slots of the layer's KV-cache group
        (``attn_metadata.group_slot_mappings``; a hybrid model's caches may be shared between
        layers of different groups: :func:`allocate_kv_caches`). ``impl``: a backend
        resolved by ``course_lib.kernels.backends.get_attn_backend``, or its name
        (``"auto"``, ``"triton"``, ``"reference"``, ``"torch"``), resolved here once."""
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"need one (key_cache, value_cache) per layer: "
                             f"{self.config.num_layers}, got {len(kv_caches)}")
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(f"input_ids and positions must both be [num_tokens], got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        self._check_ids(input_ids, positions)
        if attn_metadata.num_tokens != input_ids.shape[0]:
            raise ValueError(f"attn_metadata describes {attn_metadata.num_tokens} new tokens, "
                             f"input_ids holds {input_ids.shape[0]}")
        if attn_metadata.num_kv_cache_groups != self.num_kv_cache_groups:
            raise ValueError(f"the model has {self.num_kv_cache_groups} KV-cache groups "
                             f"(config.kv_cache_groups): attn_metadata must carry one block "
                             f"table per sequence for each, got "
                             f"{attn_metadata.num_kv_cache_groups}")
        attn = get_attn_backend(impl, input_ids.device)
        c = self.config
        h = self.model.embed_tokens(input_ids)                      # [N, hidden]
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, h.dtype)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, kv, attn_metadata, attn)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.model.norm(h)).float()

    def forward_contiguous(self, input_ids: torch.Tensor, past: list[KVCache] | None = None
                           ) -> tuple[torch.Tensor, list[KVCache]]:
        """Dense forward of ``input_ids [B, T]`` after ``past`` (per layer K, V ``[B, S, H_kv,
        d]``, or ``None``): logits ``[B, T, vocab_size]`` (float32) and the grown cache."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
        c = self.config
        start = 0 if past is None else past[0][0].shape[1]
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        self._check_ids(input_ids, positions)
        h = self.model.embed_tokens(input_ids)                      # [B, T, hidden]
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, h.dtype)  # [T, d]
        new_past = []
        for i, layer in enumerate(self.model.layers):
            a, kv = layer.self_attn.forward_contiguous(
                layer.input_layernorm(h), cos, sin, None if past is None else past[i])
            new_past.append(kv)
            h = h + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.model.norm(h)).float(), new_past


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu",
                       kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None
                       ) -> list[KVCache]:
    """One zeroed ``(key_cache, value_cache)`` pair per layer, each ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` (vLLM's layout).

    ``kv_cache_groups`` (``cfg.kv_cache_groups(block_size)``, for a hybrid model whose block
    tables come from one pool): the pairs laid out as vLLM 0.33.0 lays its groups over one
    allocation, the ``i``-th layer of every group on the same pair (``KVCacheTensor`` in
    ``vllm/v1/kv_cache_interface.py``: "cache groups overlay each other, which is sound
    because a block ID is owned by one group at a time"; built by
    ``get_kv_cache_config_from_groups`` in ``vllm/v1/core/kv_cache_planning.py``). A block id
    is then one page in each layer of one group, and a block costs a group's layers, not
    every layer. Sound only for tables from one pool (``KVCacheManager``: no block id in two
    groups at once); one group of every layer (a full-attention model) is one pair per layer,
    as without."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, "
                         f"{block_size}")
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    if kv_cache_groups is None:
        return [(torch.zeros(shape, dtype=dtype, device=device),
                 torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]
    group_size = max(len(group.layer_names) for group in kv_cache_groups)
    pairs = [(torch.zeros(shape, dtype=dtype, device=device),
              torch.zeros(shape, dtype=dtype, device=device)) for _ in range(group_size)]
    index_in_group = {name: i for group in kv_cache_groups
                      for i, name in enumerate(group.layer_names)}
    return [pairs[index_in_group[name]] for name in cfg.layer_names]
