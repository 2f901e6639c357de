"""Command line: generate text with the tiny model, or replay a trace while serving /metrics.

    python -m course_lib generate "And God said" --max-tokens 40
    python -m course_lib generate "And God said" --n 2 --temperature 0.8 --seed 0
    python -m course_lib generate "And God said" --beam-width 4
    python -m course_lib serve-metrics --port 8000 --num-requests 200 --hold 60
    python -m course_lib serve-metrics --model-free --num-requests 2000 --hold 60

The tiny model's tokens are bytes: one token is one character of English text, so
``--max-tokens 60`` is about 12 words.

``serve-metrics`` prints the URL of ``/metrics`` (127.0.0.1 only) first, then replays the
trace with a progress bar, the metrics moving while it runs: through the real engine and model
(default), or through the model-free replay of ``course_lib.sim.replay`` (``--model-free``: the
scheduler and block manager with a cost model). With ``--hold S`` the server stays up S seconds
after the replay, for ``curl`` or Prometheus; ``serve-metrics --help`` says what to expect.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Collection, Sequence

# Upper bounds of the CLI's own (the library checks the rest): beyond them a run would take
# hours or exhaust memory instead of failing at once.
MAX_NUM_REQUESTS = 100_000        # model-free: 2,000 in about 10 s; the engine: 200 in 8 s
MAX_MODEL_FREE_BLOCKS = 2 ** 20   # the model-free block manager's bookkeeping stays small
MAX_HOLD_S = 7 * 24 * 3600        # a week; time.sleep overflows near 2**63 ns
MAX_SEED = 2 ** 64 - 1            # SamplingParams' seed range
ENGINE_MAX_NUM_SEQS, ENGINE_MAX_MODEL_LEN = 256, 256     # serve-metrics' engine


def _int_in(lo: int, hi: int | None = None, what: str = "an integer",
            hi_text: str | None = None) -> Callable[[str], int]:
    """argparse type: an integer in ``[lo, hi]`` (``hi`` None: no bound, ``hi_text``: how the
    message writes it); the message names the range (argparse prefixes the option's name)."""
    where = f"{what} >= {lo}" if hi is None else f"{what} in [{lo}, {hi_text or hi}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {where}, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {where}, got {text}")
        return value
    return parse


def _real_in(lo: float, hi: float | None = None, *, lo_open: bool = False,
             inf: bool = False, what: str = "a finite number") -> Callable[[str], float]:
    """argparse type: a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``; ``hi``
    None: no bound), or ``inf`` where ``inf`` says so; never nan."""
    if hi is None:
        where = f"{what} {'>' if lo_open else '>='} {lo:g}"
    else:
        where = f"{what} in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    where += " (or inf)" if inf else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {where}, got {text!r}") from None
        if value == math.inf and inf:
            return value
        if not math.isfinite(value) or value < lo or (lo_open and value == lo) \
                or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {where}, got {text}")
        return value
    return parse


def _block_size(text: str) -> int:
    """argparse type: a power of two in [1, 256], as ``CacheConfig`` wants it."""
    value = _int_in(1, 256, "a power of two")(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two in [1, 256], got {text}")
    return value


_positive_int = _int_in(1)
_port = _int_in(0, 65535, "a TCP port (0: any free one)")
_seed = _int_in(0, MAX_SEED, hi_text="2**64 - 1")


SERVE_METRICS_HELP = """\
Replay a trace and serve its metrics, with vLLM's Prometheus names, on
http://127.0.0.1:PORT/metrics while it runs.

How long: the real engine and tiny model (the default) replay 200 requests in
about 8 s on one CPU thread; --model-free runs the scheduler with a cost model
instead of the model, 200 requests in about a second and 2,000 in about 10 s
(its summary's duration_s is the time it models, not the time it took).

What you see: while the replay runs, the gauges move (vllm:num_requests_running,
vllm:num_requests_waiting, vllm:gpu_cache_usage_perc). Once it is over they read
0 (nothing runs, every block is free), while the counters and histograms keep
their final values (vllm:num_preemptions_total, vllm:generation_tokens_total,
vllm:time_to_first_token_seconds_*). The server stops with the replay unless
--hold S keeps it up S more seconds.

Start it in one terminal, then curl it from a second one:
  python -m course_lib serve-metrics --port 8000 --num-requests 200 --hold 60
  curl -s 127.0.0.1:8000/metrics | grep vllm:

The answer is the classic text format whatever the scraper asks for, so a
Prometheus server stores the names with their colons, as curl shows them.
"""

TOKENS_ARE_BYTES = "the tiny model's tokens are bytes: 60 tokens is about 12 words"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m course_lib", description=__doc__.split(
        "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt with the tiny model",
                         description="Generate text from a prompt with the tiny model through "
                         f"the paged KV cache ({TOKENS_ARE_BYTES}).")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=_positive_int, default=40,
                     help=f"tokens to generate (default 40); {TOKENS_ARE_BYTES}")
    gen.add_argument("--n", type=_positive_int, default=1, help="parallel samples")
    gen.add_argument("--beam-width", type=_positive_int, default=1,
                     help="beam search (runs every beam to --max-tokens, past <eos>)")
    gen.add_argument("--temperature", type=_real_in(0.0), default=0.0,
                     help="0: greedy")
    gen.add_argument("--top-p", type=_real_in(0.0, 1.0, lo_open=True), default=1.0)
    gen.add_argument("--seed", type=_seed, default=None)
    gen.add_argument("--block-size", type=_block_size, default=16,
                     help="tokens (bytes) per KV block")
    srv = sub.add_parser("serve-metrics", help="replay a trace while serving /metrics",
                         description=SERVE_METRICS_HELP,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    srv.add_argument("--port", type=_port, default=0, help="0: any free port")
    srv.add_argument("--trace", choices=("sharegpt", "alpaca"), default="sharegpt",
                     help="request lengths: ShareGPT-like (chats, long answers) or "
                     "Alpaca-like (short instructions); for the engine, fitted to the model's "
                     "256-byte context")
    srv.add_argument("--num-requests", type=_int_in(1, MAX_NUM_REQUESTS), default=200)
    srv.add_argument("--rate", type=_real_in(0.0, lo_open=True, inf=True),
                     default=float("inf"), help="requests per second (Poisson); default: all "
                     "at once (the engine replays in real time: N requests take N / rate s)")
    srv.add_argument("--seed", type=_seed, default=0)
    srv.add_argument("--num-gpu-blocks", type=_int_in(1, MAX_MODEL_FREE_BLOCKS), default=None,
                     help="KV pool (default: 128 for the engine, 2048 model-free; the engine "
                     f"takes at most {ENGINE_MAX_NUM_SEQS} sequences x {ENGINE_MAX_MODEL_LEN} "
                     "tokens' worth)")
    srv.add_argument("--block-size", type=_block_size, default=16, help="tokens per KV block")
    srv.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    srv.add_argument("--model-free", action="store_true",
                     help="the cost-model replay (no model), at the lengths of a 2,048-token "
                     "server (a real model's tokens there, not bytes)")
    srv.add_argument("--hold", type=_real_in(0.0, MAX_HOLD_S, what="a number of seconds"),
                     default=0.0, help="seconds to keep serving after the replay (default 0: "
                     "the server stops with it; Ctrl-C stops it earlier)")
    srv.add_argument("--no-progress", action="store_true")
    return parser


def shown_text(token_ids: Sequence[int], stop_token_ids: Collection[int]) -> str:
    """A completion as the CLI prints it: its bytes as text, a final stop token left out (as
    ``CompletionOutput.text`` does), and each special token *inside* it written by name.

    The model was trained on verses, each ``<bos> ... <eos>``, so after a verse it emits
    ``<eos><bos>`` and starts the next one with no space in between. Greedy decoding and
    sampling stop at ``<eos>``; beam search runs every beam to ``--max-tokens``, so a beam can
    hold ``<eos><bos>``. ``CompletionOutput.text`` drops special tokens (as vLLM's
    ``skip_special_tokens`` does) and shows two verses glued together ("Israel.And"); here the
    verse break stays visible ("Israel.<eos><bos>And")."""
    from .model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    ids = [int(i) for i in token_ids]
    if ids and ids[-1] in stop_token_ids:
        ids.pop()
    parts, run = [], []
    for i in ids:
        if i < 256:
            run.append(i)
        else:
            parts += [tok.decode(run), tok.token_str(i)]
            run = []
    return "".join(parts) + tok.decode(run)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .config import CacheConfig
    from .engine.llm_engine import LLMEngine
    from .sequence import SamplingParams

    torch.set_num_threads(1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, n=args.n,
                            beam_width=args.beam_width)
    engine = LLMEngine(cache_config=CacheConfig(block_size=args.block_size, num_gpu_blocks=256))
    out = engine.generate(args.prompt, params)[0]
    if out.finish_reason in ("ignored", "error", "abort"):
        print(f"error: the request was not served ({out.finish_reason}): {out.finish_detail}",
              file=sys.stderr)
        return 1
    verse_breaks = False
    for c in out.outputs:
        label = f"[{c.index}]" if len(out.outputs) > 1 else ""
        text = shown_text(c.token_ids, engine.stop_token_ids)
        verse_breaks |= text != c.text               # a special token inside it
        print(f"{label}{args.prompt}{text}")
        if len(out.outputs) > 1 or args.beam_width > 1:
            print(f"    ({len(c.token_ids)} byte tokens, logprob "
                  f"{c.cumulative_logprob:.2f}, {c.finish_reason})")
    if verse_breaks:
        print("<eos><bos>: the model ended a verse there and began the next one (beam search "
              "does not stop a beam at <eos>)")
    return 0


def cmd_serve_metrics(args: argparse.Namespace) -> int:
    import torch

    from .scheduler.metrics import serve_metrics

    torch.set_num_threads(1)
    progress = not args.no_progress
    if args.model_free:
        from .config import CacheConfig, SchedulerConfig
        from .sim.replay import replay
        from .sim.traces import alpaca_like, sharegpt_like

        make = sharegpt_like if args.trace == "sharegpt" else alpaca_like
        trace = make(args.num_requests, seed=args.seed, rate=args.rate)
        served = []

        def serve(metrics):                    # /metrics is up before the first step
            served.extend(serve_metrics(metrics, args.port))
            print(f"serving http://127.0.0.1:{served[1]}/metrics", flush=True)

        result = replay(trace, SchedulerConfig(preemption_mode=args.preemption_mode),
                        CacheConfig(block_size=args.block_size,
                                    num_gpu_blocks=args.num_gpu_blocks or 2048,
                                    num_cpu_blocks=args.num_gpu_blocks or 2048),
                        progress=progress, on_metrics=serve)
        server, port = served
        print("replay (model-free):", result.summary(), flush=True)
    else:
        from .config import CacheConfig, SchedulerConfig
        from .engine.llm_engine import LLMEngine
        from .engine.workloads import model_trace, run_trace

        blocks = args.num_gpu_blocks or 128
        most = ENGINE_MAX_NUM_SEQS * -(-ENGINE_MAX_MODEL_LEN // args.block_size)
        if blocks > most:
            raise ValueError(f"--num-gpu-blocks must be in [1, {most}] for the engine with "
                             f"--block-size {args.block_size} ({ENGINE_MAX_NUM_SEQS} sequences "
                             f"of {ENGINE_MAX_MODEL_LEN} tokens at most: more blocks are never "
                             f"used, only allocated), got {blocks}")
        engine = LLMEngine(
            scheduler_config=SchedulerConfig(max_num_seqs=ENGINE_MAX_NUM_SEQS,
                                             max_num_batched_tokens=512,
                                             max_model_len=ENGINE_MAX_MODEL_LEN,
                                             preemption_mode=args.preemption_mode),
            cache_config=CacheConfig(block_size=args.block_size,
                                     num_gpu_blocks=blocks, num_cpu_blocks=2 * blocks),
            stop_token_ids=())
        server, port = serve_metrics(engine.metrics, args.port)
        print(f"serving http://127.0.0.1:{port}/metrics", flush=True)
        trace = model_trace(args.trace, args.num_requests, seed=args.seed, rate=args.rate)
        run = run_trace(engine, trace, progress=progress)
        print(f"replay (engine): {len(run.outputs)} requests, {run.generated_tokens} tokens "
              f"(bytes) generated in {run.duration_s:.1f} s ({run.tokens_per_s:.0f} tokens/s), "
              f"{run.num_steps} steps, {run.num_preemptions} preemptions", flush=True)
    try:
        if args.hold > 0:
            print(f"holding /metrics for {args.hold:g} s: the replay is over, so the gauges "
                  "read 0 and the counters keep their final values", flush=True)
            time.sleep(args.hold)
    finally:
        server.shutdown()
        server.server_close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; bad arguments and expected failures print one line on stderr (no
    traceback) and give a non-zero status: 2 for a bad value (argparse's own errors too),
    130 for Ctrl-C."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        return cmd_serve_metrics(args)
    except ValueError as exc:          # bad values a user can fix: one line, no traceback
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:            # `... | head`: the reader left, nothing more to say
        _quiet_stdout()
        return 1
    except OSError as exc:             # e.g. the port is in use
        print(f"error: {_one_line(exc.strerror or exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:          # Ctrl-C, e.g. to end --hold early
        print("interrupted", file=sys.stderr)
        return 130


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null, so that the interpreter's last flush
    at exit does not print "Exception ignored ... BrokenPipeError" (the recipe of Python's
    ``signal`` docs)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture)
        pass


if __name__ == "__main__":
    sys.exit(main())
