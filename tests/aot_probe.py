"""Run by tests/test_aot_hopper.py in a fresh process (Triton must be in JIT mode): compiles a few
launches with :mod:`course_lib.kernels.aot` and prints one JSON object.

* ``same_as_jit``: for each kernel, whether aot's compile of a launch is the very kernel that
  Triton's JIT builds for it (``JITFunction.warmup`` under a stand-in driver that reports an
  sm_90 GPU: the launch path minus the launch), compared by the compiled kernel's hash;
  ``without_integer_hints_same_as_jit``: the same comparison for a compile that leaves out the
  integers' divisibility hints (must be false: the comparison can tell);
* ``good``: the problems aot finds in the launches the course makes (none expected);
* ``bad``: the problems it finds in launches built to break one rule each.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_lib.kernels import aot  # noqa: E402

aot.enter_jit_mode()

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from course_lib.kernels.cache_ops import reshape_and_cache_launch  # noqa: E402
from course_lib.kernels.paged_decode import decode_launches  # noqa: E402
from course_lib.kernels.paged_prefill import prefill_launches  # noqa: E402
from course_lib.kernels.tiles import PrefillTiles, decode_tiles, prefill_tiles  # noqa: E402

META = dict(device="meta")


class Hopper:
    """Just enough of a Triton driver for ``warmup``: an sm_90 device, no launch."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget(*aot.HOPPER)


def decode(dtype=torch.bfloat16, head_dim=128, group=4, num_seqs=64, ctx=4096, block_size=16,
           kv=None, **tile_changes):
    heads, kv_heads = 8 * group, 8
    blocks = ctx // block_size
    q = torch.empty(num_seqs, heads, head_dim, dtype=dtype, **META)
    if kv is None:
        kv = torch.empty(num_seqs * blocks + 1, block_size, kv_heads, head_dim, dtype=dtype,
                         **META)
    bt = torch.empty(num_seqs, blocks, dtype=torch.int32, **META)
    sl = torch.empty(num_seqs, dtype=torch.int32, **META)
    tiles = decode_tiles(head_dim=head_dim, group=group, max_seq_len=ctx, num_seqs=num_seqs,
                         num_kv_heads=kv_heads, interpreted=False, num_sms=aot.HOPPER_SMS)
    tiles = dataclasses.replace(tiles, **tile_changes)
    return decode_launches(q, kv, kv, bt, sl, head_dim ** -0.5, ctx, tiles)[1]


def prefill(dtype=torch.bfloat16, head_dim=128, group=4, tiles=None):
    q = torch.empty(4096, 8 * group, head_dim, dtype=dtype, **META)
    kc = torch.empty(513, 16, 8, head_dim, dtype=dtype, **META)
    bt = torch.empty(2, 256, dtype=torch.int32, **META)
    ints = [torch.empty(n, dtype=torch.int32, **META) for n in (2, 3)]
    tiles = tiles or prefill_tiles(head_dim=head_dim, group=group, max_query_len=2048,
                                   max_seq_len=4096, interpreted=False,
                                   dtype_bytes=dtype.itemsize)
    return prefill_launches(q, kc, kc, bt, *ints, head_dim ** -0.5, 2048, 4096, tiles)[1][0]


def check(launch, kv16=True, is_decode=True) -> list[str]:
    v = aot.Variant("probe", launch, kv16, is_decode)
    return aot.problems(v, aot.compile_variant(v))


def same_as_jit(launch, hints: bool = True) -> bool:
    _, src, options = aot._binding(launch)
    if not hints:              # the integer hints left out, as the course's first aot.py did
        pointers = {k: v for k, v in src.attrs.items()
                    if src.signature[launch.kernel.arg_names[k[0]]].startswith("*")}
        src = triton.compiler.ASTSource(launch.kernel, src.signature, src.constants, pointers)
    ours = triton.compile(src, target=GPUTarget(*aot.HOPPER), options=options.__dict__)
    jit = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.options)
    return ours.hash == jit.hash


triton.runtime.driver.set_active(Hopper())      # this process has no other driver
k = torch.empty(512, 8, 128, dtype=torch.bfloat16, **META)
kc = torch.empty(1024, 16, 8, 128, dtype=torch.bfloat16, **META)
split, reduce = decode()
single = decode(num_seqs=256, ctx=2048)[0]
cache_op = reshape_and_cache_launch(k, k, kc, kc, torch.empty(512, dtype=torch.int64, **META))
# a cache whose rows are not 16-byte aligned (head_dim 128 stored with a stride of 129)
odd_kv = torch.empty(64 * 256 + 1, 16, 8, 129, dtype=torch.bfloat16, **META)[..., :128]
result = {
    "same_as_jit": {name: same_as_jit(launch) for name, launch in (
        ("decode", split), ("reduce", reduce), ("decode_single_split", single),
        ("prefill", prefill()), ("reshape_and_cache", cache_op))},
    "without_integer_hints_same_as_jit": same_as_jit(split, hints=False),
    "good": {"decode": check(split), "decode_single_split": check(single),
             "prefill": check(prefill(), is_decode=False)},
    "bad": {
        "spills": check(prefill(torch.float32, tiles=PrefillTiles(64, 4, 32, 128, upcast=False)),
                        kv16=False, is_decode=False),
        "unaligned_kv": check(decode(kv=odd_kv)[0]),
        "one_buffer": check(decode(num_stages=2)[0]),
        "shared_memory": check(decode(torch.float32, tile_n=256, num_stages=4)[0], kv16=False),
    },
}
print(json.dumps(result))
