"""The step's undo (``course_lib/checkpoint.py``): whatever fields an object has, a rollback
puts them back; containers in place; append-only lists by length; many small objects in one
pass; logs of undos; closed once; resumable after a failure. A hypothesis test mutates random
object graphs and checks that a rollback restores them exactly, and is proven on two broken
checkpoints (one that keeps references instead of copies, one that forgets slots). V0's
block tables, saved by length and last item, are rolled back after random manager calls
(copy-on-write included), proven on a length-only saving that misses the copy-on-write."""

from __future__ import annotations

import copy
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib import checkpoint as ck
from course_lib.checkpoint import Checkpoint


class Plain:
    def __init__(self) -> None:
        self.n = 1
        self.items = [1, 2, 3]
        self.by_key = {"a": [1], "b": [2]}          # a dict of lists: nested
        self.seen = {1, 2}
        self.order = OrderedDict([(1, "x"), (2, "y")])
        self.queue = deque([5, 6])
        self.raw = bytearray(b"\x00\x01")
        self.other: Plain | None = None


@dataclass(slots=True, eq=False)
class Slotted:
    block_id: int
    ref_cnt: int = 0
    tag: bytes | None = None
    nxt: Slotted | None = None


@dataclass(slots=True, eq=False)
class SlottedWithList:
    name: str
    blocks: list[int] = field(default_factory=list)


@dataclass(eq=False)
class Appending:
    out: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    __rollback_append_only__ = ("out",)


class Skipping:
    __rollback_skip__ = ("huge",)

    def __init__(self) -> None:
        self.huge = list(range(10))
        self.small = [1]


def state(obj):
    return {k: copy.deepcopy(v) if not isinstance(v, Plain) else id(v)
            for k, v in (vars(obj).items() if hasattr(obj, "__dict__")
                         else ((n, getattr(obj, n)) for n in obj.__slots__))}


def test_every_field_comes_back_and_containers_keep_their_identity():
    p, other = Plain(), Plain()
    before, lists = state(p), (p.items, p.by_key, p.by_key["a"], p.seen, p.order, p.queue, p.raw)
    c = Checkpoint()
    c.touch(p)
    p.n = 2
    p.items.append(4)
    p.by_key["a"].append(9)
    p.by_key["c"] = [3]
    p.seen.add(3)
    p.order[3] = "z"
    p.queue.appendleft(4)
    p.raw[0] = 7
    p.other = other
    p.items = []                           # rebound: the old list comes back, refilled
    p.added = "a field born in the step"   # gone after the rollback
    assert c.saved(p, "items") == [1, 2, 3] and c.saved(p, "by_key") == {"a": [1], "b": [2]}
    c.rollback()
    assert state(p) == before and not hasattr(p, "added")
    assert all(a is b for a, b in zip(lists, (p.items, p.by_key, p.by_key["a"], p.seen,
                                              p.order, p.queue, p.raw), strict=True))


def test_slots_append_only_and_skipped_fields():
    s, w, a, k = Slotted(1), SlottedWithList("t", [1]), Appending([1, 2], [0.5]), Skipping()
    out = a.out
    c = Checkpoint()
    c.touch(s, w, a, k)
    s.ref_cnt, s.tag, w.blocks[0] = 3, b"h", 9
    a.out.append(3)
    a.probs.append(0.1)
    k.huge.append(10)
    k.small.append(2)
    c.rollback()
    assert (s.ref_cnt, s.tag, w.blocks) == (0, None, [1])
    assert a.out is out and a.out == [1, 2] and a.probs == [0.5]
    assert k.huge[-1] == 10 and k.small == [1]          # a skipped field is not state


def test_the_first_save_wins():
    blocks = [Slotted(i) for i in range(100)]
    for a, b in zip(blocks, blocks[1:], strict=False):
        a.nxt = b
    c = Checkpoint()
    c.touch(blocks[5])                      # touched first, then changed, then all
    blocks[5].ref_cnt = 7
    c.touch(*blocks)
    for b in blocks:
        b.ref_cnt, b.nxt = b.ref_cnt + 1, None
    c.touch(blocks[6])                      # already saved: this save is ignored
    c.rollback()
    assert [b.ref_cnt for b in blocks] == [0] * 100
    assert all(a.nxt is b for a, b in zip(blocks, blocks[1:], strict=False))
    mixed = [SlottedWithList("x", [1]), SlottedWithList("y", [2])]   # slots holding lists
    c = Checkpoint()
    c.touch(*mixed)
    mixed[1].blocks.append(3)
    c.rollback()
    assert mixed[1].blocks == [2]


def test_undo_logs_run_last_first_and_a_checkpoint_closes_once():
    seen, q = [], Logged()
    c = Checkpoint()
    c.watch(q)
    c.on_rollback(lambda: seen.append("first registered"))
    c.on_rollback(lambda: seen.append("last registered"))
    q.move("a")
    c.rollback()
    assert seen == ["last registered", "first registered"] and q.undone == ["a"]
    c.rollback()                            # done: a no-op
    with pytest.raises(RuntimeError, match="already committed or rolled back"):
        c.touch(q)
    c = Checkpoint()
    c.commit()
    for again in (c.commit, c.rollback):
        with pytest.raises(RuntimeError, match="already committed or rolled back"):
            again()


def stack_and_items_step(c: Checkpoint | None) -> tuple:
    """Changes to a list, a bytearray, a dict (a list in it changed in place, a key added, one
    deleted) and a stack (popped, pushed, cut below where it was), each saved with ``c``
    first (none: nothing saved); returns the containers, and the dict's list."""
    refs, state, maps, stack = [0, 1, 2], bytearray(b"abc"), {"a": [1], "b": 2}, [5, 4, 3]
    save_items = c.save_items if c else (lambda container, keys: None)
    save_stack = c.save_stack if c else (lambda stack, cut_to=None: None)
    save_stack(stack)
    for value in (10, 11):                              # twice: the first save wins
        save_items(refs, [1])
        refs[1] = value
    save_items(state, [0])
    state[0] = ord("z")
    save_items(maps, ["a", "c"])
    maps["a"].append(2)
    maps["c"] = 3
    save_items(maps, ["b"])
    del maps["b"]
    save_stack(stack, 2)
    stack.pop()
    stack.append(9)
    save_stack(stack, 1)
    del stack[1:]
    stack += [7, 8]
    return refs, state, maps, stack, maps["a"]


def test_saved_items_and_stacks_come_back_as_first_saved():
    """``save_items`` keeps each item's first value (a dict's absent key as absent, a list in
    it copied and refilled in place); ``save_stack`` keeps a stack by its least length and
    what was cut below it. Proven: without the saves, the rollback leaves the changes."""
    c = Checkpoint()
    refs, state, maps, stack, listed = stack_and_items_step(c)
    assert c.item_at_start(refs, 1) == 1 and c.item_at_start(refs, 2) == 2
    assert c.item_at_start(maps, "a") == [1] and c.item_at_start(state, 0) == ord("a")
    with pytest.raises(KeyError):
        c.item_at_start(maps, "c")                      # absent when first saved
    c.rollback()
    assert (refs, state, maps, stack) == ([0, 1, 2], bytearray(b"abc"), {"a": [1], "b": 2},
                                          [5, 4, 3])
    assert maps["a"] is listed                          # the same list, refilled
    c = Checkpoint()
    refs, state, maps, stack, _ = stack_and_items_step(None)
    c.rollback()
    assert refs[1] == 11 and stack == [5, 7, 8] and "c" in maps


def test_a_rollback_that_fails_half_way_resumes_where_it_stopped():
    objs = [Plain() for _ in range(3)]
    c = Checkpoint()
    c.touch(*objs)
    for o in objs:
        o.n = 5
    real, calls = ck.load_fields, []

    def flaky(obj, fields):
        calls.append(obj)
        if len(calls) == 2:
            raise RuntimeError("fault")
        real(obj, fields)
    ck.load_fields = flaky
    try:
        with pytest.raises(RuntimeError, match="fault"):
            c.rollback()
        c.rollback()
    finally:
        ck.load_fields = real
    assert [o.n for o in objs] == [1, 1, 1] and len(calls) == 4   # the failed one retried


class Logged:
    def __init__(self) -> None:
        self.log, self.undone = None, []

    def begin_log(self):
        self.log = []
        return self.log

    def move(self, what):
        self.log.append(what)

    def undo(self, log):
        self.undone += reversed(log)


# ------------------------------------------------------- random graphs, and the detector
MUTATIONS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9), st.integers(-5, 5)),
                     max_size=25)


def mutate(objs: list[Plain], slots: list[Slotted], ops) -> None:
    for which, kind, value in ops:
        p, s = objs[which % len(objs)], slots[which % len(slots)]
        if kind == 0:
            p.n += value
        elif kind == 1:
            p.items.append(value)
        elif kind == 2:
            p.by_key.setdefault(str(value), []).append(value)
        elif kind == 3 and p.by_key:
            p.by_key[next(iter(p.by_key))].append(value)
        elif kind == 4:
            p.seen.add(value)
        elif kind == 5:
            p.items = [value]
        elif kind == 6:
            p.other = objs[value % len(objs)]
        elif kind == 7:
            s.ref_cnt += value
        elif kind == 8:
            s.nxt = slots[value % len(slots)]
        elif kind == 9:
            p.queue.append(value)


def graph_state(objs, slots):
    return ([(p.n, list(p.items), {k: list(v) for k, v in p.by_key.items()}, set(p.seen),
              list(p.queue), None if p.other is None else objs.index(p.other)) for p in objs],
            [(s.ref_cnt, None if s.nxt is None else slots.index(s.nxt)) for s in slots])


def rollback_restores(first, second) -> bool:
    objs, slots = [Plain() for _ in range(4)], [Slotted(i) for i in range(4)]
    mutate(objs, slots, first)
    before = graph_state(objs, slots)
    c = Checkpoint()
    c.touch(*objs, *slots)
    mutate(objs, slots, second)
    c.rollback()
    return graph_state(objs, slots) == before


@settings(max_examples=150, deadline=None)
@given(MUTATIONS, MUTATIONS)
def test_a_rollback_restores_any_mutations(first, second):
    assert rollback_restores(first, second)


def test_the_property_trips_on_broken_checkpoints(monkeypatch):
    """Two broken checkpoints, each must be caught on the inputs hypothesis draws: one that
    keeps containers by reference (no copy), one that forgets slotted objects."""
    ops = [(0, 1, 3), (1, 2, 4), (2, 7, 2)]
    assert rollback_restores([], ops)
    monkeypatch.setattr(ck, "_Saved", lambda obj: obj)          # a reference, not a copy
    assert not rollback_restores([], ops)
    monkeypatch.undo()
    real_touch = Checkpoint.touch
    monkeypatch.setattr(Checkpoint, "touch", lambda self, *objs: real_touch(
        self, *(o for o in objs if hasattr(o, "__dict__"))))        # slotted objects skipped
    assert not rollback_restores([], ops)


# --------------------------------------------- what the engine saves covers what it owns
def owned_objects(root) -> list:
    """Every object of a course_lib class reachable from ``root`` through fields and
    containers, except plain values (named tuples, enums, frozen dataclasses, functions)."""
    import enum

    seen, out, stack = set(), [], [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack += list(obj.keys()) + list(obj.values())
            continue
        if isinstance(obj, list | tuple | set | frozenset | deque):
            stack += list(obj)
            continue
        cls = type(obj)
        if not cls.__module__.startswith("course_lib") or isinstance(obj, enum.Enum) \
                or (isinstance(obj, tuple)) or callable(obj) \
                or getattr(getattr(cls, "__dataclass_params__", None), "frozen", False):
            continue
        out.append(obj)
        fields = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
        fields.update({n: getattr(obj, n) for k in cls.__mro__
                       for n in k.__dict__.get("__slots__", ()) if hasattr(obj, n)})
        stack += list(fields.values())
    return out


@pytest.mark.parametrize("design, prefix_cache", [("v0", "hash"), ("v1", "hash"),
                                                  ("v1", "radix")])
def test_the_parts_a_step_saves_are_everything_the_manager_owns(design, prefix_cache):
    """``engine/rollback.manager_parts`` lists, per design, the objects a step may change:
    after a workload with sharing, preemption and eviction, every object reachable from the
    manager is among them. Proven: leaving one kind of object out is reported."""
    from course_lib.config import CacheConfig, SchedulerConfig
    from course_lib.engine.rollback import manager_parts
    from course_lib.scheduler.scheduler import Scheduler
    from course_lib.scheduler.v1 import SchedulerV1
    from course_lib.sequence import SamplingParams
    from course_lib.sim.fake_sampler import fake_samples

    cc = CacheConfig(block_size=4, num_gpu_blocks=24, num_cpu_blocks=8 if design == "v0" else 0,
                     enable_prefix_caching=True, prefix_cache=prefix_cache)
    s = (Scheduler if design == "v0" else SchedulerV1)(SchedulerConfig(max_num_seqs=4), cc)
    for i in range(6):
        s.add_request(i, [1, 2, 3, 4, 5, 6, 7, 8, 9 + i % 2], SamplingParams(max_tokens=12, n=2))
    for _ in range(8):
        out = s.schedule()
        s.update(out, fake_samples(out))
    manager = s.block_manager
    objects, self_saved = manager_parts(manager)
    listed = {id(o) for o in objects}
    missing = [type(o).__name__ for o in owned_objects(manager)
               if id(o) not in listed and not isinstance(o, self_saved)]
    assert not missing, f"objects the step may change but does not save: {missing}"
    fewer = {id(o) for o in objects[:-1]}                  # the detector: one left out
    assert any(id(o) not in fewer and not isinstance(o, self_saved)
               for o in owned_objects(manager))


def test_the_parts_a_step_saves_cover_everything_a_kv_connector_owns():
    """A KV connector's ``rollback_parts`` (saved by ``engine/rollback.begin_connector``) are
    every object it owns, the manager it is bound to aside (the manager's parts are listed
    above) and the CPU tier's blocks, which its pool saves itself before it first changes
    them (``CPUBlockPool.attach``), after a workload of stores, CPU hits and LRU evictions.
    Proven: leaving its pool out is reported, and so would be the blocks were they not
    saved by the pool."""
    from course_lib.config import CacheConfig, SchedulerConfig
    from course_lib.engine.cpu_offload import CPUBlock, CPUOffloadConnector
    from course_lib.scheduler.v1 import SchedulerV1
    from course_lib.sequence import SamplingParams
    from course_lib.sim.fake_sampler import fake_samples

    conn = CPUOffloadConnector(6, load_async=True)
    cc = CacheConfig(block_size=4, num_gpu_blocks=12, enable_prefix_caching=True)
    s = SchedulerV1(SchedulerConfig(max_num_seqs=4), cc, conn)
    for i in range(6):
        s.add_request(i, [1 + i % 2, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
                      SamplingParams(max_tokens=6))
    for _ in range(14):
        out = s.schedule()
        s.update(out, fake_samples(out))
        s.update_from_kv_xfer_finished(None, set(out.kv_connector_metadata.async_seq_ids))
    assert conn.num_stored_blocks and conn.num_hit_tokens and conn.cpu_pool.num_evictions
    manager = {id(o) for o in owned_objects(s.kv_cache_manager)}
    listed, self_saved = {id(o) for o in conn.rollback_parts()}, (CPUBlock,)
    missing = [type(o).__name__ for o in owned_objects(conn)
               if id(o) not in listed and id(o) not in manager and not isinstance(o, self_saved)]
    assert not missing, f"objects of the connector a step may change but does not save: {missing}"
    owned = [o for o in owned_objects(conn) if id(o) not in manager]
    assert any(id(o) not in {id(conn)} and not isinstance(o, self_saved) for o in owned)
    assert any(id(o) not in listed and isinstance(o, CPUBlock) for o in owned)


# ------------------------------------- managers that save what they change, rolled back
MANAGER_OPS = st.lists(st.tuples(st.sampled_from(["admit", "free", "grow"]), st.integers(0, 5),
                                 st.integers(1, 3)), max_size=20)


def play(m, ops, live: dict) -> None:
    """Admit prompts sharing prefixes, free sequences, grow them by a token (V1 calls)."""
    for op, seq, k in ops:
        seq_id = seq + 100 * len(live)
        if op == "admit" and seq_id not in live:
            tokens = [1, 2, 3, 4, 5, 6, 7, 8][:2 + 2 * k] + [seq]
            hits, num_hit = m.get_computed_blocks(seq_id, tokens)
            if m.allocate_slots(seq_id, tokens, 0, len(tokens) - num_hit, hits,
                                admission=True) is None:
                m.forget(seq_id)
                continue
            live[seq_id] = tokens
            if hasattr(m, "cache_computed"):             # the radix tree: after the step
                m.cache_computed(seq_id, tokens, len(tokens))
        elif op == "free" and live:
            victim = sorted(live)[seq % len(live)]
            m.free(victim)
            del live[victim]
        elif op == "grow" and live:
            seq_id = sorted(live)[seq % len(live)]
            tokens = live[seq_id] + [seq + k]
            if m.allocate_slots(seq_id, tokens, len(tokens) - 1, 1) is not None:
                live[seq_id] = tokens
                if hasattr(m, "cache_computed"):
                    m.cache_computed(seq_id, tokens, len(tokens))


def manager_rolls_back(design, first, second, *, attach=True) -> bool:
    from memory_helpers import v1_state

    from course_lib.checkpoint import Checkpoint as Ckpt
    from course_lib.engine.rollback import begin_manager, manager_parts
    from course_lib.memory.radix.kv_cache_manager import RadixKVCacheManager
    from course_lib.memory.v1.kv_cache_manager import KVCacheManager

    m, live = (KVCacheManager if design == "v1" else RadixKVCacheManager)(2, 8), {}
    play(m, first, live)
    before = v1_state(m)
    c = Ckpt()
    if attach:
        begin_manager(c, m)
    else:                                     # the parts, without their own saving
        objects, _ = manager_parts(m)
        c.touch(*objects)
    play(m, second, dict(live))
    c.rollback()
    m.check_invariants()
    return v1_state(m) == before


@pytest.mark.parametrize("design", ["v1", "radix"])
@settings(max_examples=100, deadline=None)
@given(first=MANAGER_OPS, second=MANAGER_OPS)
def test_what_the_managers_save_when_changed_rolls_back_exactly(design, first, second):
    """V1's pool saves each block (and logs each hash-map entry), the radix tree each node
    (and logs each change of its evictable leaves), just before a step first changes it:
    after any calls, a rollback gives the manager back exactly."""
    assert manager_rolls_back(design, first, second)


@pytest.mark.parametrize("design", ["v1", "radix"])
def test_without_their_own_saving_a_rollback_is_wrong(design):
    """The detector: the same calls with nothing attached (the blocks or nodes unsaved)
    leave the manager changed after the rollback."""
    first = [("admit", 0, 3), ("admit", 1, 3), ("free", 0, 1)]
    second = [("admit", 2, 3), ("free", 0, 1), ("grow", 0, 1)]
    assert manager_rolls_back(design, first, second)
    try:
        restored = manager_rolls_back(design, first, second, attach=False)
    except AssertionError:                    # the manager's own invariants trip
        restored = False
    assert not restored


# ------------------------------- V0: block tables saved by length and last item, rolled back
V0_OPS = st.lists(st.tuples(st.sampled_from(["admit", "decode", "chunk", "fork", "free", "swap_out",
                                             "swap_in", "mark"]),
                            st.integers(0, 5), st.integers(0, 9)), max_size=25)


def play_v0(m, ops, live: list[int], next_id: list[int]) -> int:
    """V0 calls as the scheduler makes them (admit, decode, a prefill chunk, fork, free, swap
    out and in, mark computed) on the sequences in ``live``; returns the copy-on-writes."""
    from course_lib.memory.common import AllocStatus

    cows = 0
    for op, pick, k in ops:
        seq = live[pick % len(live)] if live else None
        on_gpu = seq is not None and m.get_table(seq).device == "gpu"
        if op == "admit":
            prompt = [1, 2, 3, 4, 5, 6][:k % 6 + 1] + [pick]
            if m.can_allocate(prompt) is AllocStatus.OK:
                m.allocate(next_id[0], prompt)
                m.mark_blocks_as_computed(next_id[0], len(prompt))
                live.append(next_id[0])
                next_id[0] += 1
        elif op == "decode" and on_gpu:
            grown = m.append_decode([seq], [k])
            cows += bool(grown and grown[0])
        elif op == "chunk" and on_gpu and m.can_append_slots(seq, k % 4):
            cows += bool(m.append_slots(seq, [7] * (k % 4)))
        elif op == "fork" and on_gpu:
            m.fork(seq, next_id[0])
            live.append(next_id[0])
            next_id[0] += 1
        elif op == "free" and seq is not None:
            m.free(seq)
            live.remove(seq)
        elif op == "swap_out" and on_gpu and m.can_swap_out([seq]):
            m.swap_out([seq])
        elif op == "swap_in" and seq is not None and not on_gpu \
                and m.can_swap_in([seq]) is AllocStatus.OK:
            m.swap_in([seq])
        elif op == "mark" and on_gpu:
            m.mark_blocks_as_computed(seq, m.get_table(seq).num_tokens)
    return cows


def v0_state(m) -> tuple:
    """The manager's public state, which objects its tables and their lists are (a
    rollback puts back the very lists handed out to the step's readers), and the prefix
    cache's four maps as they are (the order of a hash's collided blocks, the generations of
    blocks no longer cached: what the public state does not show)."""
    from memory_helpers import snapshot

    ids = {s: (id(t), id(t.blocks), id(t.token_ids), id(t.block_hashes))
           for s, t in ((s, m.get_table(s)) for s in m.seq_ids())}
    maps = None if m.cache is None else (
        dict(m.cache._block_of), {h: list(bs) for h, bs in m.cache._collided.items()},
        dict(m.cache._key_of), dict(m.cache._generation))
    return snapshot(m), ids, maps


def weak_hash(parent, tokens, extra) -> int:
    """A block hash with three values: most blocks collide."""
    return hash((parent, tokens, extra)) % 3


def v0_rolls_back(first, second, caching: bool, colliding: bool = False) -> tuple[bool, int]:
    """(whether the rollback gave the manager back exactly, the copy-on-writes of
    ``second``); ``colliding``: the prefix cache hashes with :func:`weak_hash`."""
    from memory_helpers import checkpoint

    from course_lib.memory.v0.fast import FastBlockManager

    m, live, next_id = FastBlockManager(2, 16, 8, 0.0, caching), [], [0]
    if colliding and caching:
        m.cache.hash_fn = weak_hash
    play_v0(m, first, live, next_id)
    before = v0_state(m)
    c = checkpoint(m)
    cows = play_v0(m, second, list(live), next_id)
    c.rollback()
    try:
        m.check_invariants()
    except AssertionError:                    # the ref counts no longer match the tables
        return False, cows
    return v0_state(m) == before, cows


@settings(max_examples=150, deadline=None)
@given(first=V0_OPS, second=V0_OPS, caching=st.booleans())
def test_v0_tables_saved_by_length_roll_back_exactly(first, second, caching):
    """A V0 step's checkpoint saves each table's lists by length and last item: after any
    calls (appends, copy-on-write of a shared last block, forks, frees, swaps), a rollback
    gives the manager back exactly, each table's own lists in place."""
    assert v0_rolls_back(first, second, caching)[0]


@settings(max_examples=100, deadline=None)
@given(first=V0_OPS, second=V0_OPS)
def test_v0_prefix_cache_logs_roll_back_exactly_when_hashes_collide(first, second):
    """The prefix cache's maps, logged entry by entry (``PrefixCache._save``), roll back
    exactly when most blocks collide: registered beside a first block of their hash, evicted
    from the middle of a hash's list, promoted when the first one goes."""
    assert v0_rolls_back(first, second, True, colliding=True)[0]


@pytest.mark.parametrize("structure", [list, bytearray, dict, "stack"],
                         ids=["ref counts", "states", "prefix cache maps", "free stack"])
def test_v0_step_logs_that_miss_a_change_are_caught(monkeypatch, structure):
    """The detector for V0's logs: with the saving of one structure switched off (the pools'
    ref counts (a list), their states (a bytearray), the prefix cache's maps (dicts), or the
    cuts of the free stacks), the rollback test above finds the manager changed after a step
    that only admits a prompt (its blocks come off the free stack, are held, and enter the
    prefix cache)."""
    second = [("admit", 1, 9)]
    assert v0_rolls_back([], second, True) == (True, 0)
    if structure == "stack":                            # the length kept, no cut saved
        real_stack = Checkpoint.save_stack
        monkeypatch.setattr(Checkpoint, "save_stack",
                            lambda self, stack, cut_to=None: real_stack(self, stack))
    else:
        real_items = Checkpoint.save_items
        monkeypatch.setattr(Checkpoint, "save_items", lambda self, container, keys: None
                            if type(container) is structure else real_items(self, container, keys))
    assert v0_rolls_back([], second, True) == (False, 0)


V0_LOGGED = {"gpu": ("ref_counts", "_free", "_state"),
             "cache": ("_block_of", "_key_of", "_generation", "_collided")}


def v0_step_copies(owner: str) -> tuple[list[str], int]:
    """After a step that decodes a block's worth of tokens of a sequence holding 500 cached
    blocks (one new block, registered once full): which of ``owner``'s logged structures the
    checkpoint copied, and how many items of them it saved one by one."""
    from memory_helpers import checkpoint

    from course_lib.memory.v0.fast import FastBlockManager

    m = FastBlockManager(4, 1024, 0, 0.0, True)
    m.allocate(0, list(range(2000)))                    # 500 full blocks
    m.mark_blocks_as_computed(0, 2000)
    c = checkpoint(m)
    for token in range(4):                              # a new block, filled
        m.append_decode([0], [token])
    m.mark_blocks_as_computed(0, 2004)                  # and registered
    assert m.cache.is_cached(m.get_table(0).blocks[-1])
    obj = getattr(m, owner)
    copied = []
    for name in V0_LOGGED[owner]:
        try:
            c.saved(obj, name)
            copied.append(name)
        except KeyError:                                # not saved: logged instead
            pass
    logged = [c._items[id(getattr(obj, n))][1] for n in V0_LOGGED[owner]
              if id(getattr(obj, n)) in c._items]          # Checkpoint.save_items' log
    return copied, sum(map(len, logged))


@pytest.mark.parametrize("owner", ["gpu", "cache"])
def test_a_v0_step_logs_its_pools_and_prefix_cache_without_copying_them(monkeypatch, owner):
    """What a V0 step saves of its pools and prefix cache grows with what it changes, not
    with them: the checkpoint holds no copy of the ref counts, states and free stack, or of
    the cache's maps, only the items the step changed: the one block it took (its ref
    count and state), its registration (an entry of each map). Proven: with
    the class's ``__rollback_skip__`` reduced to the checkpoint (the copy the logs replaced),
    the checkpoint copies them whole, and this test says so."""
    assert v0_step_copies(owner) == ([], 2 if owner == "gpu" else 4)
    from course_lib.memory.v0.fast import FastPrefixCache
    from course_lib.memory.v0.pool import BlockAllocator

    cls = BlockAllocator if owner == "gpu" else FastPrefixCache
    monkeypatch.setattr(cls, "__rollback_skip__", ("checkpoint", "_prompts", "_chains"))
    monkeypatch.setattr(ck, "_LAYOUTS", {})                  # the layouts worked out again
    assert v0_step_copies(owner)[0] == list(V0_LOGGED[owner])


# a forked sequence with a shared partial last block (3 tokens, block 2) decodes: copy-on-write
COW_FIRST = [("admit", 0, 1), ("fork", 0, 0)]
COW_SECOND = [("decode", 0, 1), ("decode", 0, 2)]


def test_a_length_only_saving_misses_the_copy_on_write(monkeypatch):
    """The detector: saving the tables' lists by length alone (forgetting that a
    copy-on-write replaces the last block id in place) leaves the table pointing at the
    copy after a rollback, and the test above sees it."""
    assert v0_rolls_back(COW_FIRST, COW_SECOND, False) == (True, 1)   # a CoW ran, undone
    monkeypatch.setattr(ck._Appended, "put_back",
                        lambda self: self.obj.__delitem__(slice(self.length, None)) or self.obj)
    assert v0_rolls_back(COW_FIRST, COW_SECOND, False) == (False, 1)


def test_a_v0_step_saves_its_tables_without_copying_them(monkeypatch):
    """What a V0 step saves of a table does not grow with it: each list is saved by length,
    and read back at the step's start as a view of the table's own list (``saved_view``,
    what ``engine/rollback.blocks_before`` reads). Proven: without the class's
    ``__rollback_append_only__`` the lists are copied, and this test says so."""
    from memory_helpers import checkpoint

    from course_lib.checkpoint import AppendedView
    from course_lib.memory.v0.block_table import BlockTable
    from course_lib.memory.v0.fast import FastBlockManager

    def saved_by_length() -> bool:
        m = FastBlockManager(4, 64, 0, 0.0, True)
        m.allocate(0, list(range(101)))
        m.mark_blocks_as_computed(0, 101)
        c, table = checkpoint(m), m.get_table(0)
        views = [c.saved_view(table, n) for n in ("blocks", "token_ids", "block_hashes")]
        m.append_decode([0], [5])
        return all(type(v) is AppendedView for v in views) \
            and list(views[0]) == table.blocks[:26] and len(views[1]) == 101

    assert saved_by_length()
    monkeypatch.delattr(BlockTable, "__rollback_append_only__")
    monkeypatch.setattr(ck, "_LAYOUTS", {})                  # the layouts worked out again
    assert not saved_by_length()
