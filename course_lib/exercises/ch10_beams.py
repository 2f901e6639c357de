"""Exercise 10.2: one step of beam search -- the ``width`` best continuations of all beams by
cumulative log-probability, with the beams they fork from (a beam picked twice forks, one never
picked is dropped).

:func:`beam_step` is the reference (``tests/test_exercises_ch10.py`` checks it against the
scheduler's beam step); :func:`check_beam_step` runs hand-picked cases, then random ones from a
fixed seed, and names the first beam that differs. :data:`WRONG` holds the mistakes the checker
must catch. :mod:`course_lib.exercises.ch10` registers 10.2 (its hints and solution).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from course_lib.exercises import Verdict, judge_cases, returns
from course_lib.exercises.solutions import ch10 as solutions

Beam = tuple[list[int], float]                       # (generated tokens, cumulative logprob)


def beam_step(beams: list[Beam], logits: list[list[float]], width: int
              ) -> list[tuple[list[int], float, int]]:
    """Reference of 10.2: the ``width`` best (beam + token) by cumulative log-probability
    (``score + log_softmax(logits)[token]``), best first, ties to the smaller token list:
    ``(tokens + [token], new score, index of the parent beam)``. With ``width == 1`` this is
    greedy decoding that adds up log-probabilities. (Like the engine, only each beam's
    ``2 * width`` best tokens can be among the winners, so only those are looked at.)"""
    scored = []
    for parent, ((tokens, score), row) in enumerate(zip(beams, logits, strict=True)):
        logprobs = torch.log_softmax(torch.tensor(row, dtype=torch.float64), dim=0)
        top = torch.topk(logprobs, min(2 * width, len(row)))
        for lp, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            scored.append((score + lp, [*tokens, t], parent))
    scored.sort(key=lambda c: (-c[0], c[1]))
    return [(tokens, score, parent) for score, tokens, parent in scored[:width]]


def _beam_cases() -> list[tuple[list[Beam], list[list[float]], int]]:
    rng = random.Random(11)
    cases = [([([], 0.0)], [[0.0, 1.0, 2.0, 3.0]], 1),             # width 1: greedy
             ([([5], -0.5)], [[0.0, 1.0, 2.0, 3.0]], 1),
             ([([], 0.0)], [[0.0, 1.0, 2.0, 3.0]], 3),             # one beam forks into three
             ([([], 0.0)], [[0.0, 0.0, 0.0, 0.0]], 2),             # ties: smaller token first
             ([([1], -0.1), ([2], -9.0)], [[0.0, 5.0, 1.0], [9.0, 0.0, 0.0]], 2),   # drop one
             ([([7], -1.0), ([3], -1.2)], [[800.0, 0.0, 799.0], [0.0, 801.0, 0.0]], 2),
             ([([], 0.0)], [[1.0, 2.0]], 3),                       # fewer tokens than width
             ([([5], -1.0), ([2], -1.0)], [[0.0, 0.0], [0.0, 0.0]], 2)]   # ties across beams
    for _ in range(25):
        width, vocab, length = rng.randint(1, 4), rng.randint(3, 12), rng.randint(1, 5)
        beams = [([rng.randrange(vocab) for _ in range(length)], round(-rng.random() * 6, 3))
                 for _ in range(rng.randint(1, width))]
        cases.append((beams, [[round(rng.gauss(0, 3), 3) for _ in range(vocab)]
                              for _ in beams], width))
    return cases


def _say(beam) -> str:
    tokens, score, parent = beam
    return f"beam {parent} + token {tokens[-1] if tokens else '?'} (score {score:.4f})"


def _judge_beams(case: tuple, got) -> str | None:
    beams, logits, width = case
    want = beam_step(*case)
    got = [(list(map(int, t)), float(s), int(p)) for t, s, p in got]

    def same_beam(g, w) -> bool:
        return g[0] == w[0] and g[2] == w[2] and math.isclose(g[1], w[1], abs_tol=1e-6)

    if len(got) == len(want) and all(map(same_beam, got, want)):
        return None
    where = f"beams {beams} (tokens, score), width {width}"
    if len(got) != len(want):
        return (f"{where}: {len(got)} beams kept, should be {len(want)} (the width best "
                "candidates over all beams, fewer only if the vocabulary is smaller)")
    i = next(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not same_beam(g, w))
    problem = f"{where}: new beam {i} is {_say(got[i])}, should be {_say(want[i])}"
    if (got[i][0], got[i][2]) == (want[i][0], want[i][2]) and math.isclose(
            got[i][1], want[i][1] - beams[want[i][2]][1], abs_tol=1e-6):
        problem += ": scores are cumulative (add the parent beam's score)"
    elif math.isclose(got[i][1], want[i][1], abs_tol=1e-9) and got[i][0] != want[i][0]:
        problem += (f": a tie; the smaller whole list tokens + [token] goes first "
                    f"({want[i][0]} < {got[i][0]})")
    return problem


def check_beam_step(fn: Callable[..., list[tuple[list[int], float, int]]]) -> Verdict:
    return judge_cases("10.2 beam_step", fn, _beam_cases(), returns(_judge_beams),
                       lambda case: f"beams {case[0]}, width {case[2]}")


def _wrong_not_cumulative(beams, logits, width):  # ranks by this step's logprob only
    new = solutions.beam_step([(t, 0.0) for t, _ in beams], logits, width)
    return new


def _wrong_top_per_beam(beams, logits, width):    # keeps the best token of every beam
    picks = [solutions.beam_step([b], [r], 1)[0] for b, r in zip(beams, logits, strict=True)]
    return [(t, s, i) for i, (t, s, _) in enumerate(picks)][:width]


def _candidates(beams, logits, exp=math.exp):
    out = []
    for parent, ((tokens, score), row) in enumerate(zip(beams, logits, strict=True)):
        top = max(row)
        lse = top + math.log(sum(exp(x - top) for x in row))
        out += [(score + x - lse, [*tokens, t], parent) for t, x in enumerate(row)]
    return out


def _wrong_ties_by_score_only(beams, logits, width):   # ties keep the beams' order
    scored = sorted(_candidates(beams, logits), key=lambda c: -c[0])
    return [(t, s, p) for s, t, p in scored[:width]]


def _wrong_ties_by_last_token(beams, logits, width):   # ties to the smaller new token only
    scored = sorted(_candidates(beams, logits), key=lambda c: (-c[0], c[1][-1]))
    return [(t, s, p) for s, t, p in scored[:width]]


def _wrong_no_max(beams, logits, width):               # exp(800) overflows
    scored = []
    for parent, ((tokens, score), row) in enumerate(zip(beams, logits, strict=True)):
        lse = math.log(sum(math.exp(x) for x in row))
        scored += [(score + x - lse, [*tokens, t], parent) for t, x in enumerate(row)]
    scored.sort(key=lambda c: (-c[0], c[1]))
    return [(t, s, p) for s, t, p in scored[:width]]


WRONG = (_wrong_not_cumulative, _wrong_top_per_beam)
