"""The tiny model's shape: one frozen dataclass, the same fields a Llama ``config.json`` has,
plus the per-layer attention of a hybrid model (chapter 14) as transformers spells it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from course_lib.memory.v1.kv_cache_groups import get_kv_cache_groups
from course_lib.memory.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from course_lib.sizing.blocks import check_block_size
from course_lib.sizing.models import FULL_ATTENTION, SLIDING_ATTENTION, checked_layer_types

# the layer types the tiny model runs: the paged kernels take a sliding window
# (course_lib.kernels.paged_attention), not a chunk nor a recurrent state
MODEL_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

    ``num_heads`` query heads share ``num_kv_heads`` key/value heads (GQA ratio
    ``num_heads // num_kv_heads``); the KV cache stores only the KV heads, which is why a
    GQA model's cache is smaller (chapter 01). ``max_position`` is the context length the
    weights were trained for.

    A hybrid model (chapter 14) names each layer's attention in ``layer_types``, with
    config.json's names (``course_lib.sizing.models``: ``"full_attention"``,
    ``"sliding_attention"``; gpt-oss and Gemma 3 ship this field, transformers'
    ``GptOssConfig`` builds it the same way), and the window in ``sliding_window``: a
    sliding-window layer's query at position ``p`` sees the keys ``p - sliding_window < j <=
    p``. Empty ``layer_types`` (the default, the shipped weights'): every layer full
    attention, and ``sliding_window`` stays 0, as ``ModelSpec`` spells "none" (``ModelSpec``
    sizes real models; this class runs the tiny one).
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
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0

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
        self._check_layer_types()

    def _check_layer_types(self) -> None:
        """``layer_types``: empty, or one of ``MODEL_LAYER_TYPES`` per layer (a list, as JSON
        gives it, is kept as a tuple: the config is hashable); ``sliding_window`` an integer
        >= 1 exactly when some layer is ``"sliding_attention"``, else 0."""
        types = checked_layer_types(self.layer_types, self.num_layers, MODEL_LAYER_TYPES,
                                    f": the tiny model runs {', '.join(MODEL_LAYER_TYPES)}")
        object.__setattr__(self, "layer_types", types)
        window = self.sliding_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"sliding_window must be an integer >= 0 (tokens; 0: none), got "
                             f"{window!r}")
        used = SLIDING_ATTENTION in types
        if used and window < 1:
            raise ValueError(f"sliding_window must be an integer >= 1 (tokens) when a layer is "
                             f"{SLIDING_ATTENTION!r}, got {window}")
        if window and not used:
            raise ValueError(f"sliding_window={window} is set but no layer is "
                             f"{SLIDING_ATTENTION!r}: set layer_types, or leave it at 0")

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    # ------------------------------------------------------------ hybrid models (ch. 14)
    @property
    def per_layer_types(self) -> tuple[str, ...]:
        """Each layer's attention type: ``layer_types``, or all full attention when empty."""
        return self.layer_types or (FULL_ATTENTION,) * self.num_layers

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Each attention layer's name, as the KV-cache groups list them: the parameter
        prefix of Hugging Face's Llama, ``model.layers.0.self_attn`` (vLLM 0.33.0 names the
        layer ``model.layers.0.self_attn.attn``: ``prefix=f"{prefix}.attn"`` in
        ``vllm/model_executor/models/llama.py``)."""
        return tuple(f"model.layers.{i}.self_attn" for i in range(self.num_layers))

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends with: ``sliding_window``, or None (full
        attention), the value the paged kernels take."""
        return self.sliding_window if self.per_layer_types[layer] == SLIDING_ATTENTION \
            else None

    def kv_cache_groups(self, block_size: int, dtype_bytes: int = 4) -> list[KVCacheGroupSpec]:
        """The KV-cache groups a :class:`~course_lib.memory.v1.kv_cache_manager.
        KVCacheManager` for this model is built with, and the model runner lays its tensors
        out by: one spec per layer (``FullAttentionSpec``, or ``SlidingWindowSpec`` with the
        window; ``block_size`` tokens a block, the model's KV heads and head size,
        ``dtype_bytes`` an element), grouped as vLLM 0.33.0 does
        (:func:`~course_lib.memory.v1.kv_cache_groups.get_kv_cache_groups`). A model of full
        attention only is one group of every layer. Every layer's page has one size here, so
        which layers share a group does not depend on ``block_size`` (:attr:`kv_cache_group_ids`).
        ``ValueError`` unless ``block_size`` is a power of two in [1, 256] and
        ``dtype_bytes`` an integer >= 1."""
        check_block_size(block_size)
        if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes < 1:
            raise ValueError(f"dtype_bytes must be an integer >= 1, got {dtype_bytes!r}")
        shape = dict(block_size=block_size, num_kv_heads=self.num_kv_heads,
                     head_size=self.head_dim, dtype_bytes=dtype_bytes)
        specs = {name: SlidingWindowSpec(**shape, sliding_window=self.sliding_window)
                 if kind == SLIDING_ATTENTION else FullAttentionSpec(**shape)
                 for name, kind in zip(self.layer_names, self.per_layer_types, strict=True)}
        return get_kv_cache_groups(specs)

    @property
    def kv_cache_group_ids(self) -> tuple[int, ...]:
        """The KV-cache group of each layer (its index in :meth:`kv_cache_groups`): the block
        table a layer reads. All zeros for a model of full attention only."""
        groups = self.kv_cache_groups(block_size=1)
        group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        return tuple(group_of[name] for name in self.layer_names)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        return cls(**d)
