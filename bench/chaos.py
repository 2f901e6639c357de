"""Chaos: the engine under faults and bad input in each design (V0 recompute, V0 swap, V1
with its hash prefix cache, V1 with SGLang's radix tree, V1 with the CPU offload tier, the P/D
connector's prefill and decode engines in one process), beside clean runs of the same work
(printed, never asserted).

A failed step is recovered by recompute (``course_lib/engine/recovery.py``): the request to
blame, if any, fails alone; every other request goes back to what it had when the step began
and is computed again, the KV bookkeeping rebuilt empty. The faults come from
``bench/fault_sites.py``: every method a step runs through is a fault site (the managers,
pools, prefix caches and radix tree, both schedulers, the output processing, the engine's
step, the recovery, the runner and its kernels, the sampler, the metrics, the requests, the
KV connectors), found by walking the modules, never listed by hand; a fault is one-shot, the
k-th call of a site during a step raising once. Per design:

* **the site sweep**: one fault per run at each site the design's steps reach, beside the
  clean run of ``fault_sites.workload`` (shared prefixes, n > 1, beams on V0, preemption):
  every request not blamed must give the clean run's tokens (logprobs within 1e-4), every
  recovery must leave the requests as they were when the step began and the KV bookkeeping
  empty, with nothing of the old scheduler kept; invariants after every step; no leak, no
  wedged run. Default: each site's first and middle call; ``--quick``: one site of each kind
  per design, its first call; ``--exhaustive``: several calls of every site.
* **second faults**: a first fault (a forward that fails once; a request whose sampling
  always fails), then one more fault at each site that handling it calls (the blame, the
  recovery, the new scheduler and manager being built, the connector's reset, the metrics),
  at its first call after the first fault (``--quick``: one per first fault).
* **the soak**: random requests (greedy, seeded n > 1, beams on V0; one sample each on the P/D
  pair) arriving a few per step through a pool with prefix caching (and swap space on V0
  swap), with one-shot faults at random (site, call) pairs, "poisoned" requests whose sampling
  always fails (each must end alone as an error) and bad input between the steps (NaN
  temperature, a float token id, a string seed, a token past the vocabulary, an empty prompt,
  a duplicate request id: each refused with a ``ValueError``, queueing nothing).

Printed per design: the sites (enumerated, reached by its steps, reached only while a
failure is handled), faults fired per site kind, recoveries (``StepFailed`` raised, requests
blamed), requests compared with the clean run, mismatches, the runs broken by each check,
tokens recomputed (``course:recomputed_tokens_total``, beside the harness's own count), time
to recover (median / max ms), then every failing (site, call).

    python bench/chaos.py               # first and middle calls, every second fault, soaks
                                        # of 300 requests
    python bench/chaos.py --quick       # a sample, soaks of 12 requests (about 30 s)
    python bench/chaos.py --exhaustive  # several calls of every site (long)
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fault_sites as fs  # noqa: E402  (bench/, beside this script)
import torch  # noqa: E402

from course_lib.device import describe  # noqa: E402
from course_lib.model.loader import load_tiny_model  # noqa: E402
from course_lib.sequence import SamplingParams  # noqa: E402

BAD_INPUTS = [
    ("NaN temperature", lambda e: e.add_request("x", SamplingParams(temperature=math.nan))),
    ("float token id", lambda e: e.add_request([65, 65.9])),
    ("string seed", lambda e: e.add_request("x", SamplingParams(seed="abc"))),
    ("token past the vocabulary", lambda e: e.add_request([1, 10_000])),
    ("empty prompt", lambda e: e.add_request([])),
    ("duplicate request id", lambda e: e.add_request("x", request_id=next(iter(e._requests)))),
]
SOAK_ENGINE = dict(num_gpu_blocks=48, budget=128, max_num_seqs=32, num_cpu_blocks=96)
# the runs broken by each check, in this order
CHECKS = (fs.WRONG_TOKENS, fs.WRONG_LOGPROBS, fs.WRONG_OUTPUT, fs.LOST, fs.DUPLICATE,
          fs.NOT_RESTORED, fs.NOT_QUEUED, fs.NOT_EMPTY, fs.KEPT_STATE, fs.INVARIANT,
          fs.LEAKED, fs.MAPS, fs.WEDGED, fs.RAISED, fs.COUNTERS, fs.BLAME, fs.NOT_FIRED)


def make_workload(num_requests: int, seed: int, design: str) -> list[fs.Arrival]:
    """Random prompts (bytes, some behind a shared 8- or 24-token system prompt), greedy,
    seeded n = 2-3 or beams of 2-3 (V1: seeded n = 2 instead; the P/D pair: one sample),
    about 1.5 arriving per step; the same draws for every design."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 256) for _ in range(24)]       # a system prompt some reuse
    v0, pair = fs.DESIGNS[design]["design"] == "v0", fs.is_pair(design)
    work, step = [], 0
    for i in range(num_requests):
        own = [rng.randrange(1, 256) for _ in range(rng.randint(3, 30))]
        prompt = shared[:rng.choice([0, 8, 24])] + own
        kind, tokens, width = rng.random(), rng.randint(4, 20), rng.randint(2, 3)
        if kind < 0.5:
            params = SamplingParams(max_tokens=tokens, temperature=0.0)
        elif kind < 0.8:
            params = SamplingParams(max_tokens=tokens, n=1 if pair else width,
                                    temperature=0.8, seed=i)
        elif v0:
            params = SamplingParams(max_tokens=min(tokens, 12), beam_width=width)
        else:                                   # the V1 core runs no beams
            params = SamplingParams(max_tokens=min(tokens, 12), n=1 if pair else 2,
                                    temperature=0.8, seed=i)
        work.append(fs.Arrival(step, prompt, params))
        step += rng.choice((0, 0, 1, 1, 2))
    return work


def soak(model, design: str, num_requests: int, seed: int, sites: list[fs.Site]) -> dict:
    """The clean run of the random workload (every site's calls counted), then the faulty
    one: one-shot faults at random reached sites, one armed at a time (at a random later call
    of its site, within about two steps' worth of calls, once the last one has fired),
    poisoned requests, bad input every 7th step; compared with :func:`fault_sites.compare`."""
    work = make_workload(num_requests, seed, design)
    t0 = time.perf_counter()
    clean = fs.run(model, design, work, injector=fs.Injector(sites),
                   max_steps=40 * num_requests + 200, engine_kwargs=SOAK_ENGINE)
    rng = random.Random(seed + 1)
    reached = [s for s in sites if clean.calls[s.key]]
    queue = [rng.choice(reached) for _ in range(max(8, clean.steps // 4))]
    poisoned = set(rng.sample(range(num_requests), max(1, num_requests // 30)))
    injector = fs.Injector(sites)

    def arm_next():
        if queue and not injector.plan:
            site = queue.pop()
            per_step = max(1, clean.calls[site.key] // clean.steps)
            injector.plan.add((site.key, injector.calls[site.key]
                               + rng.randint(1, 2 * per_step)))

    def poison(entry, logits, *args):
        if entry.request.request_id in poisoned:
            raise FloatingPointError("poisoned request")

    refused, accepted = Counter(), []

    def between(engine, attempt):
        arm_next()
        if attempt % 7 or not engine._requests:
            return
        name, bad = BAD_INPUTS[(attempt // 7) % len(BAD_INPUTS)]
        before = (len(engine._requests), engine.has_unfinished_requests())
        try:
            bad(engine)
            accepted.append(name)
        except ValueError:
            if (len(engine._requests), engine.has_unfinished_requests()) != before:
                accepted.append(f"{name} (queued something)")
            refused[name] += 1

    injector.hooks["sampler.sample"] = poison
    faulty = fs.run(model, design, work, injector=injector, between=between,
                    max_steps=3 * clean.steps + 200, engine_kwargs=SOAK_ENGINE)
    fs.compare(clean, faulty, expected_blamed=poisoned)
    if accepted:
        faulty.problems.append(("bad input accepted", ", ".join(accepted)))
    return {"clean": clean, "faulty": faulty, "poisoned": poisoned, "refused": refused,
            "seconds": time.perf_counter() - t0}


def by_kind(labels, kinds: dict[str, str]) -> str:
    count = Counter(kinds[label] for label in labels)
    return ", ".join(f"{k} {count[k]}" for k in fs.KINDS if count[k])


def broken(runs) -> str:
    """Runs broken by each check (only those that broke some)."""
    count = Counter(c for r in runs for c in {c for c, _ in r.problems})
    return ", ".join(f"{c} {count[c]}" for c in (*CHECKS, *sorted(set(count) - set(CHECKS)))
                     if count[c]) or "none"


def print_runs(title: str, runs: list[fs.FaultRun], clean: fs.RunResult, kinds: dict) -> None:
    fig = fs.recovery_figures(runs)
    fired = [f[0] for r in runs for f in r.result.fired]
    compared = sum(len(clean.outputs) - len(r.result.blamed) for r in runs)
    mismatches = sum(1 for r in runs for c, _ in r.problems if c in fs.MISMATCHES)
    print(f"{title}: {len(runs)} runs; faults fired: {fig['fired']} ({by_kind(fired, kinds)})")
    print(f"  recoveries: {fig['recoveries']} ({fig['step failed']} StepFailed, "
          f"{fig['blamed']} requests blamed); requests compared: {compared}, mismatches: "
          f"{mismatches}; recomputed tokens: {fig['recomputed']} (counted by the harness: "
          f"{fig['counted']}); time to recover: median {fig['median ms']:.2f} ms, max "
          f"{fig['max ms']:.2f} ms")
    print(f"  broken runs: {sum(1 for r in runs if r.problems)} ({broken(runs)})")


def print_soak(got: dict, kinds: dict) -> None:
    clean, faulty = got["clean"], got["faulty"]
    fired = [f[0] for f in faulty.fired]
    reasons = Counter(o.finish_reason for o in faulty.outputs.values())
    hit = set(faulty.blamed)
    ms = sorted(faulty.recovery_ms)
    print(f"soak: {len(clean.outputs)} requests, {len(got['poisoned'])} poisoned, "
          f"{got['seconds']:.1f} s; faults fired: {len(fired)} ({by_kind(fired, kinds)})")
    print(f"  steps: {faulty.steps} ({clean.steps} in the clean run); recoveries: "
          f"{faulty.recoveries} ({faulty.step_failed} StepFailed); recomputed tokens: "
          f"{int(faulty.metric_recomputed)} (counted: {faulty.recomputed_tokens}); time to "
          f"recover: median {ms[len(ms) // 2] if ms else 0:.2f} ms, max "
          f"{ms[-1] if ms else 0:.2f} ms; bad inputs refused: {sum(got['refused'].values())}")
    print(f"  requests finished: {len(faulty.outputs)} of {len(clean.outputs)} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(reasons.items(), key=str))}); "
          f"poisoned ended as errors: {len(got['poisoned'] & hit)} of {len(got['poisoned'])}; "
          f"requests compared: {len(faulty.outputs) - len(hit)}, mismatches: "
          f"{sum(1 for c, _ in faulty.problems if c in fs.MISMATCHES)}; broken: "
          f"{broken([faulty]) if faulty.problems else 'no'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a site of each kind, a second fault per first, soaks of 12 requests")
    parser.add_argument("--exhaustive", action="store_true",
                        help="several calls of every site")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--design", action="append", choices=list(fs.DESIGNS),
                        help="one design (repeatable; default: all six)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = 12 if args.quick else 300
    model = load_tiny_model()
    sites = fs.enumerate_sites()
    kinds = {s.key: s.kind for s in sites}
    print(f"machine: {describe()}; one thread")
    print(f"{len(sites)} fault sites ({by_kind([s.key for s in sites], kinds)}); soak: {n} "
          f"random requests per design, pools of 48 blocks of 4 (+ 96 CPU blocks to swap to), "
          f"prefix caching")
    t0, failing, totals = time.perf_counter(), [], Counter()
    for design in args.design or fs.DESIGNS:
        t1 = time.perf_counter()
        print(f"== {design} ==")
        clean, calls = fs.reach(model, design, sites)
        picked = {s.key for s in fs.sample_sites(sites, calls, 1, design)}

        def ks(site, count, design, picked=picked):
            if args.quick:
                return [1] if site.key in picked else []
            return fs.pick_ks(count, args.exhaustive)

        def pick_second(path, design):        # --quick: one, from the middle of the path
            return {k: path[k] for k in sorted(path)[len(path) // 2:][:1]} \
                if args.quick else path
        label = "one site of each kind, first call" if args.quick else \
            "several calls" if args.exhaustive else "first and middle call"
        rep = fs.sweep(model, [design], sites=sites, ks=ks, pick_second=pick_second)[design]
        on_path = {s for p in rep["paths"].values() for s in p}
        reached = sum(1 for s in sites if calls[s.key])
        print(f"sites: {len(sites)} enumerated; {reached} reached by its steps, "
              f"{len(on_path - {s.key for s in sites if calls[s.key]})} more only while a "
              f"failure is handled, {len(rep['not reached'])} never")
        print_runs(f"site sweep ({label})", rep["runs"], clean, kinds)
        print_runs("second faults (" + ", ".join(f"after a {first} fault: {len(p)} sites on "
                                                 f"its path" for first, p in
                                                 rep["paths"].items()) + ")",
                   rep["second"], clean, kinds)
        got = soak(model, design, n, args.seed, sites)
        print_soak(got, kinds)
        failing += [fs.describe_failure(r) for r in fs.failures({design: rep})]
        failing += [f"{design}: soak: {c} ({d})" for c, d in got["faulty"].problems]
        totals["runs"] += len(rep["runs"]) + len(rep["second"]) + 1
        totals["broken"] += sum(1 for r in (*rep["runs"], *rep["second"]) if r.problems) \
            + bool(got["faulty"].problems)
        print(f"wall time: {time.perf_counter() - t1:.1f} s")
    print(f"failing: {len(failing)}" + "".join(f"\n  {f}" for f in failing))
    print(f"all designs: {totals['runs']} runs, {totals['broken']} broken; wall time "
          f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
