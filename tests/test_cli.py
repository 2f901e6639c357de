"""`python -m course_lib`: generate text, and replay a trace while serving /metrics."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from course_lib.__main__ import main
from course_lib.engine.llm_engine import LLMEngine
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


def test_beam_search_shows_where_the_model_ended_a_verse(capsys) -> None:
    """The model emits <eos><bos> between verses; beam search runs past it, and the text
    without special tokens glues two verses ("Israel.And"): the CLI names them instead."""
    from course_lib.__main__ import shown_text
    from course_lib.config import CacheConfig

    assert main(["generate", "And God said", "--beam-width", "4", "--max-tokens", "60"]) == 0
    printed = capsys.readouterr().out.splitlines()
    engine = LLMEngine(cache_config=CacheConfig(block_size=16, num_gpu_blocks=256))
    beams = engine.generate("And God said", SamplingParams(max_tokens=60, beam_width=4))[0]
    texts = [shown_text(c.token_ids, engine.stop_token_ids) for c in beams.outputs]
    assert printed[0:8:2] == [f"[{i}]And God said{t}" for i, t in enumerate(texts)]
    assert printed[1] == f"    (60 byte tokens, logprob {beams.outputs[0].cumulative_logprob:.2f}" \
                         ", length)"
    for c, text in zip(beams.outputs, texts, strict=True):
        assert "Israel.And" in c.text                          # what the CLI printed before
        assert "Israel.<eos><bos>And" in text
        assert text.replace("<eos>", "").replace("<bos>", "") == c.text   # nothing else
    assert printed[-1].startswith("<eos><bos>: the model ended a verse")


def test_shown_text_names_inner_specials_only() -> None:
    from course_lib.__main__ import shown_text

    said = list(b" said.")
    assert shown_text(said + [257], {257}) == " said."        # a final stop token: dropped
    assert shown_text(said + [257, 256] + list(b"And"), {257}) == " said.<eos><bos>And"
    assert shown_text(said, {257}) == " said."


def test_help_says_what_to_expect(capsys) -> None:
    for cmd in ("generate", "serve-metrics"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tokens are bytes: 60 tokens is about 12 words" in text       # --max-tokens
    assert "200 requests in about 8 s" in text and "2,000 in about 10 s" in text
    assert "they read 0" in text and "--hold S keeps it up S more seconds" in text
    assert "curl it from a second one" in text


def cli(args: list[str], capsys) -> tuple[int, str]:
    """``main(args)``'s exit status (argparse's own errors exit 2) and what it printed on
    stderr."""
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_bad_values_give_one_line_errors(capsys) -> None:
    code, err = cli(["generate", "x", "--temperature", "-1"], capsys)
    assert code == 2 and "argument --temperature: must be a finite number >= 0, got -1" in err
    code, err = cli(["generate", "x", "--temperature", "nan"], capsys)
    assert code == 2 and err.splitlines()[-1].endswith(
        "argument --temperature: must be a finite number >= 0, got nan")
    for bad in (["generate", "x", "--max-tokens", "0"], ["serve-metrics", "--port", "70000"],
                ["serve-metrics", "--port", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            main(bad)
        assert exit_.value.code == 2
        assert "Traceback" not in capsys.readouterr().err


# Every option of every subcommand, with bad values: (arguments, the message's end). argparse
# refuses them before anything runs (its usage line, then "error: argument --x: ...").
FREE = ["serve-metrics", "--model-free", "--no-progress", "--num-requests", "2"]
REFUSED_BY_ARGPARSE = [
    (["generate", "x", "--max-tokens", v], f"--max-tokens: must be an integer >= 1, got {g}")
    for v, g in (("0", "0"), ("-3", "-3"), ("2.5", "'2.5'"), ("many", "'many'"))
] + [
    (["generate", "x", "--n", "0"], "--n: must be an integer >= 1, got 0"),
    (["generate", "x", "--beam-width", "-1"], "--beam-width: must be an integer >= 1, got -1"),
    (["generate", "x", "--temperature", "inf"], "--temperature: must be a finite number >= 0, "
                                                "got inf"),
    (["generate", "x", "--top-p", "0"], "--top-p: must be a finite number in (0, 1], got 0"),
    (["generate", "x", "--top-p", "1.5"], "--top-p: must be a finite number in (0, 1], got 1.5"),
    (["generate", "x", "--top-p", "nan"], "--top-p: must be a finite number in (0, 1], got nan"),
    (["generate", "x", "--seed", "-1"], "--seed: must be an integer in [0, 2**64 - 1], got -1"),
    (["generate", "x", "--seed", str(2 ** 64)], "--seed: must be an integer in [0, 2**64 - 1], "
                                                f"got {2 ** 64}"),
    (["generate", "x", "--block-size", "12"], "--block-size: must be a power of two in "
                                              "[1, 256], got 12"),
    (["generate", "x", "--block-size", "0"], "--block-size: must be a power of two in [1, 256], "
                                             "got 0"),
    (["generate", "x", "--block-size", "1024"], "--block-size: must be a power of two in "
                                                "[1, 256], got 1024"),
    (FREE + ["--hold", "inf"], "--hold: must be a number of seconds in [0, 604800], got inf"),
    (FREE + ["--hold", "nan"], "--hold: must be a number of seconds in [0, 604800], got nan"),
    (FREE + ["--hold", "-1"], "--hold: must be a number of seconds in [0, 604800], got -1"),
    (FREE + ["--hold", "1e300"], "--hold: must be a number of seconds in [0, 604800], got 1e300"),
    (FREE + ["--hold", "soon"], "--hold: must be a number of seconds in [0, 604800], got 'soon'"),
    (FREE + ["--rate", "0"], "--rate: must be a finite number > 0 (or inf), got 0"),
    (FREE + ["--rate", "-2"], "--rate: must be a finite number > 0 (or inf), got -2"),
    (FREE + ["--rate", "nan"], "--rate: must be a finite number > 0 (or inf), got nan"),
    (FREE + ["--rate=-inf"], "--rate: must be a finite number > 0 (or inf), got -inf"),
    (FREE + ["--seed", "-1"], "--seed: must be an integer in [0, 2**64 - 1], got -1"),
    (FREE + ["--num-requests", "0"], "--num-requests: must be an integer in [1, 100000], got 0"),
    (FREE + ["--num-requests", "100001"], "--num-requests: must be an integer in [1, 100000], "
                                          "got 100001"),
    (FREE + ["--num-requests", "1e3"], "--num-requests: must be an integer in [1, 100000], "
                                       "got '1e3'"),
    (FREE + ["--num-gpu-blocks", "0"], "--num-gpu-blocks: must be an integer in [1, 1048576], "
                                       "got 0"),
    (FREE + ["--num-gpu-blocks", "1000000000"], "--num-gpu-blocks: must be an integer in "
                                                "[1, 1048576], got 1000000000"),
    (FREE + ["--block-size", "3"], "--block-size: must be a power of two in [1, 256], got 3"),
    (FREE + ["--port", "65536"], "--port: must be a TCP port (0: any free one) in [0, 65535], "
                                 "got 65536"),
    (FREE + ["--port", "http"], "--port: must be a TCP port (0: any free one) in [0, 65535], "
                                "got 'http'"),
    (FREE + ["--trace", "gsm8k"], "--trace: invalid choice: 'gsm8k' (choose from 'sharegpt', "
                                  "'alpaca')"),
    (FREE + ["--preemption-mode", "kill"], "--preemption-mode: invalid choice: 'kill'"),
    (["serve"], "argument command: invalid choice: 'serve'"),
    ([], "the following arguments are required: command"),
]


@pytest.mark.parametrize("args, message", REFUSED_BY_ARGPARSE,
                         ids=[" ".join(a[-2:]) or "none" for a, _ in REFUSED_BY_ARGPARSE])
def test_every_option_refuses_bad_values_before_anything_runs(args, message, capsys) -> None:
    code, err = cli(args, capsys)
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("python -m course_lib") and "error: " in last
    assert last.endswith(message) or message in last, last


@pytest.mark.parametrize("args, message", [
    (["generate", "x", "--top-p", "1e-46", "--temperature", "1"],
     "error: top_p must be in (2**-150, 1], got 1e-46: the sampler compares it in float32"),
    (["generate", "x", "--n", "2", "--beam-width", "2"], "error: use either n > 1"),
    (["generate", "ab\udcff"], "error: prompt 0: the prompt text must be valid Unicode"),
    (["serve-metrics", "--num-gpu-blocks", "4097", "--no-progress"],
     "error: --num-gpu-blocks must be in [1, 4096] for the engine with --block-size 16"),
])
def test_values_the_library_refuses_are_one_line_errors(args, message, capsys) -> None:
    code, err = cli(args, capsys)
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err


def test_ctrl_c_during_hold_is_one_line_and_status_130() -> None:
    import signal

    cmd = [sys.executable, "-m", "course_lib", "serve-metrics", "--model-free", "--no-progress",
           "--num-requests", "2", "--hold", "60"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:                  # up to the hold (or an early end)
            if line.startswith("holding /metrics"):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and err == "interrupted\n"


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
            tokens = int(re.search(r"(\d+) tokens \(bytes\) generated in", summary)[1])
            assert after["vllm:generation_tokens_total"] == tokens
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "20/20" in err                         # the tqdm bar reached the end
    assert "GET /metrics" not in err              # the server logs no line per scrape
