"""The real engine on the tiny model: paged continuous batching vs static batching, and the
KV memory saved by sharing (printed, never asserted).

1. **Throughput** (generated tokens / wall-clock second, one CPU thread): a ShareGPT-like
   trace scaled to the model's 256-token context (``course_lib.engine.workloads.model_trace``),
   all requests at t=0, through ``LLMEngine`` (paging + continuous batching, recompute
   preemption) and through the static baseline ``course_lib.engine.workloads.run_static`` (a
   contiguous 256-slot cache per request, static batches) with the same model and kernels at
   the same KV memory (``num_gpu_blocks x block_size`` slots). Two baselines: "static" computes a
   finished request as padding until its batch ends (a fixed-shape batch, as FasterTransformer
   or a padded ``generate`` run); "static, no padding" stops computing it (kinder). Target:
   paged / static >= 2.5x.
2. **Sharing**: an Alpaca-like trace with parallel sampling (n = 2, 4, 6) and beam search
   (width 2, 4, 6); saving = 1 - blocks held / blocks the same sequences would hold without
   sharing, summed over steps (the vLLM paper's Fig. 15 measure; its Alpaca ranges: parallel
   sampling 6.1-9.8%, beam search 37.6-55.2%).
3. **A step beside a waiting queue, and what being recoverable costs**: the same batch of 8
   decoding sequences, with 0, 1,000, 8,000 and 16,000 requests waiting behind them
   (``max_num_seqs=8``: none gets in), for each design (V0, V1 over hash chains, V1 over the
   radix tree). A step must not pay for the waiting queue: its time must stay within 1.2x of
   the step with nothing waiting. Printed beside it, the share of a step spent on what makes it
   recoverable (``engine/recovery.py``: the records of the requests it ran and the counters,
   O(batch)); then the time one recovery takes (the records restored, a new empty scheduler
   and pool, every request queued again: O(requests + blocks), paid only when a step fails) by
   queue length and pool size.

    python bench/engine.py            # full run (a few minutes on 2 shared cores)
    python bench/engine.py --quick    # small sizes, for a smoke test
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from course_lib.config import CacheConfig, SchedulerConfig  # noqa: E402
from course_lib.engine.llm_engine import LLMEngine  # noqa: E402
from course_lib.engine.workloads import model_trace, run_static, run_trace, sharing_savings  # noqa: E402
from course_lib.model.loader import load_tiny_model  # noqa: E402
from course_lib.sequence import SamplingParams  # noqa: E402
from course_lib.sim.traces import trace_summary  # noqa: E402

PAPER_ALPACA = {"parallel": (6.1, 9.8), "beam": (37.6, 55.2)}


def machine() -> str:
    from course_lib.device import describe

    return f"{platform.processor() or platform.machine()}, python " \
           f"{platform.python_version()}; {describe()}"


def engine(model, num_gpu_blocks: int, block_size: int = 16) -> LLMEngine:
    sc = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=512, max_model_len=256)
    return LLMEngine(model, sc, CacheConfig(block_size, num_gpu_blocks), stop_token_ids=())


def table_throughput(model, num_requests: int, budgets: list[int]) -> None:
    trace = model_trace("sharegpt", num_requests, seed=0)
    s = trace_summary(trace)
    print(f"\n1. throughput: {num_requests} ShareGPT-like requests scaled to 256 tokens "
          f"(mean prompt {s['mean_input']:.1f}, mean output {s['mean_output']:.1f}), "
          "block 16, greedy, no stop token")
    print(f"{'KV slots':>9} {'system':>20} {'tok/s':>8} {'steps':>6} {'preempt':>8} "
          f"{'paged/this':>11}")
    for blocks in budgets:
        slots = blocks * 16
        paged = run_trace(engine(model, blocks), trace)
        static = run_static(model, trace, slots)
        kind = run_static(model, trace, slots, pad_finished=False)
        for name, r in (("paged (engine)", paged), (f"static ({slots // 256}/batch)", static),
                        ("static, no padding", kind)):
            ratio = paged.tokens_per_s / r.tokens_per_s
            print(f"{slots:>9} {name:>20} {r.tokens_per_s:>8.0f} {r.num_steps:>6} "
                  f"{r.num_preemptions:>8} {ratio:>10.2f}x")
    print("   target: paged / static >= 2.5x")


def table_sharing(model, num_requests: int, sizes: list[int]) -> None:
    trace = model_trace("alpaca", num_requests, seed=0)
    s = trace_summary(trace)
    print(f"\n2. KV memory saved by sharing: {num_requests} Alpaca-like requests (mean prompt "
          f"{s['mean_input']:.1f}, mean output {s['mean_output']:.1f}), block 16")
    print(f"{'decoding':>16} {'saving':>8} {'paper (Alpaca)':>15}")
    for kind in ("parallel", "beam"):
        lo, hi = PAPER_ALPACA[kind]
        for k in sizes:
            params = SamplingParams(temperature=1.0, seed=0, n=k) if kind == "parallel" \
                else SamplingParams(beam_width=k)
            r = sharing_savings(engine(model, 1024), trace, params)
            label = f"{'n' if kind == 'parallel' else 'beam'} = {k}"
            print(f"{label:>16} {100 * r.saving:>7.1f}% {f'{lo}-{hi}%':>15}")


def _decoding_engine(model, design: str, prefix_cache: str, blocks: int,
                     waiting: int) -> LLMEngine:
    """8 sequences decoding (``max_num_seqs=8``) and ``waiting`` requests queued behind them."""
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256)
    cc = CacheConfig(16, blocks, enable_prefix_caching=True, prefix_cache=prefix_cache)
    eng = LLMEngine(model, sc, cc, stop_token_ids=(), design=design)
    long = SamplingParams(max_tokens=200, temperature=0.0)
    for i in range(8):
        eng.add_request([65 + i, 66, 67], long)
    eng.step()                                   # the batch prefilled, now decoding
    for i in range(waiting):
        eng.add_request([70 + i % 20, 71, 72], long)
    return eng


DESIGNS3 = (("v0", "hash", "v0"), ("v1", "hash", "v1"), ("v1", "radix", "v1 radix"))


def table_waiting_queue(model, sizes: list[int], steps: int) -> None:
    import statistics
    import time

    from course_lib.engine.recovery import Counters, records_of_step

    print(f"\n3. one step of 8 decoding sequences beside a waiting queue (median of {steps} "
          "steps, CPU time)")
    print(f"{'design':>10} {'waiting':>8} {'step ms':>8} {'vs 0':>6} {'recoverable':>12}")
    for design, prefix_cache, label in DESIGNS3:
        base = None
        for waiting in sizes:
            eng = _decoding_engine(model, design, prefix_cache, 512, waiting)
            times, commits = [], []
            for _ in range(steps):
                t0 = time.process_time()
                eng.step()
                times.append(time.process_time() - t0)
                t0 = time.process_time()                 # what the commit adds to a step
                records_of_step(eng.scheduler, eng.last_output, [], eng._requests)
                Counters.of(eng.scheduler, eng.runner)
                commits.append(time.process_time() - t0)
            ms, commit = 1e3 * statistics.median(times), 1e3 * statistics.median(commits)
            base = base or ms
            print(f"{label:>10} {waiting:>8,} {ms:>8.2f} {ms / base:>5.2f}x "
                  f"{100 * commit / ms:>10.2f} %")
    print("   target: within 1.2x of the step with nothing waiting; 'recoverable': the share "
          "of the step spent on its records and counters")
    print("\n   one recovery (a failed step's: records restored, new empty scheduler and pool, "
          f"every request queued again; median of {min(steps, 5)})")
    print(f"{'design':>10} {'blocks':>8} {'waiting':>8} {'ms':>8}")
    for design, prefix_cache, label in DESIGNS3:
        for blocks, waiting in ((512, 0), (512, sizes[-1]), (16384, 0)):
            eng = _decoding_engine(model, design, prefix_cache, blocks, waiting)
            costs = []
            for _ in range(min(steps, 5)):
                t0 = time.process_time()
                eng._recovery = {}                           # as after a failed step
                eng._recover_now()
                costs.append(time.process_time() - t0)
                eng._unreturned.clear()
            print(f"{label:>10} {blocks:>8,} {waiting:>8,} "
                  f"{1e3 * statistics.median(costs):>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {machine()}; one thread, wall-clock time")
    if not torch.cuda.is_available():
        print("no GPU here: CPU figures (the engine's batched torch attention path)")
    model = load_tiny_model()
    if args.quick:
        table_throughput(model, 12, [64])
        table_sharing(model, 6, [2])
        table_waiting_queue(model, [0, 1000], 5)
    else:
        table_throughput(model, 200, [64, 128])
        table_sharing(model, 60, [2, 4, 6])
        table_waiting_queue(model, [0, 1000, 8000, 16000], 20)


if __name__ == "__main__":
    main()
