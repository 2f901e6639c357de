"""Compile every GPU variant of the course's kernels ahead of time for Hopper (sm_90), on CPU.

A kernel that the interpreter runs happily can still be rejected by the GPU compiler: a tile
that needs more shared memory than an SM has, a ``tl.dot`` with fewer than 16 rows, a dtype the
tensor cores refuse. ``triton.compile`` with a CUDA target runs the whole pipeline (Triton IR ->
TTGIR -> LLVM -> PTX -> ``ptxas`` -> cubin; ``ptxas`` ships inside the Triton wheel) without a
GPU, so those failures show up in CI instead of on a learner's GPU.

The variants are the launch configurations :mod:`course_lib.kernels.tiles` picks for a grid of
realistic problems (fp16/bf16/fp32; head_dim 16/32 as in chapter 04 and the tests, 64/128 as
in real models; GQA groups 1/4/8; batch 1..256 x context 512..32k), compiled with
the same specialisations the JIT would make (innermost strides == 1, 16-byte aligned pointers).

Triton must be in JIT mode for this, and ``TRITON_INTERPRET=1`` (which ``course_lib.device`` sets
on a CPU machine) is read when ``triton`` is imported; so this runs in a fresh process:
``python -m course_lib.kernels.aot`` (``--list`` to only list the variants).
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass, field

HOPPER = ("cuda", 90, 32)          # GPUTarget(backend, compute capability, warp size)
MAX_SHARED_BYTES = 232_448         # H100/H200: 227 KiB of shared memory per block (opt-in)
# Strides that are 1 for the contiguous tensors the course passes; the JIT specialises them.
UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_kcd", "stride_vcd",
                "stride_btb", "stride_mc"}


def enter_jit_mode() -> None:
    """Import triton in JIT mode, then course_lib.device, on a machine without CUDA."""
    if "triton" in sys.modules or "course_lib.device" in sys.modules:
        raise RuntimeError("enter_jit_mode() must run before triton or course_lib.device is "
                           "imported: run `python -m course_lib.kernels.aot` in a fresh process")
    os.environ.pop("TRITON_INTERPRET", None)
    import triton  # noqa: F401  (JIT mode: TRITON_INTERPRET is unset)

    with warnings.catch_warnings():                # device warns that triton came first
        warnings.simplefilter("ignore", RuntimeWarning)
        import course_lib.device  # noqa: F401
    os.environ.pop("TRITON_INTERPRET", None)      # kernels decorated from now on: JITFunction


@dataclass(frozen=True)
class Variant:
    kernel: str                    # "module._kernel_name"
    ptr_types: tuple               # ((arg name, triton type), ...); other pointers: the dtype
    dtype: str                     # "fp16" | "bf16" | "fp32"
    constexprs: tuple              # ((name, value), ...)
    num_warps: int = 4
    num_stages: int = 2
    label: str = field(default="", compare=False)


def _tl_dtype(torch_dtype) -> str:
    import torch

    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[torch_dtype]


def variants() -> list[Variant]:
    """Every distinct launch configuration the heuristics produce on the problem grid."""
    import torch

    from course_lib.kernels.tiles import (
        decode_tiles,
        dot_precision,
        next_power_of_2,
        prefill_tiles,
    )

    out: dict[Variant, None] = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        t = _tl_dtype(dtype)
        for head_dim in (16, 32, 64, 128):  # 16, 32: the chapter's and the tests' shapes
            for group in (1, 4, 8):
                for num_seqs, ctx in ((1, 512), (8, 4096), (64, 4096), (256, 32768)):
                    dt = decode_tiles(head_dim=head_dim, group=group, max_seq_len=ctx,
                                      num_seqs=num_seqs, num_kv_heads=8, interpreted=False)
                    out[Variant("paged_decode._paged_decode_kernel",
                                (("out_ptr", "fp32"), ("lse_ptr", "fp32"),
                                 ("block_tables_ptr", "i32"), ("seq_lens_ptr", "i32")), t,
                                (("TILE_N", dt.tile_n), ("HEAD_PAD", dt.head_pad),
                                 ("GROUP_PAD", dt.group_pad), ("UPCAST", False),
                                 ("DOT_PRECISION", dot_precision(dtype))),
                                dt.num_warps, dt.num_stages,
                                f"decode {t} d={head_dim} group={group}")] = None
                    out[Variant("paged_decode._lse_reduce_kernel",
                                (("part_ptr", "fp32"), ("lse_ptr", "fp32")), t,
                                (("SPLITS_PAD", dt.splits_pad), ("HEAD_PAD", dt.head_pad)),
                                4, 1, f"lse reduce {t} d={head_dim} splits={dt.num_splits}")
                        ] = None
                pt = prefill_tiles(head_dim=head_dim, group=group, max_query_len=2048,
                                   max_seq_len=4096, interpreted=False)
                out[Variant("paged_prefill._paged_prefill_kernel",
                            (("block_tables_ptr", "i32"), ("seq_lens_ptr", "i32"),
                             ("query_start_loc_ptr", "i32")), t,
                            (("BLOCK_M", pt.block_m), ("GROUP_PAD", pt.group_pad),
                             ("TILE_N", pt.tile_n), ("HEAD_PAD", pt.head_pad),
                             ("UPCAST", False), ("DOT_PRECISION", dot_precision(dtype))),
                            pt.num_warps, pt.num_stages,
                            f"prefill {t} d={head_dim} group={group}")] = None
        for kv_heads, head_dim in ((1, 64), (8, 128), (32, 128)):
            out[Variant("cache_ops._reshape_and_cache_kernel", (("slot_mapping_ptr", "i64"),), t,
                        (("TILE", next_power_of_2(kv_heads * head_dim)),), 4, 1,
                        f"reshape_and_cache {t} {kv_heads}x{head_dim}")] = None
        out[Variant("cache_ops._copy_blocks_kernel", (("mapping_ptr", "i64"),), t,
                    (("TILE", 1024),), 4, 1, f"copy_blocks {t}")] = None
    return list(out)


@dataclass(frozen=True)
class Compiled:
    variant: Variant
    shared_bytes: int
    cubin_bytes: int
    seconds: float


def compile_variant(v: Variant) -> Compiled:
    """``triton.compile`` one variant for sm_90; raises what the GPU compiler raises."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget

    module, name = v.kernel.split(".")
    fn = getattr(importlib.import_module(f"course_lib.kernels.{module}"), name)
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError(f"{v.kernel} is a {type(fn).__name__}, not a JITFunction: Triton is "
                           "in interpreter mode (call enter_jit_mode() first)")
    ptr_types = dict(v.ptr_types)
    constexprs = dict(v.constexprs)
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in UNIT_STRIDES:
            signature[arg], constexprs[arg] = "constexpr", 1
        elif arg.endswith("_ptr"):
            signature[arg] = "*" + ptr_types.get(arg, v.dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg == "qk_scale":
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
    start = time.perf_counter()
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                    attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget(*HOPPER),
                            options={"num_warps": v.num_warps, "num_stages": v.num_stages})
    shared = int(kernel.metadata.shared)
    if shared > MAX_SHARED_BYTES:
        raise RuntimeError(f"{v.label}: needs {shared} bytes of shared memory, an sm_90 block "
                           f"has at most {MAX_SHARED_BYTES}")
    return Compiled(v, shared, len(kernel.asm["cubin"]), time.perf_counter() - start)


def main(argv: list[str]) -> int:
    enter_jit_mode()
    import triton

    todo = variants()
    print(f"triton {triton.__version__}: {len(todo)} kernel variants for sm_90")
    if "--list" in argv:
        for v in todo:
            print(" ", v.label, dict(v.constexprs), f"warps={v.num_warps} stages={v.num_stages}")
        return 0
    failed = 0
    for v in todo:
        try:
            c = compile_variant(v)
        except Exception as exc:  # report every variant, then fail
            failed += 1
            print(f"FAIL {v.label}: {type(exc).__name__}: {str(exc).splitlines()[-1][:300]}")
        else:
            print(f"ok   {v.label}: shared {c.shared_bytes} B, cubin {c.cubin_bytes} B, "
                  f"{c.seconds:.1f} s")
    print(f"{len(todo) - failed}/{len(todo)} compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
