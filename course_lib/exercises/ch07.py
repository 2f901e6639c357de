"""Chapter 07 exercises: chunked prefill, the victim, recompute or swap, swap space in blocks.

References run the library: the real ``Scheduler`` for the chunks, ``last_arrived_first`` for
the victim, ``CostModel`` for the preemption choice, ``course_lib.capacity`` for swap space.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from course_lib import capacity as cap
from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import Verdict, check
from course_lib.scheduler import Scheduler, last_arrived_first
from course_lib.sequence import Request, SamplingParams
from course_lib.sim.fake_sampler import fake_samples
from course_lib.sim.replay import CostModel


def prefill_chunks(prompt_len: int, max_num_batched_tokens: int, num_decoding: int) -> list[int]:
    """Reference: the prompt's chunk in each step, while ``num_decoding`` other requests
    decode in every step (they go first and take one token each), chunked prefill on."""
    s = Scheduler(SchedulerConfig(max_num_seqs=num_decoding + 1,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=prompt_len + 10_000),
                  CacheConfig(block_size=16, num_gpu_blocks=4 * (prompt_len // 16 + 2)
                              + 4 * num_decoding * 80, watermark=0.0))

    def step() -> list[int]:
        out = s.schedule()
        s.update(out, fake_samples(out))
        return [e.num_tokens for e in out.scheduled if e.request.request_id == -1]

    for i in range(num_decoding):                  # get them decoding first
        s.add_request(i, (1, 2, 3), SamplingParams(max_tokens=10_000))
    while any(r.is_prefill for r in s.running) or s.waiting:
        step()
    s.add_request(-1, tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=1))
    chunks = []
    while any(r.request_id == -1 for r in [*s.waiting, *s.running]):
        chunks += step()
    return chunks


def pick_victim(requests: list[tuple[int, float]]) -> int:
    """Reference: which request (id, arrival time) vLLM's default policy preempts."""
    reqs = [Request(rid, (1,), SamplingParams(), arrival_time=t) for rid, t in requests]
    return last_arrived_first(reqs).request_id


def cheaper_preemption(num_tokens: int, block_size: int, kv_bytes_per_token: int,
                       s_per_token: float) -> str:
    """Reference: "recompute" or "swap" (out + in), whichever ``CostModel`` says is cheaper
    (the other constants at their defaults); a tie goes to recompute, vLLM's default."""
    cm = CostModel(s_per_token=s_per_token, kv_bytes_per_token=kv_bytes_per_token)
    blocks = -(-num_tokens // block_size)
    return "recompute" if cm.recompute_time(num_tokens) <= 2 * cm.swap_time(blocks, block_size) \
        else "swap"


def cpu_blocks(swap_space_gib: float, preset: str, block_size: int) -> int:
    """Reference: vLLM's ``swap_space`` (GiB) turned into CPU blocks of a model."""
    spec = cap.get_preset(preset)
    return cap.num_cpu_blocks(swap_space_gib, cap.block_bytes(spec, block_size))


def check_prefill_chunks(fn: Callable[[int, int, int], list[int]]) -> Verdict:
    rng = random.Random(7)
    cases = [(50, 16, 0), (50, 16, 3), (16, 16, 0), (17, 16, 0), (1, 8, 0), (100, 10, 9),
             (33, 2048, 5)]
    cases += [(rng.randrange(1, 300), rng.randrange(8, 64), rng.randrange(0, 7))
              for _ in range(15)]
    return check("7.1 prefill_chunks", fn, prefill_chunks, cases)


def check_pick_victim(fn: Callable[[list[tuple[int, float]]], int]) -> Verdict:
    rng = random.Random(8)
    cases = [([(0, 0.0)],), ([(0, 0.0), (1, 1.0), (2, 0.5)],), ([(5, 2.0), (3, 2.0)],),
             ([(9, 0.0), (1, 3.0), (4, 3.0), (2, 1.0)],)]
    for _ in range(20):
        ids = rng.sample(range(100), rng.randrange(1, 8))
        cases.append(([(i, float(rng.randrange(0, 4))) for i in ids],))
    return check("7.2 pick_victim", fn, pick_victim, cases)


def check_cheaper_preemption(fn: Callable[[int, int, int, float], str]) -> Verdict:
    cases = [(n, bs, kv, spt) for n in (16, 1000, 4096) for bs in (1, 16, 256)
             for kv, spt in ((524_288, 1e-4), (819_200, 1.7e-4), (131_072, 1e-4),
                             (524_288, 2e-5))]
    return check("7.3 cheaper_preemption", fn, cheaper_preemption, cases)


def check_cpu_blocks(fn: Callable[[float, str, int], int]) -> Verdict:
    cases = [(4.0, "llama-2-7b", 16), (0.0, "llama-2-7b", 16), (8.0, "deepseek-v3", 16),
             (4.0, "llama-3-8b", 32), (1.5, "llama-2-70b", 8), (16.0, "qwen2.5-7b", 16)]
    return check("7.4 cpu_blocks", fn, cpu_blocks, cases)
