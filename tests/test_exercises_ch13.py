"""Exercises 13.1 (which blocks a CPU tier stores) and 13.2 (how many tokens it reports): the
checkers' references are the library tier's own answers, those answers are what a real engine
run stores and loads, and a wrong answer is told the blocks or tokens that differ."""

from __future__ import annotations

import pytest
import torch

from course_lib.engine.cpu_offload import CPUOffloadConnector
from course_lib.engine.offload_study import make_engine, run_prompts
from course_lib.exercises import ch13
from course_lib.exercises.solutions import ch13 as solutions
from course_lib.model.loader import load_tiny_model
from course_lib.sequence import SamplingParams

pytestmark = pytest.mark.ch13
torch.set_num_threads(1)


def test_the_references_follow_the_statements():
    abcd = ["a", "b", "c", "d"]
    assert ch13.blocks_to_store(abcd, set(), 0, 10, 4) == [0, 1]
    assert ch13.blocks_to_store(abcd, set(), 6, 6, 4) == [1, 2]
    assert ch13.blocks_to_store(abcd, {"b"}, 0, 16, 4) == [0, 2, 3]
    assert ch13.blocks_to_store(abcd, set(), 9, 2, 4) == []
    assert ch13.num_new_matched_tokens(abcd, set(abcd), 17, 0, 4) == 16
    assert ch13.num_new_matched_tokens(abcd, set(abcd), 16, 0, 4) == 12
    assert ch13.num_new_matched_tokens(abcd, {"a", "c", "d"}, 18, 0, 4) == 4
    assert ch13.num_new_matched_tokens(abcd, {"c", "d"}, 18, 8, 4) == 8


class Watching(CPUOffloadConnector):
    """Checks the exercises' solutions against each call of a real run: the stores of every
    step with one scheduled sequence, and every count of matched tokens."""

    checked_stores = checked_matches = 0

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        held = set(self.cpu_pool.hash_to_block)
        want = solutions.num_new_matched_tokens(self._hashes(seq), held, len(seq),
                                                num_computed_tokens, self.block_size)
        got = super().get_num_new_matched_tokens(seq, num_computed_tokens)
        assert got[0] == want
        Watching.checked_matches += want > 0
        return got

    def build_connector_meta(self, scheduler_output):
        held = set(self.cpu_pool.hash_to_block)
        (e, *rest) = scheduler_output.scheduled or [None]
        bs = self.block_size
        # 13.1's case: the offer stands at the step's first block (not an admission that
        # re-offers a GPU hit from block 0), the hashes are the prompt's full blocks
        plain = e is not None and not rest and \
            self._next_stored.get(e.seq.seq_id, 0) == e.seq.num_computed_tokens // bs
        meta = super().build_connector_meta(scheduler_output)
        if plain:
            prompt_blocks = len(e.seq.prompt_token_ids) // bs
            want = solutions.blocks_to_store(self._hashes(e.seq)[:prompt_blocks], held,
                                             e.seq.num_computed_tokens, e.num_tokens,
                                             self.block_size)
            assert [g for g, _ in meta.stores] == [e.block_ids[i] for i in want]
            Watching.checked_stores += bool(want)
        return meta


def test_the_solutions_are_what_a_real_run_stores_and_loads():
    model = load_tiny_model()
    engine = make_engine(model, 16, tier=Watching(64))
    prompts = [list(range(3, 43)), list(range(100, 140)), list(range(3, 43)) + [9, 9, 9]]
    runs = run_prompts(engine, prompts, SamplingParams(max_tokens=6, temperature=0.0))
    # the returning prompt: some blocks left on the GPU, the rest in the tier (a partly
    # offloaded prefix, 13.2's case), none computed again but the last token's block
    assert runs[2].gpu_hit_tokens > 0 and runs[2].tier_hit_tokens > 0
    assert runs[2].gpu_hit_tokens + runs[2].tier_hit_tokens == 40
    assert Watching.checked_stores >= 2 and Watching.checked_matches >= 1


@pytest.mark.parametrize("wrong, words", [
    (ch13._stores_partial, "the library stores [0, 1] (the full prompt blocks this step "
                           "completes are 0..1"),
    (ch13._skips_begun_block, "yours [2], the library stores [1, 2]"),
    (ch13._stops_at_held, "yours [0], the library stores [0, 2, 3]"),
])
def test_13_1_names_the_blocks_that_differ(wrong, words):
    verdict = ch13.check_blocks_to_store(wrong)
    assert not verdict.ok and words in verdict.first_problem, verdict.first_problem


@pytest.mark.parametrize("wrong, words", [
    (ch13._counts_blocks, "yours 4, the library 16 (blocks 0..3 from the tier"),
    (ch13._loads_last_token, "yours 16, the library 12"),
    (ch13._counts_every_held, "yours 12, the library 4"),
])
def test_13_2_names_the_tokens_that_differ(wrong, words):
    verdict = ch13.check_num_new_matched_tokens(wrong)
    assert not verdict.ok and words in verdict.first_problem, verdict.first_problem


def test_a_learner_exception_or_a_bool_is_a_verdict():
    assert "raised KeyError" in ch13.check_blocks_to_store(
        lambda *a: {}["x"]).first_problem
    assert not ch13.check_num_new_matched_tokens(lambda *a: True).ok


@pytest.mark.parametrize("num_layers", [1, 3, 8])
def test_13_3_the_reference_follows_the_pipelining_formulas(num_layers):
    """Sent in the forward's order, the first forward ends at send + L * layer when the link
    is the faster (each layer waits only for the one before it), at L * send + layer when
    the link is the slower (each layer waits for its K/V); sent in reverse, at L * send +
    L * layer: the forward waits for the last layer sent, layer 0. Waiting for every layer
    (the course's connector, and NIXL's) costs the reversed order's time whatever the order."""
    forward = list(range(num_layers))
    assert ch13.first_forward_done(forward, 0.5, 1.0) == 0.5 + num_layers * 1.0
    assert ch13.first_forward_done(forward, 2.0, 1.0) == num_layers * 2.0 + 1.0
    assert ch13.first_forward_done(forward[::-1], 1.0, 1.0) == 2.0 * num_layers
    assert solutions.first_forward_done(forward[::-1], 0.5, 3.0) == \
        ch13.first_forward_done(forward[::-1], 0.5, 3.0)
