"""SamplingParams validation, sequence token bookkeeping, the deterministic fake sampler."""

from __future__ import annotations

import pytest

from course_lib.sequence import Request, SamplingParams, Sequence, SequenceStatus
from course_lib.sim.fake_sampler import expected_tokens, fake_sample

pytestmark = pytest.mark.ch07


@pytest.mark.parametrize("kwargs, word", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"n": 0}, "n must"), ({"beam_width": 0}, "beam_width"),
    ({"n": 2, "beam_width": 2}, "either"),
])
def test_sampling_params_reject_bad_values(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_num_seqs_and_beam_flag():
    assert SamplingParams(n=3).num_seqs == 3 and not SamplingParams(n=3).use_beam_search
    beam = SamplingParams(beam_width=4)
    assert beam.num_seqs == 4 and beam.use_beam_search


def test_num_candidates_is_the_one_rule_for_samples_and_beams():
    assert [SamplingParams(n=n).num_candidates(first) for n in (1, 4) for first in (True, False)] \
        == [1, 1, 4, 1]
    assert [SamplingParams(beam_width=w).num_candidates(first) for w in (2, 3)
            for first in (True, False)] == [4, 4, 6, 6]


def test_prefill_target_is_prompt_then_all_but_last_token():
    seq = Sequence(0, (1, 2, 3))
    assert seq.prefill_target == 3 and seq.needs_prefill and seq.last_token_id == 3
    seq.output_token_ids += [7, 8]
    assert seq.token_ids == [1, 2, 3, 7, 8] and len(seq) == 5
    assert seq.prefill_target == 4 and seq.last_token_id == 8  # recompute: 8 is fed by decode
    seq.num_computed_tokens = 4
    assert not seq.needs_prefill


def test_fork_copies_outputs_not_shares_them():
    seq = Sequence(0, (1, 2), output_token_ids=[5])
    child = seq.fork(1, 1)
    child.output_token_ids.append(6)
    assert seq.output_token_ids == [5] and child.token_ids == [1, 2, 5, 6] and child.index == 1


def test_token_ids_is_the_sequences_own_list_kept_in_step_with_its_outputs():
    """``token_ids`` is handed out without a copy (O(1) per read at any length) and grows as
    tokens are appended; outputs changed behind its back are noticed, never served stale,
    including outputs cut back (a recovery's ``restore``, ``engine/recovery.py``)."""
    seq = Sequence(0, (1, 2, 3))
    tokens = seq.token_ids
    assert seq.token_ids is tokens                   # no copy per read
    seq.append_output_token_ids(7)
    assert tokens == [1, 2, 3, 7] and seq.token_ids is tokens and seq.output_token_ids == [7]
    seq.output_token_ids.append(8)                   # appended directly: noticed (length)
    assert seq.token_ids == [1, 2, 3, 7, 8]
    seq.output_token_ids[-1] = 9                     # replaced directly: noticed (last token)
    assert seq.token_ids == [1, 2, 3, 7, 9]
    seq.append_output_token_ids(4)
    del seq.output_token_ids[2:]                     # cut back to what was committed
    assert seq.output_token_ids == [7, 9] and seq.token_ids == [1, 2, 3, 7, 9]
    seq.append_output_token_ids(5)
    assert seq.token_ids == [1, 2, 3, 7, 9, 5] and len(seq) == 6


def test_request_rejects_empty_prompt_and_reports_status():
    with pytest.raises(ValueError, match="prompt"):
        Request(0, (), SamplingParams())
    req = Request(0, (1,), SamplingParams(), seqs=[Sequence(0, (1,))])
    assert not req.is_finished and req.is_prefill
    req.seqs[0].status = SequenceStatus.FINISHED_IGNORED
    assert req.is_finished and SequenceStatus.FINISHED_IGNORED.is_finished
    assert not SequenceStatus.SWAPPED.is_finished


def test_fake_sampler_depends_only_on_request_index_and_position():
    req = Request(7, (1, 2, 3), SamplingParams(n=3))
    a, b = Sequence(0, (1, 2, 3), index=0), Sequence(99, (1, 2, 3), index=0)
    assert fake_sample(req, a, 1) == fake_sample(req, b, 1)     # seq id does not matter
    three = fake_sample(req, a, 3)
    assert [t for t, _ in three] == [expected_tokens((1, 2, 3), 7, i, 1)[0] for i in range(3)]
    c = Sequence(1, (1, 2, 3), index=2, output_token_ids=[three[2][0]])
    assert fake_sample(req, c, 1)[0][0] == expected_tokens((1, 2, 3), 7, 2, 2)[1]


def test_beam_candidates_depend_on_the_beam_tokens():
    req = Request(1, (4, 5), SamplingParams(beam_width=2))
    x = Sequence(0, (4, 5), output_token_ids=[1])
    y = Sequence(5, (4, 5), output_token_ids=[1])
    z = Sequence(6, (4, 5), output_token_ids=[2])
    assert fake_sample(req, x, 4) == fake_sample(req, y, 4) != fake_sample(req, z, 4)
    assert all(lp < 0 for _, lp in fake_sample(req, x, 4))


def test_finish_reasons_are_short_codes():
    S = SequenceStatus
    assert [s.finish_reason for s in S] == [None, None, None, None, "stop", "length", "abort",
                                            "ignored", "error"]
    assert all(s.is_finished == (s.finish_reason is not None) for s in S)


# ------------------------------------------------------- bounds: every bad value names itself
def test_top_p_too_small_for_float32_is_refused_at_the_exact_threshold():
    """The sampler compares top_p in float32: 2**-150 and below round to 0 and keep no token
    (a step later, "invalid multinomial distribution"); the next double above keeps one."""
    import math

    import torch

    from course_lib.engine.sampler import top_p_probs
    from course_lib.sequence import TOP_P_FLOOR

    logits = torch.randn(259, generator=torch.Generator().manual_seed(0))
    smallest_kept = math.nextafter(TOP_P_FLOOR, 1.0)
    assert TOP_P_FLOOR == 2.0 ** -150
    assert int((top_p_probs(logits, 1.0, TOP_P_FLOOR) > 0).sum()) == 0      # the sampler's edge
    assert int((top_p_probs(logits, 1.0, smallest_kept) > 0).sum()) == 1
    for bad in (TOP_P_FLOOR, 1e-46, 5e-324, math.nextafter(TOP_P_FLOOR, 0.0)):
        with pytest.raises(ValueError, match=r"top_p must be in \(2\*\*-150, 1\], got .*float32"):
            SamplingParams(top_p=bad, temperature=1.0)
    assert SamplingParams(top_p=smallest_kept).top_p == smallest_kept
    assert SamplingParams(top_p=2.0 ** -149).top_p == 2.0 ** -149
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            SamplingParams(top_p=bad)


@pytest.mark.parametrize("stops", [None, 5, 2.5, "ab", b"ab"])
def test_stop_token_ids_that_are_not_a_sequence_name_themselves(stops):
    with pytest.raises(ValueError, match=r"stop_token_ids must be a sequence of ints in >= 0, "
                                         rf"got {type(stops).__name__}"):
        SamplingParams(stop_token_ids=stops)


def test_stop_token_ids_accept_any_iterable_of_ints():
    assert SamplingParams(stop_token_ids=[3, 1]).stop_token_ids == (3, 1)
    assert SamplingParams(stop_token_ids=iter([7])).stop_token_ids == (7,)
    with pytest.raises(ValueError, match=r"stop_token_ids must be ints in >= 0; item 1 is -1"):
        SamplingParams(stop_token_ids=[1, -1])


@pytest.mark.parametrize("name", ["n", "beam_width", "max_tokens"])
@pytest.mark.parametrize("bad", [0, -1, 1.0, 2.5, True, "2", None])
def test_counts_must_be_ints_at_least_one(name, bad):
    """n and beam_width (and max_tokens): ints >= 1, never bools, floats or strings (their
    upper bound is the scheduler's design, not checked here)."""
    with pytest.raises(ValueError, match=rf"^{name} must be an int >= 1, got "):
        SamplingParams(**{name: bad})
    import numpy as np

    assert getattr(SamplingParams(**{name: np.int64(3)}), name) == 3


def test_n_and_beam_width_are_bounded_as_vllm_bounds_them():
    """vLLM 0.33.0 refuses n (and beam_width) above VLLM_MAX_N_SEQUENCES (16384): an outside
    audit's SamplingParams(n=10**9) made the V1 design create child sequences until memory
    ran out."""
    from course_lib.sequence import MAX_N_SEQUENCES

    SamplingParams(n=MAX_N_SEQUENCES, temperature=1.0)
    for kwargs in ({"n": MAX_N_SEQUENCES + 1}, {"n": 10**9}, {"beam_width": 10**9}):
        with pytest.raises(ValueError, match=rf"must be at most {MAX_N_SEQUENCES}, got"):
            SamplingParams(temperature=1.0, **kwargs)
