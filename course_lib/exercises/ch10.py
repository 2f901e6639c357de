"""Chapter 10 exercises: the slots of a step, beam candidates, the memory sharing saves.

References run the library: ``course_lib.kernels.reference.slot_mapping`` (what the model
runner builds from a block table), ``course_lib.engine.sampler.sample`` for beam search (top
``2 x width`` log-probabilities), ``course_lib.engine.workloads.saving_of_tables``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from course_lib.engine.workloads import saving_of_tables
from course_lib.exercises import Verdict, check
from course_lib.kernels.reference import slot_mapping
from course_lib.scheduler.output import ScheduledSeq
from course_lib.sequence import Request, SamplingParams, Sequence


def step_slots(block_table: list[int], num_computed: int, num_new: int,
               block_size: int) -> list[int]:
    """Reference: the cache slots of tokens ``num_computed .. num_computed + num_new - 1``."""
    return slot_mapping(block_table, list(range(num_computed, num_computed + num_new)),
                        block_size)


def beam_candidates(logits: list[float], width: int) -> list[tuple[int, float]]:
    """Reference: the ``2 * width`` best (token, logprob) of one beam, best first."""
    req = Request(0, (1,), SamplingParams(beam_width=width))
    entry = ScheduledSeq(req, Sequence(0, (1,)), 1, False, 2 * width, [])
    from course_lib.engine.sampler import sample

    return [(t, round(lp, 5)) for t, lp in sample(entry, torch.tensor(logits), 0)]


def sharing_saving(tables: list[list[int]]) -> float:
    """Reference: ``1 - distinct blocks / table entries`` at one instant."""
    return saving_of_tables(tables)


def _slot_cases() -> list[tuple]:
    rng = random.Random(10)
    cases = [([7], 0, 1, 16), ([3, 9], 15, 2, 16), ([5, 2, 8], 0, 12, 4), ([4, 1], 3, 1, 4)]
    for _ in range(20):
        bs = rng.choice([1, 2, 4, 16])
        computed, new = rng.randint(0, 40), rng.randint(1, 20)
        table = rng.sample(range(200), -(-(computed + new) // bs))
        cases.append((table, computed, new, bs))
    return cases


def check_step_slots(fn: Callable[[list[int], int, int, int], list[int]]) -> Verdict:
    return check("10.1 step_slots", fn, step_slots, _slot_cases())


def check_beam_candidates(fn: Callable[[list[float], int], list[tuple[int, float]]]) -> Verdict:
    rng = random.Random(11)
    cases = [([0.0, 1.0, 2.0, 3.0], 1), ([5.0, -1.0, 2.5, 0.0, 4.0, 3.0], 2)]
    for _ in range(10):
        n = rng.randint(6, 40)
        cases.append(([round(rng.gauss(0, 3), 3) + i * 1e-4 for i in range(n)],
                      rng.randint(1, 3)))

    def rounded(got, want) -> bool:
        return [(int(t), round(float(lp), 4)) for t, lp in got] == \
            [(t, round(lp, 4)) for t, lp in want]
    return check("10.2 beam_candidates", fn, beam_candidates, cases, compare=rounded)


def check_sharing_saving(fn: Callable[[list[list[int]]], float]) -> Verdict:
    rng = random.Random(12)
    cases = [([],), ([[1, 2, 3]],), ([[1, 2, 3], [1, 2, 4]],), ([[0], [0], [0], [0]],)]
    for _ in range(10):
        prefix = rng.sample(range(100, 200), rng.randint(0, 5))
        cases.append(([prefix + rng.sample(range(100), rng.randint(1, 4))
                       for _ in range(rng.randint(1, 6))],))
    return check("10.3 sharing_saving", fn, sharing_saving, cases,
                 compare=lambda got, want: abs(float(got) - want) < 1e-9)
