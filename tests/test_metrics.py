"""vLLM-named Prometheus metrics, updated from the scheduler, scraped over real HTTP."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.scheduler.metrics import Metrics, serve_metrics
from course_lib.scheduler.scheduler import Scheduler
from course_lib.sequence import SamplingParams
from course_lib.sim.fake_sampler import fake_samples

pytestmark = pytest.mark.ch07


def run(s: Scheduler, metrics: Metrics, steps: int | None = None) -> None:
    t = 0
    while s.has_unfinished_requests() and (steps is None or t < steps):
        out = s.schedule()
        samples = fake_samples(out)
        t += 1
        finished = s.update(out, samples, now=0.5 * t)
        metrics.update(s)
        metrics.observe_step([e.request for e in out.scheduled if e.num_candidates], 0.5 * t)
        metrics.observe_finished(finished)


def small_scheduler(mode="recompute", caching=True):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                     max_model_len=64, preemption_mode=mode),
                     CacheConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8,
                                 watermark=0.0, enable_prefix_caching=caching))


def test_gauges_follow_the_queues_and_the_pools():
    s = small_scheduler()
    m = Metrics(s)
    for i in range(6):
        s.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=20))
    run(s, m, steps=3)
    assert m.value("vllm:num_requests_running") == len(s.running) > 0
    assert m.value("vllm:num_requests_waiting") == len(s.waiting)
    assert m.value("vllm:num_requests_swapped") == len(s.swapped)
    assert m.value("vllm:gpu_cache_usage_perc") == s.block_manager.usage().block_usage > 0.5
    assert m.value("vllm:cpu_cache_usage_perc") == s.block_manager.usage("cpu").block_usage


def test_counters_accumulate_and_histograms_count_requests():
    s = small_scheduler()
    m = Metrics(s)
    for i in range(6):
        s.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=20), arrival_time=0.0)
    run(s, m)
    assert s.num_preemptions > 0
    assert m.value("vllm:num_preemptions_total") == s.num_preemptions
    stats = s.block_manager.prefix_cache_stats
    assert stats.queries > 0 and stats.hits > 0
    # V0 (0.6.3) exported a hit-rate gauge, not counters
    assert m.value("vllm:gpu_prefix_cache_hit_rate") == pytest.approx(stats.hits / stats.queries)
    with pytest.raises(ValueError, match="no sample"):
        m.value("vllm:prefix_cache_hits_total")
    assert m.value("vllm:generation_tokens_total") == s.num_generated_tokens == 6 * 20
    assert m.value("vllm:prompt_tokens_total") == s.num_prompt_tokens >= 6 * 12  # + recomputed
    assert m.value("vllm:time_to_first_token_seconds_count") == 6
    # V0 observed its time per output token per generated token (an inter-token latency)
    assert m.value("vllm:time_per_output_token_seconds_count") == 6 * 19
    assert m.value("vllm:gpu_cache_usage_perc") == 0.0                 # all done


def test_v0_hit_rate_is_minus_one_with_prefix_caching_off():
    """0.6.3's naive allocator reported -1 ("not supported or disabled"), not 0."""
    s = small_scheduler(caching=False)
    m = Metrics(s)
    for i in range(2):
        s.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=4), arrival_time=0.0)
    run(s, m)
    assert m.value("vllm:gpu_prefix_cache_hit_rate") == -1.0
    assert Metrics(small_scheduler()).value("vllm:gpu_prefix_cache_hit_rate") == 0.0


def test_two_engines_do_not_share_a_registry():
    a, b = Metrics(small_scheduler()), Metrics(small_scheduler())
    assert a.registry is not b.registry
    with pytest.raises(ValueError, match="no sample"):
        a.value("vllm:nonexistent")


def test_scrape_over_http_and_parse():
    s = small_scheduler(mode="swap")
    m = Metrics(s)
    for i in range(6):
        s.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=20))
    run(s, m, steps=12)
    assert s.swapped and m.value("vllm:cpu_cache_usage_perc") > 0    # something is on the CPU
    server, port = serve_metrics(m)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    samples = {}
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for fam in families.values():
        for sample in fam.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    label = (("model_name", "course-model"),)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_requests_swapped", "vllm:gpu_cache_usage_perc",
                 "vllm:cpu_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:gpu_prefix_cache_hit_rate"):
        assert samples[(name, label)] == m.value(name), name
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert families["vllm:time_per_output_token_seconds"].type == "histogram"
    info = [lbl for (name, lbl), v in samples.items() if name == "vllm:cache_config_info"]
    assert len(info) == 1 and dict(info[0])["num_gpu_blocks"] == "16"
    assert dict(info[0])["block_size"] == "4"
    assert samples[("vllm:num_preemptions_total", label)] > 0


def test_the_v1_design_exports_v1s_names_and_no_created_series():
    """vLLM 0.33.0's names (vllm/v1/metrics/loggers.py): kv_cache_usage_perc, per-token
    inter_token_latency, per-request request_time_per_output_token; no swap, no V0 names."""
    from course_lib.scheduler.v1 import SchedulerV1

    s = SchedulerV1(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64),
                    CacheConfig(block_size=4, num_gpu_blocks=16, watermark=0.0,
                                enable_prefix_caching=True))
    m = Metrics(s)
    for i in range(4):
        s.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=10), arrival_time=0.0)
    run(s, m)
    names = {x.name for f in m.registry.collect() for x in f.samples}
    assert {"vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds_count",
            "vllm:request_time_per_output_token_seconds_count"} <= names
    assert not names & {"vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc",
                        "vllm:num_requests_swapped", "vllm:time_per_output_token_seconds_count"}
    assert not any(n.endswith("_created") for n in names)
    assert m.value("vllm:inter_token_latency_seconds_count") == 4 * 9
    assert m.value("vllm:request_time_per_output_token_seconds_count") == 4
    stats = s.block_manager.prefix_cache_stats
    assert m.value("vllm:prefix_cache_hits_total") == stats.hits > 0
    assert m.value("vllm:prefix_cache_queries_total") == stats.queries
    assert "vllm:gpu_prefix_cache_hit_rate" not in names
    with pytest.raises(ValueError, match="design"):
        Metrics(s, design="v2")


# What Prometheus 2.x (Debian's 2.42, for one) sends when it scrapes: OpenMetrics first, no
# escaping scheme named (Prometheus 3 adds escaping=allow-utf-8).
PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                       "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def get(url: str, accept: str | None = None) -> tuple[str, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.headers["Content-Type"], resp.read().decode()


def sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_every_series_exists_at_zero_before_anything_happened():
    """A counter series that appears only at its first preemption would start above 0, and
    Prometheus' rate() could not count what came before its first sample."""
    m = Metrics(small_scheduler())
    for name in ("vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:num_requests_running"):
        assert m.value(name) == 0.0, name


def test_a_prometheus_2_scrape_gets_the_classic_format_with_colon_names():
    """serve_metrics ignores the negotiation; prometheus_client's own server (the detector's
    input) answers the same Accept header in OpenMetrics with colons turned into underscores
    on the sample lines (prometheus/client_python#1177)."""
    from prometheus_client import start_http_server

    s = small_scheduler()
    m = Metrics(s)
    for i in range(6):
        s.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=20))
    run(s, m, steps=6)
    ours, port = serve_metrics(m)
    default, _ = start_http_server(0, addr="127.0.0.1", registry=m.registry)
    try:
        got = {accept: get(f"http://127.0.0.1:{port}/metrics", accept)
               for accept in (PROMETHEUS_2_ACCEPT, None, "application/openmetrics-text")}
        ctype, bad = get(f"http://127.0.0.1:{default.server_port}/metrics", PROMETHEUS_2_ACCEPT)
        try:
            other = get(f"http://127.0.0.1:{port}/other")
        except urllib.error.HTTPError as exc:
            other = exc.code
    finally:
        for server in (ours, default):
            server.shutdown()
            server.server_close()
    (ctype_ours, text), *others = got.values()
    assert ctype_ours == "text/plain; version=0.0.4; charset=utf-8"
    assert all(other == (ctype_ours, text) for other in others)        # whatever is asked
    names = sample_names(text)
    assert {"vllm:gpu_cache_usage_perc", "vllm:num_preemptions_total",
            "vllm:time_to_first_token_seconds_bucket"} <= names
    assert all(n.startswith("vllm:") for n in names)
    assert f"vllm:gpu_cache_usage_perc{{model_name=\"course-model\"}} " \
           f"{m.value('vllm:gpu_cache_usage_perc')}" in text
    # the detector's input: the default handler loses every colon on the sample lines
    assert ctype.startswith("application/openmetrics-text")
    assert "# HELP vllm:gpu_cache_usage_perc" in bad                  # ... but not in HELP
    bad_names = sample_names(bad)
    assert "vllm_gpu_cache_usage_perc" in bad_names
    assert not any(n.startswith("vllm:") for n in bad_names)
    assert other == 404                                             # only /metrics is served


def test_a_silent_client_does_not_block_a_scrape(monkeypatch, capfd):
    """A connection that never sends its request is dropped (after the handler's timeout,
    shortened here), quietly; the next scrape is answered."""
    import socket

    from course_lib.scheduler import metrics as metrics_module

    monkeypatch.setattr(metrics_module.MetricsServer, "request_deadline_s", 0.5)
    server, port = serve_metrics(Metrics(small_scheduler()))
    try:
        with socket.create_connection(("127.0.0.1", port)):
            _, text = get(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.shutdown()
        server.server_close()
    assert "vllm:num_requests_running" in text
    assert "Traceback" not in capfd.readouterr().err


def test_a_client_trickling_its_headers_blocks_no_scrape_and_is_cut_at_its_deadline(
        monkeypatch, capfd):
    """A client that sends its request a byte every 0.1 s (well inside any per-read timeout)
    holds only its own thread: another scrape meanwhile is answered at once. And it holds
    it only until the per-connection deadline (the handler's timeout, 2 s here), though it
    never stops sending."""
    import socket
    import threading
    import time

    from course_lib.scheduler import metrics as metrics_module

    monkeypatch.setattr(metrics_module.MetricsServer, "request_deadline_s", 2.0)
    server, port = serve_metrics(Metrics(small_scheduler()))
    stop = threading.Event()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as slow:
            t0 = time.monotonic()
            slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")

            def trickle() -> None:
                while not stop.wait(0.1):
                    try:
                        slow.sendall(b"a")
                    except OSError:
                        return

            threading.Thread(target=trickle, daemon=True).start()
            time.sleep(0.5)                             # the slow client is being read
            start = time.perf_counter()
            _, text = get(f"http://127.0.0.1:{port}/metrics")
            took = time.perf_counter() - start
            try:
                cut = slow.recv(1024)                   # waits until the server lets go
            except ConnectionResetError:                # closed with trickled bytes unread
                cut = b""
            held = time.monotonic() - t0
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
    assert "vllm:num_requests_running" in text and took < 1.0
    assert cut == b"" and 1.5 < held < 8.0
    assert "Traceback" not in capfd.readouterr().err


def test_a_burst_of_concurrent_scrapers_is_answered_without_syn_retries():
    """64 scrapers connecting at once: every one is answered, well within the 1 s a client
    waits to retry a SYN that a full listen backlog dropped (socketserver's default backlog is
    5, and one thread answered one scrape at a time)."""
    import threading
    import time

    server, port = serve_metrics(Metrics(small_scheduler()))
    barrier, took, errors = threading.Barrier(64), [], []

    def scrape() -> None:
        barrier.wait()
        start = time.perf_counter()
        try:
            get(f"http://127.0.0.1:{port}/metrics")
            took.append(time.perf_counter() - start)
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=scrape) for _ in range(64)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert not errors and len(took) == 64
    assert max(took) < 0.9, f"slowest scrape {max(took):.2f} s"


def test_the_body_is_generated_again_only_after_a_change():
    """Scrapes between two changes share one body; any change of the metrics (through
    Metrics' methods) is in the next scrape."""
    s = small_scheduler()
    m = Metrics(s)
    server, port = serve_metrics(m)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        before = get(url)[1]
        assert get(url)[1] == before
        s.add_request(0, tuple(range(1, 13)), SamplingParams(max_tokens=4))
        m.update(s)
        assert 'vllm:num_requests_waiting{model_name="course-model"} 1.0' in get(url)[1]
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------- the inter-token-latency clock's map
def test_itl_map_forgets_requests_however_they_end():
    """Keyed by the request itself (never ``id()``, which a later request may reuse): a
    finished request leaves at observe_finished, an aborted one at forget() or, if nobody
    calls it, at the next step; many aborted requests leave nothing behind."""
    s = small_scheduler(caching=False)
    m = Metrics(s)
    for i in range(40):
        s.add_request(i, tuple(range(1, 5)), SamplingParams(max_tokens=50))
    run(s, m, steps=3)
    running = [r for r in s.running]
    assert running and set(m._last_token_time) == set(running)
    first = running[0]
    assert s.abort_request(first.request_id)
    m.forget(first)
    assert first not in m._last_token_time
    for r in list(s.running):                           # aborted, nobody tells the metrics
        s.abort_request(r.request_id)
    run(s, m, steps=1)
    assert not any(r.is_finished for r in m._last_token_time)
    for rid in range(100, 400):                        # a long run of aborted requests
        s.add_request(rid, (1, 2, 3), SamplingParams(max_tokens=50))
        run(s, m, steps=2)
        s.abort_request(rid)
    run(s, m)
    assert m._last_token_time == {}


def test_a_reused_request_id_starts_a_new_itl_clock():
    """A new request with the id of an aborted one must not measure its first token's
    latency from the old one's last token."""
    s = small_scheduler(caching=False)
    m = Metrics(s)
    s.add_request(7, (1, 2, 3), SamplingParams(max_tokens=50))
    run(s, m, steps=3)                                  # t = 0.5 .. 1.5: 2 ITLs of 0.5 s
    s.abort_request(7)
    count = m.value("vllm:time_per_output_token_seconds_count")
    s.add_request(7, (1, 2, 3), SamplingParams(max_tokens=2))
    run(s, m)
    # the new request: 2 tokens, one ITL; its first token is not an ITL of the old one
    assert m.value("vllm:time_per_output_token_seconds_count") == count + 1
    assert m._last_token_time == {}


# ------------------------------------------------------- a scrape beside a running step
def test_a_scrape_never_waits_for_a_step_nor_sees_half_of_one():
    """A step is stopped half-way through its commit (the generation counter's ``inc``
    blocks on an Event: its gauges are set, its counters not yet). A scrape meanwhile is
    answered at once, while the step is still blocked, and with the metrics as of a whole
    step: the last committed one, or the one before (never rendered mid-commit). Before
    the snapshot a scrape rendered the collectors as they were: the new KV usage beside the
    old token counts."""
    import threading

    from course_lib.scheduler import metrics as metrics_module

    s = small_scheduler()
    m = Metrics(s)
    for i in range(4):
        s.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=4))
    server, port = serve_metrics(m)
    url = f"http://127.0.0.1:{port}/metrics"

    def step(now: float) -> None:                   # the engine's step, metrics-wise
        m.begin()
        out = s.schedule()
        finished = s.update(out, fake_samples(out), now=now)
        m.update(s)
        m.observe_step([e.request for e in out.scheduled if e.num_candidates], now)
        m.observe_finished(finished)
        m.commit()

    entered, release, answered = threading.Event(), threading.Event(), []
    real = m.generation_tokens

    class HeldCounter:                                   # its inc waits for `release`
        def labels(self, *values):
            child = real.labels(*values)

            class Child:
                def inc(self, amount: float) -> None:
                    entered.set()
                    release.wait(30)
                    child.inc(amount)
            return Child()

    try:
        before = get(url)[1]                            # rendered: the body of version v0
        step(0.5)
        whole = metrics_module.classic_text(m.registry).decode()   # step 1, never served yet
        m.generation_tokens = HeldCounter()
        stepping = threading.Thread(target=step, args=(1.0,))
        stepping.start()
        assert entered.wait(30)                         # step 2 is half-way through its commit
        mid = get(url)[1]
        answered.append(not release.is_set())           # answered while the step was blocked
        release.set()
        stepping.join(30)
        m.generation_tokens = real
        after = get(url)[1]
    finally:
        release.set()
        server.shutdown()
        server.server_close()
    assert answered == [True]
    assert mid in (before, whole), "a scrape served a half-applied step"
    assert after not in (before, whole)                 # step 2 is served once committed
    assert f"vllm:generation_tokens_total{{model_name=\"course-model\"}} " \
           f"{m.value('vllm:generation_tokens_total')}" in after


def test_the_server_speaks_enough_http():
    """GET and HEAD of /metrics (HEAD: the same headers, no body), 405 for another method,
    400 for a malformed request line, 431 for a request head over 8 KiB; one request per
    connection."""
    import socket

    from course_lib.scheduler import metrics as metrics_module

    def raw(port: int, request: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request)
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
        return got

    server, port = serve_metrics(Metrics(small_scheduler()))
    try:
        got = raw(port, b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n")
        head = raw(port, b"HEAD /metrics HTTP/1.1\r\nHost: a\r\n\r\n")
        post = raw(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        bad = raw(port, b"hello\r\n\r\n")
        big = raw(port, b"GET /metrics HTTP/1.1\r\nX-Big: "
                  + b"a" * metrics_module.MetricsServer.max_head_bytes + b"\r\n\r\n")
    finally:
        server.shutdown()
        server.server_close()
    status, _, body = got.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200 OK") and b"Connection: close" in status
    assert f"Content-Length: {len(body)}".encode() in status
    assert b"vllm:num_requests_running" in body
    assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n")
    assert f"Content-Length: {len(body)}".encode() in head
    assert post.startswith(b"HTTP/1.1 405") and b"Allow: GET, HEAD" in post
    assert bad.startswith(b"HTTP/1.1 400")
    assert big.startswith(b"HTTP/1.1 431")
