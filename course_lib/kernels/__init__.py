"""Kernels of the course: a torch reference (the spec) and Triton kernels checked against it.

Modules (each imports :mod:`course_lib.device` before ``triton``, so that on a machine without
CUDA Triton's interpreter is switched on in time; they load on demand):

* ``reference``      torch specs: ``paged_attention_ref``, ``gather_kv``, cache-op references
* ``paged_decode``   split-K decode kernel + log-sum-exp reduce kernel
* ``paged_prefill``  packed-query causal kernel (prefill, chunked prefill, mixed batches)
* ``cache_ops``      ``reshape_and_cache``, ``copy_blocks`` (CoW), ``swap_blocks``
* ``tiles``          the tile heuristics (interpreter-aware, no autotune)
* ``aot``            compiles every GPU variant for Hopper (sm_90) without a GPU
* ``batch``          random paged batches (permuted block tables, NaN in unused slots)
* ``timing``         timers, bytes read, peak bandwidth, stored GPU results
* ``walkthrough``    chapter 04's three loops: the article's (wrong), two-pass, online softmax
* ``smoke``          the vector-add kernel of chapter 00
* ``batched``        the whole batch in a few torch ops: the serving engine's CPU path
* ``backends``       :func:`~course_lib.kernels.backends.get_attn_backend`: the one place that
                     resolves which implementation a model runs (``"auto"``, ``"triton"``,
                     ``"reference"``, ``"torch"``)

Every implementation choice is made in this package. A model runs the backend that
``backends.get_attn_backend`` resolved once. :func:`paged_attention`, the kernel-level entry
point of chapter 04, validates its input and, with ``impl="auto"``, picks per call
(:func:`choose_impl`): compiled Triton on CUDA, interpreted Triton on CPU for small problems,
the torch reference for CPU problems too big for the interpreter. Both, and the cache ops'
fallbacks, ask one fact of :mod:`course_lib.device`: ``BACKEND.triton_runs_on(tensors)``.

This package module itself imports neither ``course_lib.device`` nor ``triton`` at import time,
so that ``python -m course_lib.kernels.aot`` can put Triton in JIT mode first.
"""

from __future__ import annotations

import math
import numbers
import re

import torch

from ..sizing.units import cdiv

TRITON = "triton"
REFERENCE = "reference"
# The interpreter runs ~one numpy call per tl operation; past this many (token x KV head) reads,
# a CPU problem goes to the torch reference instead (a few seconds of interpretation).
INTERPRETER_MAX_KV_READS = 1 << 16


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor | None, values: bool = True, *,
                 max_query_len: int | None = None, max_seq_len: int | None = None) -> None:
    """Raise ``ValueError`` naming the bad input. ``values=False`` checks shapes, dtypes and
    devices only (no device sync); ``values=True`` also checks the lengths, the block-table
    entries and the host-side bounds ``max_query_len`` / ``max_seq_len`` (a bound below the
    true maximum makes the kernels skip tokens: a wrong result, not an error), with one
    device-to-host copy for the whole batch."""
    named = dict(query=query, key_cache=key_cache, value_cache=value_cache,
                 block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc)
    for name, t in named.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    # a kernel handed a pointer of another device reads garbage or faults: one device for all
    devices = {name: t.device for name, t in named.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    for name, bound in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)
                                  or bound < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {bound!r}")
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got "
                         f"{tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    if query.shape[2] != head_dim or num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query heads x head_dim {tuple(query.shape[1:])} must be a multiple "
                         f"of the cache's ({num_kv_heads}, {head_dim}) (GQA)")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"query, key_cache and value_cache must be float16, bfloat16 or "
                         f"float32, got {query.dtype}")
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        raise ValueError(f"query, key_cache, value_cache dtypes differ: {query.dtype}, "
                         f"{key_cache.dtype}, {value_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.dtype not in INDEX_DTYPES:
        raise ValueError("block_tables must be an int32/int64 [num_seqs, max_blocks] tensor, "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if num_seqs == 0:
        raise ValueError("empty batch: block_tables has no rows (need at least one sequence)")
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype not in INDEX_DTYPES:
        raise ValueError(f"seq_lens must be an int32/int64 [{num_seqs}] tensor, got "
                         f"{seq_lens.dtype} {tuple(seq_lens.shape)}")
    if query_start_loc is None:
        if query.shape[0] != num_seqs:
            raise ValueError(f"decode (query_start_loc=None) needs one query per sequence: "
                             f"{num_seqs} sequences, {query.shape[0]} query rows")
    elif (query_start_loc.shape != (num_seqs + 1,)
          or query_start_loc.dtype not in INDEX_DTYPES):
        raise ValueError(f"query_start_loc must be an int32/int64 [{num_seqs + 1}] tensor, got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    if not values:
        return
    # everything the kernels will read, copied to the host once
    lens = seq_lens.long()
    starts = (torch.arange(num_seqs + 1, device=lens.device) if query_start_loc is None
              else query_start_loc.long().to(lens.device))
    tables = block_tables.long().to(lens.device)
    used = (torch.arange(tables.shape[1], device=lens.device)[None, :]
            < (lens[:, None] + block_size - 1).clamp(min=0) // block_size)
    bad_entry = (used & ((tables < 0) | (tables >= num_blocks))).any(1)
    lens, starts, bad_entry = torch.cat([lens, starts, bad_entry.long()]).cpu().split(
        [num_seqs, num_seqs + 1, num_seqs])
    lens, starts, bad_entry = lens.tolist(), starts.tolist(), bad_entry.tolist()
    if starts[0] != 0 or starts[-1] != query.shape[0]:
        raise ValueError(f"query_start_loc must run from 0 to {query.shape[0]} "
                         f"(num_tokens), got {starts}")
    capacity = block_tables.shape[1] * block_size
    for s, (n, a, b) in enumerate(zip(lens, starts, starts[1:], strict=False)):
        if not 1 <= b - a <= n <= capacity:
            raise ValueError(f"sequence {s}: need 1 <= query_len <= seq_len <= {capacity} "
                             f"(max_blocks x block_size), got query_len {b - a}, seq_len {n}")
        if bad_entry[s]:
            entries = block_tables[s, :cdiv(n, block_size)].tolist()
            raise ValueError(f"sequence {s}: block table entries must be in "
                             f"0..{num_blocks - 1}, got {entries}")
    query_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    for name, bound, true in (("max_query_len", max_query_len, max(query_lens)),
                              ("max_seq_len", max_seq_len, max(lens))):
        if bound is not None and bound < true:
            raise ValueError(f"{name} must be >= the batch's longest ({true}), got {bound}")


def check_sliding_window(sliding_window: object) -> int | None:
    """``sliding_window`` as a Python int >= 1, or ``None`` (full attention); ``ValueError``
    naming anything else. The doors of the attention kernels (:func:`paged_attention`, the
    backends' entries, the launch planners) call it before anything runs: a window of 0 would
    reach the kernels as "no window" (their constant for full attention) and silently attend
    to everything. A numpy integer is taken by its value."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) \
            or sliding_window < 1:
        raise ValueError(f"sliding_window must be None (full attention) or an integer >= 1 "
                         f"(keys per query, itself included), got {sliding_window!r}")
    return int(sliding_window)


def interpreter_incompatibility() -> str | None:
    """Why Triton's interpreter cannot run the attention kernels here, or None (also None when
    kernels are compiled, not interpreted). Known case: Triton < 3.7 turns a loop bound into a
    Python int with ``int(array)``, which NumPy >= 2.4 refuses for a 1-element array."""
    from course_lib.device import BACKEND

    if not BACKEND.interpreted or BACKEND.triton_version is None:
        return None
    import numpy

    def major_minor(version: str) -> tuple[int, ...]:
        return tuple(int(re.match(r"\d+", part).group()) for part in version.split(".")[:2])

    if major_minor(BACKEND.triton_version) < (3, 7) and major_minor(numpy.__version__) >= (2, 4):
        return (f"Triton {BACKEND.triton_version}'s interpreter cannot run kernels with dynamic "
                f"loop bounds under NumPy {numpy.__version__} (int() of a 1-element array): use "
                "Triton >= 3.7 or NumPy < 2.4")
    return None


def choose_impl(query: torch.Tensor, key_cache: torch.Tensor, seq_lens: torch.Tensor) -> str:
    """``"triton"`` (compiled on CUDA, interpreted on CPU if small enough) or ``"reference"``
    (no Triton, a CPU problem too big for the interpreter, or tensors not on the backend's
    device). Never syncs with a GPU."""
    from course_lib.device import BACKEND  # imported here: see course_lib.kernels.aot

    if not BACKEND.triton_runs_on(query, key_cache):
        return REFERENCE
    if not BACKEND.interpreted:
        return TRITON
    if interpreter_incompatibility():
        return REFERENCE
    reads = int(seq_lens.sum()) * key_cache.shape[2]
    return TRITON if reads <= INTERPRETER_MAX_KV_READS else REFERENCE


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor | None = None, scale: float | None = None,
                    *, impl: str = "auto", max_query_len: int | None = None,
                    max_seq_len: int | None = None, validate: bool = True,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Attention of the packed new tokens over each sequence's paged K/V (see ``reference``).

    query ``[num_tokens, num_heads, head_dim]``; caches ``[num_blocks, block_size,
    num_kv_heads, head_dim]``; ``block_tables [num_seqs, max_blocks]``; ``seq_lens [num_seqs]``
    (all tokens, new ones included, already cached); ``query_start_loc [num_seqs + 1]`` or
    ``None`` for decode (one query per sequence). ``scale`` defaults to ``head_dim ** -0.5``.
    ``impl``: ``"auto"`` (:func:`choose_impl`), ``"triton"`` or ``"reference"``. Pass
    ``max_query_len`` / ``max_seq_len`` and ``validate=False`` to avoid host syncs on a GPU.
    ``sliding_window``: ``None`` (full attention) or ``W >= 1``: the query at position ``p``
    sees the keys at ``p - W < j <= p`` (vLLM's meaning: ``SlidingWindowSpec.sliding_window``
    in ``vllm/v1/kv_cache_interface.py``, passed to FlashAttention as ``window_size=(W - 1,
    0)`` in ``vllm/v1/attention/backends/flash_attn.py``, 0.33.0); blocks wholly before a
    query's window are never read (a hybrid model's table points them at the null block).
    Returns ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.
    """
    sliding_window = check_sliding_window(sliding_window)
    check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                 values=validate, max_query_len=max_query_len, max_seq_len=max_seq_len)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not 0 < scale < math.inf):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    # the kernels read seq_lens[s] at seq_lens + s (and query_start_loc alike): strided views
    # (a column of a bigger tensor) are copied here, a few integers
    seq_lens = seq_lens.contiguous()
    if query_start_loc is not None:
        query_start_loc = query_start_loc.contiguous()
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if impl == "auto":
        impl = choose_impl(query, key_cache, seq_lens)
    if impl == REFERENCE:
        from course_lib.kernels.reference import paged_attention_ref

        return paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens,
                                   query_start_loc, scale, sliding_window=sliding_window)
    if impl != TRITON:
        raise ValueError(f"impl must be 'auto', 'triton' or 'reference', got {impl!r}")
    from course_lib.device import BACKEND

    if not BACKEND.uses_triton:
        raise ValueError("impl='triton' needs Triton, which is not installed here")
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if max_query_len is None:
        max_query_len = (1 if query_start_loc is None
                         else int((query_start_loc[1:] - query_start_loc[:-1]).max()))
    if max_query_len == 1 and query.shape[0] == block_tables.shape[0]:
        from course_lib.kernels.paged_decode import paged_decode

        return paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                            max_seq_len, sliding_window=sliding_window)
    from course_lib.kernels.paged_prefill import paged_prefill

    if query_start_loc is None:
        query_start_loc = torch.arange(block_tables.shape[0] + 1, dtype=torch.int32,
                                       device=query.device)
    return paged_prefill(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                         scale, max_query_len, max_seq_len, sliding_window=sliding_window)
