"""The models the course sizes: their shape, the presets, and the length vLLM runs them at.

``ModelSpec`` holds the few numbers of a decoder that decide its KV-cache and weight memory
(MHA, GQA, MQA or MLA), and, for a hybrid model, the attention type of each layer (full,
sliding window, chunked local, or a linear-attention layer with a fixed-size recurrent state);
``PRESETS`` names real models whose every layer is full attention, ``HYBRID_PRESETS`` real
hybrid ones, ``get_preset`` finds either; ``verify_max_model_len`` applies vLLM's rule for
max_model_len against the model's own context length. ``sizing/hybrid.py`` turns a hybrid
spec into vLLM's KV-cache groups and block counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from course_lib.sizing.units import GiB, check_int

# The attention types a layer can have, spelled as config.json's ``layer_types`` field spells
# them (transformers' GptOssConfig, Gemma3TextConfig, Qwen3NextConfig build it the same way).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"     # attends to the last sliding_window tokens
CHUNKED_ATTENTION = "chunked_attention"     # attends within its attention_chunk_size chunk
LINEAR_ATTENTION = "linear_attention"       # Gated DeltaNet / Mamba-like: one fixed state
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION, LINEAR_ATTENTION)


def repeat_layer_pattern(pattern: Sequence[str], num_layers: int) -> tuple[str, ...]:
    """``pattern`` repeated over ``num_layers`` layers, cut where the layers end: how
    transformers fills a config's ``layer_types`` when it has none (gpt-oss: ``("sliding",
    "full")``; Gemma 3: five sliding then one full, 62 layers ending on two sliding ones).
    Each entry must be one of ``LAYER_TYPES``; ``ModelSpec`` checks that."""
    check_int("num_layers", num_layers, 1)
    if isinstance(pattern, str) or not isinstance(pattern, Sequence) or not pattern:
        raise ValueError(f"pattern must be a non-empty sequence of layer types "
                         f"{LAYER_TYPES}, got {pattern!r:.80}")
    return tuple(pattern[i % len(pattern)] for i in range(num_layers))


def gated_delta_net_state_bytes(num_k_heads: int, num_v_heads: int, head_k_dim: int,
                                head_v_dim: int, conv_kernel_dim: int,
                                dtype_bytes: int = 2) -> int:
    """Bytes of one Gated DeltaNet layer's recurrent state for one sequence (TP=1), from the
    config's ``linear_*`` fields.

    As vLLM 0.33.0 shapes it (``MambaStateShapeCalculator.gated_delta_net_state_shape`` in
    ``vllm/model_executor/layers/mamba/mamba_utils.py``): a convolution state of
    ``conv_kernel_dim - 1`` steps over the q, k and v channels
    (``num_k_heads * head_k_dim * 2 + num_v_heads * head_v_dim``) and one
    ``[num_v_heads, head_v_dim, head_k_dim]`` delta-rule state; both in the model dtype
    (``mamba_ssm_cache_dtype="auto"``, no speculative tokens). It does not grow with the
    context: that is the point of linear attention.
    """
    for name, value in (("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads),
                        ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim),
                        ("conv_kernel_dim", conv_kernel_dim), ("dtype_bytes", dtype_bytes)):
        check_int(name, value, 1)
    conv_dim = num_k_heads * head_k_dim * 2 + num_v_heads * head_v_dim
    conv_state = conv_dim * (conv_kernel_dim - 1)
    delta_state = num_v_heads * head_v_dim * head_k_dim
    return (conv_state + delta_state) * dtype_bytes


def checked_layer_types(types: object, num_layers: int, known: tuple[str, ...],
                        unknown: str) -> tuple[str, ...]:
    """``layer_types`` as a tuple (a config is hashable), after the checks every config that
    names its layers' attention makes (``ModelSpec`` here, the tiny model's ``ModelConfig``):
    a sequence, not a string; empty (all full attention) or one entry per layer; each entry in
    ``known``, else a ``ValueError`` ending in ``unknown``."""
    if isinstance(types, str) or not isinstance(types, Sequence):
        raise ValueError(f"layer_types must be a sequence of {known}, got "
                         f"{type(types).__name__} {types!r:.60}")
    if types and len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries; it must have one per "
                         f"layer, num_layers={num_layers} (or none: all full)")
    for i, kind in enumerate(types):
        if kind not in known:
            raise ValueError(f"layer_types[{i}]={kind!r}{unknown}")
    return tuple(types)


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

    Hybrid models: ``layer_types`` gives each layer's attention type, one of ``LAYER_TYPES``
    (config.json's field, ``num_layers`` entries); empty means every layer is full
    attention, as in every model of ``PRESETS``. A sliding-window layer keeps the last
    ``sliding_window`` tokens, a chunked-local layer the tokens of its
    ``attention_chunk_size`` chunk, a linear-attention layer one state of
    ``linear_state_bytes`` per sequence whatever the context (``gated_delta_net_state_bytes``
    computes it for Gated DeltaNet). Each of these three numbers is set exactly when some
    layer uses it. All attention layers share the head geometry above, as in gpt-oss, Gemma 3
    and Qwen3-Next. ``course_lib.capacity``'s functions count every layer as full attention
    (the baseline the hybrid is compared with); ``sizing/hybrid.py`` counts each layer as its
    type.
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
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    attention_chunk_size: int = 0
    linear_state_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
                     "num_params", "dtype_bytes"):
            check_int(name, getattr(self, name), 1)
        for name in ("kv_lora_rank", "qk_rope_head_dim", "max_position_embeddings",
                     "sliding_window", "attention_chunk_size", "linear_state_bytes"):
            check_int(name, getattr(self, name), 0)
        self._check_layer_types()
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

    def _check_layer_types(self) -> None:
        """layer_types: empty, or one known type per layer; each type's size set exactly when
        a layer has that type. A list is kept as a tuple (a spec is hashable)."""
        types = checked_layer_types(self.layer_types, self.num_layers, LAYER_TYPES,
                                    f" is not a layer type; valid: {', '.join(LAYER_TYPES)}")
        object.__setattr__(self, "layer_types", types)
        for kind, field, unit in ((SLIDING_ATTENTION, "sliding_window", "tokens"),
                                  (CHUNKED_ATTENTION, "attention_chunk_size", "tokens"),
                                  (LINEAR_ATTENTION, "linear_state_bytes", "bytes")):
            value, used = getattr(self, field), kind in types
            if used and value < 1:
                raise ValueError(f"{field} must be an integer >= 1 ({unit}) when a layer is "
                                 f"{kind!r}, got {value}")
            if value and not used:
                raise ValueError(f"{field}={value} is set but no layer is {kind!r}: set "
                                 f"layer_types, or leave {field} at 0")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer is not full attention."""
        return any(kind != FULL_ATTENTION for kind in self.layer_types)

    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """Each layer's attention type: layer_types, or all full attention when it is empty."""
        return self.layer_types or (FULL_ATTENTION,) * self.num_layers

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


# Hybrid models, each with the numbers of its published config, cited above it. All keep
# their KV cache (and a linear layer's state) in BF16, 2 B: vLLM's kv_cache_dtype="auto".
HYBRID_PRESETS: dict[str, ModelSpec] = {s.name.lower(): s for s in (
    # gpt-oss (OpenAI): a 128-token sliding window on even layers, full attention on odd ones;
    # 64 query heads, 8 KV heads of 64; max_position_embeddings 131,072. transformers'
    # GptOssConfig (huggingface/transformers, src/transformers/models/gpt_oss/
    # configuration_gpt_oss.py) has gpt-oss-120b's numbers as defaults (36 layers) and builds
    # layer_types sliding on even layers; gpt-oss-20b's config.json (copied in
    # EchoCog/gpt-oss-20b, config.json) has 24 layers and the same attention. Parameters and
    # checkpoint size (MXFP4 experts, the rest BF16) from OpenAI's gpt-oss model card
    # (arXiv:2508.10925): 20.91B and 12.8 GiB, 116.83B and 60.8 GiB; param_bytes makes
    # weight_bytes the checkpoint's size.
    ModelSpec("gpt-oss-20b", 24, 64, 8, 64, num_params=20_910_000_000,
              param_bytes=12.8 * GiB / 20_910_000_000, max_position_embeddings=131_072,
              layer_types=repeat_layer_pattern((SLIDING_ATTENTION, FULL_ATTENTION), 24),
              sliding_window=128),
    ModelSpec("gpt-oss-120b", 36, 64, 8, 64, num_params=116_830_000_000,
              param_bytes=60.8 * GiB / 116_830_000_000, max_position_embeddings=131_072,
              layer_types=repeat_layer_pattern((SLIDING_ATTENTION, FULL_ATTENTION), 36),
              sliding_window=128),
    # Gemma 3 27B (Google): 62 layers, five local ones (sliding window 1,024) then a global one,
    # repeated: transformers' Gemma3TextConfig (sliding_window_pattern 6) makes layer i global
    # when (i + 1) % 6 == 0, so 10 global and 52 local; 32 query heads, 16 KV heads of 128.
    # gemma-3-27b-it's config.json text_config as MaxText copies it (AI-Hypercomputer/maxtext,
    # MaxText/utils/ckpt_conversion/utils/hf_model_configs.py, gemma3_27b_config). The released
    # config.json sets no max_position_embeddings, so Gemma3TextConfig's default 131,072 (128K)
    # applies. 27,432,406,640 parameters: the -it checkpoint with its vision tower, as llama.cpp
    # and keras-hub's Gemma 3 27B presets count it.
    ModelSpec("Gemma-3-27B", 62, 32, 16, 128, num_params=27_432_406_640,
              max_position_embeddings=131_072,
              layer_types=repeat_layer_pattern((SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,), 62),
              sliding_window=1024),
    # Qwen3-Next-80B-A3B (Qwen): 48 layers, three Gated DeltaNet (linear attention) layers then
    # one full attention layer, repeated (full_attention_interval 4: 12 full, 36 linear); full
    # layers: 16 query heads, 2 KV heads of 256; linear layers: 16 key and 32 value heads of 128,
    # convolution kernel 4. transformers' Qwen3NextConfig (huggingface/transformers,
    # src/transformers/models/qwen3_next/configuration_qwen3_next.py) has these numbers as its
    # defaults; max_position_embeddings 262,144 from Qwen/Qwen3-Next-80B-A3B-Instruct's
    # config.json; 80B parameters as transformers' model page gives them
    # (docs/source/en/model_doc/qwen3_next.md).
    ModelSpec("Qwen3-Next-80B-A3B", 48, 16, 2, 256, num_params=80_000_000_000,
              max_position_embeddings=262_144,
              layer_types=repeat_layer_pattern((LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,), 48),
              linear_state_bytes=gated_delta_net_state_bytes(
                  num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                  conv_kernel_dim=4)),
)}


def get_preset(name: str) -> ModelSpec:
    """The preset called name (case-insensitive), from PRESETS or HYBRID_PRESETS."""
    known = ", ".join(s.name for s in (*PRESETS.values(), *HYBRID_PRESETS.values()))
    if not isinstance(name, str):
        raise ValueError(f"the preset name must be a str, one of {known}; got "
                         f"{type(name).__name__} {name!r:.60}")
    key = name.lower()
    if key in PRESETS:
        return PRESETS[key]
    if key in HYBRID_PRESETS:
        return HYBRID_PRESETS[key]
    raise ValueError(f"unknown model preset {name!r}; known presets: {known}")


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
