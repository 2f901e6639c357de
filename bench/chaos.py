"""Chaos soak: the engine under faults and bad input in each design (V0 recompute, V0 swap,
V1 with its hash prefix cache, V1 with SGLang's radix tree), beside clean runs of the same
work (printed, never asserted).

The faults come from ``bench/fault_sites.py``: every method a step runs through is a fault
site (the managers, pools, prefix caches and radix tree, both schedulers, the output
processing, the engine's step, the runner and its kernels, the sampler, the metrics, the
requests), found by walking the classes, never listed by hand; a fault is one-shot, the k-th
call of a site during a step raising once. Per design:

* **the site sweep**: one fault per run at each site the design's steps reach, beside the
  clean run of ``fault_sites.workload`` (shared prefixes, n > 1, beams on V0, preemption):
  the failed step must be undone (``StepFailed``, retried) or blame one request alone, and
  the others must produce the clean run's tokens and logprobs. ``--quick``: each site's first
  call; by default also its middle call; ``--exhaustive``: several calls of each site, every
  run to its end, and each site a failed step's handling calls (rollback, diagnosis, blame)
  faulted after a first fault (second faults: printed apart, a double fault is not promised
  to be undone). In every mode also: one request whose sampling always fails, and one fault
  at each site that finishing it alone calls (its blocks, the engine's maps, its output).
* **the soak**: random requests (greedy, seeded n > 1, beams on V0) arriving a few per step
  through a pool with prefix caching (and swap space on V0 swap), with one-shot faults at
  random (site, call) pairs, "poisoned" requests whose sampling always fails (each must end
  alone as an error) and bad input between the steps (NaN temperature, a float token id, a
  string seed, a token past the vocabulary, an empty prompt, a duplicate request id: each
  refused with a ``ValueError``, queueing nothing).

Printed per design: the sites reached, faults injected per site kind, steps rolled back,
requests compared with the clean run, mismatches, invariant breaks, leaked blocks and wedged
runs (all four must be 0), other breaks of the all-or-nothing step (a failed step that
changed something, an exception other than ``StepFailed``, counters or metrics that differ
at the end), then every failing (site, call).

A separate section then throws a bounded burst at ``/metrics`` (``serve_metrics`` on
127.0.0.1, the metrics of a model-free replay): 2,000 scrapes from 32 threads of another
process (as a Prometheus server scrapes: not sharing the server's interpreter lock) while a slow
client trickles header bytes, printing p50/p99 latency (target: p99 under 100 ms) and whether
the slow client blocked the others (:func:`metrics_section`); then 500 scrapes while a
model-free replay steps in the served process (:func:`metrics_while_stepping_section`).

    python bench/chaos.py               # first and middle calls, soaks of 300 requests
    python bench/chaos.py --quick       # first calls, soaks of 24 requests (under a minute)
    python bench/chaos.py --exhaustive  # several calls of every site, to the end (long)
    python bench/chaos.py --metrics-only  # only the /metrics bursts (about half a minute)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import math
import multiprocessing
import random
import socket
import sys
import threading
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
MISMATCH = (fs.WRONG_TOKENS, fs.WRONG_LOGPROBS, fs.OUTPUT_DIFFERS, fs.LOST, fs.DUPLICATE)
COUNTED = (*MISMATCH, fs.INVARIANT, fs.LEAKED, fs.WEDGED)


def make_workload(num_requests: int, seed: int, design: str) -> list[fs.Arrival]:
    """Random prompts (bytes, some behind a shared 8- or 24-token system prompt), greedy,
    seeded n = 2-3 or beams of 2-3 (V1: seeded n = 2 instead), about 1.5 arriving per step;
    the same draws for every design."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 256) for _ in range(24)]       # a system prompt some reuse
    work, step = [], 0
    for i in range(num_requests):
        own = [rng.randrange(1, 256) for _ in range(rng.randint(3, 30))]
        prompt = shared[:rng.choice([0, 8, 24])] + own
        kind, tokens, width = rng.random(), rng.randint(4, 20), rng.randint(2, 3)
        if kind < 0.5:
            params = SamplingParams(max_tokens=tokens, temperature=0.0)
        elif kind < 0.8:
            params = SamplingParams(max_tokens=tokens, n=width, temperature=0.8, seed=i)
        elif fs.DESIGNS[design]["design"] == "v0":
            params = SamplingParams(max_tokens=min(tokens, 12), beam_width=width)
        else:                                   # the V1 core runs no beams
            params = SamplingParams(max_tokens=min(tokens, 12), n=2, temperature=0.8, seed=i)
        work.append(fs.Arrival(step, prompt, params))
        step += rng.choice((0, 0, 1, 1, 2))
    return work


def soak(model, design: str, num_requests: int, seed: int, sites: list[fs.Site]) -> dict:
    """The clean run of the random workload (every site's calls counted), then the faulty
    one: one-shot faults at random reached sites, one armed at a time (at a random later
    call of its site, within about two steps' worth of calls, once the last one has fired:
    no double fault), poisoned requests, bad input every 7th step; compared with
    :func:`fault_sites.compare`."""
    work = make_workload(num_requests, seed, design)
    t0 = time.perf_counter()
    clean = fs.run(model, design, work, injector=fs.Injector(sites), check_steps=False,
                   max_steps=20 * num_requests + 100, engine_kwargs=SOAK_ENGINE)
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

    def poison(entry, logits, base_seed):
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
                    max_steps=2 * clean.steps + 100, engine_kwargs=SOAK_ENGINE)
    fs.compare(clean, faulty, expected_blamed=poisoned)
    if accepted:
        faulty.problems.append(("bad input accepted", ", ".join(accepted)))
    return {"clean": clean, "faulty": faulty, "poisoned": poisoned, "refused": refused,
            "seconds": time.perf_counter() - t0}


def by_kind(labels, kinds: dict[str, str]) -> str:
    count = Counter(kinds[label] for label in labels)
    return ", ".join(f"{k} {count[k]}" for k in fs.KINDS)


def breaks(runs: list[fs.FaultRun | fs.RunResult]) -> tuple[Counter, Counter]:
    """(runs with each counted kind of break, runs with each other kind)."""
    counted, other = Counter(), Counter()
    for r in runs:
        for cat in {c for c, _ in r.problems}:
            (counted if cat in COUNTED else other)[cat] += 1
    return counted, other


def print_sweep(design: str, rep: dict, sites: list[fs.Site], kinds: dict, label: str) -> None:
    runs, calls, path = rep["runs"], rep["calls"], rep["failure path"]
    reached = sum(1 for s in sites if calls[s.key])
    only = sum(1 for s in path if not calls[s])
    print(f"sites: {len(sites)} enumerated; {reached} reached by its steps, {only} more "
          f"only by a failed one ({len(path)} called when a step fails), "
          f"{len(rep['not reached'])} never")
    fired = [f[0] for r in runs for f in r.result.fired]
    compared = sum(len(rep["clean"].outputs) - len(r.result.blamed) for r in runs)
    counted, other = breaks(runs)
    print(f"site sweep ({label}): {len(runs)} runs, {rep['seconds']:.1f} s; faults injected: "
          f"{len(fired)} ({by_kind(fired, kinds)})")
    print(f"  steps rolled back: {sum(r.result.rolled_back for r in runs)}, requests blamed: "
          f"{sum(len(r.result.blamed) for r in runs)}, requests compared: {compared}, "
          f"mismatches: {sum(counted[c] for c in MISMATCH)}, invariant breaks: "
          f"{counted[fs.INVARIANT]}, leaked blocks: {counted[fs.LEAKED]}, "
          f"wedged runs: {counted[fs.WEDGED]}, other breaks: {sum(1 for r in runs if r.problems)}"
          f" runs ({', '.join(f'{c} {n}' for c, n in sorted(other.items())) or 'none'})")
    if rep["blame"]:
        bad = [r for r in rep["blame"] if r.problems]
        print(f"  faults while a failed request is finished (one poisoned request, then one "
              f"fault at each site finishing it calls): {len(rep['blame'])} runs, {len(bad)} "
              f"broke the step")
    if rep["second order"]:
        bad = [r for r in rep["second order"] if r.problems]
        print(f"  second faults (a site a failed step's handling calls, after a first fault): "
              f"{len(rep['second order'])} runs, {len(bad)} broke the step")


def print_soak(got: dict, kinds: dict) -> None:
    clean, faulty = got["clean"], got["faulty"]
    fired = [f[0] for f in faulty.fired]
    reasons = Counter(o.finish_reason for o in faulty.outputs.values())
    counted, other = breaks([faulty])
    print(f"soak: {len(clean.outputs)} requests, {len(got['poisoned'])} poisoned, "
          f"{got['seconds']:.1f} s; faults injected: {len(fired)} ({by_kind(fired, kinds)})")
    print(f"  steps: {faulty.steps} ({clean.steps} in the clean run), rolled back and "
          f"retried: {faulty.rolled_back}; bad inputs refused: {sum(got['refused'].values())} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(got['refused'].items()))})")
    hit = set(faulty.blamed)
    print(f"  requests finished: {len(faulty.outputs)} of {len(clean.outputs)} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))}); poisoned ended as "
          f"errors: {len(got['poisoned'] & hit)} of {len(got['poisoned'])}; requests "
          f"compared: {len(faulty.outputs) - len(hit)}, mismatches: "
          f"{sum(counted[c] for c in MISMATCH)}, invariant breaks: {counted[fs.INVARIANT]}, "
          f"wedged: {'yes' if counted[fs.WEDGED] else 'no'}")
    leaked = faulty.leaked if faulty.final is not None else "n/a (the run stopped early)"
    print(f"  blocks leaked: {leaked} (clean run: {clean.leaked}); other breaks: "
          f"{', '.join(sorted(other)) or 'none'}")


# ------------------------------------------------------- /metrics under a burst of scrapers
def _trickle(port: int, period_s: float, stop: threading.Event, max_s: float = 12.0) -> float:
    """A slow client: sends a request line, then a header one byte per ``period_s`` until
    ``stop``, ``max_s`` or the server cuts it off; returns how long it held its connection."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            while not stop.wait(period_s) and time.perf_counter() - t0 < max_s:
                sock.sendall(b"a")
        except OSError:                     # cut off at the server's per-connection deadline
            pass
    return time.perf_counter() - t0


def _scrape_ms(port: int, timeout_s: float = 30.0) -> float:
    """One scrape of /metrics, connect to last byte, in ms (raises if not a 200)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200 or b"vllm:num_requests_running" not in body:
            raise RuntimeError(f"scrape answered {resp.status}")
    finally:
        conn.close()
    return 1e3 * (time.perf_counter() - t0)


def scrape_burst(port: int, scrapes: int = 2000, threads: int = 32,
                 slow_period_s: float = 0.05) -> dict:
    """``scrapes`` scrapes of http://127.0.0.1:``port``/metrics from ``threads`` threads (a
    bounded burst), while a slow client trickles header bytes: latencies in ms, and one probe
    scrape timed while only the slow client is connected (did it block the others?)."""
    stop = threading.Event()
    slow = concurrent.futures.ThreadPoolExecutor(1).submit(_trickle, port, slow_period_s, stop)
    time.sleep(0.2)                                      # the slow client is connected
    try:
        probe_ms = _scrape_ms(port, timeout_s=5.0)
    except OSError:                                      # blocked behind the slow client
        probe_ms = math.inf
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(_scrape_ms, port) for _ in range(scrapes)]
    wall_s = time.perf_counter() - t0
    stop.set()
    ms = sorted(f.result() for f in futures if f.exception() is None)
    errors = [f.exception() for f in futures if f.exception() is not None]
    return {"scrapes": scrapes, "threads": threads, "ok": len(ms), "errors": len(errors),
            "first_error": repr(errors[0]) if errors else None, "wall_s": wall_s,
            "p50_ms": ms[len(ms) // 2] if ms else math.nan,
            "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else math.nan,
            "max_ms": ms[-1] if ms else math.nan, "probe_ms": probe_ms,
            "slow_held_s": slow.result(timeout=60)}


def metrics_section(scrapes: int = 2000, threads: int = 32) -> dict:
    """Serve the metrics of a model-free replay (200 ShareGPT-like requests: every histogram
    filled) with ``serve_metrics`` and throw :func:`scrape_burst` at it; prints the figures."""
    from course_lib.scheduler.metrics import serve_metrics
    from course_lib.sim.replay import replay
    from course_lib.sim.traces import sharegpt_like

    metrics = replay(sharegpt_like(200, seed=0), with_metrics=True).metrics
    server, port = serve_metrics(metrics)
    try:
        got = _burst_from_another_process(port, scrapes, threads)
    finally:
        server.shutdown()
        server.server_close()
    verdict = "met" if got["p99_ms"] < 100 and not got["errors"] else "MISSED"
    print(f"/metrics burst: {got['ok']} of {scrapes} scrapes from {threads} threads of another "
          f"process in "
          f"{got['wall_s']:.1f} s: p50 {got['p50_ms']:.1f} ms, p99 {got['p99_ms']:.1f} ms, max "
          f"{got['max_ms']:.1f} ms, errors {got['errors']} (target p99 < 100 ms: {verdict})")
    blocked = "did not block" if got["probe_ms"] < 1000 else "BLOCKED (5 s timeout)"
    print(f"/metrics slow client (a header byte every 50 ms, held its connection "
          f"{got['slow_held_s']:.1f} s) {blocked} the others: a scrape beside it took "
          f"{got['probe_ms']:.1f} ms")
    return got


def _burst_from_another_process(port: int, scrapes: int, threads: int) -> dict:
    """:func:`scrape_burst` run in a process of its own, as a Prometheus server is: its
    threads do not share the served process's interpreter lock."""
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as scrapers:
        return scrapers.submit(scrape_burst, port, scrapes, threads).result()


def metrics_while_stepping_section(scrapes: int = 500, threads: int = 32,
                                   num_requests: int = 1000) -> dict:
    """The same burst (fewer scrapes) while a model-free replay (``num_requests``
    ShareGPT-like requests) steps in the served process, as ``python -m course_lib
    serve-metrics --model-free`` serves it: the steps are pure Python, so the scrapes'
    threads share the interpreter lock with them, and the metrics change every step (the
    body is rendered again). Prints the figures and how many steps ran during the burst."""
    from course_lib.scheduler.metrics import serve_metrics
    from course_lib.sim.replay import replay
    from course_lib.sim.traces import sharegpt_like

    served: list = []
    up, done = threading.Event(), threading.Event()

    def serve(metrics) -> None:
        served.extend([metrics, *serve_metrics(metrics)])
        up.set()

    def run() -> None:
        try:
            replay(sharegpt_like(num_requests, seed=0), on_metrics=serve)
        finally:
            done.set()
            up.set()

    threading.Thread(target=run, name="replay", daemon=True).start()
    up.wait()
    metrics, server, port = served
    try:
        v0 = metrics.version
        got = _burst_from_another_process(port, scrapes, threads)
        changes, overlapped = metrics.version - v0, not done.is_set()
    finally:
        done.wait()
        server.shutdown()
        server.server_close()
    print(f"/metrics burst while a replay steps: {got['ok']} of {scrapes} scrapes from "
          f"{threads} threads of another process in {got['wall_s']:.1f} s: p50 "
          f"{got['p50_ms']:.1f} ms, p99 {got['p99_ms']:.1f} ms, max {got['max_ms']:.1f} ms, "
          f"errors {got['errors']}; {changes} metric changes (3 a step) during the burst"
          f"{'' if overlapped else ' (the replay ended before the burst did)'}")
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="first calls only, soaks of 24 requests")
    parser.add_argument("--exhaustive", action="store_true",
                        help="several calls of every site, each run to its end, second faults")
    parser.add_argument("--metrics-only", action="store_true",
                        help="only the /metrics bursts (idle, then while a replay steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--design", action="append", choices=list(fs.DESIGNS),
                        help="one design (repeatable; default: all four)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.metrics_only:
        metrics_section()
        metrics_while_stepping_section()
        return
    n = 24 if args.quick else 300
    model = load_tiny_model()
    sites = fs.enumerate_sites()
    kinds = {s.key: s.kind for s in sites}
    if args.quick:
        label, ks = "first call", (lambda site, calls, design: [1] if calls else [])
    elif args.exhaustive:
        label, ks = "several calls, each run to its end", \
            (lambda site, calls, design: fs.pick_ks(calls, exhaustive=True))
    else:
        label, ks = "first and middle call", None
    print(f"machine: {describe()}; one thread")
    print(f"{len(sites)} fault sites ({by_kind([s.key for s in sites], kinds)}); soak: "
          f"{n} random requests per design, pool of 48 blocks of 4 (+ 96 CPU blocks to swap "
          f"to), prefix caching")
    t0, failing = time.perf_counter(), []
    for design in args.design or fs.DESIGNS:
        print(f"== {design} ==")
        rep = fs.sweep(model, [design], sites=sites, ks=ks, converge=not args.exhaustive,
                       second_order=args.exhaustive, blame=True)
        print_sweep(design, rep[design], sites, kinds, label)
        got = soak(model, design, n, args.seed, sites)
        print_soak(got, kinds)
        failing += [fs.describe_failure(r) for r in fs.failures(rep)]
        failing += [f"{design}: soak: {c} ({d})" for c, d in got["faulty"].problems]
    print(f"failing: {len(failing)}" + "".join(f"\n  {f}" for f in failing))
    print(f"wall time: {time.perf_counter() - t0:.1f} s")
    metrics_section()
    metrics_while_stepping_section()


if __name__ == "__main__":
    main()
