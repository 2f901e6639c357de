"""The tiny model's shape: one frozen dataclass, the same fields a Llama ``config.json`` has."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

    ``num_heads`` query heads share ``num_kv_heads`` key/value heads (GQA ratio
    ``num_heads // num_kv_heads``); the KV cache stores only the KV heads, which is why a
    GQA model's cache is smaller (chapter 01). ``max_position`` is the context length the
    weights were trained for.
    """

    vocab_size: int = 259
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    rope_theta: float = 10000.0
    max_position: int = 256
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        return cls(**d)
