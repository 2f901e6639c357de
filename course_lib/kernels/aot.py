"""Compile every GPU launch of the course's kernels for Hopper (sm_90) on a CPU, as the JIT would.

A kernel that the interpreter runs happily can still be slow or rejected on a GPU: registers
spilled to local memory, keys loaded two bytes at a time, a tile that needs more shared memory
than an SM has. ``triton.compile`` with a CUDA target runs the whole pipeline (Triton IR ->
TTGIR -> LLVM -> PTX -> ``ptxas``, shipped inside the Triton wheel) without a GPU.

**Faithful.** Each variant is a real launch: the wrappers' own planners
(``decode_launches``, ``prefill_launches``, ``reshape_and_cache_launch``, ``copy_blocks_launch``)
plan it for tensors of a realistic shape on the ``meta`` device (shapes and strides, no memory),
with the tiles :mod:`~course_lib.kernels.tiles` picks for an H100/H200 (132 SMs), and a
sliding-window layer's launches (a window of 128 tokens, as gpt-oss's). Its arguments
then go through Triton's own binder, the function the JIT calls at launch, which decides every
specialisation (an integer divisible by 16, a stride equal to 1, a 16-byte aligned pointer as a
caching allocator returns) and the compile-time constants. So the kernel compiled here is the
one a GPU builds for that launch, and its resources are the ones it runs with.

**Checked** (a failure names the variant and the rule):

* no register spills (``ptxas -v``: spill stores and loads are 0);
* shared memory within an sm_90 block's 227 KiB;
* attention kernels with 16-bit K/V: keys and values move as 16-byte asynchronous copies
  (``cp.async ... 16``) or 16-byte vector loads, never as scalar 2-byte loads;
* the decode kernel keeps at least two K/V tiles in flight (its K and V shared-memory buffers
  are allocated at least two deep by the software pipeliner).

``python -m course_lib.kernels.aot`` prints one line per variant (registers, spills, shared
memory, warps, stages, K/V buffers, load kinds) and writes the table to
``bench/results/aot_sm90.md``; ``--list`` lists the variants only. It must run in a fresh
process: Triton reads ``TRITON_INTERPRET`` (which ``course_lib.device`` sets on a CPU machine)
when it is imported.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

HOPPER = ("cuda", 90, 32)          # GPUTarget(backend, compute capability, warp size)
HOPPER_SMS = 132                   # H100 SXM / H200: the SM count the tiles are sized for
MAX_SHARED_BYTES = 232_448         # H100/H200: 227 KiB of shared memory per block (opt-in)
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "aot_sm90.md"


def enter_jit_mode() -> None:
    """Import triton in JIT mode, then course_lib.device, on a machine without CUDA."""
    if "triton" in sys.modules or "course_lib.device" in sys.modules:
        raise RuntimeError("enter_jit_mode() must run before triton or course_lib.device is "
                           "imported: run `python -m course_lib.kernels.aot` in a fresh process")
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.pop("COURSE_BACKEND", None)         # a forced backend would hide the kernels
    import triton  # noqa: F401  (JIT mode: TRITON_INTERPRET is unset)

    with warnings.catch_warnings():                # device warns that triton came first
        warnings.simplefilter("ignore", RuntimeWarning)
        import course_lib.device  # noqa: F401
    os.environ.pop("TRITON_INTERPRET", None)      # kernels decorated from now on: JITFunction


@dataclass(frozen=True)
class Variant:
    """One launch to compile: ``label`` says which problem it comes from."""
    label: str
    launch: object                 # course_lib.kernels.launch.Launch
    kv16: bool                     # reads 16-bit K/V through a block table (attention)
    decode: bool                   # the decode split kernel: two K/V tiles must be in flight


def _launches() -> list[tuple[str, object, bool, bool]]:
    """(label, launch, 16-bit K/V attention?, decode?) for the grid of realistic problems."""
    import torch

    from course_lib.kernels.cache_ops import copy_blocks_launch, reshape_and_cache_launch
    from course_lib.kernels.paged_decode import decode_launches
    from course_lib.kernels.paged_prefill import prefill_launches
    from course_lib.kernels.tiles import decode_tiles, prefill_tiles

    meta = dict(device="meta")
    names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    out = []
    for dtype, t in names.items():
        half = dtype.itemsize == 2
        # (head_dim, group, block sizes): the course's tiny model (d 32, 8/2 heads); chapter
        # 04's and the tests' small heads; Llama-2-7B (MHA) and Llama-3-8B (32/8 heads), d 128.
        for head_dim, group, block_sizes in ((16, 1, (16,)), (32, 4, (16,)), (128, 1, (16,)),
                                             (128, 4, (16, 32))):
            kv_heads = 8
            heads = kv_heads * group
            for block_size in block_sizes:
                shape = f"{t} d={head_dim} group={group} block={block_size}"
                # one long sequence (many splits), the benchmark's batch (64 x 4096) and a
                # batch big enough for one split (no reduce launch)
                for num_seqs, ctx in ((1, 4096), (64, 4096), (256, 2048)):
                    blocks = ctx // block_size
                    q = torch.empty(num_seqs, heads, head_dim, dtype=dtype, **meta)
                    kc = torch.empty(num_seqs * blocks + 1, block_size, kv_heads, head_dim,
                                     dtype=dtype, **meta)
                    bt = torch.empty(num_seqs, blocks, dtype=torch.int32, **meta)
                    sl = torch.empty(num_seqs, dtype=torch.int32, **meta)
                    tiles = decode_tiles(head_dim=head_dim, group=group, max_seq_len=ctx,
                                         num_seqs=num_seqs, num_kv_heads=kv_heads,
                                         interpreted=False, num_sms=HOPPER_SMS)
                    _, launches = decode_launches(q, kc, kc, bt, sl, head_dim ** -0.5, ctx,
                                                  tiles)
                    where = f"{num_seqs}x{ctx} splits={tiles.num_splits}"
                    out.append((f"decode {shape} {where}", launches[0], half, True))
                    for extra in launches[1:]:
                        out.append((f"lse reduce {t} d={head_dim} {where}", extra, False,
                                    False))
                max_q, ctx = 2048, 4096
                q = torch.empty(max_q * 2, heads, head_dim, dtype=dtype, **meta)
                kc = torch.empty(2 * ctx // block_size + 1, block_size, kv_heads, head_dim,
                                 dtype=dtype, **meta)
                bt = torch.empty(2, ctx // block_size, dtype=torch.int32, **meta)
                sl = torch.empty(2, dtype=torch.int32, **meta)
                qsl = torch.empty(3, dtype=torch.int32, **meta)
                tiles = prefill_tiles(head_dim=head_dim, group=group, max_query_len=max_q,
                                      max_seq_len=ctx, interpreted=False,
                                      dtype_bytes=dtype.itemsize)
                _, launches = prefill_launches(q, kc, kc, bt, sl, qsl, head_dim ** -0.5, max_q,
                                               ctx, tiles)
                out.append((f"prefill {shape}", launches[0], half, False))
        out += _window_launches(dtype, t)
        for kv_heads, head_dim in ((2, 32), (8, 128)):
            k = torch.empty(512, kv_heads, head_dim, dtype=dtype, **meta)
            kc = torch.empty(1024, 16, kv_heads, head_dim, dtype=dtype, **meta)
            slots = torch.empty(512, dtype=torch.int64, **meta)
            out.append((f"reshape_and_cache {t} {kv_heads}x{head_dim}",
                        reshape_and_cache_launch(k, k, kc, kc, slots), False, False))
            pairs = torch.empty(8, 2, dtype=torch.int64, **meta)
            out.append((f"copy_blocks {t} {kv_heads}x{head_dim}",
                        copy_blocks_launch(kc, kc, pairs), False, False))
    return out


def _window_launches(dtype, t: str) -> list[tuple[str, object, bool, bool]]:
    """A sliding-window layer (gpt-oss's window, 128 tokens) on the grid's Llama-3-8B shape
    (head_dim 128, 32 query / 8 KV heads), so that each windowed kernel sits beside its
    full-attention twin in the table: ``SLIDING_WINDOW`` is a compile-time constant (as in
    vLLM 0.33.0's unified Triton kernel), a window is a kernel of its own. Decode plans its
    splits for the window's span (:func:`~course_lib.kernels.paged_decode.positions_read`)."""
    import torch

    from course_lib.kernels.paged_decode import decode_launches, positions_read
    from course_lib.kernels.paged_prefill import prefill_launches
    from course_lib.kernels.tiles import decode_tiles, prefill_tiles

    meta = dict(device="meta")
    head_dim, kv_heads, group, block_size, window = 128, 8, 4, 16, 128
    half = dtype.itemsize == 2
    shape = f"{t} d={head_dim} group={group} block={block_size} window={window}"
    out = []
    for num_seqs, ctx in ((1, 4096), (64, 4096)):
        q = torch.empty(num_seqs, kv_heads * group, head_dim, dtype=dtype, **meta)
        kc = torch.empty(num_seqs * ctx // block_size + 1, block_size, kv_heads, head_dim,
                         dtype=dtype, **meta)
        bt = torch.empty(num_seqs, ctx // block_size, dtype=torch.int32, **meta)
        sl = torch.empty(num_seqs, dtype=torch.int32, **meta)
        tiles = decode_tiles(head_dim=head_dim, group=group,
                             max_seq_len=positions_read(ctx, block_size, window),
                             num_seqs=num_seqs, num_kv_heads=kv_heads, interpreted=False,
                             num_sms=HOPPER_SMS)
        _, launches = decode_launches(q, kc, kc, bt, sl, head_dim ** -0.5, ctx, tiles,
                                      sliding_window=window)
        where = f"{num_seqs}x{ctx} splits={tiles.num_splits}"
        out.append((f"decode {shape} {where}", launches[0], half, True))
        for extra in launches[1:]:
            out.append((f"lse reduce {t} d={head_dim} {where} window={window}", extra, False,
                        False))
    max_q, ctx = 2048, 4096
    q = torch.empty(max_q * 2, kv_heads * group, head_dim, dtype=dtype, **meta)
    kc = torch.empty(2 * ctx // block_size + 1, block_size, kv_heads, head_dim, dtype=dtype,
                     **meta)
    bt = torch.empty(2, ctx // block_size, dtype=torch.int32, **meta)
    sl = torch.empty(2, dtype=torch.int32, **meta)
    qsl = torch.empty(3, dtype=torch.int32, **meta)
    tiles = prefill_tiles(head_dim=head_dim, group=group, max_query_len=max_q, max_seq_len=ctx,
                          interpreted=False, dtype_bytes=dtype.itemsize)
    _, launches = prefill_launches(q, kc, kc, bt, sl, qsl, head_dim ** -0.5, max_q, ctx, tiles,
                                   sliding_window=window)
    out.append((f"prefill {shape}", launches[0], half, False))
    return out


def _binding(launch):
    """What the JIT would compile for ``launch``: (key, src, options) from Triton's binder."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError(f"{launch.name} is a {type(fn).__name__}, not a JITFunction: Triton "
                           "is in interpreter mode (call enter_jit_mode() first)")
    backend = make_backend(GPUTarget(*HOPPER))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.options)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.options, bound,
                                                          specialization, options)
    key = (launch.name, tuple(signature.items()), tuple(sorted(
        (k, repr(v)) for k, v in constexprs.items())), tuple(sorted(
            (k, repr(v)) for k, v in attrs.items())), repr(sorted(options.__dict__.items())))
    return key, ASTSource(fn, signature, constexprs, attrs), options


def variants() -> list[Variant]:
    """Every distinct kernel the launches compile to (two launches that bind to the same
    specialisation compile once: the label of the first is kept)."""
    seen: dict[tuple, Variant] = {}
    for label, launch, kv16, decode in _launches():
        key, _, _ = _binding(launch)
        seen.setdefault(key, Variant(label, launch, kv16, decode))
    return list(seen.values())


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_bytes: int               # spill stores + spill loads
    shared_bytes: int
    num_warps: int
    num_stages: int
    kv_buffers: int                # depth of the pipelined K/V shared-memory buffers (0: none)
    async_copies_16b: int          # cp.async ... 16 instructions in the PTX
    vector_loads_16b: int          # ld.global.v4.b32 / v2.b64 (16-byte) loads
    scalar_16bit_loads: int        # ld.global of one 2-byte value
    seconds: float


def _ptxas_info(ptx: str) -> tuple[int, int]:
    """(registers, spill bytes) from ``ptxas -v`` (the one shipped with Triton)."""
    from triton.backends.nvidia.compiler import get_ptxas

    arch = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([get_ptxas(HOPPER[1]).path, f"-arch={arch}", "-v", str(src), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"ptxas failed: {res.stderr.strip()[-500:]}")
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", res.stderr))
    return regs, spills


def compile_variant(v: Variant) -> Resources:
    """Compile ``v`` for sm_90 and read its resources; raises what the GPU compiler raises."""
    import triton
    from triton.backends.compiler import GPUTarget

    start = time.perf_counter()
    _, src, options = _binding(v.launch)
    kernel = triton.compile(src, target=GPUTarget(*HOPPER), options=options.__dict__)
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    regs, spills = _ptxas_info(ptx)
    # mutable [depth, rows, cols] buffers of 2-D K/V tiles: the pipeliner's multi-buffering
    depths = [int(m) for m in re.findall(
        r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+x\d+x(?:f16|bf16|f32)", ttgir)]
    return Resources(
        registers=regs, spill_bytes=spills, shared_bytes=int(kernel.metadata.shared),
        num_warps=options.num_warps, num_stages=options.num_stages,
        kv_buffers=min(depths) if depths else 0,
        async_copies_16b=len(re.findall(
            r"cp\.async\.c[ag]\.shared\.global\S*\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(?:16|0x10)\b",
            ptx)),
        vector_loads_16b=len(re.findall(r"ld\.global\S*\.v4\.(?:b32|u32|f32)|ld\.global\S*\.v2\."
                                        r"(?:b64|u64)", ptx)),
        scalar_16bit_loads=len(re.findall(r"ld\.global(?:\.[a-z]+)*\.(?:b16|u16|f16|bf16)\s",
                                          ptx)),
        seconds=time.perf_counter() - start)


def problems(v: Variant, r: Resources) -> list[str]:
    """The rules ``r`` breaks (empty: the variant passes)."""
    bad = []
    if r.spill_bytes:
        bad.append(f"{r.spill_bytes} bytes of register spills")
    if r.shared_bytes > MAX_SHARED_BYTES:
        bad.append(f"{r.shared_bytes} B of shared memory > {MAX_SHARED_BYTES} B (sm_90)")
    if v.kv16 and not (r.async_copies_16b or r.vector_loads_16b):
        bad.append("16-bit K/V loaded without 16-byte async copies or vector loads")
    if v.kv16 and r.scalar_16bit_loads:
        bad.append(f"{r.scalar_16bit_loads} scalar 2-byte global loads")
    if v.decode and r.kv_buffers < 2:
        bad.append(f"K/V buffered {r.kv_buffers} deep: fewer than two tiles in flight")
    return bad


HEADER = ("| variant | regs | spill B | shared B | warps | stages | K/V buffers | cp.async 16 B"
          " | ld 16 B | ld 2 B | verdict |\n|---|---|---|---|---|---|---|---|---|---|---|")


def table_row(v: Variant, r: Resources, bad: list[str]) -> str:
    return (f"| {v.label} | {r.registers} | {r.spill_bytes} | {r.shared_bytes} | {r.num_warps}"
            f" | {r.num_stages} | {r.kv_buffers} | {r.async_copies_16b} | {r.vector_loads_16b}"
            f" | {r.scalar_16bit_loads} | {'; '.join(bad) or 'ok'} |")


def main(argv: list[str]) -> int:
    enter_jit_mode()
    import triton

    todo = variants()
    print(f"triton {triton.__version__}: {len(todo)} kernel variants for sm_90")
    if "--list" in argv:
        for v in todo:
            print(" ", v.label, {k: val for k, val in v.launch.options.items()})
        return 0
    rows, failed = [], 0
    for v in todo:
        try:
            r = compile_variant(v)
        except Exception as exc:  # report every variant, then fail
            failed += 1
            print(f"FAIL {v.label}: {type(exc).__name__}: {str(exc).splitlines()[-1][:300]}")
            rows.append(f"| {v.label} | | | | | | | | | | FAIL: {type(exc).__name__} |")
            continue
        bad = problems(v, r)
        failed += bool(bad)
        print(f"{'FAIL' if bad else 'ok  '} {v.label}: {r.registers} regs, {r.spill_bytes} B "
              f"spilled, shared {r.shared_bytes} B, {r.num_warps} warps, {r.num_stages} stages, "
              f"K/V x{r.kv_buffers}, cp.async16 {r.async_copies_16b}, ld16B "
              f"{r.vector_loads_16b}, ld2B {r.scalar_16bit_loads}, {r.seconds:.1f} s"
              + (f"  <- {'; '.join(bad)}" if bad else ""))
        rows.append(table_row(v, r, bad))
    if "--no-save" not in argv:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(
            f"# Kernels compiled for sm_90 as the JIT compiles them (triton {triton.__version__})"
            f"\n\nWritten by `python -m course_lib.kernels.aot` (no GPU needed): one row per "
            f"distinct kernel the course launches on the problem grid of "
            f"`course_lib/kernels/aot.py`.\n\n{HEADER}\n" + "\n".join(rows) + "\n")
    print(f"{len(todo) - failed}/{len(todo)} compiled for sm_90 and passed the checks")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
