"""Exercise 5.3, predict then run: what copy-on-write does to a pool, told as numbers.

The statement gives five scenarios on a ``BlockManager`` (blocks of 4 tokens, 8 blocks, no
prefix caching) in words; the learner writes a prediction for each, and the checker plays each
scenario on the library and compares. A wrong prediction is told with the library's value.
"""

from __future__ import annotations

from collections.abc import Callable

from course_lib.exercises import Scenario, Verdict, judge_predictions
from course_lib.memory.v0.manager import BlockManager

BLOCK_SIZE, NUM_BLOCKS = 4, 8


def _pool() -> BlockManager:
    return BlockManager(BLOCK_SIZE, NUM_BLOCKS, watermark=0.0)


def _held(m: BlockManager) -> int:
    return m.num_gpu_blocks - m.num_free_gpu_blocks


def _write_after_fork() -> int:
    m = _pool()
    m.allocate(0, [0] * 18)
    m.fork(0, 1)
    m.append_slots(0, [0])
    m.append_slots(1, [0])
    return _held(m)


def _full_block_fork() -> int:
    m = _pool()
    m.allocate(0, [0] * 16)
    m.fork(0, 1)
    m.append_slots(0, [0])
    m.append_slots(1, [0])
    return _held(m)


def _three_sharers() -> int:
    m = _pool()
    m.allocate(0, [0] * 6)
    m.fork(0, 1)
    m.fork(0, 2)
    return sum(len(m.append_slots(seq, [0])) for seq in (1, 2, 0))


def _free_a_sharer() -> int:
    m = _pool()
    m.allocate(0, [0] * 10)
    m.fork(0, 1)
    m.free(0)
    m.append_slots(1, [0])
    return _held(m)


def _reuse_after_free() -> int:
    m = _pool()
    m.allocate(0, [0] * 12)
    m.free(0)
    m.allocate(1, [0] * 4)
    return m.get_block_table(1)[0]


SCENARIOS = (
    Scenario("a", "an 18-token prompt, fork it, append one token to the parent, then one to "
                  "the child: blocks held", _write_after_fork),
    Scenario("b", "a 16-token prompt, fork it, append one token to the parent, then one to "
                  "the child: blocks held", _full_block_fork),
    Scenario("c", "a 6-token prompt, fork it twice, append one token to each child, then one "
                  "to the parent: copies made", _three_sharers),
    Scenario("d", "a 10-token prompt, fork it, free the parent, append one token to the "
                  "child: blocks held", _free_a_sharer),
    Scenario("e", "a 12-token prompt, free it, then a 4-token prompt: the id of its block",
             _reuse_after_free),
)


def check_cow_predictions(predictions: Callable[[], dict]) -> Verdict:
    """5.3: each scenario played on a ``BlockManager``, against the learner's prediction."""
    return judge_predictions("5.3 cow_predictions", predictions, SCENARIOS)


# ----------------------------------------------------------------- plausible wrong answers
def _right() -> dict:
    from course_lib.exercises.solutions.ch05 import cow_predictions

    return cow_predictions()


def _both_copy():
    """Wrong: both sharers copy the partial block (the last one could write in place)."""
    return {**_right(), "a": 7}


def _full_block_copied():
    """Wrong: the full shared last block is copied before the new token goes in."""
    return {**_right(), "b": 8}


def _every_sharer_copies():
    """Wrong: each of the three sharers copies (the last one is the only owner by then)."""
    return {**_right(), "c": 3}


def _sole_owner_copies():
    """Wrong: the child copies the partial block, though it is its only owner by then."""
    return {**_right(), "d": 4}


def _free_head_first():
    """Wrong: free pushes the blocks from the first to the last, so the last is on top."""
    return {**_right(), "e": 2}


WRONG = (_both_copy, _full_block_copied, _every_sharer_copies, _sole_owner_copies,
         _free_head_first)
