"""Prefill/decode disaggregation against colocated serving: the tuning row answered with figures.

Sections (each a function; printed, never asserted):

1. **Replay** (``course_lib.sim.disagg_replay``, model-free: the real V1 scheduler and block
   manager on every GPU, chapter 07's cost model for Llama-2-7B, each GPU's pool from
   ``course_lib.capacity.plan_kv_cache`` on 80 GB): colocated on 4 GPUs against 1P3D, 2P2D
   and 3P1D on the same 4, for a prefill-heavy workload (long prompts, short answers, bursty:
   the tuning row's "high TTFT") and a decode-heavy one (short prompts, long answers). TTFT
   and ITL (mean, p99), throughput, the share of requests meeting the SLO and goodput (vLLM's
   ``request_goodput``), the decode engines' KV usage; then DistServe's goodput: the highest
   request rate, per GPU, at which 90% of the requests meet the SLO.
2. **Capacity**: one decode node's pool (Llama-2-7B and Llama-3-8B on an 80 GB GPU): how many
   decodes it holds with paging against a max_model_len reservation each, on each workload's
   lengths, beside the "PagedAttention explained" article's utilization figures; then the
   decode-heavy replay with the decode nodes limited to what static reservation holds.

3. **Real processes** (``course_lib.parallel.disagg``: engines of the tiny model on their own
   processes, ``device="auto"``: on CUDA where there is a GPU; K/V on a ``torch.distributed``
   group per (prefill, decode) pair: gloo, or NCCL with a GPU per engine): one colocated engine
   (on the device of the first engine) against 1P1D and 2P1D on the same prompts: the engines'
   devices and the data path, tokens identical or not, blocks moved, the hand-over (read
   request to blocks loaded) and end-to-end TTFT. On a CPU machine's few cores the processes
   compete for them: the figures show what the mechanism costs, not a GPU's speed.

    python bench/disagg.py            # full run (a few minutes on 2 shared cores)
    python bench/disagg.py --quick    # small sizes, for a smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_lib.claims.sources_claim import cite  # noqa: E402
from course_lib.config import CacheConfig, SchedulerConfig  # noqa: E402
from course_lib.sim.disagg_replay import (  # noqa: E402
    SLO,
    STUDY_DEPLOYMENTS,
    STUDY_GPUS,
    STUDY_MODEL,
    STUDY_SCHEDULER,
    STUDY_SLO,
    DeploymentResult,
    KVLink,
    decode_node_capacity,
    max_goodput_rate,
    run_deployment,
    study_cache_config,
    study_workloads,
)

NUM_GPUS, MODEL, SLO_DEFAULT = STUDY_GPUS, STUDY_MODEL, STUDY_SLO
SCHED, DEPLOYMENTS = STUDY_SCHEDULER, STUDY_DEPLOYMENTS
cache_config = study_cache_config


def run(trace, x: int, y: int, decode_sc: SchedulerConfig | None = None) -> DeploymentResult:
    return run_deployment(trace, x, y, decode_sc)


def workloads(quick: bool) -> dict[str, tuple[Callable[[float], list], float]]:
    """name -> (trace of a rate, the rate of the table)."""
    return study_workloads(*((40, 150) if quick else (200, 400)))


def print_row(r: DeploymentResult, slo: SLO) -> None:
    print(f"  {r.name:>13} {r.ttft_mean:>9.3f} {r.ttft_p99:>9.3f} {r.itl_mean * 1e3:>9.1f} "
          f"{r.itl_p99 * 1e3:>9.1f} {r.throughput_tokens_s:>9.0f} "
          f"{r.slo_attainment(slo):>8.1%} {r.goodput(slo):>9.2f} "
          f"{r.decode_kv_usage_mean:>8.1%} {r.decode_kv_usage_max:>8.1%}")


def section_replay(quick: bool) -> None:
    slo = SLO_DEFAULT
    link = KVLink()
    print(f"== replay: colocated x{NUM_GPUS} vs xPyD on {NUM_GPUS} GPUs ({MODEL} costs, "
          f"{cache_config().num_gpu_blocks} blocks of 16 per GPU, max_num_batched_tokens "
          f"{SCHED.max_num_batched_tokens}; link {link.bytes_per_s / 1e9:.0f} GB/s + "
          f"{link.latency_s * 1e3:.0f} ms a transfer)")
    print(f"SLO: TTFT <= {slo.ttft_s} s ({cite('000', '§13.2')}'s healthy TTFT p99) and TPOT "
          f"<= {slo.tpot_s * 1e3:.0f} ms; goodput = requests meeting it / run time")
    for name, (make, rate) in workloads(quick).items():
        print(f"\n{name}, {rate} req/s:")
        print(f"  {'deployment':>13} {'TTFT mean':>9} {'TTFT p99':>9} {'ITL mean':>9} "
              f"{'ITL p99':>9} {'tok/s':>9} {'in SLO':>8} {'goodput':>9} {'KV mean':>8} "
              f"{'KV max':>8}")
        print(f"  {'':>13} {'s':>9} {'s':>9} {'ms':>9} {'ms':>9} {'':>9} {'':>8} "
              f"{'req/s':>9} {'decode':>8} {'decode':>8}")
        trace = make(rate)
        t0 = time.perf_counter()
        for x, y in DEPLOYMENTS:
            print_row(run(trace, x, y), slo)
        print(f"  ({time.perf_counter() - t0:.1f} s of CPU for the four replays)")
    # The sweep needs traces long enough to reach a steady state: with the table's 400
    # decode-heavy requests, every rate up to 50 req/s ends before the decode batches fill the
    # pools, and colocated and 1P3D both "pass" everything. 1,000 requests (and 400 prefill-heavy
    # ones) separate them.
    sweep_sizes = (40, 80) if quick else (400, 1000)
    print(f"\nDistServe's goodput: the highest rate (req/s) at which >= 90% of the requests "
          f"meet the SLO, and per GPU ('>=': the highest rate tried passed); traces of "
          f"{sweep_sizes[0]} prefill-heavy and {sweep_sizes[1]} decode-heavy requests")
    sweeps = {0: (2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0),
              1: (10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0)}
    if quick:
        sweeps = {0: (3.0, 5.0, 7.0), 1: (20.0, 40.0)}
    for k, (name, (make, _)) in enumerate(study_workloads(*sweep_sizes).items()):
        rates = sweeps[k]
        cells = []
        best_pd = ((3, 1), (1, 3))[k]          # quick: colocated and the P/D split that fits
        for x, y in DEPLOYMENTS if not quick else (DEPLOYMENTS[0], best_pd):
            best, per_gpu = max_goodput_rate(make, lambda tr, x=x, y=y: run(tr, x, y),
                                             rates, slo)
            label = f"colocated x{y}" if x == 0 else f"{x}P{y}D"
            mark = ">=" if best == max(rates) else ""
            cells.append(f"{label} {mark}{best:g} ({per_gpu:.2f}/GPU)")
        print(f"  {name.split(' (')[0]:>14}: " + ", ".join(cells))


def section_capacity(quick: bool) -> None:
    print("\n== capacity: one decode node, paged vs a max_model_len reservation per request")
    print(f"{cite('003', 'summary')}: utilization '20%-40%' -> '95%+', and 'for teams running "
          "P/D disaggregation, the decode node's memory efficiency matters most'")
    print(f"  {'model':>10} {'workload':>14} {'blocks':>7} {'max len':>7} {'mean tok':>8} "
          f"{'static':>7} {'paged':>7} {'x':>6} {'static util':>11} {'paged util':>10}")
    traces = {name.split(" (")[0]: make(rate) for name, (make, rate) in workloads(quick).items()}
    rows = {}
    for model in ("Llama-2-7B", "Llama-3-8B"):
        for wname, trace in traces.items():
            c = decode_node_capacity(model, trace, gpu_memory_gib=80.0, max_model_len=4096)
            rows[(model, wname)] = c
            print(f"  {model:>10} {wname:>14} {c.num_gpu_blocks:>7} {c.max_model_len:>7} "
                  f"{c.mean_tokens:>8.0f} {c.static_concurrency:>7} {c.paged_concurrency:>7} "
                  f"{c.ratio:>6.1f} {c.static_utilization:>11.1%} {c.paged_utilization:>10.1%}")
    print("  (static: pool // blocks of max_model_len; paged: pool // mean blocks of prompt + "
          "output, each request at its largest)")
    wname = "decode-heavy"
    make, rate = workloads(quick)[next(k for k in workloads(quick) if k.startswith(wname))]
    cap = rows[(MODEL, wname)].static_concurrency
    print(f"\n{wname} at {rate} req/s, 1P3D, the decode nodes paged vs holding only what "
          f"static reservation fits ({cap} decodes each: max_num_seqs={cap}):")
    slo = SLO_DEFAULT
    trace = make(rate)
    print_row(run(trace, 1, 3), slo)
    capped = run(trace, 1, 3, SchedulerConfig(max_model_len=4096, max_num_batched_tokens=2048,
                                              max_num_seqs=cap))
    capped.name = "1P3D static"
    print_row(capped, slo)


def _ttft_e2e(cluster, out) -> float:
    """Proxy's first send to the decode engine's first token: the hand-over included."""
    hops = cluster.timeline(out.request_id)
    start = hops[0].t
    sent = [h.t for h in hops if h.where == "proxy" and h.what.startswith("sent to decode")]
    return (sent[-1] - start if sent else 0.0) + (out.ttft or 0.0)


def section_processes(quick: bool) -> None:
    import random
    import statistics

    import torch

    from course_lib.engine.llm_engine import LLMEngine
    from course_lib.model.loader import load_tiny_model
    from course_lib.parallel.disagg import DisaggCluster, resolve_device
    from course_lib.sequence import SamplingParams

    torch.set_num_threads(1)
    rng = random.Random(0)
    n = 6 if quick else 16
    prompts = [[1] + [rng.randrange(3, 200) for _ in range(rng.randrange(40, 160))]
               for _ in range(n)]
    params = [SamplingParams(max_tokens=16, temperature=0.0),
              SamplingParams(max_tokens=16, temperature=0.8, seed=11)] * (n // 2)
    cache = CacheConfig(block_size=16, num_gpu_blocks=256, enable_prefix_caching=True)
    device = resolve_device("auto")
    first = "cuda:0" if device == "cuda" else "cpu"      # where rank 0 runs
    print(f"\n== real processes: the tiny model, {n} prompts of 41-160 tokens, 16 tokens each "
          f"(half greedy, half seeded), engines on {device}")
    engine = LLMEngine(load_tiny_model(device=first), None, cache, attn_impl="torch",
                       design="v1")
    t = time.perf_counter()
    ref = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    want = [o.outputs[0].token_ids for o in ref]
    print(f"  {'deployment':<12} {'same tokens':>11} {'blocks moved':>12} "
          f"{'hand-over ms (mean / max)':>26} {'TTFT s (mean)':>14} {'run s':>6}")
    print(f"  {'colocated':<12} {'-':>11} {'-':>12} {'-':>26} "
          f"{statistics.mean(o.ttft for o in ref):>14.3f} {wall:>6.2f}")
    paths = []
    for x, y in ((1, 1), (2, 1)):
        with DisaggCluster(x, y, cache_config=cache, attn_impl="torch",
                           device=device) as cluster:
            t = time.perf_counter()
            outs = cluster.generate(prompts, params)
            wall = time.perf_counter() - t
            stats = cluster.settle()
            moved = sum(s["num_recv_blocks"] for s in stats.values())
            hand = []
            for o in outs:
                hops = cluster.timeline(o.request_id)
                ask = [h.t for h in hops if h.what == "read request"]
                got = [h.t for h in hops if h.what == "loaded"]
                if ask and got:
                    hand.append((got[-1] - ask[-1]) * 1e3)
            same = [o.outputs[0].token_ids for o in outs] == want
            ttft = statistics.mean(_ttft_e2e(cluster, o) for o in outs)
            print(f"  {f'{x}P{y}D':<12} {'yes' if same else 'NO':>11} {moved:>12} "
                  f"{statistics.mean(hand):>12.1f} / {max(hand):<11.1f} {ttft:>14.3f} "
                  f"{wall:>6.2f}")
            devices = ", ".join(f"rank {r} {s['device']}" for r, s in sorted(stats.items()))
            paths.append(f"  {x}P{y}D: {devices}; data: {cluster.data_path()}")
    print("\n".join(paths))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    ap.add_argument("--sections", default="replay,capacity,processes",
                    help="which sections, comma-separated (default: all)")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    if sections & {"replay", "capacity"}:
        print("model-free: figures of the cost model (course_lib.sim.replay.CostModel), no GPU")
    if "replay" in sections:
        section_replay(args.quick)
    if "capacity" in sections:
        section_capacity(args.quick)
    if "processes" in sections:
        section_processes(args.quick)


if __name__ == "__main__":
    main()
