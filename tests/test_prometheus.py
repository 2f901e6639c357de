"""A real Prometheus server scrapes the engine's ``/metrics`` and answers vLLM's PromQL.

Debian's ``prometheus`` (2.42 on bookworm; ``.ci/run`` installs it) scrapes two targets every
second, both serving the same registry of a real run (the tiny model, a pool small enough to
preempt): the course's :func:`serve_metrics` (prometheus_client's own WSGI app and server, with
the ``Accept`` header removed) and, as the detector's input, prometheus_client's own
``start_http_server``. Prometheus 2.x negotiates OpenMetrics, and prometheus_client then
writes ``vllm_...`` on the sample lines (prometheus/client_python#1177): the queries the
chapters teach must find the engine's values through the course's server and nothing through
the default one.

The run goes in three phases: Prometheus scrapes the engine at rest (every series at 0), the
engine steps until it has preempted, filled most of the pool and finished some requests, then
it stops and Prometheus scrapes the frozen state. Queried at the time of the last scrape, with
a window that starts before the run, PromQL has nothing to extrapolate (the counters start at
0, the window ends on a sample): ``increase`` is exactly the engine's counter and a quantile of
the rated buckets is exactly the quantile of the engine's own buckets.

Skipped when the ``prometheus`` binary is not installed (a learner's machine).
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from course_lib.scheduler.metrics import Metrics, serve_metrics

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.ch10,
    pytest.mark.skipif(PROMETHEUS is None, reason="Debian's `prometheus` binary is not installed "
                       "(apt-get install prometheus; .ci/run installs it)"),
]

WINDOW_S = 300                   # the PromQL range, [5m]: it starts before the run
FREEZE_STEP = 49                 # 30 ShareGPT-like requests on 32 blocks: preempted by then


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@contextmanager
def prometheus_scraping(targets: dict[str, int]) -> Iterator[Callable[..., list]]:
    """Run Debian's prometheus on 127.0.0.1 (a free port, a temporary config and storage),
    scraping ``127.0.0.1:PORT/metrics`` every second for each ``job: port`` of ``targets``;
    yield ``query(promql, at=None)``, the result list of the HTTP API's instant query. The
    process and the directory go away on exit, also when the test fails."""
    with tempfile.TemporaryDirectory(prefix="course-prometheus-") as tmp:
        jobs = "".join(f"  - job_name: {job}\n    static_configs:\n"
                       f"      - targets: ['127.0.0.1:{port}']\n"
                       for job, port in targets.items())
        config = Path(tmp, "prometheus.yml")
        config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                          f"scrape_configs:\n{jobs}")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log_path = Path(tmp, "prometheus.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            def ready() -> bool:
                if proc.poll() is not None:
                    pytest.fail(f"prometheus exited ({proc.returncode}):\n"
                                f"{log_path.read_text()[-3000:]}")
                try:
                    with urllib.request.urlopen(f"{base}/-/ready", timeout=1) as resp:
                        return resp.status == 200
                except OSError:
                    return False

            wait_until(ready, 20, "prometheus to be ready")

            def query(promql: str, at: float | None = None) -> list:
                params = {"query": promql} | ({} if at is None else {"time": f"{at:.3f}"})
                got = get_json(f"{base}/api/v1/query?{urllib.parse.urlencode(params)}")
                assert got["status"] == "success", got
                return got["data"]["result"]

            yield query
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_until(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.2)


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' ``histogram_quantile`` on cumulative ``(le, count)`` buckets, +Inf last:
    linear interpolation inside the bucket where the rank falls (from 0 in the first)."""
    buckets = sorted(buckets)
    total = buckets[-1][1]
    rank = q * total
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    start, below = (0.0, 0.0) if b == 0 else buckets[b - 1]
    end, count = buckets[b]
    return start + (end - start) * (rank - below) / (count - below)


def own_buckets(metrics: Metrics, name: str) -> list[tuple[float, float]]:
    return [(float(s.labels["le"]), s.value) for f in metrics.registry.collect()
            for s in f.samples if s.name == f"{name}_bucket"]


def test_a_real_prometheus_reads_the_engines_values_under_vllms_names() -> None:
    import torch
    from prometheus_client import start_http_server

    from course_lib.config import CacheConfig, SchedulerConfig
    from course_lib.engine.llm_engine import LLMEngine
    from course_lib.engine.workloads import model_trace
    from course_lib.sequence import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine(scheduler_config=SchedulerConfig(max_num_seqs=256,
                                                        max_num_batched_tokens=512,
                                                        max_model_len=256),
                       cache_config=CacheConfig(block_size=16, num_gpu_blocks=32),
                       stop_token_ids=())
    for t in model_trace("sharegpt", 30, seed=0):
        engine.add_request(list(t.prompt_token_ids),
                           SamplingParams(temperature=0.0, max_tokens=t.output_len))
    m = engine.metrics
    course, port = serve_metrics(m)
    default, _ = start_http_server(0, addr="127.0.0.1", registry=m.registry)
    try:
        with prometheus_scraping({"course": port,
                                  "client_default": default.server_port}) as query:
            def scrapes_since(job: str, since: float) -> int:
                got = query(f'up{{job="{job}"}}[1m]')
                return sum(1 for ts, up in (got[0]["values"] if got else ())
                           if float(ts) > since and up == "1")

            for job in ("course", "client_default"):     # the engine at rest, twice
                wait_until(lambda job=job: scrapes_since(job, 0) >= 2, 15, f"{job} scrapes")
            ttfts = []
            for _ in range(FREEZE_STEP):
                ttfts += [o.ttft for o in engine.step()]
            frozen = time.time()
            for job in ("course", "client_default"):     # the frozen state, twice
                wait_until(lambda job=job: scrapes_since(job, frozen) >= 2, 15,
                           f"{job} scrapes after the run")
            scrapes = query('up{job="course"}[1m]')[0]["values"]
            at = float(scrapes[-1][0])          # the last scrape of the course's server
            check_the_chapters_queries(query, at, m, ttfts)
    finally:
        for server in (course, default):
            server.shutdown()
            server.server_close()


def check_the_chapters_queries(query: Callable[..., list], at: float, m: Metrics,
                               ttfts: list[float]) -> None:
    usage = m.value("vllm:gpu_cache_usage_perc")
    preemptions = m.value("vllm:num_preemptions_total")
    buckets = own_buckets(m, "vllm:time_to_first_token_seconds")
    assert 0 < usage < 1 and preemptions > 0 and len(ttfts) >= 5    # the run is worth testing
    assert m.value("vllm:time_to_first_token_seconds_count") == len(ttfts)
    median = bucket_quantile(0.5, buckets)
    # the engine's own TTFTs: their median lies in the bucket the quantile interpolates in
    low = max((le for le, count in buckets if count < len(ttfts) / 2), default=0.0)
    high = min(le for le, count in buckets if count >= len(ttfts) / 2)
    assert low <= statistics.median_low(ttfts) <= high and low <= median <= high

    chapters = {                                     # PromQL -> what the engine reports
        "vllm:gpu_cache_usage_perc{job=~'%s'}": usage,
        f"increase(vllm:num_preemptions_total{{job=~'%s'}}[{WINDOW_S}s])": preemptions,
        f"rate(vllm:num_preemptions_total{{job=~'%s'}}[{WINDOW_S}s])": preemptions / WINDOW_S,
        ("histogram_quantile(0.5, sum by (le) (rate("
         f"vllm:time_to_first_token_seconds_bucket{{job=~'%s'}}[{WINDOW_S}s])))"): median,
    }
    for promql, want in chapters.items():
        got = query(promql % "course", at)
        assert len(got) == 1, f"{promql % 'course'} gave {got}"
        assert float(got[0]["value"][1]) == pytest.approx(want, rel=1e-9, abs=0), promql
    # The detector: the same queries find nothing through prometheus_client's own server ...
    for promql in chapters:
        got = query(promql % "client_default", at)
        assert got == [] or all(math.isnan(float(r["value"][1])) for r in got), \
            f"{promql % 'client_default'} gave {got}"
    # ... because the samples arrived, but under other names: every colon became "_"
    renamed = query('{__name__=~"vllm.+", job="client_default"}', at)
    names = {r["metric"]["__name__"] for r in renamed}
    assert "vllm_gpu_cache_usage_perc" in names and not any(":" in n for n in names), names
    assert [float(r["value"][1]) for r in renamed
            if r["metric"]["__name__"] == "vllm_gpu_cache_usage_perc"] == [usage]
