"""The CPU offload tier on the real engine (issue 24, item 2): prefix reuse that outgrows the
GPU pool, with no offload, with vLLM V1's CPU tier and with V0's swap space of the same CPU
bytes (printed, never asserted).

Two workloads (``course_lib.engine.offload_study``): the multi-turn chat of chapter 12 (a
round sends one turn of every conversation at once, each prompt the whole conversation so
far) and a RAG-like trace (one or two of a few shared documents plus a question, a few
requests at once). Per workload and configuration: the shares of the prompt tokens looked up
that the GPU prefix cache found and that the CPU tier loaded (one denominator: they add up),
the prompt tokens computed and how many fewer than with no offload, TTFT
(mean and p99 on the engine's clock: by default this process's CPU seconds, so the load of
other processes on a shared machine does not count, ``--clock wall`` for wall-clock seconds;
the median over ``--repeats`` interleaved runs), the engine steps, preemptions, V0's swapped
blocks, the tier's stored, loaded and evicted blocks, and whether every answer's tokens
equal the no-offload run's (greedy; seeded sampling checked too). Then the sweep chapter 13
plots (``offload_study.sweep``, here with one tier size): the tier's hits and the prefill it
saves as the GPU pool shrinks, beside a pool that holds everything.

    python bench/offload.py            # about a minute of CPU time
    python bench/offload.py --quick    # small sizes, for a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from course_lib.engine.cpu_offload import GiB  # noqa: E402
from course_lib.engine.offload_study import (  # noqa: E402
    BLOCK_SIZE,
    CONFIGS,
    OffloadRow,
    OffloadWorkload,
    compare,
    make_engine,
    sweep,
)
from course_lib.model.loader import load_tiny_model  # noqa: E402

CLOCKS = {"cpu": "this process's CPU time (time.process_time: one thread, so the engine's "
                 "work, whatever else the machine runs)",
          "wall": "wall-clock time (time.perf_counter)"}


def machine() -> str:
    from course_lib.device import describe

    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() \
        else "?"
    return f"{platform.processor() or platform.machine()}, python " \
           f"{platform.python_version()}, load average {load}; {describe()}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:6.1%}"


def table(model, workload: OffloadWorkload, gpu_blocks: int, cpu_blocks: int,
          repeats: int, clock) -> None:
    runs = [compare(model, workload, gpu_blocks, cpu_blocks, clock=clock)
            for _ in range(repeats)]
    first = runs[0]
    for rows in runs[1:]:                  # the counts do not depend on the clock
        if [r._replace(ttft_mean=0, ttft_p99=0) for r in rows] != \
                [r._replace(ttft_mean=0, ttft_p99=0) for r in first]:
            print("  WARNING: the counts differ between repeats")
    seeded = compare(model, workload, gpu_blocks, cpu_blocks, sampled=True)
    print(f"  {'configuration':<15} {'GPU hit':>7} {'CPU hit':>7} {'prefill':>7} "
          f"{'saved':>6} {'TTFT mean':>9} {'TTFT p99':>8} {'steps':>5} {'preempt':>7} "
          f"{'swapped':>7} "
          f"{'tier stored/loaded/evicted':>26}  same tokens (greedy, seeded)")
    for i, r in enumerate(first):
        mean = statistics.median(rows[i].ttft_mean for rows in runs)
        p99 = statistics.median(rows[i].ttft_p99 for rows in runs)
        tier = f"{r.cpu_stored}/{r.cpu_loaded}/{r.cpu_evictions}" \
            if r.config == CONFIGS[1] else "-"
        same = "reference" if i == 0 else \
            f"{'yes' if r.same_tokens else 'NO'}, {'yes' if seeded[i].same_tokens else 'NO'}"
        print(f"  {r.config:<15} {pct(r.gpu_hit_rate):>7} {pct(r.cpu_hit_rate):>7} "
              f"{r.prefill_tokens:>7} {r.prefill_saved:>6} {mean * 1e3:>7.1f}ms "
              f"{p99 * 1e3:>6.1f}ms {r.steps:>5} {r.preemptions:>7} {r.swapped_blocks:>7} "
              f"{tier:>26}  {same}")


def print_sweep(model, workload: OffloadWorkload, sizes: list[int], cpu_blocks: int,
                fits: int) -> None:
    rows = sweep(model, workload, [fits, *sizes], [cpu_blocks])
    pairs: list[tuple[OffloadRow, OffloadRow]] = list(zip(rows[::2], rows[1::2], strict=True))
    floor = pairs[0][0].prefill_tokens                 # nothing evicted: the least prefill
    print(f"  {'GPU blocks':>10} {'GPU hit':>7} {'CPU hit':>7} {'prefill, none':>13} "
          f"{'with tier':>9} {'saved':>6} {'gap closed':>10} {'same tokens':>11}")
    for plain, r in pairs:
        gap = plain.prefill_tokens - floor
        closed = f"{r.prefill_saved / gap:.0%}" if gap > 0 else "-"
        note = "  (holds everything)" if r.gpu_blocks == fits else ""
        print(f"  {r.gpu_blocks:>10} {pct(r.gpu_hit_rate):>7} {pct(r.cpu_hit_rate):>7} "
              f"{plain.prefill_tokens:>13} {r.prefill_tokens:>9} {r.prefill_saved:>6} "
              f"{closed:>10} {'yes' if r.same_tokens else 'NO':>11}{note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small workloads, one repeat")
    parser.add_argument("--repeats", type=int, default=5,
                        help="interleaved runs per table, for the TTFT medians")
    parser.add_argument("--gpu-blocks", type=int, default=32)
    parser.add_argument("--cpu-blocks", type=int, default=128)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="TTFT's clock: this process's CPU time (default: other processes' "
                             "load does not count) or wall-clock time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_tiny_model()
    if args.quick:
        chat, rag = OffloadWorkload("chat", num=4, turns=3), OffloadWorkload("rag", num=12)
        sizes, repeats = [32, 24], 1
    else:
        chat, rag = OffloadWorkload("chat", num=8, turns=5), OffloadWorkload("rag", num=36)
        sizes, repeats = [64, 48, 32, 24], args.repeats
    block_bytes = make_engine(model, 8).runner.kv_bytes_per_block
    cpu_bytes = args.cpu_blocks * block_bytes
    print(f"machine: {machine()}; torch threads 1; {datetime.date.today()}")
    print(f"blocks of {BLOCK_SIZE} tokens ({block_bytes} bytes, all layers, K and V); GPU pool "
          f"{args.gpu_blocks} blocks; CPU: {args.cpu_blocks} blocks = {cpu_bytes / 2**20:.2f} "
          f"MiB, the tier's (kv_offloading_size={cpu_bytes / GiB:.6f} GiB) and V0's swap "
          f"space (num_cpu_blocks={args.cpu_blocks}) alike; 4 sequences and 64 tokens a step")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"TTFT: arrival -> first token, seconds of {CLOCKS[args.clock]} (machine-dependent), "
          f"median of {repeats} interleaved run(s); counts are exact and the same in every run")
    print("GPU hit, CPU hit: shares of the prompt tokens looked up (every admission, "
          "re-admissions after a preemption included) found in the GPU pool and loaded from "
          "the CPU tier: they add up; the rest was computed")
    print("V0 + swap: V0's prefix cache (GPU only) and swap preemption; its swap space holds "
          "preempted running sequences, never a prefix for another request; 'saved' is "
          "against V1 with no offload")
    for workload, what in ((chat, f"multi-turn chat: {chat.num} conversations x "
                                  f"{chat.turns} turns, a round = one turn of each"),
                           (rag, f"RAG-like: {rag.num} requests, {rag.concurrency} at a time, "
                                 f"1-2 of {rag.num_docs} documents of {rag.doc_len} tokens "
                                 f"+ a 4-12 token question")):
        print(f"\n== {what}; {workload.max_tokens} tokens per answer ==")
        table(model, workload, args.gpu_blocks, args.cpu_blocks, repeats, clock)
        print(f"  sweep: the GPU pool shrinks, CPU tier of {args.cpu_blocks} blocks; gap "
              "closed = prefill saved / (prefill with no offload - prefill when the pool "
              "holds everything)")
        print_sweep(model, workload, sizes, args.cpu_blocks, fits=256)


if __name__ == "__main__":
    main()
