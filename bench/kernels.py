"""Paged decode attention: achieved HBM bandwidth, and time against torch's SDPA.

The large case is vLLM's bread and butter: batch 64 x context 4096, 32 query heads / 8 KV heads,
head_dim 128, bf16, block_size 16. Decode reads every cached K and V once, so the figure of
merit is bytes of K/V read / time, as a fraction of the GPU's data-sheet peak (target >= 80% on
H100/H200). The baseline is ``torch.nn.functional.scaled_dot_product_attention`` on the same
K/V stored contiguously (``enable_gqa=True``); target: paged / contiguous time <= 1.10. A sweep
of batch x context follows, then (``--tiles``) a sweep of the decode kernel's launch
configuration (tile 32/64 x stages 3/4/5 x warps 4/8) that records the best one per shape next
to the heuristic's choice. On a GPU the figures are also saved to
``bench/results/kernels_<gpu>.json``, which chapter 04 shows when it runs on CPU.

    PYTHONPATH=. python3 bench/kernels.py            # GPU: large case + sweep
    PYTHONPATH=. python3 bench/kernels.py --tiles    # + the tile sweep (scripts/gpu_check.sh)
    PYTHONPATH=. python3 bench/kernels.py --quick    # smaller sweep
On a machine without a GPU it says so and runs small shapes through Triton's interpreter
(timings of the interpreter, not of a kernel).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from course_lib.device import BACKEND, describe  # noqa: E402
from course_lib.kernels import timing  # noqa: E402

LARGE = dict(batch=64, ctx=4096, heads=32, kv_heads=8, head_dim=128, block_size=16)


def decode_problem(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int,
                   block_size: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Query, paged caches with a random permuted block table, and the same K/V contiguous in
    SDPA's layout ``[batch, kv_heads, ctx, head_dim]``. Built on ``device`` directly."""
    if ctx % block_size:
        raise ValueError(f"ctx {ctx} must be a multiple of block_size {block_size}")
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = ctx // block_size
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, -1)
    caches, contiguous = [], []
    for _ in range(2):
        x = torch.randn(batch, ctx, kv_heads, head_dim, generator=gen, device=device,
                        dtype=dtype)
        cache = torch.empty(num_blocks, block_size, kv_heads, head_dim, device=device,
                            dtype=dtype)
        cache[tables] = x.view(batch, blocks_per_seq, block_size, kv_heads, head_dim)
        caches.append(cache)
        contiguous.append(x.transpose(1, 2).contiguous())
        del x
    query = torch.randn(batch, heads, head_dim, generator=gen, device=device, dtype=dtype)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return query, caches[0], caches[1], tables.to(torch.int32), seq_lens, *contiguous


def sdpa_runner(q4, k, v, scale):
    """The fastest SDPA backend that accepts GQA decode here, and its name."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", None):
        def run(name=name):
            if name is None:
                return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
            with sdpa_kernel(getattr(SDPBackend, name)):
                return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
        try:
            with warnings.catch_warnings():       # a refused backend warns, then raises
                warnings.simplefilter("ignore")
                run()
        except (RuntimeError, AttributeError):
            continue
        return run, (name or "default").lower()
    raise RuntimeError("no SDPA backend runs GQA decode on this machine")


def measure(batch, ctx, heads, kv_heads, head_dim, block_size, dtype=torch.bfloat16,
            peak=None, device="cuda", **launch) -> dict:
    """One decode problem: paged Triton kernel vs SDPA on contiguous K/V, same inputs.
    ``launch``: ``tile_n`` / ``num_warps`` / ``num_stages`` overrides for ``decode_tiles``."""
    from course_lib.kernels.paged_decode import paged_decode
    from course_lib.kernels.tiles import decode_tiles

    q, kc, vc, bt, sl, k, v = decode_problem(batch, ctx, heads, kv_heads, head_dim, block_size,
                                             dtype, device)
    scale = head_dim ** -0.5
    on_gpu = device == "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if on_gpu else 1
    tiles = decode_tiles(head_dim=head_dim, group=heads // kv_heads, max_seq_len=ctx,
                         num_seqs=batch, num_kv_heads=kv_heads, interpreted=not on_gpu,
                         num_sms=sms, **launch)
    out = torch.empty_like(q)

    def paged():
        return paged_decode(q, kc, vc, bt, sl, scale, ctx, tiles=tiles, out=out)

    sdpa, sdpa_name = sdpa_runner(q.unsqueeze(2), k, v, scale)
    diff = (paged().float() - sdpa().squeeze(2).float()).abs().max().item()
    reps = dict(repeats=7, warmup=3, inner=10) if on_gpu else dict(repeats=3)
    t_paged = timing.time_fn(paged, device, **reps)
    t_sdpa = timing.time_fn(sdpa, device, **reps)
    nbytes = timing.kv_bytes_read([ctx] * batch, kv_heads, head_dim, dtype)
    gbps = nbytes / t_paged / 1e9
    return dict(batch=batch, ctx=ctx, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                block_size=block_size, dtype=str(dtype).removeprefix("torch."),
                num_splits=tiles.num_splits, tile_n=tiles.tile_n, num_warps=tiles.num_warps,
                num_stages=tiles.num_stages, paged_ms=t_paged * 1e3,
                sdpa_ms=t_sdpa * 1e3, sdpa_backend=sdpa_name, ratio=t_paged / t_sdpa,
                gbps=gbps, sdpa_gbps=nbytes / t_sdpa / 1e9,
                peak_fraction=None if peak is None else gbps / peak, max_abs_diff=diff)


def row(r: dict) -> str:
    frac = "   n/a" if r.get("peak_fraction") is None else f"{100 * r['peak_fraction']:5.1f}%"
    return (f"{r['batch']:>5} {r['ctx']:>6} {r['block_size']:>5} {r['paged_ms']:>10.3f} "
            f"{r['sdpa_ms']:>10.3f} {r['ratio']:>6.2f} {r['gbps']:>8.0f} {frac:>7} "
            f"{r['num_splits']:>6}")


HEADER = (f"{'batch':>5} {'ctx':>6} {'block':>5} {'paged ms':>10} {'sdpa ms':>10} "
          f"{'ratio':>6} {'GB/s':>8} {'%peak':>7} {'splits':>6}")


TILE_SHAPES = ((1, 4096), (8, 4096), (64, 4096), (16, 16384))   # batch x context, 32/8 heads


def tile_sweep(peak: float | None) -> list[dict]:
    """Every (tile_n, num_stages, num_warps) on a few shapes; the best per shape by time, beside
    the heuristic's choice (``decode_tiles`` defaults)."""
    print("\ntile sweep (32/8 heads, head_dim 128, bf16, block 16): tile x stages x warps")
    results = []
    for batch, ctx in TILE_SHAPES:
        default = measure(batch, ctx, 32, 8, 128, 16, peak=peak)
        tried = []
        for tile_n in (32, 64):
            for num_stages in (3, 4, 5):
                for num_warps in (4, 8):
                    try:
                        r = measure(batch, ctx, 32, 8, 128, 16, peak=peak, tile_n=tile_n,
                                    num_stages=num_stages, num_warps=num_warps)
                    except Exception as exc:   # e.g. out of shared memory: say so, go on
                        print(f"  {batch}x{ctx} tile {tile_n} stages {num_stages} warps "
                              f"{num_warps}: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    tried.append({k: r[k] for k in ("tile_n", "num_stages", "num_warps",
                                                    "num_splits", "paged_ms", "gbps")})
                    torch.cuda.empty_cache()
        best = min(tried, key=lambda t: t["paged_ms"])
        print(f"  {batch:>3} x {ctx:>5}: heuristic tile {default['tile_n']} stages "
              f"{default['num_stages']} warps {default['num_warps']} -> {default['gbps']:.0f} "
              f"GB/s; best tile {best['tile_n']} stages {best['num_stages']} warps "
              f"{best['num_warps']} -> {best['gbps']:.0f} GB/s", flush=True)
        results.append(dict(batch=batch, ctx=ctx, heuristic={k: default[k] for k in (
            "tile_n", "num_stages", "num_warps", "num_splits", "paged_ms", "gbps")},
            best=best, tried=tried))
    return results


def run_gpu(quick: bool, save: bool = True, tiles: bool = False) -> None:
    name = torch.cuda.get_device_name(0)
    peak = timing.peak_bandwidth_gbps(name)
    print(f"GPU: {name}; peak HBM bandwidth "
          f"{'unknown (add it to timing.PEAK_GBPS)' if peak is None else f'{peak:.0f} GB/s'}")
    large = measure(**LARGE, peak=peak)
    print("\nlarge case: batch 64 x ctx 4096, 32/8 heads, head_dim 128, bf16, block 16")
    print(HEADER)
    print(row(large))
    print(f"SDPA backend: {large['sdpa_backend']}; max |paged - sdpa| = "
          f"{large['max_abs_diff']:.2e}")
    if large["peak_fraction"] is not None:
        ok_bw = "meets" if large["peak_fraction"] >= 0.80 else "MISSES"
        print(f"bandwidth {100 * large['peak_fraction']:.1f}% of peak: {ok_bw} the 80% target")
    ok_t = "meets" if large["ratio"] <= 1.10 else "MISSES"
    print(f"paged / contiguous time {large['ratio']:.2f}: {ok_t} the 1.10 target")

    batches = (1, 16, 64) if quick else (1, 8, 32, 64, 128)
    contexts = (512, 4096) if quick else (512, 2048, 4096, 16384)
    sweep = []
    print("\nsweep (32/8 heads, head_dim 128, bf16)")
    print(HEADER)
    for block_size in (16,) if quick else (8, 16, 32):
        for b in batches:
            for ctx in contexts:
                r = measure(b, ctx, 32, 8, 128, block_size, peak=peak)
                torch.cuda.empty_cache()            # the last problem's tensors are gone
                sweep.append(r)
                print(row(r), flush=True)
    results = dict(device=name, peak_gbps=peak, torch=BACKEND.torch_version,
                   triton=BACKEND.triton_version, date=datetime.date.today().isoformat(),
                   large=large, sweep=sweep, tile_sweep=tile_sweep(peak) if tiles else [])
    if not save:
        print("\nresults not saved (--no-save)")
        return
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    path = timing.RESULTS_DIR / f"kernels_{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nsaved {path}")


def run_cpu(quick: bool) -> None:
    print("no GPU on this machine: no bandwidth figures (a GPU's HBM is what they measure).")
    if not BACKEND.uses_triton:
        print("no Triton either: nothing to run but the torch reference.")
        return
    from course_lib.kernels import interpreter_incompatibility

    if interpreter_incompatibility():
        print(interpreter_incompatibility())
        return
    print("Small shapes through Triton's interpreter instead, same code path as on a GPU "
          "(its milliseconds measure Python running the kernel, not a kernel).")
    print(f"{'batch':>5} {'ctx':>5} {'block':>5} {'paged ms':>10} {'sdpa ms':>10} "
          f"{'max |paged - sdpa|':>19}")
    shapes = [(2, 64)] if quick else [(2, 64), (4, 256)]
    for batch, ctx in shapes:
        for block_size in (8, 16, 32):
            r = measure(batch, ctx, 4, 1, 32, block_size, dtype=torch.float32, device="cpu")
            print(f"{batch:>5} {ctx:>5} {block_size:>5} {r['paged_ms']:>10.1f} "
                  f"{r['sdpa_ms']:>10.3f} {r['max_abs_diff']:>19.1e}")
    stored = timing.stored_results()
    if stored:
        s = stored[0]
        print(f"stored GPU figures: {s['device']} ({s['date']}): large case "
              f"{s['large']['gbps']:.0f} GB/s, paged/sdpa {s['large']['ratio']:.2f}")
    else:
        print("no stored GPU figures in bench/results/ yet: run this script on a GPU.")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--tiles", action="store_true",
                        help="also sweep tile x stages x warps and record the best per shape")
    parser.add_argument("--no-save", action="store_true",
                        help="do not write bench/results/kernels_<gpu>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(describe())
    if BACKEND.device == "cuda":
        run_gpu(args.quick, save=not args.no_save, tiles=args.tiles)
    else:
        run_cpu(args.quick)


if __name__ == "__main__":
    main()
