"""/metrics under bursts of scrapers: ``serve_metrics`` (prometheus_client's WSGI app on its
thread-per-request server) on the metrics of a model-free replay. Printed, never asserted.

1. **Idle**: a bounded burst of scrapes from 32 threads of another process (as a Prometheus
   server scrapes: not sharing the served process's interpreter lock) while a slow client
   trickles header bytes: scrapes answered and failed, p50 / p99 / max latency (target: p99
   under 100 ms), and a probe scrape timed while only the slow client is connected (did it
   block the others?).
2. **While a replay steps**: the same burst (fewer scrapes) while a model-free replay steps
   in the served process, as ``python -m course_lib serve-metrics --model-free`` serves it:
   the steps are pure Python, so the scrapes' threads share the interpreter lock with them,
   and every step's ``record_step`` takes the registry's lock a scrape collects under.

    python bench/metrics_server.py            # 2,000 idle scrapes, 500 while stepping
    python bench/metrics_server.py --quick    # 400 and 200 (under a minute)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import math
import multiprocessing
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _trickle(port: int, period_s: float, stop: threading.Event, max_s: float = 60.0) -> float:
    """A slow client: sends a request line, then a header one byte per ``period_s`` until
    ``stop`` (or ``max_s``); returns how long it held its connection."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            while not stop.wait(period_s) and time.perf_counter() - t0 < max_s:
                sock.sendall(b"a")
        except OSError:                     # cut off by the server
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
                 slow_period_s: float = 0.05, alone: int = 100) -> dict:
    """``scrapes`` scrapes of http://127.0.0.1:``port``/metrics from ``threads`` threads (a
    bounded burst), while a slow client trickles header bytes: latencies in ms, and one probe
    scrape timed while only the slow client is connected (did it block the others?). First,
    ``alone`` scrapes one at a time: what a scrape costs when nothing else is scraping."""
    one = sorted(_scrape_ms(port) for _ in range(alone))
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
            "slow_held_s": slow.result(timeout=120), "alone": alone,
            "alone_p50_ms": one[len(one) // 2],
            "alone_p99_ms": one[min(len(one) - 1, int(0.99 * len(one)))]}


def _burst_from_another_process(port: int, scrapes: int, threads: int) -> dict:
    """:func:`scrape_burst` run in a process of its own, as a Prometheus server is: its
    threads do not share the served process's interpreter lock."""
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as scrapers:
        return scrapers.submit(scrape_burst, port, scrapes, threads).result()


def _line(what: str, got: dict) -> str:
    return (f"{what}: one scraper at a time ({got['alone']} scrapes): p50 "
            f"{got['alone_p50_ms']:.1f} ms, p99 {got['alone_p99_ms']:.1f} ms; a burst of "
            f"{got['scrapes']} from {got['threads']} threads of another process in "
            f"{got['wall_s']:.1f} s: {got['ok']} ok, {got['errors']} failed, p50 "
            f"{got['p50_ms']:.1f} ms, p99 {got['p99_ms']:.1f} ms, max {got['max_ms']:.1f} ms"
            + (f" (first error: {got['first_error']})" if got["errors"] else ""))


def idle_section(scrapes: int = 2000, threads: int = 32, num_requests: int = 200) -> dict:
    """Serve the metrics of a finished model-free replay (``num_requests`` ShareGPT-like
    requests: every histogram filled) and throw :func:`scrape_burst` at it."""
    from course_lib.scheduler.metrics import serve_metrics
    from course_lib.sim.replay import replay
    from course_lib.sim.traces import sharegpt_like

    metrics = replay(sharegpt_like(num_requests, seed=0), with_metrics=True).metrics
    server, port = serve_metrics(metrics)
    try:
        got = _burst_from_another_process(port, scrapes, threads)
    finally:
        server.shutdown()
        server.server_close()
    verdict = "met" if got["p99_ms"] < 100 and not got["errors"] else "MISSED"
    print(_line("/metrics burst, idle", got) + f" (target p99 < 100 ms: {verdict})")
    blocked = "did not block" if got["probe_ms"] < 1000 else "BLOCKED (5 s timeout)"
    print(f"/metrics slow client (a header byte every 50 ms, held its connection "
          f"{got['slow_held_s']:.1f} s) {blocked} the others: a scrape beside it took "
          f"{got['probe_ms']:.1f} ms")
    return got


def stepping_section(scrapes: int = 500, threads: int = 32, num_requests: int = 1000) -> dict:
    """The same burst while a model-free replay (``num_requests`` ShareGPT-like requests)
    steps in the served process; prints the figures and how many steps were recorded during
    the burst (one ``record_step`` each)."""
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
        steps, overlapped = metrics.version - v0, not done.is_set()
    finally:
        done.wait()
        server.shutdown()
        server.server_close()
    print(_line("/metrics burst while a replay steps", got)
          + f"; {steps} steps recorded during the burst"
          + ("" if overlapped else " (the replay ended before the burst did)"))
    blocked = "did not block" if got["probe_ms"] < 1000 else "BLOCKED (5 s timeout)"
    print(f"/metrics slow client while stepping {blocked} the others: a scrape beside it took "
          f"{got['probe_ms']:.1f} ms")
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="400 idle scrapes and 200 while stepping (under a minute)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    idle_section(400 if args.quick else 2000)
    stepping_section(200 if args.quick else 500, num_requests=600 if args.quick else 1000)


if __name__ == "__main__":
    main()
