"""Exercise 5.1: one step of beam search on shared block tables -- which blocks the dropped
beams give back, which blocks the appends copy, how many blocks the step leaves held.

The cases are beam searches replayed on a real ``BlockManager`` from a hand-picked or random
(fixed seed) history of picks; the step judged is taken on the same manager, as the V0
scheduler's beam step does it (free, fork, then append).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

from course_lib.exercises import Verdict, judge_cases
from course_lib.exercises.solutions import ch05 as solutions
from course_lib.memory.v0.manager import BlockManager


class BeamCase(NamedTuple):
    """A beam search of one prompt, replayed on a ``BlockManager``: ``history`` holds the picks
    of the steps already taken, ``picks`` those of the step to judge (indices into the live
    beams, one per beam of the next step)."""

    prompt_len: int
    block_size: int
    history: tuple[tuple[int, ...], ...]
    picks: tuple[int, ...]


def _take_step(m: BlockManager, beams: list[int], picks: Sequence[int],
               next_id: int) -> tuple[list[int], int, list[int], list[tuple[int, int]]]:
    """One beam step as the V0 scheduler's ``_beam_step`` does it, on ``m``: a beam never
    picked is freed, a beam picked k times is forked k - 1 times; then every beam appends one
    token. Returns the new beams, the next free id, the blocks the frees gave back (before an
    append can take one again) and the copies the appends asked for."""
    chosen = [beams[i] for i in picks]
    before = {b for s in beams for b in m.get_block_table(s)}
    new: list[int] = []
    for beam in beams:
        k = chosen.count(beam)
        if k == 0:
            m.free(beam)
            continue
        for _ in range(k - 1):
            m.fork(beam, next_id)
            new.append(next_id)
            next_id += 1
        new.append(beam)
    freed = sorted(before - {b for s in new for b in m.get_block_table(s)})
    copies = [c for beam in new for c in m.append_slots(beam, [0])]
    return new, next_id, freed, copies


def _replay(case: BeamCase) -> tuple[BlockManager, list[int], int]:
    width = max([len(case.picks), *map(len, case.history)])
    longest = case.prompt_len + len(case.history) + 1
    m = BlockManager(case.block_size, 2 * width * (longest // case.block_size + 2),
                     watermark=0.0)
    m.allocate(0, [0] * case.prompt_len)
    beams, next_id = [0], 1
    for picks in case.history:
        beams, next_id, _, _ = _take_step(m, beams, picks, next_id)
    return m, beams, next_id


def beam_args(case: BeamCase) -> tuple[dict[int, list[int]], int, list[int], int]:
    """The learner's arguments: ``(tables, num_tokens, picks, block_size)``."""
    m, beams, _ = _replay(case)
    tables = {b: m.get_block_table(b) for b in beams}
    return (tables, case.prompt_len + len(case.history), [beams[i] for i in case.picks],
            case.block_size)


def beam_blocks(case: BeamCase) -> tuple[list[int], list[int], int]:
    """Reference: take the step on the manager; (blocks freed, sorted; blocks copied, sorted,
    one per copy; blocks held after the appends)."""
    m, beams, next_id = _replay(case)
    _, _, freed, copies = _take_step(m, beams, case.picks, next_id)
    return freed, sorted(src for src, _ in copies), m.num_gpu_blocks - m.num_free_gpu_blocks


def beam_cases() -> list[BeamCase]:
    """Edge cases, then random searches from a fixed seed."""
    cases = [BeamCase(7, 4, (), (0, 0)),                  # one beam forks: its partial block
             BeamCase(8, 4, (), (0, 0)),                  # a full last block: no copy
             BeamCase(6, 4, (), (0,)),                    # width 1: nothing shared
             BeamCase(7, 4, ((0, 0),), (0, 1)),           # every beam keeps itself
             BeamCase(7, 4, ((0, 0),), (1, 1)),           # one beam dropped, the other forks
             BeamCase(5, 4, ((0, 0, 0), (0, 1, 2)), (2, 2, 2)),   # one beam picked 3 times
             BeamCase(3, 1, ((0, 0), (0, 1)), (0, 0)),    # block size 1: every block full
             BeamCase(6, 2, ((0, 0, 0), (0, 1, 2), (2, 0, 1), (1, 1, 0)), (0, 0, 2)),
             BeamCase(9, 4, ((0, 0, 0, 0), (0, 1, 2, 3), (3, 3, 1, 1)), (1, 1, 3, 3))]
    rng = random.Random(51)
    for _ in range(30):
        width, live, history = rng.randrange(1, 5), 1, []
        for _ in range(rng.randrange(0, 9)):
            history.append(tuple(rng.randrange(live) for _ in range(width)))
            live = width
        cases.append(BeamCase(rng.randrange(1, 20), rng.choice([1, 2, 4, 8]), tuple(history),
                              tuple(rng.randrange(live) for _ in range(width))))
    return cases


def _beam_text(case: BeamCase) -> str:
    tables, n, picks, bs = beam_args(case)
    return f"beams {tables} at {n} tokens, block size {bs}, picks {picks}"


def _judge_beam(case: BeamCase, got) -> str | None:
    freed, copied, held = want = beam_blocks(case)
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        return f"{_beam_text(case)}: expected (freed, copied, held), got {got!r:.80}"
    try:
        mine = (sorted(got[0]), sorted(got[1]), got[2])
    except TypeError:
        return f"{_beam_text(case)}: freed and copied must be lists of blocks, got {got!r:.80}"
    if mine == want:
        return None
    full = (case.prompt_len + len(case.history)) % case.block_size == 0
    for name, g, w, why in (
            ("freed", mine[0], freed, "a block goes back to the pool only when no beam that "
             "is kept still points at it"),
            ("copied", mine[1], copied, "a full last block is never copied: each beam's "
             "token opens a new block" if full else "k beams that share a partial last "
             "block make k - 1 copies: the last one left on it writes in place"),
            ("held", mine[2], held, "held = blocks still pointed at + one per copy + one new "
             "block per beam when the last blocks are full")):
        if g != w:
            return f"{_beam_text(case)}: {name} is {g}, the library's manager {w} ({why})"
    return None


def check_beam_blocks(fn: Callable[[dict, int, list[int], int], tuple]) -> Verdict:
    """5.1: ``fn(tables, num_tokens, picks, block_size)`` against the manager's step."""
    return judge_cases("5.1 beam_blocks", fn, beam_cases(),
                       lambda learner, case: _judge_beam(case, learner(*beam_args(case))),
                       _beam_text)


# ----------------------------------------------------------------- plausible wrong answers
def _every_beam_copies(tables, num_tokens, picks, block_size):
    """Wrong: each of the k beams on a shared partial block copies it (k copies, not k - 1)."""
    freed, copied, held = solutions.beam_blocks(tables, num_tokens, picks, block_size)
    if num_tokens % block_size:
        extra = [tables[b][-1] for b in set(picks) if picks.count(b) > 1]
        copied, held = sorted(copied + extra), held + len(extra)
    return freed, copied, held


def _frees_whole_tables(tables, num_tokens, picks, block_size):
    """Wrong: frees every block of a dropped beam, even those a kept beam shares."""
    freed, copied, held = solutions.beam_blocks(tables, num_tokens, picks, block_size)
    dropped = [b for beam, t in tables.items() if beam not in picks for b in t]
    return sorted(set(dropped)), copied, held


def _copies_full_blocks(tables, num_tokens, picks, block_size):
    """Wrong: copies a shared last block even when it is full (the token opens a new one)."""
    freed, copied, held = solutions.beam_blocks(tables, num_tokens, picks, block_size)
    if num_tokens % block_size == 0:
        copied = [tables[b][-1] for b in set(picks) for _ in range(picks.count(b) - 1)]
    return freed, copied, held


WRONG = (_every_beam_copies, _frees_whole_tables, _copies_full_blocks)
