"""Grouping a hybrid model's layers into KV-cache groups over one pool: vLLM 0.33.0's
``_get_kv_cache_groups_uniform_page_size`` and ``unify_kv_cache_spec_page_size``
(``vllm/v1/core/kv_cache_planning.py``), at the course's size.

One pool, several kinds of layers: every block of the pool must fit any layer's page, so
vLLM makes every layer's page (bytes for one block of one layer) the same size. Layers whose
page is smaller get a larger ``block_size`` until it matches
(:func:`unify_kv_cache_spec_page_size`: page ``p``, largest page ``P``, block size times
``P // p``). Then (:func:`get_kv_cache_groups`) layers with equal specs are bucketed, and each
bucket is cut into groups of the same number of layers, so that a block id names one page in
each layer of a group: gpt-oss-20b's 12 sliding-window and 12 full-attention layers are two
groups of 12; Gemma 3 27B's 52 local and 10 global layers are seven groups of 10 pages a
block: six local ones of 9 or 8 layers (8 padding layers in all) and one global one. A model
of one kind of layer is one group.

Followed: the page-size unification by block size; bucketing by spec; the group size (the
fewest layers of any kind, or the most when no kind has 1.5 times the fewest: gpt-oss with
an EAGLE draft layer, 12 + 13, pads to 13 + 13); layers dealt round-robin
(``layers[i::num_groups]``, so that pipeline stages each get whole groups); padding counted.
Left out: merging specs that differ only in a window (vLLM's ``merge``), Mamba's padded
pages, non-divisible page padding, packed groups, draft models, and the fallback that treats
every layer as full attention (``--disable-hybrid-kv-cache-manager``).

The course's :class:`~course_lib.memory.v1.kv_cache_coordinator.KVCacheCoordinator` runs
groups of one block size (declared there); a unified config whose block sizes differ is for
sizing (chapter 14's numbers), not for the manager.
"""

from __future__ import annotations

from dataclasses import replace

from ...sizing.hybrid import group_size
from ...sizing.units import cdiv
from .kv_cache_interface import AttentionSpec, KVCacheGroupSpec


def unify_kv_cache_spec_page_size(
        kv_cache_spec: dict[str, AttentionSpec]) -> dict[str, AttentionSpec]:
    """Every layer's spec with the largest page size: a smaller page's block size is scaled
    up by the ratio (vLLM's ``unify_kv_cache_spec_page_size``). A page that does not divide
    the largest raises ``NotImplementedError`` (vLLM pads it; the course leaves that out)."""
    max_page = max(spec.page_size_bytes for spec in kv_cache_spec.values())
    unified = {}
    for name, spec in kv_cache_spec.items():
        if max_page % spec.page_size_bytes:
            raise NotImplementedError(
                f"layer {name}: page size {spec.page_size_bytes} does not divide the largest "
                f"page size {max_page}")
        unified[name] = replace(spec, block_size=spec.block_size * max_page
                                // spec.page_size_bytes)
    return unified


def get_kv_cache_groups(kv_cache_spec: dict[str, AttentionSpec]) -> list[KVCacheGroupSpec]:
    """The KV-cache groups of a model's layers (layer name -> spec, in model order): pages
    unified, layers of equal spec bucketed, each bucket dealt round-robin into groups of
    ``group_size`` layers (vLLM's ``_get_kv_cache_groups_uniform_page_size``). A group that
    falls short of ``group_size`` layers is padded (:func:`num_padding_layers` counts them)."""
    specs = unify_kv_cache_spec_page_size(kv_cache_spec)
    buckets: dict[AttentionSpec, list[str]] = {}
    for name, spec in specs.items():
        buckets.setdefault(spec, []).append(name)
    size = group_size([len(names) for names in buckets.values()])
    groups = []
    for spec, names in buckets.items():
        num_groups = cdiv(len(names), size)
        groups.extend(KVCacheGroupSpec(tuple(names[i::num_groups]), spec)
                      for i in range(num_groups))
    return groups


def num_padding_layers(groups: list[KVCacheGroupSpec]) -> int:
    """Padding layers: the pages a block allocates in groups shorter than the longest (memory
    a block id reserves that no layer uses; vLLM logs it as a warning)."""
    size = max(len(g.layer_names) for g in groups)
    return sum(size - len(g.layer_names) for g in groups)
