"""Chapter 10: its figures beside the published ones, and its exercises.

Figures: the memory sharing saves per width beside the vLLM paper's (:func:`sharing_rows`),
the metric names of the two designs (:func:`metric_names`), and the "Memory optimization"
article's prefix-caching speed-up in numbers (:func:`article_prefix_case`).

Exercises: a step's flat batch (positions, and the rows the sampler reads: none for a prefill
chunk that stops short of the prompt's end), one beam-search step (cumulative log-probabilities,
forks and drops), predictions of the memory sharing saves (each scenario played on a
``BlockManager``). ``tests/test_exercises_ch10.py`` checks the references against the engine
(``make_attention_metadata``, the scheduler's beam step, ``workloads.saving_of_tables``).
10.2's reference and checker live in
:mod:`course_lib.exercises.ch10_beams` (the notebook calls ``ch10_beams.check_beam_step``);
this module registers 10.2 with its hints.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from course_lib import capacity as cap
from course_lib.claims.sources_claim import cite
from course_lib.engine.llm_engine import LLMEngine
from course_lib.engine.workloads import PAPER_SHARING_SAVINGS, saving_of_tables, sharing_savings
from course_lib.exercises import (
    Exercise,
    Exercises,
    Rule,
    Scenario,
    Verdict,
    ch10_beams,
    judge_cases,
    judge_predictions,
    returns,
    rule_wrongs,
)
from course_lib.exercises.ch10_beams import WRONG as _WRONG_BEAMS
from course_lib.exercises.ch10_beams import (
    check_beam_step,
)
from course_lib.exercises.solutions import ch10 as solutions
from course_lib.memory.v0.manager import BlockManager
from course_lib.scheduler.metrics import Metrics
from course_lib.sequence import SamplingParams
from course_lib.sim.traces import TraceRequest
from course_lib.sizing.blocks import num_full_blocks
from course_lib.sizing.models import get_preset
from course_lib.sizing.units import format_bytes


@dataclass(frozen=True)
class SharingRow:
    decoding: str          # "parallel sampling" (n) or "beam search" (beam_width)
    width: int
    saving: float          # ours: 1 - held blocks / blocks without sharing, over the run
    paper_pct: float       # the paper's Fig. 15 figure for the same width (workloads.py)

    def __str__(self) -> str:
        knob = "n" if self.decoding == "parallel sampling" else "beam_width"
        label = f"{self.decoding}, {knob} = {self.width}:"
        return f"{label:<33} ours {100 * self.saving:5.1f}%   paper {self.paper_pct:5.2f}%"


def sharing_rows(make_engine: Callable[[], LLMEngine], trace: Sequence[TraceRequest],
                 widths: Sequence[int] = (2, 4, 6), seed: int = 0) -> list[SharingRow]:
    """Run ``trace`` on a fresh engine for every decoding and width of the paper's Fig. 15
    and pair our saving with the paper's (``workloads.PAPER_SHARING_SAVINGS``; sampling at
    temperature 1.0, ``seed``)."""
    rows = []
    for decoding in ("parallel sampling", "beam search"):
        for w in widths:
            params = (SamplingParams(temperature=1.0, seed=seed, n=w)
                      if decoding == "parallel sampling" else SamplingParams(beam_width=w))
            r = sharing_savings(make_engine(), trace, params)
            rows.append(SharingRow(decoding, w, r.saving, PAPER_SHARING_SAVINGS[decoding][w]))
    return rows


def metric_names(metrics: Metrics) -> list[str]:
    """The metric names an engine exports, as a scrape shows them (counters end in _total,
    a histogram is named once, without its _bucket/_sum/_count samples)."""
    return sorted(f.name + "_total" if f.type == "counter" else f.name
                  for f in metrics.registry.collect())


@dataclass(frozen=True)
class PrefixCachingCase:
    """The "Memory optimization" article's prefix-caching case, what course_lib can compute
    of it: Llama-3-8B on 8 x A100 80GB, 64 concurrent requests each carrying 1,000 tokens of
    history that begin with a ~500-token shared system prompt; 850 -> 2,600 tokens/s."""

    tokens_per_s: tuple[float, float]    # the article's: without, with prefix caching
    num_requests: int
    history_tokens: int
    system_prompt_tokens: int
    kv_bytes_needed: int                 # every request's history, no sharing
    pool_tokens_per_gpu: int             # one 80 GiB GPU, gpu_memory_utilization 0.9
    prefill_no_cache: int                # prompt tokens computed without prefix caching
    prefill_system_prompt_cached: int    # the shared prompt's full blocks computed once
    prefill_history_cached: int          # each history cached by its previous turn

    @property
    def speedup(self) -> float:
        return self.tokens_per_s[1] / self.tokens_per_s[0]

    def __str__(self) -> str:
        n, h = self.num_requests, self.history_tokens
        return "\n".join([
            f"{cite('001', '(prefix caching case)')}: {self.tokens_per_s[0]:,.0f} -> "
            f"{self.tokens_per_s[1]:,.0f} tokens/s = {self.speedup:.2f}x; Llama-3-8B, "
            f"8 x A100 80GB, {n} requests x {h:,} tokens of history "
            f"({self.system_prompt_tokens}-token shared system prompt)",
            f"memory is not the limit: {n} x {h:,} tokens need "
            f"{format_bytes(self.kv_bytes_needed)} of KV; one GPU's pool holds "
            f"{self.pool_tokens_per_gpu:,} tokens, so the batch is the same with or without "
            "the cache",
            f"prefill tokens computed: {self.prefill_no_cache:,} without the cache, "
            f"{self.prefill_system_prompt_cached:,} at best with the system prompt cached "
            f"({self.prefill_no_cache / self.prefill_system_prompt_cached:.2f}x fewer), "
            f"{self.prefill_history_cached:,} if every history was cached by its previous turn",
            "decode is not faster with the cache: the speed-up depends on the output length, "
            "on what was cached and on how the 8 GPUs were used, none of which the article gives",
        ])


def article_prefix_case(block_size: int = 16) -> PrefixCachingCase:
    """:class:`PrefixCachingCase`, computed (the first request computes its whole prompt; the
    others skip the full blocks cached before them)."""
    spec, n, h, sp = get_preset("llama-3-8b"), 64, 1000, 500
    pool = cap.plan_kv_cache(spec, 80, block_size=block_size).num_gpu_tokens
    shared = num_full_blocks(sp, block_size) * block_size
    history = num_full_blocks(h, block_size) * block_size
    return PrefixCachingCase((850, 2600), n, h, sp, cap.contiguous_kv_bytes(spec, n * h), pool,
                             n * h, h + (n - 1) * (h - shared), n * (h - history))


# ---------------------------------------------------------------- exercises
Entry = tuple[int, int, int]        # (num_tokens, num_computed, num_new) of one scheduled seq


def flatten_step(entries: list[Entry]) -> tuple[list[int], list[int | None]]:
    """Reference of 10.1: the positions of a step's flat batch (entries in order), and the row
    of each entry's logits the sampler reads (its last new token), ``None`` for a prefill chunk
    that ends before the sequence's last token (it samples nothing)."""
    positions: list[int] = []
    rows: list[int | None] = []
    for num_tokens, num_computed, num_new in entries:
        positions.extend(range(num_computed, num_computed + num_new))
        rows.append(len(positions) - 1 if num_computed + num_new == num_tokens else None)
    return positions, rows


def _flatten_cases() -> list[list[Entry]]:
    rng = random.Random(10)
    cases = [[], [(5, 4, 1)], [(9, 0, 9)], [(40, 0, 16)], [(40, 32, 8), (7, 6, 1)],
             [(12, 8, 4), (30, 16, 8), (3, 2, 1)]]        # prefix hit, mid-prompt chunk, decode
    for _ in range(30):
        batch = []
        for _ in range(rng.randint(1, 6)):
            n = rng.randint(1, 60)
            done = rng.randint(0, n - 1)
            batch.append((n, done, rng.randint(1, n - done)))
        cases.append(batch)
    return cases


def _judge_flatten(case: tuple, got) -> str | None:
    (entries,) = case
    want_pos, want_rows = flatten_step(entries)
    got_pos, got_rows = got
    got_pos, got_rows = [int(p) for p in got_pos], list(got_rows)
    if got_pos == want_pos and got_rows == want_rows:
        return None
    start = 0
    for i, (n, c, q) in enumerate(entries):
        where = f"batch {entries}, entry {i} (num_tokens={n}, computed={c}, new={q})"
        if got_pos[start:start + q] != want_pos[start:start + q]:
            return (f"{where}: positions at rows {start}..{start + q - 1} are "
                    f"{got_pos[start:start + q]}, should be {c}..{c + q - 1}")
        if i >= len(got_rows) or got_rows[i] != want_rows[i]:
            g = got_rows[i] if i < len(got_rows) else "missing"
            why = ("its chunk stops before the last token, so it samples nothing"
                   if want_rows[i] is None else "the row of its last new token")
            return f"{where}: sample row {g}, should be {want_rows[i]} ({why})"
        start += q
    return (f"batch {entries}: {len(got_pos)} positions and {len(got_rows)} rows, should be "
            f"{len(want_pos)} and {len(want_rows)}")


def check_flatten_step(fn: Callable[[list[Entry]], tuple[list[int], list[int | None]]]
                       ) -> Verdict:
    return judge_cases("10.1 flatten_step", fn, [(e,) for e in _flatten_cases()],
                       returns(_judge_flatten), lambda case: f"batch {case[0]}")


def sharing_saving(tables: list[list[int]]) -> float:
    """``1 - distinct blocks / entries`` of block tables at one instant (0.0 for none)."""
    return saving_of_tables(tables)


def _samples_saving(num_samples: int, prompt_len: int, writes: int = 0,
                    freed: int = 0) -> Callable[[], float]:
    """The saving of the live tables after ``num_samples`` samples fork from one prompt (blocks
    of 16 tokens), each then writes ``writes`` tokens, and ``freed`` of them are freed."""
    def run() -> float:
        m = BlockManager(16, 64, watermark=0.0)
        m.allocate(0, list(range(prompt_len)))
        for child in range(1, num_samples):
            m.fork(0, child)
        for _ in range(writes):
            for seq in range(num_samples):
                m.append_slots(seq, [0])
        for seq in range(freed):
            m.free(seq)
        return sharing_saving([m.get_block_table(s) for s in m.seq_ids()])
    return run


SHARING_SCENARIOS = (
    Scenario("a", "4 samples of a 32-token prompt, before any of them writes",
             _samples_saving(4, 32)),
    Scenario("b", "4 samples of a 30-token prompt, after each wrote one token",
             _samples_saving(4, 30, writes=1)),
    Scenario("c", "2 samples of a 32-token prompt, after each wrote one token",
             _samples_saving(2, 32, writes=1)),
    Scenario("d", "3 samples of a 32-token prompt, after one of them was freed",
             _samples_saving(3, 32, freed=1)),
)


def check_sharing_predictions(fn: Callable[[], dict]) -> Verdict:
    """10.3: each scenario played on a ``BlockManager``, its tables' saving against the
    learner's prediction."""
    return judge_predictions("10.3 sharing_predictions", fn, SHARING_SCENARIOS)


def _sharing_predictions(**changed: float) -> Callable[[], dict]:
    """A wrong answer: the solution's predictions with ``changed`` ones."""
    return lambda: {**solutions.sharing_predictions(), **changed}


_DISTINCT_OVER_ENTRIES = _sharing_predictions(a=0.25)     # forgot the "1 -"
_EVERY_WRITER_COPIES = _sharing_predictions(b=0.25)       # 4 copies, not 3
_NEW_BLOCKS_FORGOTTEN = _sharing_predictions(c=0.5)       # the blocks opened for the new token
_FREED_STILL_COUNTED = _sharing_predictions(d=2 / 3)      # the freed table still counted


def _wrong_rows_always(entries):                 # samples after every chunk
    positions, rows = solutions.flatten_step(entries)
    starts = [0]
    for _, _, q in entries:
        starts.append(starts[-1] + q)
    return positions, [s - 1 for s in starts[1:]]


def _wrong_positions_from_zero(entries):         # forgets the tokens already cached
    positions, rows = solutions.flatten_step(entries)
    return [p for _, _, q in entries for p in range(q)], rows


EXERCISES = Exercises(
    Exercise("10.1", "flatten_step", check_flatten_step, hints=(
        "Walk the entries in order and keep a running count of rows: entry i's new tokens "
        "sit at rows start .. start + num_new - 1, at positions num_computed .. "
        "num_computed + num_new - 1.",
        "The sampler reads only the last new token's row, and only when the chunk reaches "
        "the sequence's end (num_computed + num_new == num_tokens); otherwise append None.",
    ), solution=solutions.flatten_step,
        rules=(
        Rule("sample_rows is None when the chunk stops before the sequence's last token",
             "batch [(40, 0, 1",
             _wrong_rows_always),
        Rule("positions start at num_computed",
             "batch [(5, 4",
             _wrong_positions_from_zero),
        Rule("rows are counted over the whole batch, entry after entry",
             "batch [(40, 32, ",
             rule_wrongs.flatten_rows_per_entry),
    ), compare_with=(
        "make_attention_metadata and AttentionMetadata.last_token_indices in "
        "course_lib/model/attention.py, and how num_candidates is 0 for a short chunk "
        "(SamplingParams.num_candidates in course_lib/sequence.py)")),
    Exercise("10.2", "beam_step", check_beam_step, hints=(
        "Every (beam, token) pair is a candidate scored score + logprob, where logprob = "
        "logit - logsumexp(logits of that beam); subtract the max before exp().",
        "Put the candidates of all beams in one list, sort by (-score, tokens + [token]) and "
        "keep the first width: a beam picked twice forks, a beam never picked is dropped.",
        "Ties: two candidates of equal score, from different beams, can end in the same "
        "token; the whole list tokens + [token] decides, not the new token alone.",
    ), solution=solutions.beam_step, wrong=_WRONG_BEAMS, rules=(
        Rule("scores are cumulative: the parent's score plus this token's log-probability",
             "beams [([5], -0.5)], width 1", _WRONG_BEAMS[0]),
        Rule("the width best over all beams (a beam may fork or be dropped)",
             "beams [([1], -0.1), ([2], -9.0)], width 2", _WRONG_BEAMS[1]),
        Rule("ties go to the smaller tokens + [token] list", "beams [([5], -1.0), ([2], "
             "-1.0)], width 2", ch10_beams._wrong_ties_by_score_only),
        Rule("ties compare the whole list, not the new token", "beams [([5], -1.0), ([2], "
             "-1.0)], width 2", ch10_beams._wrong_ties_by_last_token),
        Rule("large logits (800): subtract the max before exp", "beams [([7], -1.0), ([3], "
             "-1.2)], width 2", ch10_beams._wrong_no_max),
    ), compare_with="_beam_step in course_lib/scheduler/output_processor.py (and the "
                    "sampler's beam branch in course_lib/engine/sampler.py, which hands it "
                    "2 x width candidates a beam)"),
    Exercise("10.3", "predict what sharing saves", check_sharing_predictions, hints=(
        "Draw each sample's table as a row of block ids, blocks of 16 tokens; a forked "
        "sample's row is a copy of the parent's. Count the entries (every box of every row) "
        "and the distinct ids.",
        "A write into a partial block shared by k samples: the first k - 1 writers copy it, "
        "the last one writes in place. A write after a full block opens a new block for that "
        "sample alone.",
        "A freed sample's row is gone: its entries leave the count, its blocks stay while "
        "another row holds them.",
    ), solution=solutions.sharing_predictions, rules=(
        Rule("the saving is 1 - distinct blocks / table entries", "a (4 samples of a 32",
             _DISTINCT_OVER_ENTRIES),
        Rule("a shared partial block: k - 1 copies, the last writer keeps it",
             "b (4 samples of a 30", _EVERY_WRITER_COPIES),
        Rule("after a full block each writer opens a block of its own", "c (2 samples",
             _NEW_BLOCKS_FORGOTTEN),
        Rule("only the tables of live sequences count", "d (3 samples", _FREED_STILL_COUNTED),
    ), trivial=(lambda *a: None, lambda *a: {}), compare_with=(
        "saving_of_tables in course_lib/engine/workloads.py and BlockUsage.sharing_saving in "
        "course_lib/memory/common.py")),
)


hint = EXERCISES.print_hint            # ch10.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch10.solution("N.M"): a solution's code
