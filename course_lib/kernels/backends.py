"""The attention implementation a model runs: resolved once, here, and nowhere else.

An :class:`AttentionBackend` bundles the three operations a paged forward pass and its engine
need, all from one implementation:

* ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, validate=True)``:
  write the new tokens' K/V into the paged cache;
* ``paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
  scale, *, max_query_len=None, max_seq_len=None, validate=True, sliding_window=None)``:
  attend through the block tables. The model's layers pass the batch's maxima as host
  integers and ``validate=False`` (:func:`~course_lib.model.attention.make_attention_metadata`
  checked the batch once), so a forward pass on a GPU never waits for a value read back from
  the device. ``sliding_window`` (``None`` or ``W >= 1``, a host integer checked by every
  backend: :func:`~course_lib.kernels.check_sliding_window`) restricts the query at position
  ``p`` to the keys ``p - W < j <= p``; garbage before a window (the null block of a hybrid
  model) never reaches the output: the kernels and the reference never load it, the batched
  torch path gathers whole blocks and zeroes it first;
* ``copy_blocks(key_cache, value_cache, block_mapping)``: the copy-on-write copies.

The model, the model runner and the static baseline receive a backend and call it; none of
them branches on a name (vLLM's ``get_attn_backend`` in ``vllm/attention/selector.py`` picks one
backend class per model the same way). Names:

* ``"triton"``: the Triton kernels, compiled on a GPU; on a CPU, Triton's interpreter runs them
  (every line real, but ~10 ms per token per layer: a few tokens only);
* ``"reference"``: the torch spec of :mod:`course_lib.kernels.reference` (a loop over sequences);
* ``"torch"``: :mod:`course_lib.kernels.batched`, the whole batch in a few torch ops, the
  serving engine's CPU path;
* ``"auto"``: ``"triton"`` where Triton compiles for the tensors' device (CUDA), else ``"torch"``.

Swapping blocks between the GPU and the CPU pool is a plain device-to-host copy whatever the
backend (``cache_ops.swap_blocks``), so it is not part of a backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

ATTN_BACKENDS = ("auto", "triton", "reference", "torch")


@dataclass(frozen=True)
class AttentionBackend:
    """One implementation of the paged-cache operations (see the module docstring)."""

    name: str                         # "triton" | "reference" | "torch"
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]


def get_attn_backend(name: str | AttentionBackend = "auto",
                     device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called ``name`` for tensors on ``device`` (a backend passes through).

    Raises ``ValueError`` for an unknown name, or for ``"triton"`` where Triton cannot run on
    ``device`` (not installed, or a CPU model on a GPU machine)."""
    if isinstance(name, AttentionBackend):
        return name
    if name not in ATTN_BACKENDS:
        raise ValueError(f"attn_impl must be one of {ATTN_BACKENDS}, got {name!r}")
    from course_lib.device import BACKEND  # imported here: see course_lib.kernels.aot

    device = torch.device(device)
    if name == "auto":
        name = "triton" if BACKEND.triton_runs_on(device) and not BACKEND.interpreted \
            else "torch"
    from course_lib.kernels import paged_attention
    from course_lib.kernels.reference import copy_blocks_ref, reshape_and_cache_ref

    if name == "reference":
        return AttentionBackend("reference", reshape_and_cache_ref,
                                partial(paged_attention, impl="reference"), copy_blocks_ref)
    if name == "torch":
        from course_lib.kernels.batched import paged_attention_batched

        return AttentionBackend("torch", reshape_and_cache_ref, paged_attention_batched,
                                copy_blocks_ref)
    if not BACKEND.triton_runs_on(device):
        where = f"on {BACKEND.device} tensors" if BACKEND.uses_triton else "nowhere"
        raise ValueError(f"attn_impl='triton' needs Triton to run on {device.type} "
                         f"tensors; here it runs {where} (backend {BACKEND.name})")
    from course_lib.kernels import cache_ops

    return AttentionBackend("triton", cache_ops.reshape_and_cache,
                            partial(paged_attention, impl="triton"), cache_ops.copy_blocks)
