"""The KV-connector interface (``course_lib/engine/kv_connector.py``, vLLM V1's
``KVConnectorBase_V1``) and the CPU offload tier behind it (``course_lib/engine/cpu_offload.py``).

On a workload of conversations that outgrow the GPU pool (each turn resends the whole
conversation; the other conversations evict it from the GPU meanwhile), the engine with the
tier produces exactly the tokens of the engine without it (greedy and seeded sampling, the
loads synchronous or through ``WAITING_FOR_REMOTE_KVS``), loads blocks from the CPU instead
of recomputing them, and keeps its invariants after every step; a fault at any call of the
connector rolls the step back exactly (``bench/fault_sites.py``'s harness). The tier's pool,
which saves only what a step changes in it, is put back exactly after random steps of stores,
hits and evictions (hypothesis), and a pool that does not save is caught.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st
from memory_helpers import load_fault_sites

from course_lib.checkpoint import Checkpoint
from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.engine.cpu_offload import (
    CPUBlock,
    CPUBlockPool,
    CPUOffloadConnector,
    num_offload_blocks,
)
from course_lib.engine.kv_connector import KVConnectorBase_V1
from course_lib.engine.llm_engine import LLMEngine
from course_lib.engine.rollback import begin_connector
from course_lib.model.loader import load_tiny_model
from course_lib.sequence import SamplingParams, SequenceStatus

torch.set_num_threads(1)

BLOCK_BYTES = 8192          # the tiny Llama's block of 4 tokens: 2 * 4 layers * 4 * 2 * 32 * 4 B


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


def make_engine(model, connector=None, *, num_gpu_blocks=24, **cache_kwargs) -> LLMEngine:
    cc = CacheConfig(block_size=4, num_gpu_blocks=num_gpu_blocks, watermark=0.0,
                     enable_prefix_caching=True, **cache_kwargs)
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                         max_model_len=model.config.max_position)
    return LLMEngine(model, sc, cc, design="v1", kv_connector=connector, stop_token_ids=(),
                     clock=lambda: 0.0)


def conversations(engine: LLMEngine, *, sampled: bool, turns: int = 3, num_convs: int = 4
                  ) -> list[tuple[int, ...]]:
    """``num_convs`` conversations, ``turns`` turns each, one turn of each in turn: each
    prompt is the conversation so far (its earlier prompts and answers) plus a new line.
    Invariants checked after every step. Returns every answer's tokens, in order."""
    history = {c: list(engine.tokenizer.encode(f"Conversation {c}: tell me about the sea"))
               for c in range(num_convs)}
    answers = []
    for turn in range(turns):
        for c in range(num_convs):
            params = SamplingParams(max_tokens=6, temperature=0.8 if sampled else 0.0,
                                    seed=10 * c + turn)
            engine.add_request(history[c], params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens = tuple(out.outputs[0].token_ids)
                    answers.append(tokens)
                    history[c] += list(tokens) + \
                        engine.tokenizer.encode(f" and then {turn}", add_bos=False)
                engine.check_invariants()
    return answers


# ------------------------------------------------------------------ the tier, end to end
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_the_cpu_tier_gives_the_same_tokens_and_saves_prefill(model, sampled, load_async):
    plain = make_engine(model)
    want = conversations(plain, sampled=sampled)
    conn = CPUOffloadConnector(64, load_async=load_async)
    tiered = make_engine(model, conn)
    got = conversations(tiered, sampled=sampled)
    assert got == want
    assert conn.num_hit_tokens > 0 and conn.num_loaded_blocks == conn.num_hit_tokens // 4
    saved = plain.scheduler.num_prompt_tokens - tiered.scheduler.num_prompt_tokens
    assert saved == conn.num_hit_tokens          # every token loaded is one not recomputed
    assert plain.block_manager.prefix_cache_stats == tiered.block_manager.prefix_cache_stats
    assert 0 < conn.hit_rate <= 1
    print(f"\nGPU hits {tiered.block_manager.prefix_cache_stats}; CPU tier: "
          f"{conn.num_hit_tokens} of {conn.num_queried_tokens} tokens past the GPU hit "
          f"({conn.hit_rate:.0%}), {conn.num_stored_blocks} blocks stored; prefill "
          f"{plain.scheduler.num_prompt_tokens} -> {tiered.scheduler.num_prompt_tokens}")


def test_a_small_tier_evicts_least_recently_used_and_stays_exact(model):
    want = conversations(make_engine(model), sampled=True)
    conn = CPUOffloadConnector(10)
    assert conversations(make_engine(model, conn), sampled=True) == want
    assert conn.cpu_pool.num_evictions > 0


def test_async_loads_wait_for_remote_kvs_for_one_step(model):
    """With ``load_async`` a request whose prefix the tier holds spends one step in
    ``WAITING_FOR_REMOTE_KVS`` (blocks held, nothing computed), then runs."""
    conn = CPUOffloadConnector(64, load_async=True)
    engine = make_engine(model, conn, num_gpu_blocks=16)
    prompt = list(range(3, 43))                      # 40 tokens: 10 blocks
    engine.generate([prompt], SamplingParams(max_tokens=1))
    engine.generate([list(range(100, 140))], SamplingParams(max_tokens=1))   # evicts it
    engine.add_request(prompt, SamplingParams(max_tokens=2))
    out = engine.scheduler.schedule()                # (a scheduler step, outside the engine)
    seq = engine.scheduler.waiting_for_remote[0]
    assert seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS and not out.scheduled
    assert seq.num_computed_tokens == 36 and out.kv_connector_metadata.async_seq_ids == [
        seq.seq_id]
    engine.check_invariants()


# ------------------------------------------------------------------ configuration
def test_kv_offloading_size_builds_the_tier(model):
    engine = make_engine(model, kv_offloading_size=32 * BLOCK_BYTES / 2**30)
    assert isinstance(engine.kv_connector, CPUOffloadConnector)
    assert engine.kv_connector.cpu_pool.num_blocks == 32
    assert engine.runner.kv_bytes_per_block == BLOCK_BYTES
    assert engine.kv_connector.cpu_caches[0][0].shape == (32, 4, 2, 32)
    assert make_engine(model).kv_connector is None and make_engine(model).runner.kv_connector \
        is None
    assert num_offload_blocks(1.0, BLOCK_BYTES) == 2**30 // BLOCK_BYTES


def test_errors_name_what_to_change(model):
    with pytest.raises(ValueError, match="kv_offloading_size is GiB"):
        CacheConfig(kv_offloading_size=0)
    with pytest.raises(ValueError, match="holds no block"):
        num_offload_blocks(1e-9, BLOCK_BYTES)
    with pytest.raises(ValueError, match="needs design='v1'"):
        LLMEngine(model, cache_config=CacheConfig(kv_offloading_size=0.001))
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        LLMEngine(model, cache_config=CacheConfig(enable_prefix_caching=False), design="v1",
                  kv_connector=CPUOffloadConnector(8))
    with pytest.raises(ValueError, match="prefix_cache='hash'"):
        make_engine(model, CPUOffloadConnector(8), prefix_cache="radix")
    with pytest.raises(ValueError, match="not both"):
        make_engine(model, CPUOffloadConnector(8), kv_offloading_size=0.001)
    with pytest.raises(TypeError):
        KVConnectorBase_V1()                       # abstract: the methods are the contract


def test_the_cpu_pool_is_an_lru_that_never_evicts_a_pinned_block():
    pool = CPUBlockPool(2)
    assert pool.allocate(b"a", set()) == (0, None)
    assert pool.allocate(b"b", set()) == (1, None)
    pool.touch(b"a")                                  # b is now the least recently used
    assert pool.allocate(b"c", set()) == (1, b"b")
    assert pool.allocate(b"d", {0, 1}) is None        # all pinned: nothing changes
    assert pool.lru_hashes() == [b"a", b"c"] and pool.lookup(b"b") is None
    pool.check_invariants()


# ------------------------------------------------ the tier's pool, rolled back exactly
#: stores and hits of 10 hashes into a tier of 6 blocks (so stores evict), each store with
#: the blocks it must not evict (a step's loads and stores)
POOL_OPS = st.lists(st.tuples(st.sampled_from(["store", "hit"]), st.integers(0, 9),
                              st.frozensets(st.integers(0, 5), max_size=3)), max_size=24)


def play_pool(pool: CPUBlockPool, ops) -> None:
    for op, key, pinned in ops:
        h = bytes([key])
        if op == "hit" and h in pool:
            pool.touch(h)
        elif op == "store" and h not in pool:
            pool.allocate(h, set(pinned))


def pool_state(pool: CPUBlockPool) -> tuple:
    """All the pool is: the map, the LRU order (with the blocks), the free list, the count."""
    return ({h: b.block_id for h, b in pool.hash_to_block.items()},
            [(h, pool.lookup(h)) for h in pool.lru_hashes()], list(pool.free_blocks),
            pool.num_evictions)


def pool_rollback_restores(before, during) -> bool:
    """Play ``before`` outside a step, then ``during`` inside one (begun as the engine begins
    a connector's: ``engine/rollback.begin_connector``), roll it back: is the pool exactly as
    it was, and does it play ``during`` again as a pool that never saw the step does?"""
    conn, twin = CPUOffloadConnector(6), CPUBlockPool(6)
    play_pool(conn.cpu_pool, before)
    play_pool(twin, before)
    checkpoint = Checkpoint()
    begin_connector(checkpoint, conn)
    play_pool(conn.cpu_pool, during)
    checkpoint.rollback()
    try:
        conn.cpu_pool.check_invariants()
    except AssertionError:
        return False
    if pool_state(conn.cpu_pool) != pool_state(twin):
        return False
    play_pool(conn.cpu_pool, during)
    play_pool(twin, during)
    return pool_state(conn.cpu_pool) == pool_state(twin)


@settings(max_examples=150, deadline=None)
@given(POOL_OPS)
def test_the_cpu_pool_evicts_as_the_textbook_lru(ops):
    """The linked list picks what an ``OrderedDict`` ordered by use picks (the reference: a
    hit or a store moves a hash to the end, a full tier evicts the first one not pinned)."""
    pool, ref, free = CPUBlockPool(6), OrderedDict(), list(range(5, -1, -1))
    for op, key, pinned in ops:
        h = bytes([key])
        if op == "hit" and h in ref:
            pool.touch(h)
            ref.move_to_end(h)
        elif op == "store" and h not in ref:
            if free:
                want = (free.pop(), None)
            else:
                old = next((k for k, b in ref.items() if b not in pinned), None)
                want = None if old is None else (ref.pop(old), old)
            if want is not None:
                ref[h] = want[0]
            assert pool.allocate(h, set(pinned)) == want
        assert [(k, pool.lookup(k)) for k in pool.lru_hashes()] == list(ref.items())
    pool.check_invariants()


@settings(max_examples=150, deadline=None)
@given(POOL_OPS, POOL_OPS)
def test_a_rolled_back_step_leaves_the_cpu_pool_exactly_as_it_was(before, during):
    assert pool_rollback_restores(before, during)


@pytest.mark.parametrize("switched_off", ["attach", "block saves", "undo entries"])
def test_the_rollback_test_catches_a_pool_that_does_not_save(monkeypatch, switched_off):
    """The detector: with the pool's lazy saving switched off (no checkpoint handed to it; its
    blocks' links not saved; its map's and free list's undos not registered), hypothesis
    finds a step whose rollback leaves the pool changed."""
    if switched_off == "attach":
        monkeypatch.setattr(CPUBlockPool, "attach", lambda self, checkpoint: None)
    elif switched_off == "block saves":
        real_touch = Checkpoint.touch
        monkeypatch.setattr(Checkpoint, "touch", lambda self, *objs: real_touch(
            self, *(o for o in objs if not isinstance(o, CPUBlock))))
    else:
        monkeypatch.setattr(Checkpoint, "on_rollback", lambda self, undo: None)
    before, during = find(st.tuples(POOL_OPS, POOL_OPS),
                          lambda ops: not pool_rollback_restores(*ops),
                          settings=settings(max_examples=2000, database=None))
    assert during                           # a step that changed nothing is always restored


# ------------------------------------------------------------------ delayed freeing
class DelayingConnector(CPUOffloadConnector):
    """Says a transfer still reads every finished sequence's blocks, and reports it done one
    ``get_finished`` later (as a connector sending K/V to a decode instance would)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sending: set[int] = set()

    def request_finished(self, seq, block_ids):
        self.sending.add(seq.seq_id)
        return True, None

    def get_finished(self, finished_req_ids):
        done, self.sending = self.sending - finished_req_ids, self.sending & finished_req_ids
        return done or None, super().get_finished(finished_req_ids)[1]


def test_blocks_a_transfer_reads_are_kept_until_it_is_done(model):
    conn = DelayingConnector(32)
    engine = make_engine(model, conn)
    engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=1))
    engine.step()                                      # prefills, samples, finishes
    kvm = engine.block_manager
    assert list(kvm.delayed_frees) == [0] and kvm.num_free_gpu_blocks == 24 - 5
    engine.check_invariants()
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=1))
    engine.step()                            # seq 0 reported sent; seq 1 finishes, kept
    assert list(kvm.delayed_frees) == [1]
    engine.check_invariants()
    engine.step()                            # an empty step: seq 1 reported sent
    assert not kvm.delayed_frees and kvm.num_free_gpu_blocks == 24
    engine.check_invariants()


# ------------------------------------------------------------------ all or nothing
def offload_workload(fs, design: str, max_tokens: int = 4):
    """The harness's workload, then two new prompts of 9 blocks each, and each again with a
    word more: between a prompt and its return the other evicts it from the 12 GPU blocks,
    so the return loads it from the CPU tier."""
    from course_lib.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    x, y = "Blessed are the meek: for they shall", "Ask, and it shall be given you; seek"
    rows = [(10, x, SamplingParams(max_tokens=2, temperature=0.0, seed=21)),
            (14, y, SamplingParams(max_tokens=2, n=2, temperature=0.7, seed=22)),
            (18, x + " see", SamplingParams(max_tokens=3, temperature=0.9, seed=23, logprobs=1)),
            (22, y + " and", SamplingParams(max_tokens=3, temperature=0.0, seed=24))]
    return fs.BASE_WORKLOAD(design, max_tokens) + \
        [fs.Arrival(step, tok.encode(p), sp) for step, p, sp in rows]


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_a_fault_at_any_call_of_the_connector_rolls_the_step_back(model, monkeypatch,
                                                                   load_async):
    """Every method of the connector and its pool that a step calls, faulted once (its first
    call, and a later one): the step is undone exactly (bookkeeping, the tier's map and the
    K/V of both tiers) or one request alone is blamed; the others' tokens are the clean
    run's. Proven: without the connector's objects in the step's checkpoint, faults break."""
    from course_lib.engine import rollback

    fs = load_fault_sites()
    monkeypatch.setitem(fs.DESIGNS, "v1 offload", fs.OFFLOAD_DESIGN)
    monkeypatch.setattr(fs, "BASE_WORKLOAD", fs.workload, raising=False)
    monkeypatch.setattr(fs, "workload", lambda d, mt=4: offload_workload(fs, d, mt))
    if load_async:
        real = CPUOffloadConnector.__init__
        monkeypatch.setattr(CPUOffloadConnector, "__init__",
                            lambda self, n, load_async=False: real(self, n, load_async=True))
    hits = []
    real_alloc = CPUOffloadConnector.update_state_after_alloc
    monkeypatch.setattr(CPUOffloadConnector, "update_state_after_alloc",
                        lambda self, seq, ids, n: (hits.append(n), real_alloc(self, seq, ids,
                                                                              n))[1])
    sites = [s for s in fs.enumerate_sites() if s.kind == "connector"]
    clean, calls = fs.reach(model, "v1 offload", sites)
    assert sum(hits) >= 60, hits                  # the tier is used: blocks are loaded
    assert fs.make_engine(model, "v1 offload").kv_connector.load_async == load_async
    reached = [s for s in sites if calls[s.key]]
    for label in ("CPUOffloadConnector.get_num_new_matched_tokens",
                  "CPUOffloadConnector.update_state_after_alloc",
                  "CPUOffloadConnector.build_connector_meta",
                  "CPUOffloadConnector.start_load_kv", "CPUOffloadConnector.wait_for_layer_load",
                  "CPUOffloadConnector.save_kv_layer", "CPUOffloadConnector.wait_for_save",
                  "CPUOffloadConnector.get_finished", "CPUBlockPool.allocate",
                  "CPUBlockPool.touch", "KVConnectorBase_V1.bind_connector_metadata"):
        assert label in {s.label for s in reached}, label
    runs = []
    for site in reached:
        for k in sorted({1, (calls[site.key] + 1) // 2}):
            runs.append(fs.fault_run(model, "v1 offload", site, k, clean))
    failed = [r for r in runs if r.problems]
    assert not failed, "\n".join(fs.describe_failure(r) for r in failed)
    assert sum(r.result.rolled_back for r in runs) > 0
    # the detector: the connector left out of the step's checkpoint
    monkeypatch.setattr(rollback, "begin_connector", lambda checkpoint, connector: None)
    site = next(s for s in reached if s.label == "CPUOffloadConnector.wait_for_save")
    assert fs.fault_run(model, "v1 offload", site, 1, clean).problems
