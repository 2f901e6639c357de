"""vLLM-named Prometheus metrics, updated from the scheduler, scraped over real HTTP."""

from __future__ import annotations

import contextlib
import gzip
import inspect
import socket
import sys
import threading
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.scheduler.metrics import Metrics, serve_metrics
from course_lib.scheduler.scheduler import Scheduler
from course_lib.scheduler.v1 import SchedulerV1
from course_lib.sequence import Request, SamplingParams
from course_lib.sim.fake_sampler import fake_samples

pytestmark = pytest.mark.ch07


def step(s: Scheduler | SchedulerV1, metrics: Metrics, now: float) -> list[Request]:
    """One step of the scheduler, recorded as the engine records it; returns the finished."""
    out = s.schedule()
    finished = s.update(out, fake_samples(out), now=now)
    metrics.record_step(s, [e.request for e in out.scheduled if e.num_candidates], finished,
                        now)
    return finished


def run(s: Scheduler | SchedulerV1, metrics: Metrics, steps: int | None = None) -> None:
    t = 0
    while s.has_unfinished_requests() and (steps is None or t < steps):
        t += 1
        step(s, metrics, 0.5 * t)


def small_scheduler(mode="recompute", caching=True):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                     max_model_len=64, preemption_mode=mode),
                     CacheConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8,
                                 watermark=0.0, enable_prefix_caching=caching))


def small_v1_scheduler():
    return SchedulerV1(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                       max_model_len=64),
                       CacheConfig(block_size=4, num_gpu_blocks=16, watermark=0.0,
                                   enable_prefix_caching=True))


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
# escaping scheme named (Prometheus 3 adds escaping=allow-utf-8), and gzip accepted.
PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                       "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def get(url: str, accept: str | None = None, gzipped: bool = False) -> tuple[str, str]:
    headers = ({"Accept": accept} if accept else {}) | ({"Accept-Encoding": "gzip"}
                                                        if gzipped else {})
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                timeout=10) as resp:
        body = resp.read()
        if resp.headers["Content-Encoding"] == "gzip":
            body = gzip.decompress(body)
        return resp.headers["Content-Type"], body.decode()


def sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


@contextlib.contextmanager
def serving(metrics: Metrics):
    """``serve_metrics(metrics)``'s URL of /metrics, stopped and closed on exit."""
    server, port = serve_metrics(metrics)
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_every_series_exists_at_zero_before_anything_happened():
    """A counter series that appears only at its first preemption would start above 0, and
    Prometheus' rate() could not count what came before its first sample."""
    for m in (Metrics(small_scheduler()), Metrics(small_v1_scheduler())):
        for name in ("vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                     "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                     "vllm:e2e_request_latency_seconds_count", "vllm:num_requests_running",
                     "course:engine_recoveries_total", "course:recomputed_tokens_total"):
            assert m.value(name) == 0.0, name


def test_a_prometheus_2_scrape_gets_the_classic_format_with_colon_names():
    """serve_metrics answers the classic text format whatever is asked (gzipped when asked,
    as prometheus_client's app does); prometheus_client's own server (the detector's input)
    answers the same Accept header in OpenMetrics with colons turned into underscores on the
    sample lines (prometheus/client_python#1177)."""
    from prometheus_client import start_http_server

    s = small_scheduler()
    m = Metrics(s)
    for i in range(6):
        s.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=20))
    run(s, m, steps=6)
    default, _ = start_http_server(0, addr="127.0.0.1", registry=m.registry)
    try:
        with serving(m) as url:
            got = [get(url, accept, gzipped) for accept, gzipped in (
                (PROMETHEUS_2_ACCEPT, True), (PROMETHEUS_2_ACCEPT, False), (None, False),
                ("application/openmetrics-text", False))]
            other = get(url.replace("/metrics", "/other"))
        ctype, bad = get(f"http://127.0.0.1:{default.server_port}/metrics", PROMETHEUS_2_ACCEPT)
    finally:
        default.shutdown()
        default.server_close()
    (ctype_ours, text), *others = got
    assert ctype_ours == "text/plain; version=0.0.4; charset=utf-8"
    assert all(o == (ctype_ours, text) for o in others)                # whatever is asked
    assert text == m.exposition().decode()
    assert other == (ctype_ours, text)              # prometheus_client's app: any path
    names = sample_names(text)
    assert {"vllm:gpu_cache_usage_perc", "vllm:num_preemptions_total",
            "vllm:time_to_first_token_seconds_bucket", "course:engine_recoveries_total"} <= names
    assert all(n.startswith(("vllm:", "course:")) for n in names)
    assert f"vllm:gpu_cache_usage_perc{{model_name=\"course-model\"}} " \
           f"{m.value('vllm:gpu_cache_usage_perc')}" in text
    # the detector's input: the default handler loses every colon on the sample lines
    assert ctype.startswith("application/openmetrics-text")
    assert "# HELP vllm:gpu_cache_usage_perc" in bad                  # ... but not in HELP
    bad_names = sample_names(bad)
    assert "vllm_gpu_cache_usage_perc" in bad_names
    assert not any(":" in n for n in bad_names)


def test_a_scrape_can_name_the_families_it_wants():
    """``?name[]=``, prometheus_client's filter, works on the step-consistent registry."""
    m = Metrics(small_scheduler())
    with serving(m) as url:
        _, text = get(url + "?name[]=vllm:num_requests_running"
                      "&name[]=vllm:generation_tokens_total")
    assert sample_names(text) == {"vllm:num_requests_running", "vllm:generation_tokens_total"}


def raw(url: str, request: bytes) -> bytes:
    """Send ``request`` as is on a connection of its own; all the server answered."""
    port = int(url.split(":")[2].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    return got


def test_malformed_requests_do_not_stop_the_server(capfd):
    """Garbage, a request line that is not HTTP, a header line over wsgiref's 64 KiB, a
    client that leaves mid-request: each is refused (or dropped), quietly, and the next
    scrape is answered."""
    m = Metrics(small_scheduler())
    with serving(m) as url:
        answers = [raw(url, bad) for bad in (
            b"\x00\xff\xfe garbage\r\n\r\n", b"hello\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")]
        port = int(url.split(":")[2].split("/")[0])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /metr")                  # and leaves
        good = raw(url, b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n")
        _, text = get(url)
    assert all(b"Error code: 4" in a for a in answers), answers
    assert good.startswith(b"HTTP/1.0 200 OK") and b"vllm:num_requests_running" in good
    assert "vllm:num_requests_running" in text
    assert "Traceback" not in capfd.readouterr().err


def test_a_silent_client_does_not_block_a_scrape(capfd):
    """A connection that never sends its request holds only its own thread; the next scrape
    is answered."""
    with serving(Metrics(small_scheduler())) as url:
        port = int(url.split(":")[2].split("/")[0])
        with socket.create_connection(("127.0.0.1", port)):
            _, text = get(url)
    assert "vllm:num_requests_running" in text
    assert "Traceback" not in capfd.readouterr().err


def test_a_client_trickling_its_headers_blocks_no_scrape(capfd):
    """A client that sends its request a byte every 0.1 s holds only its own thread: other
    scrapes meanwhile are answered, and it is answered too once its request is whole."""
    with serving(Metrics(small_scheduler())) as url:
        port = int(url.split(":")[2].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=20) as slow:
            slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            texts = []
            for _ in range(5):
                slow.sendall(b"a")
                texts.append(get(url)[1])               # while the slow client is being read
                threading.Event().wait(0.1)
            slow.sendall(b"\r\n\r\n")
            answer = b""
            while chunk := slow.recv(65536):
                answer += chunk
    assert all("vllm:num_requests_running" in t for t in texts)
    assert answer.startswith(b"HTTP/1.0 200 OK") and b"vllm:num_requests_running" in answer
    assert "Traceback" not in capfd.readouterr().err


def test_a_burst_of_concurrent_scrapers_is_answered_without_syn_retries():
    """64 scrapers connecting at once: every one is answered, well within the 1 s a client
    waits to retry a SYN that a full listen backlog dropped (socketserver's default backlog
    is 5: with it the slowest of these scrapes took seconds)."""
    import time

    barrier, took, errors = threading.Barrier(64), [], []

    def scrape(url: str) -> None:
        barrier.wait()
        start = time.perf_counter()
        try:
            get(url)
            took.append(time.perf_counter() - start)
        except OSError as exc:
            errors.append(exc)

    with serving(Metrics(small_scheduler())) as url:
        threads = [threading.Thread(target=scrape, args=(url,)) for _ in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert not errors and len(took) == 64
    assert max(took) < 0.9, f"slowest scrape {max(took):.2f} s"


def test_every_change_is_in_the_next_scrape():
    s = small_scheduler()
    m = Metrics(s)
    with serving(m) as url:
        before = get(url)[1]
        assert get(url)[1] == before
        s.add_request(0, tuple(range(1, 13)), SamplingParams(max_tokens=4))
        m.update(s)
        assert 'vllm:num_requests_waiting{model_name="course-model"} 1.0' in get(url)[1]


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


# ------------------------------------------------------- a whole step in one call
COUNTERS = ("vllm:num_preemptions_total", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total")


def test_record_step_is_the_pieces_in_one_apply():
    """record_step changes the metrics as update + observe_step + observe_finished do, in one
    apply (``version`` + 1 a step, against 3)."""
    whole, pieces = small_scheduler(), small_scheduler()
    mw, mp = Metrics(whole), Metrics(pieces)
    for s in (whole, pieces):
        for i in range(6):
            s.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=20),
                          arrival_time=0.0)
    t = 0
    while whole.has_unfinished_requests():
        t += 1
        v = mw.version, mp.version
        step(whole, mw, 0.5 * t)
        out = pieces.schedule()
        finished = pieces.update(out, fake_samples(out), now=0.5 * t)
        mp.update(pieces)
        mp.observe_step([e.request for e in out.scheduled if e.num_candidates], 0.5 * t)
        mp.observe_finished(finished)
        assert (mw.version - v[0], mp.version - v[1]) == (1, 3)
        assert mw.exposition() == mp.exposition(), f"step {t}"
    assert whole.num_preemptions > 0 and mw.value("vllm:e2e_request_latency_seconds_count") == 6


class InjectedFault(Exception):
    pass


def course_lib_sites() -> list[tuple[type, str]]:
    """(class, name) of every function and property a class of ``course_lib`` defines: where
    the engine's fault harness injects a fault, at the entry."""
    sites = []
    for mod_name, mod in sorted(sys.modules.items()):
        if mod_name != "course_lib" and not mod_name.startswith("course_lib."):
            continue
        for cls in vars(mod).values():
            if inspect.isclass(cls) and cls.__module__ == mod_name:
                sites += [(cls, name) for name, attr in vars(cls).items()
                          if inspect.isfunction(attr) or isinstance(attr, property)]
    return sites


@contextlib.contextmanager
def wrapped(sites, calls: dict, fail_at: tuple[type, str] | None = None):
    """Count the calls of each site in ``calls`` meanwhile; the first call of ``fail_at``
    raises :class:`InjectedFault` at its entry."""
    with pytest.MonkeyPatch.context() as mp:
        for cls, name in sites:
            attr = vars(cls)[name]
            fn = attr.fget if isinstance(attr, property) else attr

            def wrapper(*args, _fn=fn, _site=(cls, name), **kwargs):
                calls[_site] = calls.get(_site, 0) + 1
                if _site == fail_at and calls[_site] == 1:
                    raise InjectedFault(_site)
                return _fn(*args, **kwargs)
            mp.setattr(cls, name, property(wrapper, attr.fset, attr.fdel)
                       if isinstance(attr, property) else wrapper)
        yield


def state(m: Metrics) -> tuple:
    return m.exposition(), m.version, dict(m._seen), dict(m._last_token_time)


def check_all_or_nothing(make) -> int:
    """``make()`` builds the same metrics and call (``(metrics, call)``) each time. A fault at
    the entry of each course_lib function the call reaches must leave the metrics as they
    were, and the call made again must give the clean call's metrics. Returns the sites."""
    m, call = make()
    calls: dict = {}
    with wrapped(course_lib_sites(), calls):
        call()
    clean = m.exposition()
    assert (Metrics, "_apply") in calls and len(calls) >= 6, calls       # reads, then apply
    for site in calls:
        m, call = make()
        before = state(m)
        with wrapped([site], {}, fail_at=site), pytest.raises(InjectedFault):
            call()
        assert state(m) == before, f"a fault at {site} applied something"
        call()                                          # recorded again: once, whole
        assert m.exposition() == clean, site
    return len(calls)


def a_step_to_record(design: str):
    """Metrics mid-run (inter-token clocks running), and the scheduler's next step done but
    not recorded: one that finishes a request. Returns (scheduler, metrics, sampled,
    finished, now)."""
    s = small_scheduler() if design == "v0" else small_v1_scheduler()
    m = Metrics(s)
    for i, n in enumerate((2, 5, 8)):
        s.add_request(i, tuple(range(1, 9)), SamplingParams(max_tokens=n), arrival_time=0.0)
    t = 0
    while True:
        t += 1
        out = s.schedule()
        finished = s.update(out, fake_samples(out), now=0.5 * t)
        sampled = [e.request for e in out.scheduled if e.num_candidates]
        if finished and m._last_token_time:
            return s, m, sampled, finished, 0.5 * t
        m.record_step(s, sampled, finished, 0.5 * t)


@pytest.mark.parametrize("design", ["v0", "v1"])
def test_a_fault_in_record_steps_reads_applies_nothing(design):
    """The lead's fault harness injects a fault at the entry of every course_lib function a
    step calls: in record_step, each lands before anything is applied (nothing changed,
    not even the inter-token clocks), and the step recorded again is recorded once."""
    def make():
        s, m, sampled, finished, now = a_step_to_record(design)
        return m, lambda: m.record_step(s, sampled, finished, now)
    assert check_all_or_nothing(make) >= 8


def test_itl_is_observed_once_per_token_when_every_recording_fails_first():
    """Every step's record_step fails once in its reads (a request's ``is_finished``), and is
    called again: each token after a request's first is one inter-token latency, each
    request one TTFT, each token one generation token."""
    s = small_scheduler(caching=False)
    m = Metrics(s)
    for i in range(4):
        s.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=10), arrival_time=0.0)
    t, failures = 0, 0
    while s.has_unfinished_requests():
        t += 1
        out = s.schedule()
        finished = s.update(out, fake_samples(out), now=0.5 * t)
        sampled = [e.request for e in out.scheduled if e.num_candidates]
        with wrapped([(Request, "is_finished")], {}, fail_at=(Request, "is_finished")):
            with pytest.raises(InjectedFault):
                m.record_step(s, sampled, finished, 0.5 * t)
        failures += 1
        m.record_step(s, sampled, finished, 0.5 * t)
    assert s.num_preemptions > 0 and failures == t
    assert m.value("vllm:time_per_output_token_seconds_count") == 4 * 9
    assert m.value("vllm:time_to_first_token_seconds_count") == 4
    assert m.value("vllm:generation_tokens_total") == 4 * 10
    assert m._last_token_time == {}


# ------------------------------------------------------- a recovery
def recovered(s: Scheduler | SchedulerV1) -> Scheduler | SchedulerV1:
    """A fresh scheduler of the same configuration holding ``s``'s cumulative counters, as
    the engine's recovery hands it (the counts the metrics last saw), with two requests."""
    fresh = (Scheduler if isinstance(s, Scheduler) else SchedulerV1)(s.config, s.cache_config)
    fresh.num_preemptions, fresh.num_prompt_tokens = s.num_preemptions, s.num_prompt_tokens
    fresh.num_generated_tokens = s.num_generated_tokens
    fresh.block_manager.prefix_cache_stats = s.block_manager.prefix_cache_stats
    for i in (100, 101):
        fresh.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=6),
                          arrival_time=0.0)
    return fresh


@pytest.mark.parametrize("design", ["v0", "v1"])
def test_record_recovery_counts_it_and_the_counters_go_on_from_the_fresh_scheduler(design):
    """After a recovery: one recovery and the recomputed tokens counted, the gauges of the
    fresh scheduler, the failed request's clock dropped (the others kept: their next token's
    latency includes the recovery), no counter double counted, none going backwards, and
    the counters follow the fresh scheduler's counts from there."""
    s = small_scheduler() if design == "v0" else small_v1_scheduler()
    m = Metrics(s)
    for i in range(6):
        s.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=20), arrival_time=0.0)
    run(s, m, steps=8)
    counters = COUNTERS + (("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
                           if design == "v1" else ())
    seen = {name: m.value(name) for name in counters}
    assert seen["vllm:num_preemptions_total"] > 0 and len(m._last_token_time) >= 2
    failed, kept = list(m._last_token_time)[:2]
    fresh = recovered(s)
    version = m.version
    m.record_recovery(fresh, recomputed_tokens=123, failed=[failed])
    assert m.version == version + 1                                      # one apply
    assert m.value("course:engine_recoveries_total") == 1
    assert m.value("course:recomputed_tokens_total") == 123
    assert {name: m.value(name) for name in counters} == seen            # nothing counted twice
    assert m.value("vllm:num_requests_running") == 0
    assert m.value("vllm:num_requests_waiting") == 2
    assert m.value("vllm:kv_cache_usage_perc" if design == "v1"
                   else "vllm:gpu_cache_usage_perc") == 0.0
    assert failed not in m._last_token_time and kept in m._last_token_time
    before = dict(seen)
    t = 8
    while fresh.has_unfinished_requests():
        t += 1
        step(fresh, m, 0.5 * t)
        now = {name: m.value(name) for name in counters}
        assert all(now[name] >= before[name] for name in counters), (before, now)
        before = now
    assert m.value("vllm:num_preemptions_total") == fresh.num_preemptions
    assert m.value("vllm:prompt_tokens_total") == fresh.num_prompt_tokens
    assert m.value("vllm:generation_tokens_total") == fresh.num_generated_tokens \
        == seen["vllm:generation_tokens_total"] + 2 * 6
    if design == "v1":
        stats = fresh.block_manager.prefix_cache_stats
        assert m.value("vllm:prefix_cache_queries_total") == stats.queries
        assert m.value("vllm:prefix_cache_hits_total") == stats.hits > 0
    m.record_recovery(small_scheduler() if design == "v0" else small_v1_scheduler(), 0, [])
    assert m.value("vllm:generation_tokens_total") == fresh.num_generated_tokens  # no way back
    assert m.value("course:engine_recoveries_total") == 2


def test_a_fault_in_record_recoverys_reads_applies_nothing():
    def make():
        s = small_scheduler()
        m = Metrics(s)
        for i in range(6):
            s.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=20))
        run(s, m, steps=5)
        fresh, failed = recovered(s), list(m._last_token_time)[:1]
        return m, lambda: m.record_recovery(fresh, 40, failed)
    assert check_all_or_nothing(make) >= 4


# ------------------------------------------------------- a scrape beside a running step
class FakeRequest:
    is_finished = False


class LockstepScheduler:
    """What Metrics reads of a scheduler, with counters that move in lockstep: after step k,
    k preemptions, k prompt tokens and ``WIDTH`` * k generated tokens. ``WIDTH`` requests get
    a token every step, so a whole step's scrape has ``WIDTH`` * (k - 1) inter-token
    latencies, and any scrape with other counts saw part of a step."""

    WIDTH = 200

    def __init__(self) -> None:
        self.cache_config = CacheConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8)
        self.running, self.waiting, self.swapped = [], [], []
        self.block_manager = SimpleNamespace(usage=lambda device: SimpleNamespace(
            block_usage=0.0), prefix_cache_stats=SimpleNamespace(queries=0, hits=0))
        self.num_preemptions = self.num_prompt_tokens = self.num_generated_tokens = 0
        self.requests = [FakeRequest() for _ in range(self.WIDTH)]

    def step(self, metrics: Metrics, now: float) -> None:
        self.num_preemptions += 1
        self.num_prompt_tokens += 1
        self.num_generated_tokens += self.WIDTH
        metrics.record_step(self, self.requests, [], now)


def half_a_step(text: str) -> bool:
    v = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
         if s.labels.get("le") is None}
    k, width = v["vllm:num_preemptions_total"], LockstepScheduler.WIDTH
    return (v["vllm:prompt_tokens_total"], v["vllm:generation_tokens_total"],
            v["vllm:time_per_output_token_seconds_count"]) != (k, width * k,
                                                               width * max(k - 1, 0))


def scrapes_racing_steps(locked: bool, steps: int = 1000) -> tuple[int, int]:
    """Scrape /metrics over HTTP while another thread records ``steps`` steps of a
    :class:`LockstepScheduler` (thread switches forced every microsecond); returns
    (scrapes, scrapes that saw half a step). ``locked=False`` takes the registry's lock
    away: the detector's input."""
    s = LockstepScheduler()
    m = Metrics(s, design="v0")
    if not locked:
        m.registry.lock = contextlib.nullcontext()
    done = threading.Event()

    def stepping() -> None:
        try:
            for t in range(steps):
                s.step(m, float(t))
        finally:
            done.set()

    interval = sys.getswitchinterval()
    scrapes = halves = 0
    with serving(m) as url:
        sys.setswitchinterval(1e-6)
        thread = threading.Thread(target=stepping)
        thread.start()
        try:
            while not done.is_set() or not scrapes:
                scrapes += 1
                halves += half_a_step(get(url)[1])
        finally:
            sys.setswitchinterval(interval)
            thread.join()
    assert m.value("vllm:num_preemptions_total") == steps
    return scrapes, halves


def test_a_scrape_racing_many_steps_never_sees_half_of_one():
    scrapes, halves = scrapes_racing_steps(locked=True)
    assert scrapes >= 10 and halves == 0


def test_without_the_lock_a_scrape_racing_the_steps_sees_half_of_one():
    """The detector of the test above: the registry without its lock, the same race. (A
    step's apply is about a hundred microseconds here; most scrapes land in one.)"""
    scrapes, halves = scrapes_racing_steps(locked=False)
    assert halves > 0, f"{scrapes} scrapes, none saw half a step"


@pytest.mark.parametrize("held", ["read", "apply", "apply without the lock"])
def test_a_scrape_waits_for_an_apply_never_for_a_step(held):
    """Step 2 is held inside its reads (``block_manager.usage``) or inside its apply (the
    generation counter's ``inc``), in another thread, while /metrics is scraped. Held in
    its reads: the scrape is answered at once, with step 1. Held in its apply: the scrape
    waits for the apply (microseconds in real life), then has step 2 whole. Without the
    registry's lock (the detector's input) that scrape is answered at once, with half of
    step 2: its gauges beside step 1's token counts."""
    s = small_scheduler()
    m = Metrics(s)
    if held == "apply without the lock":
        m.registry.lock = contextlib.nullcontext()
    for i in range(4):
        s.add_request(i, tuple(range(1, 13)), SamplingParams(max_tokens=4))
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        assert release.wait(30)

    real_usage, real_counter = s.block_manager.usage, m.generation_tokens

    class HeldCounter:                           # what the apply calls: inc waits for release
        def labels(self, *values):
            child = real_counter.labels(*values)
            return SimpleNamespace(inc=lambda amount: (hold(), child.inc(amount)))

    with serving(m) as url:
        step(s, m, 0.5)
        step1 = get(url)[1]
        if held == "read":
            s.block_manager.usage = lambda *a: (hold(), real_usage(*a))[1]
        else:
            m.generation_tokens = HeldCounter()
        stepping = threading.Thread(target=step, args=(s, m, 1.0))
        stepping.start()
        got: list[str] = []
        scraper = threading.Thread(target=lambda: got.append(get(url)[1]))
        try:
            assert entered.wait(30)
            scraper.start()
            scraper.join(timeout=0.5 if held == "apply" else 30)
            answered_while_held = not scraper.is_alive()
        finally:
            release.set()
            stepping.join(30)
            scraper.join(30)
        step2 = get(url)[1]
    assert step2 != step1 and 'vllm:generation_tokens_total{model_name="course-model"} ' \
        f"{s.num_generated_tokens}.0" in step2
    if held == "read":
        assert answered_while_held and got == [step1]
    elif held == "apply":
        assert not answered_while_held and got == [step2]
    else:
        assert answered_while_held and got[0] not in (step1, step2)      # half a step
