"""Chapter 10's exercise references against the engine, computed independently.

10.1: the sample rows are ``make_attention_metadata``'s last-token rows where the sampler asks
for candidates. 10.2: the beam step equals the scheduler's ``_beam_step`` fed by the engine's
sampler (beam width >= 2) and, for width 1, greedy decoding that adds up log-probabilities (the
engine's sampler treats width 1 as no beam search at all, so it cannot be the reference there).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from course_lib.engine.sampler import sample
from course_lib.exercises import ch10
from course_lib.exercises.ch10_beams import _beam_cases, beam_step, check_beam_step
from course_lib.exercises.solutions import ch10 as solutions
from course_lib.model.attention import make_attention_metadata
from course_lib.scheduler.output import ScheduledSeq
from course_lib.scheduler.output_processor import _beam_step
from course_lib.sequence import Request, SamplingParams, Sequence

pytestmark = pytest.mark.ch10
torch.set_num_threads(1)


def test_10_1_rows_are_the_metadatas_last_tokens_where_the_step_samples():
    for entries in ch10._flatten_cases()[1:]:
        meta = make_attention_metadata([[0] * 64 for _ in entries], [c for _, c, _ in entries],
                                       [q for _, _, q in entries], 1)
        last = meta.last_token_indices().tolist()
        want = [row if c + q == n else None for row, (n, c, q) in zip(last, entries, strict=True)]
        positions, rows = ch10.flatten_step(entries)
        assert rows == want
        assert positions == [p for _, c, q in entries for p in range(c, c + q)]


class _NoBlocks:
    def fork(self, parent, child): pass

    def free(self, seq_id): pass


def engine_beam_step(beams, logits, width):
    """The engine's own beam step: its sampler's candidates, its scheduler's selection."""
    req = Request(0, (1,), SamplingParams(beam_width=width, max_tokens=99))
    req.seqs = [Sequence(i, (1,), i, list(t), cumulative_logprob=s)
                for i, (t, s) in enumerate(beams)]
    entries = [ScheduledSeq(req, s, 1, False, min(2 * width, len(row)), [])
               for s, row in zip(req.seqs, logits, strict=True)]
    samples = {e.seq.seq_id: sample(e, torch.tensor(row), 0)
               for e, row in zip(entries, logits, strict=True)}
    ids = iter(range(100, 200))
    _beam_step(req, entries, samples, _NoBlocks(), lambda: next(ids))
    kept = [s for s in req.seqs if s.status.name != "FINISHED_ABORTED"]
    return sorted((s.output_token_ids, s.cumulative_logprob) for s in kept)


def greedy(beams, logits):
    (tokens, score), row = beams[0], logits[0]
    t = max(range(len(row)), key=lambda i: (row[i], -i))
    return [([*tokens, t], score + row[t] - math.log(sum(math.exp(x) for x in row)), 0)]


def test_10_2_reference_is_the_engines_beam_step_and_greedy_for_width_1():
    widths = {1: 0, 2: 0, 3: 0, 4: 0}
    for beams, logits, width in _beam_cases():
        want = beam_step(beams, logits, width)
        widths[width] += 1
        if width == 1:
            if len(beams) == 1 and max(map(abs, logits[0])) < 100:
                (t, s, p), = greedy(beams, logits)
                assert (want[0][0], want[0][2]) == (t, p) and math.isclose(want[0][1], s)
            continue
        got = engine_beam_step(beams, logits, width)
        assert len(got) == len(want)
        for (gt, gs), (wt, ws, _) in zip(got, sorted((t, s, p) for t, s, p in want),
                                         strict=True):
            assert gt == wt and math.isclose(gs, ws, abs_tol=1e-4)
    assert min(widths.values()) >= 3        # every width is tried, width 1 included


def test_10_2_a_correct_width_1_answer_passes():
    case = ([([], 0.0)], [[0.0, 1.0, 2.0, 3.0]], 1)
    (tokens, score, parent), = beam_step(*case)
    assert tokens == [3] and parent == 0 and math.isclose(score, -0.4401896985611957)
    assert check_beam_step(solutions.beam_step).ok

    rng = random.Random(0)
    for _ in range(20):                            # random single-beam greedy cases agree
        row = [rng.gauss(0, 2) for _ in range(8)]
        assert beam_step([([], 0.0)], [row], 1)[0][0] == greedy([([], 0.0)], [row])[0][0]
