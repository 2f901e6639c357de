"""`python -m course_lib`: generate text, and replay a trace while serving /metrics."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from course_lib.__main__ import main
from course_lib.engine import LLMEngine
from course_lib.sequence import SamplingParams

pytestmark = pytest.mark.ch10
ROOT = Path(__file__).resolve().parents[1]


def test_generate_prints_the_engines_greedy_text(capsys) -> None:
    assert main(["generate", "And God said", "--max-tokens", "20"]) == 0
    printed = capsys.readouterr().out
    want = LLMEngine().generate("And God said", SamplingParams(max_tokens=20,
                                                               temperature=0.0))[0].text
    assert printed == f"And God said{want}\n"


def test_generate_with_n_samples_prints_each_and_is_seeded(capsys) -> None:
    args = ["generate", "And God said", "--max-tokens", "12", "--n", "2", "--temperature",
            "0.8", "--seed", "0"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.count("[0]And God said") == 1 and first.count("[1]And God said") == 1
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_bad_values_give_one_line_errors(capsys) -> None:
    assert main(["generate", "x", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
    assert main(["generate", "x", "--temperature", "nan"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: temperature must be a finite number") and err.count("\n") == 1
    for bad in (["generate", "x", "--max-tokens", "0"], ["serve-metrics", "--port", "70000"],
                ["serve-metrics", "--port", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            main(bad)
        assert exit_.value.code == 2
        assert "Traceback" not in capsys.readouterr().err


def test_a_port_in_use_is_a_one_line_error(capsys) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve-metrics", "--port", str(port), "--model-free", "--num-requests",
                     "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1


def test_a_request_that_is_not_served_exits_non_zero(capsys) -> None:
    assert main(["generate", "x" * 300, "--max-tokens", "4"]) == 1     # past the context
    err = capsys.readouterr().err
    assert "not served (ignored)" in err and "max_model_len" in err


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'^(vllm:\w+)\{model_name="[^"]+"\} (\S+)$',
                                                    text, re.M)}


@pytest.mark.parametrize("model_free", [False, True])
def test_serve_metrics_replays_a_trace_with_progress_and_serves_metrics(model_free) -> None:
    cmd = [sys.executable, "-m", "course_lib", "serve-metrics", "--port", "0",
           "--num-requests", "20", "--hold", "30"]
    cmd += ["--num-gpu-blocks", "64" if model_free else "32"]
    if model_free:
        cmd.append("--model-free")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        url = re.search(r"serving (http://127\.0\.0\.1:\d+/metrics)", proc.stdout.readline())[1]
        first = scrape(url)                       # answered while the replay runs (or after)
        assert "vllm:num_requests_running" in first and "vllm:gpu_cache_usage_perc" in first
        summary = proc.stdout.readline()
        assert summary.startswith("replay (model-free)" if model_free else "replay (engine)")
        assert proc.stdout.readline().startswith("holding /metrics")
        after = scrape(url)
        assert after["vllm:generation_tokens_total"] > 0
        assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
        if not model_free:
            tokens = int(re.search(r"(\d+) tokens in", summary)[1])
            assert after["vllm:generation_tokens_total"] == tokens
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "20/20" in err                         # the tqdm bar reached the end
