"""Chapter 02 exercises: where every slot of the KV cache goes (token states, reservation,
internal and external fragmentation), and events that make a broken first-fit allocator fail.

Each ``check_*`` runs the learner's function and the library's on the same cases (edge cases
first, then random ones from a fixed seed) and returns a :class:`Verdict` that names the first
difference in the chapter's terms.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from course_lib.exercises import (
    Exercise,
    Exercises,
    Rule,
    Verdict,
    judge_cases,
    returns,
)
from course_lib.exercises.solutions import ch02 as solutions
from course_lib.sim.static import CATEGORIES, ContiguousAllocator, reservation
from course_lib.sizing.units import cdiv


def split_memory(residents: list[tuple[int, int, int]], holes: list[int],
                 head_need: int | None) -> dict[str, int]:
    """Reference: the paper's split of memory (its Fig. 2), in slots, at one moment.

    ``residents``: ``(held, tokens_now, final_len)`` per request in memory, ``tokens_now <=
    final_len <= held``; ``holes``: the lengths of the free ranges; ``head_need``: the slots the
    request at the head of the queue needs in one range, or None when nobody waits. Returns
    ``token_states`` (KV already computed), ``reserved`` (held for tokens still to come),
    ``internal`` (held but never to be used), ``external`` (free slots, all of them, when the
    head waits and no hole holds it; else 0) and ``free`` (the rest of the free slots).
    """
    out = dict.fromkeys(CATEGORIES, 0)
    for held, now, final in residents:
        if not 0 <= now <= final <= held:
            raise ValueError(f"need 0 <= tokens_now <= final_len <= held, got {now, final, held}")
        out["token_states"] += now
        out["reserved"] += final - now
        out["internal"] += held - final
    free = sum(holes)
    if head_need is not None and max(holes, default=0) < head_need:
        out["external"] = free
    out["free"] = free - out["external"]
    return out


def _resident(rng: random.Random, policy: str) -> tuple[int, int, int]:
    final = rng.randrange(1, 2049)
    now = rng.randrange(0, final + 1)
    held = cdiv(final, 16) * 16 if policy == "paged" else reservation(policy, final)
    return held, now, final


def split_cases() -> list[tuple]:
    rng = random.Random(21)
    cases = [
        ([(1024, 256, 256), (1024, 512, 512), (1024, 128, 128)], [], None),  # the article's
        ([(1024, 100, 300)], [2048, 1024], 1500),    # E blocked: every free slot external
        ([(1024, 100, 300)], [1000, 1500], 1500),    # a hole of exactly 1500: E fits
        ([(1024, 100, 300)], [100, 50], None),       # nobody waits: free is free
        ([], [4096], 2048),                           # empty memory, the head fits
        ([], [], 1),                                  # no memory at all, and someone waits
        ([(48, 33, 40)], [16, 16], 32),               # paged: 3 blocks, the last one part-used
        ([(8, 8, 8)], [0], None),                     # full request, a zero-length hole
    ]
    for _ in range(30):
        policy = rng.choice(["max", "pow2", "oracle", "paged"])
        residents = [_resident(rng, policy) for _ in range(rng.randrange(0, 6))]
        holes = [rng.randrange(0, 2049) for _ in range(rng.randrange(0, 4))]
        head = rng.choice([None, rng.randrange(1, 2049), max(holes, default=0),
                           max(holes, default=0) + 1])
        cases.append((residents, holes, head))
    return cases


def _concept(key: str) -> str:
    return {"token_states": "the tokens each request holds now",
            "reserved": "slots held for tokens the request will still produce "
                        "(final_len - tokens_now)",
            "internal": "slots held past the final length, never used (held - final_len)",
            "external": "all the free slots when the waiting request fits in no single hole "
                        "(a hole of exactly its size holds it), else 0",
            "free": "the free slots that are not external fragmentation"}[key]


def _judge_split(case: tuple, got) -> str | None:
    want = split_memory(*case)
    if not isinstance(got, dict):
        return f"{_split_text(case)}: returned {got!r:.60}, not a dict of the five categories"
    if got == want:
        return None
    key = next((k for k in CATEGORIES if got.get(k) != want[k]), None)
    return f"{_split_text(case)}: " + (
        f"{key} = {got.get(key)!r}, the library {want[key]} ({_concept(key)})"
        if key else f"extra keys {sorted(set(got) - set(want))}")


def _split_text(case: tuple) -> str:
    return f"residents {case[0]}, holes {case[1]}, head_need {case[2]}"


def check_split_memory(fn: Callable) -> Verdict:
    """2.1: compare the five numbers; a difference names the category and what it counts."""
    return judge_cases("2.1 split_memory", fn, split_cases(), returns(_judge_split), _split_text)


class RightMergeFirstFit:
    """2.2's broken allocator, as the notebook shows it: first fit over a sorted list of holes,
    whose ``free`` merges a freed range with the hole right after it and forgets the hole
    right before it."""

    def __init__(self, num_slots):
        self.holes = [(0, num_slots)]          # (start, length), sorted by start

    def allocate(self, size):
        for i, (start, length) in enumerate(self.holes):
            if length >= size:                 # the first hole long enough
                if length == size:
                    del self.holes[i]
                else:
                    self.holes[i] = (start + size, length - size)
                return start
        return None

    def free(self, start, size):
        for i, (s, n) in enumerate(self.holes):
            if s == start + size:              # the hole right after the freed range
                self.holes[i] = (start, size + n)
                return
        self.holes.append((start, size))
        self.holes.sort()


MAX_EVENTS = 200


def _lowest_run(taken: list[bool], size: int) -> int | None:
    """The lowest start of ``size`` free slots side by side, or None."""
    run = 0
    for slot, used in enumerate(taken):
        run = 0 if used else run + 1
        if run == size:
            return slot - size + 1
    return None


def _invalid(num_slots: int, events) -> str | None:
    """Why ``events`` cannot run on a correct first-fit allocator, or None."""
    if not isinstance(events, (list, tuple)):
        return f"returned {events!r:.60}, not a list of events"
    if len(events) > MAX_EVENTS:
        return f"{len(events)} events; keep it under {MAX_EVENTS}"
    correct, got, freed = ContiguousAllocator(num_slots), {}, set()
    for i, event in enumerate(events):
        ok = (isinstance(event, (list, tuple)) and len(event) == 2 and event[0] in
              ("alloc", "free") and isinstance(event[1], int) and not isinstance(event[1], bool))
        if not ok or (event[0] == "alloc" and event[1] < 1):
            return (f"event {i} {event!r} is neither ('alloc', size) with size >= 1 nor "
                    "('free', i)")
        kind, value = event
        if kind == "alloc":
            got[i] = correct.allocate(value)
            continue
        where = f"event {i} {tuple(event)!r} is not valid on a correct allocator: "
        if value not in got:
            return where + (f"event {value} is not an earlier alloc (a free names the alloc's "
                            "index in events, not a slot)")
        if got[value] is None:
            return where + f"the alloc of event {value} got no slots, so nothing is freed"
        if value in freed:
            return where + f"the alloc of event {value} was freed already"
        freed.add(value)
        correct.free(got[value])
    return None


def _breaks(make: Callable[[int], Any], num_slots: int, events) -> tuple[int, int | None,
                                                                         int | None] | None:
    """The first alloc of ``make(num_slots)`` that breaks the rule: ``(event, got, lowest)``."""
    alloc, taken, got = make(num_slots), [False] * num_slots, {}
    for i, (kind, value) in enumerate(events):
        if kind == "alloc":
            lowest, got[i] = _lowest_run(taken, value), alloc.allocate(value)
            if got[i] != lowest:
                return i, got[i], lowest
            if got[i] is not None:
                taken[got[i]:got[i] + value] = [True] * value
        else:
            alloc.free(got[value], events[value][1])
            taken[got[value]:got[value] + events[value][1]] = [False] * events[value][1]
    return None


class _Correct:
    """The library's allocator with the broken one's ``free(start, size)``."""

    def __init__(self, num_slots):
        self.inner = ContiguousAllocator(num_slots)

    def allocate(self, size):
        return self.inner.allocate(size)

    def free(self, start, size):
        self.inner.free(start)


def _judge_failing(case: tuple, got) -> str | None:
    (num_slots,) = case
    where = f"a pool of {num_slots} slots"
    if problem := _invalid(num_slots, got):
        return f"{where}: {problem}"
    events = [tuple(e) for e in got]
    if broke := _breaks(_Correct, num_slots, events):    # cannot happen: the library's bug
        return f"{where}: the correct allocator breaks the rule at event {broke[0]}"
    if broke := _breaks(RightMergeFirstFit, num_slots, events):
        return None
    return (f"{where}: the broken allocator keeps the rule all through your {len(events)} "
            "events (each alloc got the lowest start of size free slots side by side, or "
            "None where there was none): find events after which it does not")


def check_failing_events(fn: Callable[[int], list[tuple[str, int]]]) -> Verdict:
    """2.2: the learner's events, for several pool sizes, must be valid on a correct first-fit
    allocator and make :class:`RightMergeFirstFit` break first fit's rule."""
    return judge_cases("2.2 failing_events", fn, [(2,), (3,), (10,), (64,)],
                       returns(_judge_failing), lambda case: f"a pool of {case[0]} slots")


def failing_break(num_slots: int, events: list) -> tuple[int, int | None, int | None] | None:
    """Where :class:`RightMergeFirstFit` breaks on valid ``events``: ``(event, its start,
    the lowest start)``, or None (for the notebook and the tests)."""
    return _breaks(RightMergeFirstFit, num_slots, [tuple(e) for e in events])


def _split_forgets_reserved(residents, holes, head_need):
    """Wrong: counts the slots held for future tokens as internal fragmentation."""
    out = solutions.split_memory(residents, holes, head_need)
    out["internal"] += out["reserved"]
    out["reserved"] = 0
    return out


def _split_external_is_small_holes(residents, holes, head_need):
    """Wrong: external = the holes too small for the head, even when another hole holds it."""
    out = solutions.split_memory(residents, holes, head_need)
    free = sum(holes)
    out["external"] = sum(h for h in holes if head_need is not None and h < head_need)
    out["free"] = free - out["external"]
    return out


def _split_strict_fit(residents, holes, head_need):
    """Wrong: a hole of exactly the head's size counted as too small."""
    out = solutions.split_memory(residents, holes, head_need)
    if head_need is not None and max(holes, default=0) <= head_need:
        out["external"], out["free"] = sum(holes), 0
    return out


def _frees_by_start(num_slots):
    """Wrong: a free names the slot where the range starts, not the alloc's index."""
    return [("alloc", 2), ("alloc", 2), ("free", 0), ("free", 2), ("alloc", 4)]


def _frees_in_merging_order(num_slots):
    """Wrong: valid, but slot 1 is freed before slot 0, so each free finds its hole after it."""
    return [("alloc", 1), ("alloc", 1), ("free", 1), ("free", 0), ("alloc", 2)]


def _sized_for_ten(num_slots):
    """Wrong: sizes that break a pool of 10 slots, but a pool of 2 cannot serve them."""
    return [("alloc", 3), ("alloc", 3), ("alloc", 4), ("free", 0), ("free", 1), ("alloc", 6)]


EXERCISES = Exercises(
    Exercise("2.1", "where every slot goes", check_split_memory, hints=(
        "Walk the residents: tokens_now slots hold KV (token states); final_len - tokens_now "
        "are held for tokens still to come (reserved); held - final_len will never be used "
        "(internal fragmentation).",
        "The free slots are sum(holes). They are external fragmentation only when someone "
        "waits (head_need is not None) and no single hole is at least head_need long; then all "
        "of them are, as in the paper's Fig. 2. max(holes, default=0) handles no holes.",
        "Return the five keys token_states, reserved, internal, external, free.",
    ), solution=solutions.split_memory,
        rules=(
        Rule("slots held for tokens still to come are reserved, not internal",
             "residents [(1024, 100, 300)], holes [204",
             _split_forgets_reserved),
        Rule("external only when no single hole holds head_need slots (else 0)",
             "residents [(1024, 100, 300)], holes [204",
             _split_external_is_small_holes),
        Rule("a hole of exactly head_need slots holds the head",
             "residents [(1024, 100, 300)], holes [1000, 1",
             _split_strict_fit),
    ),
        compare_with=(
        "simulate_static in course_lib/sim/static.py, which counts the same five at every step of"
        " a trace")),
    Exercise("2.2", "find where a first-fit allocator fails", check_failing_events, hints=(
        "The rule breaks only when two holes touch: a freed range that should have merged "
        "with the hole before it. Which order of frees leaves a hole right before the range "
        "being freed, and none right after it?",
        "Play the free above on paper in the smallest pool that can show it, writing the "
        "holes list after each event. You are looking for a list in which one hole ends "
        "exactly where the next begins; then ask for an alloc that fits only in the two "
        "together.",
        "Two neighbouring allocs of one slot each are enough: free the lower one first, then "
        "the higher, then alloc 2. It must start at slot 0, and the broken allocator finds no "
        "hole of 2 there. Sizes this small keep the events valid in a pool of 2 slots too.",
    ), solution=solutions.failing_events, rules=(
        Rule("every free names an earlier alloc that got slots, once (valid on a correct "
             "allocator)", "a pool of 10 slots", _frees_by_start),
        Rule("the broken allocator must break first fit's rule", "a pool of 10 slots",
             _frees_in_merging_order),
        Rule("for every pool size num_slots >= 2", "a pool of 2 slots", _sized_for_ten),
    ), trivial=(lambda *a: None, lambda *a: []), compare_with=(
        "ContiguousAllocator.free in course_lib/sim/static.py, which merges a freed range with "
        "the holes on both sides")),
)


hint = EXERCISES.print_hint            # ch02.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch02.solution("N.M"): a solution's code
