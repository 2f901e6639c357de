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
3. **A step beside a waiting queue**: the same batch of 8 decoding sequences, with 0, 1,000,
   8,000 and 16,000 requests waiting behind them (``max_num_seqs=8``: none gets in), for each
   design (V0, V1 over hash chains, V1 over the radix tree). The step's transaction saves
   what the step can touch, never the waiting queue, so the step time must stay within 20%;
   printed with the share of a step spent beginning the transaction (the scheduler's and the
   block manager's snapshots); then the transaction (begin + commit) by GPU pool size, and by
   CPU offload tier size (1k, 16k, 256k blocks, the tier full: ``--tier`` for that table alone).

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
from course_lib.engine.cpu_offload import CPUOffloadConnector  # noqa: E402
from course_lib.engine.kv_connector import KVConnectorBase_V1  # noqa: E402
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


def table_waiting_queue(model, sizes: list[int], steps: int) -> None:
    import statistics
    import time

    print(f"\n3. one step of 8 decoding sequences beside a waiting queue (median of {steps} "
          "steps, CPU time)")
    print(f"{'design':>10} {'waiting':>8} {'step ms':>8} {'vs 0':>6} {'transaction':>12}")
    for design, prefix_cache in (("v0", "hash"), ("v1", "hash"), ("v1", "radix")):
        label, base = design if prefix_cache == "hash" else "v1 radix", None
        for waiting in sizes:
            sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256)
            cc = CacheConfig(16, 512, enable_prefix_caching=True, prefix_cache=prefix_cache)
            eng = LLMEngine(model, sc, cc, stop_token_ids=(), design=design)
            long = SamplingParams(max_tokens=200, temperature=0.0)
            for i in range(8):
                eng.add_request([65 + i, 66, 67], long)
            eng.step()                                   # the batch prefilled, now decoding
            for i in range(waiting):
                eng.add_request([70 + i % 20, 71, 72], long)
            times, begins = [], []
            for _ in range(steps):
                t0 = time.process_time()
                txn = eng._begin()                       # what a step's transaction costs
                begins.append(time.process_time() - t0)
                eng._rollback(txn)
                t0 = time.process_time()
                eng.step()
                times.append(time.process_time() - t0)
            ms, begin = 1e3 * statistics.median(times), 1e3 * statistics.median(begins)
            base = base or ms
            print(f"{label:>10} {waiting:>8,} {ms:>8.2f} {ms / base:>5.2f}x "
                  f"{100 * begin / ms:>10.1f} %")
    print("   target: within 1.2x of the step with nothing waiting")
    print(f"\n   the transaction by pool size (begin + commit, median of {steps}; each design "
          "saves only what a step changes: V0's pool items and cache entries, V1's blocks, "
          "the radix tree's nodes)")
    print(f"{'design':>10} {'blocks':>8} {'ms':>8}")
    for design, prefix_cache in (("v0", "hash"), ("v1", "hash"), ("v1", "radix")):
        label = design if prefix_cache == "hash" else "v1 radix"
        for blocks in (512, 16384):
            sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256)
            cc = CacheConfig(16, blocks, enable_prefix_caching=True, prefix_cache=prefix_cache)
            eng = LLMEngine(model, sc, cc, stop_token_ids=(), design=design)
            for i in range(8):
                eng.add_request([65 + i, 66, 67], SamplingParams(max_tokens=200, temperature=0.0))
            eng.step()
            costs = []
            for _ in range(steps):
                t0 = time.process_time()
                eng._begin().commit()
                costs.append(time.process_time() - t0)
            print(f"{label:>10} {blocks:>8,} {1e3 * statistics.median(costs):>8.3f}")
    table_transaction_by_tier(model, [1024, 16384, 262144], steps)


class _BookkeepingOnlyTier(CPUOffloadConnector):
    """The CPU tier without its tensors (a 256k-block tier of the tiny model's 32 KiB blocks
    would take 8 GiB): enough for a transaction, which saves bookkeeping only; no step runs."""

    def register_kv_caches(self, kv_caches) -> None:
        KVConnectorBase_V1.register_kv_caches(self, kv_caches)


def table_transaction_by_tier(model, sizes: list[int], steps: int) -> None:
    """The transaction (begin + commit) of V1 with a full CPU offload tier of each size: the
    tier's pool saves what a step changes in it (``CPUBlockPool.attach``), so the cost must not
    grow with the tier."""
    import statistics
    import time

    print(f"\n   the transaction by CPU tier size (V1 + CPUOffloadConnector, the tier full; "
          f"begin + commit, median of {steps})")
    print(f"{'tier blocks':>12} {'ms':>8}")
    for blocks in sizes:
        sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256)
        conn = _BookkeepingOnlyTier(blocks)
        eng = LLMEngine(model, sc, CacheConfig(16, 512, enable_prefix_caching=True),
                        stop_token_ids=(), design="v1", kv_connector=conn)
        for i in range(blocks):                         # fill the tier
            conn.cpu_pool.allocate(i.to_bytes(8, "little"), set())
        for i in range(8):
            eng.add_request([65 + i, 66, 67], SamplingParams(max_tokens=200, temperature=0.0))
        costs = []
        for _ in range(steps):
            t0 = time.process_time()
            eng._begin().commit()
            costs.append(time.process_time() - t0)
        print(f"{blocks:>12,} {1e3 * statistics.median(costs):>8.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    ap.add_argument("--tier", action="store_true",
                    help="only the transaction by CPU tier size (section 3's last table)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {machine()}; one thread, wall-clock time")
    if not torch.cuda.is_available():
        print("no GPU here: CPU figures (the engine's batched torch attention path)")
    model = load_tiny_model()
    if args.tier:
        table_transaction_by_tier(model, [1024, 16384, 262144], 5 if args.quick else 20)
    elif args.quick:
        table_throughput(model, 24, [64])
        table_sharing(model, 6, [2])
        table_waiting_queue(model, [0, 1000], 5)
    else:
        table_throughput(model, 200, [64, 128])
        table_sharing(model, 60, [2, 4, 6])
        table_waiting_queue(model, [0, 1000, 8000, 16000], 20)


if __name__ == "__main__":
    main()
