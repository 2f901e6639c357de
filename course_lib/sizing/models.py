"""The models the course sizes: their shape, the presets, and the length vLLM runs them at.

``ModelSpec`` holds the few numbers of a decoder that decide its KV-cache and weight memory
(MHA, GQA, MQA or MLA); ``PRESETS`` / ``get_preset`` name real models; ``verify_max_model_len``
applies vLLM's rule for max_model_len against the model's own context length.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.sizing.units import check_int


@dataclass(frozen=True)
class ModelSpec:
    """The few numbers of a decoder that decide its KV-cache and weight memory.

    MHA: num_kv_heads == num_attention_heads. GQA: fewer KV heads, each shared by a group of
    query heads. MLA (DeepSeek-V2/V3): per token and layer the cache holds one compressed
    latent of kv_lora_rank values plus one shared RoPE key of qk_rope_head_dim values, for
    all heads together; num_kv_heads must be 1 and head_dim is the per-head query/value
    width, which the cache never stores. dtype_bytes is the KV-cache element size (vLLM's
    kv_cache_dtype="auto" takes the model dtype); param_bytes is bytes per weight (1 for FP8).
    num_params is approximate: it only sizes the weights. max_position_embeddings is the
    longest context the model was built for (config.json's field; vLLM's default
    max_model_len), 0 when unknown.
    """

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    dtype_bytes: int = 2
    param_bytes: float = 2.0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    max_position_embeddings: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
                     "num_params", "dtype_bytes"):
            check_int(name, getattr(self, name), 1)
        for name in ("kv_lora_rank", "qk_rope_head_dim", "max_position_embeddings"):
            check_int(name, getattr(self, name), 0)
        pb = self.param_bytes
        if isinstance(pb, bool) or not isinstance(pb, (int, float)) or not 0 < pb < float("inf"):
            raise ValueError(f"param_bytes must be > 0, got {pb!r} (bytes per weight: a "
                             f"finite number)")
        if self.is_mla:
            if self.num_kv_heads != 1:
                raise ValueError("an MLA model caches one latent per token, so num_kv_heads "
                                 f"must be 1, got {self.num_kv_heads}")
        elif self.qk_rope_head_dim:
            raise ValueError("qk_rope_head_dim is an MLA field: set kv_lora_rank > 0 too, "
                             f"got kv_lora_rank=0, qk_rope_head_dim={self.qk_rope_head_dim}")
        elif self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a "
                             f"multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_type(self) -> str:
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def weight_bytes(self) -> int:
        """Memory of all weights on one device (before any parallel split)."""
        return round(self.num_params * self.param_bytes)


PRESETS: dict[str, ModelSpec] = {s.name.lower(): s for s in (
    ModelSpec("Llama-2-7B", 32, 32, 32, 128, num_params=6_738_415_616,
              max_position_embeddings=4096),
    ModelSpec("Llama-2-70B", 80, 64, 8, 128, num_params=68_976_648_192,
              max_position_embeddings=4096),
    ModelSpec("Llama-3-8B", 32, 32, 8, 128, num_params=8_030_261_248,
              max_position_embeddings=8192),
    ModelSpec("Llama-3-70B", 80, 64, 8, 128, num_params=70_553_706_496,
              max_position_embeddings=8192),
    ModelSpec("Qwen2.5-7B", 28, 28, 4, 128, num_params=7_615_616_512,
              max_position_embeddings=131_072),
    # Released in FP8 (1 B/weight); vLLM caches the 512 + 64 latent in BF16 (2 B).
    ModelSpec("DeepSeek-V3", 61, 128, 1, 128, num_params=671_000_000_000, param_bytes=1.0,
              kv_lora_rank=512, qk_rope_head_dim=64, max_position_embeddings=163_840),
)}


def get_preset(name: str) -> ModelSpec:
    """The preset called name (case-insensitive)."""
    known = ", ".join(s.name for s in PRESETS.values())
    if not isinstance(name, str):
        raise ValueError(f"the preset name must be a str, one of {known}; got "
                         f"{type(name).__name__} {name!r:.60}")
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {known}") from None


def verify_max_model_len(spec: ModelSpec, max_model_len: int | None = None, *,
                         allow_long_max_model_len: bool = False) -> int:
    """The max_model_len vLLM would run spec with, or ValueError where vLLM refuses to start.

    As ``_get_and_verify_max_len`` in vLLM 0.33.0's ``vllm/config/model.py``: None means the
    model's own length (max_position_embeddings); a longer request is refused unless the
    environment variable VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is set (allow_long_max_model_len),
    since positions the model never saw break its attention (NaNs with RoPE). When the preset
    does not know its length (0), vLLM assumes 2048 for None and trusts any explicit value.
    """
    if max_model_len is None:
        return spec.max_position_embeddings or 2048
    check_int("max_model_len", max_model_len, 1)
    limit = spec.max_position_embeddings
    if limit and max_model_len > limit and not allow_long_max_model_len:
        raise ValueError(
            f"max_model_len={max_model_len:,} is longer than {spec.name}'s "
            f"max_position_embeddings={limit:,}: vLLM refuses to start unless "
            f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is set (positions past {limit:,} were never "
            "trained: NaNs with RoPE)")
    return max_model_len
