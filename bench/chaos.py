"""Chaos soak: random requests through the engine with faults injected and bad input thrown at
it, beside a clean run of the same workload (printed, never asserted).

The workload: requests with random prompts (bytes), greedy, seeded sampling with n > 1, or
beam search, arriving a few per step, through a small KV pool with swap space and prefix
caching, so that preemption by swap and recompute, copy-on-write and cache hits all happen.
Into the faulty run go:

* one-shot faults at random calls of the model forward, the sampler, the swap and the
  copy-on-write cache operations and the scheduler's update (a transient failure: the step is
  rolled back and raises ``StepFailed``, or, for a sampler fault, the request it hit ends with
  ``finish_reason="error"``);
* "poisoned" requests whose sampling always fails (each must end alone as an error);
* bad input between the steps (NaN temperature, a float token id, a string seed, a token past
  the vocabulary, an empty prompt, a duplicate request id), each of which must be refused
  with a ``ValueError`` and queue nothing.

Printed: faults injected by point, steps rolled back, bad inputs refused, requests finished
by reason, requests not hit by a fault whose tokens equal the clean run's, and blocks leaked
at the end (must be 0).

    python bench/chaos.py            # 300 requests (about a minute on 2 cores)
    python bench/chaos.py --quick    # 40 requests, for a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from course_lib.config import CacheConfig, SchedulerConfig  # noqa: E402
from course_lib.device import describe  # noqa: E402
from course_lib.engine import llm_engine, model_runner  # noqa: E402
from course_lib.engine.llm_engine import LLMEngine  # noqa: E402
from course_lib.engine.rollback import StepFailed  # noqa: E402
from course_lib.model.loader import load_tiny_model  # noqa: E402
from course_lib.sequence import SamplingParams  # noqa: E402

POINTS = ("forward", "sampler", "swap", "copy", "update")
BAD_INPUTS = [
    ("NaN temperature", lambda e: e.add_request("x", SamplingParams(temperature=math.nan))),
    ("float token id", lambda e: e.add_request([65, 65.9])),
    ("string seed", lambda e: e.add_request("x", SamplingParams(seed="abc"))),
    ("token past the vocabulary", lambda e: e.add_request([1, 10_000])),
    ("empty prompt", lambda e: e.add_request([])),
    ("duplicate request id", lambda e: e.add_request(
        "x", request_id=next(iter(e.scheduler.waiting or e.scheduler.running)).request_id)),
]


def make_workload(num_requests: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 256) for _ in range(24)]       # a system prompt some reuse
    work = []
    for i in range(num_requests):
        own = [rng.randrange(1, 256) for _ in range(rng.randint(3, 30))]
        prompt = shared[:rng.choice([0, 8, 24])] + own
        kind = rng.random()
        if kind < 0.5:
            params = SamplingParams(max_tokens=rng.randint(4, 24), temperature=0.0)
        elif kind < 0.8:
            params = SamplingParams(max_tokens=rng.randint(4, 20), n=rng.randint(2, 3),
                                    temperature=0.8, seed=i)
        else:
            params = SamplingParams(max_tokens=rng.randint(4, 12), beam_width=rng.randint(2, 3))
        work.append((prompt, params))
    return work


# Probability of a fault per call: the forward, the swaps and the copies run once per step;
# the sampler once per sampling sequence (a fault there ends that request: keep it rare).
FAULT_P = {"forward": 0.04, "sampler": 0.002, "swap": 0.05, "copy": 0.05, "update": 0.02}


class Chaos:
    """Injects one-shot faults at each point with probability ``FAULT_P[point]`` per call."""

    def __init__(self, seed: int, poisoned: set[int]) -> None:
        self.rng, self.poisoned = random.Random(seed), poisoned
        self.injected: Counter = Counter()

    def wrap(self, point, fn):
        def wrapped(*args, **kwargs):
            if self.rng.random() < FAULT_P[point]:
                self.injected[point] += 1
                raise RuntimeError(f"chaos at {point}")
            return fn(*args, **kwargs)
        return wrapped

    def install(self, engine: LLMEngine) -> None:
        engine.runner.execute_model = self.wrap("forward", engine.runner.execute_model)
        real_sample = llm_engine.sample

        def sample(entry, logits, base_seed):
            if entry.request.request_id in self.poisoned:
                raise FloatingPointError("poisoned request")
            return real_sample(entry, logits, base_seed)

        llm_engine.sample = self.wrap("sampler", sample)
        model_runner.swap_blocks = self.wrap("swap", model_runner.swap_blocks)
        attn = engine.runner.attn
        engine.runner.attn = dataclasses.replace(attn, copy_blocks=self.wrap("copy",
                                                                             attn.copy_blocks))
        engine.scheduler.update = self.wrap("update", engine.scheduler.update)


def run(model, work, *, chaos: Chaos | None = None, bad_every: int = 0, seed: int = 0):
    engine = LLMEngine(model, SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=128,
                                              max_model_len=256, preemption_mode="swap"),
                       CacheConfig(block_size=4, num_gpu_blocks=48, num_cpu_blocks=96,
                                   watermark=0.0, enable_prefix_caching=True),
                       stop_token_ids=())
    saved = (llm_engine.sample, model_runner.swap_blocks)
    if chaos is not None:
        chaos.install(engine)
    rng = random.Random(seed)
    outs, rolled_back, refused, added, steps = {}, 0, Counter(), 0, 0
    try:
        while added < len(work) or engine.has_unfinished_requests():
            for _ in range(rng.randint(0, 3)):
                if added < len(work):
                    engine.add_request(*work[added], request_id=added)
                    added += 1
            if bad_every and steps % bad_every == 0:
                name, bad = BAD_INPUTS[(steps // bad_every) % len(BAD_INPUTS)]
                queued = engine.scheduler.has_unfinished_requests(), len(engine.scheduler.waiting)
                try:
                    bad(engine)
                except ValueError:
                    assert (engine.scheduler.has_unfinished_requests(),
                            len(engine.scheduler.waiting)) == queued, f"{name} queued something"
                    refused[name] += 1
            try:
                for o in engine.step():
                    outs[o.request_id] = o
            except StepFailed:
                rolled_back += 1
            steps += 1
        engine.check_invariants()
    finally:
        llm_engine.sample, model_runner.swap_blocks = saved
    bm = engine.block_manager
    leaked = (bm.num_gpu_blocks - bm.num_free_gpu_blocks) + \
        (bm.num_cpu_blocks - bm.num_free_cpu_blocks)
    return outs, rolled_back, refused, leaked, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 requests instead of 300")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = 40 if args.quick else 300
    model = load_tiny_model()
    work = make_workload(n, args.seed)
    poisoned = set(random.Random(args.seed + 1).sample(range(n), max(1, n // 30)))
    print(f"machine: {describe()}; one thread")
    print(f"workload: {n} requests (greedy, seeded n = 2-3, beams of 2-3), pool of 48 + 96 "
          f"blocks of 4, swap preemption, prefix caching; {len(poisoned)} poisoned requests")
    t0 = time.perf_counter()
    clean, _, _, clean_leak, clean_steps = run(model, work)
    chaos = Chaos(seed=args.seed, poisoned=poisoned)
    faulty, rolled_back, refused, leaked, steps = run(model, work, chaos=chaos, bad_every=7,
                                                      seed=args.seed)
    elapsed = time.perf_counter() - t0
    reasons = Counter(o.finish_reason for o in faulty.values())
    hit = {rid for rid, o in faulty.items() if o.finish_reason == "error"}
    same = sum(1 for rid, o in faulty.items() if rid not in hit
               and [c.token_ids for c in o.outputs] == [c.token_ids for c in clean[rid].outputs])
    print(f"faults injected: {sum(chaos.injected.values())} "
          f"({', '.join(f'{p} {chaos.injected[p]}' for p in POINTS)})")
    print(f"steps: {steps} ({clean_steps} in the clean run), rolled back and retried: "
          f"{rolled_back}")
    print(f"bad inputs refused: {sum(refused.values())} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(refused.items()))})")
    print(f"requests finished: {len(faulty)} of {n} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))}); poisoned ended as "
          f"errors: {len(poisoned & hit)} of {len(poisoned)}; other errors (an injected fault "
          f"that struck the same request twice in a row): {len(hit - poisoned)}")
    print(f"requests not hit by a fault with the clean run's tokens: {same} of "
          f"{len(faulty) - len(hit)}")
    print(f"blocks leaked: {leaked} (clean run: {clean_leak})")
    print(f"wall time: {elapsed:.1f} s for both runs")


if __name__ == "__main__":
    main()
