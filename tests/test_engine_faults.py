"""A step is all or nothing, and no request can hurt another (fault injection and bad input).

Faults are injected where a real engine fails: the model's forward (a CUDA error), the
sampler (bad logits), each cache operation (a swap, a copy-on-write copy), the output
processing. After each one the engine must be consistent, a failed step must have changed
nothing a later step can see, and every request not to blame must produce exactly the tokens
of a run without faults.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from memory_helpers import snapshot as manager_state

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.engine import llm_engine, model_runner, rollback
from course_lib.engine.llm_engine import LLMEngine
from course_lib.engine.rollback import StepFailed
from course_lib.model.loader import load_tiny_model
from course_lib.sequence import SamplingParams

pytestmark = pytest.mark.ch10
torch.set_num_threads(1)

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


def make_engine(model, *, blocks: int = 64, prefix: bool = True, mode: str = "recompute",
                cpu: int = 0, budget: int = 64, design: str = "v0") -> LLMEngine:
    """``design``: "v0", "v1", or "v1-radix" (the V1 pair with SGLang's radix tree)."""
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget,
                         max_model_len=model.config.max_position, preemption_mode=mode)
    cc = CacheConfig(block_size=4, num_gpu_blocks=blocks, num_cpu_blocks=cpu, watermark=0.0,
                     enable_prefix_caching=prefix,
                     prefix_cache="radix" if design == "v1-radix" else "hash")
    return LLMEngine(model, sc, cc, stop_token_ids=(), design=design.split("-")[0])


def v1_state(engine: LLMEngine):
    """``state`` for the V1 design: queues of sequences, every table and block of the pool."""
    s, kvm, r = engine.scheduler, engine.block_manager, engine.runner
    seqs = {q.seq_id: (q.status, q.num_computed_tokens, list(q.output_token_ids))
            for q in (*s.waiting, *s.running)}
    pool = kvm.block_pool
    blocks = [(b.ref_cnt, b.block_hash) for b in pool.blocks]
    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    tables = {q: kvm.get_block_table(q) for q in kvm.seq_ids()}
    metrics = {(m.name, tuple(sorted(m.labels.items()))): m.value
               for f in engine.metrics.registry.collect() for m in f.samples
               if not m.name.endswith("_created")}
    content = []
    for q in s.running:
        slots = torch.tensor([t * 4 + p % 4 for p in range(q.num_computed_tokens)
                              for t in [tables[q.seq_id][p // 4]]], dtype=torch.long)
        content += [k.flatten(0, 1)[slots].clone() for k, _ in r.gpu_caches]
    counters = (s.num_steps, s.num_preemptions, s.num_prompt_tokens, s.num_generated_tokens,
                engine.num_steps, kvm.prefix_cache_stats)
    return seqs, (blocks, queue, tables), metrics, counters, content


def state(engine: LLMEngine):
    """What a failed step must leave as it was: queues, requests, sequences, every table,
    pool and cache key, metrics, counters, and the cache contents that mean something (each
    held sequence's computed slots, every evictable cached block)."""
    s, bm, r = engine.scheduler, engine.block_manager, engine.runner
    reqs = {}
    for q in (s.waiting, s.running, s.swapped):
        for req in q:
            reqs[req.request_id] = (
                req.first_scheduled_time, req.first_token_time, req.finish_reason,
                req.num_preemptions, req.num_cached_tokens,
                [(x.seq_id, x.status, x.num_computed_tokens, list(x.output_token_ids),
                  x.cumulative_logprob) for x in req.seqs])
    metrics = {(m.name, tuple(sorted(m.labels.items()))): m.value
               for f in engine.metrics.registry.collect() for m in f.samples
               if not m.name.endswith("_created")}
    content = []
    for req in s.running:
        for seq in req.unfinished_seqs:
            table = bm.get_table(seq.seq_id)
            slots = torch.tensor(table.slot_mapping()[:seq.num_computed_tokens], dtype=torch.long)
            content += [k.flatten(0, 1)[slots].clone() for k, _ in r.gpu_caches]
    evictable = bm.gpu.evictable_block_ids()
    content += [k[evictable].clone() for k, _ in r.gpu_caches]
    queues = ([q.request_id for q in s.waiting], [q.request_id for q in s.running],
              [q.request_id for q in s.swapped])
    counters = (s.num_steps, s.num_preemptions, s.num_prompt_tokens, s.num_generated_tokens,
                engine.num_steps, r.counters())
    return queues, reqs, manager_state(bm), metrics, counters, content


def same_state(a, b) -> bool:
    *plain_a, content_a = a
    *plain_b, content_b = b
    return plain_a == plain_b and len(content_a) == len(content_b) and all(
        torch.equal(x, y) for x, y in zip(content_a, content_b, strict=True))


# ----------------------------------------------------------------- bad input, at once
@pytest.mark.parametrize("kwargs, word", [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": -0.1}, "temperature"), ({"top_p": math.nan}, "top_p"),
    ({"seed": "abc"}, "seed"), ({"seed": 1.5}, "seed"), ({"seed": True}, "seed"),
    ({"seed": 2 ** 64}, "seed"), ({"seed": -1}, "seed"), ({"max_tokens": True}, "max_tokens"),
    ({"n": 2.0}, "n must"), ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids"), ({"temperature": True}, "temperature"),
])
def test_bad_sampling_values_are_refused_when_made(kwargs, word) -> None:
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_sampling_params_take_what_vllm_takes() -> None:
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)     # a list is fine
    tiny = SamplingParams(temperature=1e-39)
    assert tiny.is_greedy                                 # below vLLM's _SAMPLING_EPS
    assert SamplingParams(temperature=1e-3).sampling_temperature == 1e-2     # vLLM's _MAX_TEMP
    assert SamplingParams(seed=2 ** 64 - 1).seed == 2 ** 64 - 1


@pytest.mark.parametrize("prompt, word", [
    (["65", "66"], "item 0 is '65'"), ([65.9], "item 0 is 65.9"), ([True], "item 0 is True"),
    ([1, -1], "item 1 is -1"), ([1, 259], "0..258"), ([], "at least one token"),
    (b"AB", "sequence of ints"),
])
def test_bad_prompts_are_refused_when_added_and_queue_nothing(model, prompt, word) -> None:
    engine = make_engine(model)
    with pytest.raises(ValueError, match=word):
        engine.add_request(prompt)
    with pytest.raises(ValueError, match="prompt 1"):
        engine.generate(["ok", prompt])               # the good one is not queued either
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, word", [
    ({"request_id": "x"}, "request_id"), ({"request_id": True}, "request_id"),
    ({"arrival_time": math.nan}, "arrival_time"), ({"arrival_time": math.inf}, "arrival_time"),
    ({"cache_salt": 7}, "cache_salt"), ({"params": {"max_tokens": 3}}, "SamplingParams"),
])
def test_bad_request_fields_are_refused_and_queue_nothing(model, kwargs, word) -> None:
    engine = make_engine(model)
    with pytest.raises(ValueError, match=word):
        engine.add_request("And God said", **kwargs)
    assert not engine.has_unfinished_requests() and engine.add_request("x") == 0


# -------------------------------------------------------- one request fails, alone
def run_all(engine: LLMEngine, max_steps: int = 2000) -> tuple[dict, int]:
    """Step until done (retrying failed steps), checking the invariants after every call."""
    outs, failed = {}, 0
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs, failed
        try:
            for o in engine.step():
                outs[o.request_id] = o
        except StepFailed:
            failed += 1
        engine.check_invariants()
    raise AssertionError("the engine did not finish")


def test_the_issues_repro_one_failing_request_cannot_poison_the_prefix_cache(model,
                                                                             monkeypatch):
    """The issue's repro: A runs two steps; B's sampling fails in every step it samples. B
    alone is finished with a reason naming the cause; A's tokens are a clean run's; a prompt
    equal to A's whole text hits only genuine cached blocks and generates what a cache-free
    engine does."""
    clean = make_engine(model).generate("And God said, Let there", GREEDY)[0]
    engine = make_engine(model)
    a = engine.add_request("And God said, Let there", GREEDY)
    engine.step(), engine.step()
    b = engine.add_request("Blessed are", SamplingParams(max_tokens=16, temperature=0.7, seed=1))
    real = llm_engine.sample

    def poisoned(entry, logits, seed):
        if entry.request.request_id == b:
            raise FloatingPointError("logits hold NaN")
        return real(entry, logits, seed)

    monkeypatch.setattr(llm_engine, "sample", poisoned)
    outs, failed = run_all(engine)
    assert failed == 0
    assert outs[b].finish_reason == "error" and "FloatingPointError: logits hold NaN" in \
        outs[b].finish_detail and outs[b].outputs[0].finish_reason == "error"
    assert outs[a].outputs[0].token_ids == clean.outputs[0].token_ids
    monkeypatch.setattr(llm_engine, "sample", real)
    whole = list(clean.prompt_token_ids) + clean.outputs[0].token_ids
    again = engine.generate([whole], GREEDY)[0]
    fresh = make_engine(model, prefix=False).generate([whole], GREEDY)[0]
    assert again.num_cached_tokens >= 20 and again.outputs[0].token_ids == \
        fresh.outputs[0].token_ids
    engine.check_invariants()


def test_a_request_whose_forward_fails_is_found_and_finished_alone(model, monkeypatch):
    engine = make_engine(model)
    a = engine.add_request("And God said", GREEDY)
    c = engine.add_request("Jesus wept.", GREEDY)
    real = engine.runner.execute_model

    def forward(entries):
        if any(e.request.request_id == c for e in entries):
            raise IndexError("an embedding index past the table")
        return real(entries)

    monkeypatch.setattr(engine.runner, "execute_model", forward)
    outs, failed = run_all(engine)
    assert failed == 0 and outs[c].finish_reason == "error"
    assert "IndexError" in outs[c].finish_detail
    assert outs[a].outputs[0].token_ids == \
        make_engine(model).generate("And God said", GREEDY)[0].outputs[0].token_ids


def test_an_interrupt_mid_step_leaves_the_engine_as_before(model, monkeypatch):
    engine = make_engine(model)
    engine.add_request("And God said", GREEDY)
    engine.step()
    before = state(engine)
    monkeypatch.setattr(engine.runner, "execute_model",
                        lambda entries: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert same_state(before, state(engine))


# ----------------------------------------------- a failed step changes nothing
def pressured_engine(model):
    """An engine whose next step evicts cached blocks and preempts (the risky writes)."""
    engine = make_engine(model, blocks=14, budget=32)
    for p in ("In the beginning God", "And the earth was without form"):
        engine.generate(p, SamplingParams(max_tokens=4, temperature=0.0))   # cached blocks
    engine.add_request("And God said, Let there be light", GREEDY)
    engine.add_request("Blessed are the meek: for they", GREEDY)
    for _ in range(3):
        engine.step()
    return engine


def failing_steps(engine, monkeypatch) -> int:
    """Make every forward fail once after it wrote the cache: count the steps that failed
    while some block at risk (evicted or preempted) was overwritten."""
    real, risky = engine.runner.execute_model, []

    def forward(entries):
        real(entries)                                    # the cache writes happen
        raise RuntimeError("injected after the forward")

    monkeypatch.setattr(engine.runner, "execute_model", forward)
    for _ in range(6):
        before = state(engine)
        gpu_risk = []
        real_at_risk = rollback.blocks_at_risk

        def spy(*args, _real=real_at_risk, _out=gpu_risk):
            result = _real(*args)
            _out.append(result[0])
            return result

        monkeypatch.setattr(llm_engine, "blocks_at_risk", spy)
        with pytest.raises(StepFailed, match="injected after the forward"):
            engine.step()
        monkeypatch.setattr(llm_engine, "blocks_at_risk", real_at_risk)
        assert same_state(before, state(engine))
        engine.check_invariants()
        risky.append(any(gpu_risk))
        monkeypatch.setattr(engine.runner, "execute_model", real)
        engine.step()                                    # a good step, then fail the next
        monkeypatch.setattr(engine.runner, "execute_model", forward)
    monkeypatch.setattr(engine.runner, "execute_model", real)
    return sum(risky)


def test_a_failed_step_changes_nothing_a_later_step_can_see(model, monkeypatch):
    engine = pressured_engine(model)
    assert failing_steps(engine, monkeypatch) > 0, "no step wrote over a block at risk"
    outs, _ = run_all(engine)
    assert all(o.finish_reason == "length" for o in outs.values())


def test_without_the_backup_a_failed_step_would_corrupt_the_cache(model, monkeypatch):
    """The detector trips: with no backup of the blocks at risk, a failed step that wrote
    over an evicted or preempted block leaves different contents behind."""
    engine = pressured_engine(model)
    monkeypatch.setattr(llm_engine, "blocks_at_risk", lambda *a: ([], []))
    real = engine.runner.execute_model

    def forward(entries):
        real(entries)
        raise RuntimeError("injected")

    corrupted = False
    for _ in range(6):
        before = state(engine)
        monkeypatch.setattr(engine.runner, "execute_model", forward)
        with pytest.raises(StepFailed):
            engine.step()
        corrupted |= not same_state(before, state(engine))
        monkeypatch.setattr(engine.runner, "execute_model", real)
        engine.step()
    assert corrupted


# ----------------------------------------------------- random faults, property test
POINTS = ("forward", "sampler", "swap", "copy", "update")
REQUESTS = [("And God said", SamplingParams(max_tokens=12, temperature=0.0)),
            ("In the beginning God created", SamplingParams(max_tokens=10, n=3,
                                                             temperature=0.8, seed=5)),
            ("Blessed are the", SamplingParams(max_tokens=8, beam_width=2)),
            ("And God said unto Moses", SamplingParams(max_tokens=12, temperature=0.0)),
            ("Jesus wept. And", SamplingParams(max_tokens=10, n=2, temperature=0.0))]


class Faults:
    """One-shot faults: the k-th call at a point raises once (a transient failure)."""

    def __init__(self, plan):
        self.plan = {(p, k) for p, k in plan}
        self.calls = dict.fromkeys(POINTS, 0)
        self.fired: list[tuple[str, int]] = []

    def wrap(self, point, fn):
        def wrapped(*args, **kwargs):
            self.calls[point] += 1
            if (point, self.calls[point]) in self.plan:
                self.plan.discard((point, self.calls[point]))
                self.fired.append((point, self.calls[point]))
                raise RuntimeError(f"injected fault at {point} call {self.calls[point]}")
            return fn(*args, **kwargs)
        return wrapped

    def install(self, engine, monkeypatch):
        monkeypatch.setattr(engine.runner, "execute_model",
                            self.wrap("forward", engine.runner.execute_model))
        monkeypatch.setattr(llm_engine, "sample", self.wrap("sampler", llm_engine.sample))
        monkeypatch.setattr(model_runner, "swap_blocks",
                            self.wrap("swap", model_runner.swap_blocks))
        attn = engine.runner.attn
        engine.runner.attn = dataclasses.replace(attn, copy_blocks=self.wrap("copy",
                                                                             attn.copy_blocks))
        sched = engine.scheduler
        monkeypatch.setattr(sched, "update", self.wrap("update", sched.update))


def run_workload(model, picks, mode, prefix, faults=None, monkeypatch=None, design="v0"):
    engine = make_engine(model, blocks=26, prefix=prefix, mode=mode, cpu=40, budget=32,
                         design=design)
    if faults is not None:
        faults.install(engine, monkeypatch)
    ids = [engine.add_request(*REQUESTS[i]) for i in picks]
    outs, failed = run_all(engine)
    engine.check_invariants()
    bm = engine.block_manager
    assert bm.seq_ids() == [] and bm.num_free_gpu_blocks == bm.num_gpu_blocks \
        and bm.num_free_cpu_blocks == bm.num_cpu_blocks, "blocks leaked"
    return [outs[i] for i in ids], failed


@settings(max_examples=12)
@given(picks=st.lists(st.integers(0, len(REQUESTS) - 1), min_size=2, max_size=5),
       mode=st.sampled_from(["recompute", "swap"]), prefix=st.booleans(),
       plan=st.lists(st.tuples(st.sampled_from(POINTS), st.integers(1, 40)), max_size=5),
       design=st.sampled_from(["v0", "v1", "v1-radix"]))
def test_random_faults_hurt_only_the_requests_they_hit(model, picks, mode, prefix, plan,
                                                       design):
    if design != "v0":                     # the V1 core runs no beam search (or swap)
        picks = [p for p in picks if not REQUESTS[p][1].use_beam_search] or [0, 1]
    clean, _ = run_workload(model, picks, mode, prefix, design=design)
    with pytest.MonkeyPatch.context() as mp:
        faults = Faults(plan)
        faulty, failed = run_workload(model, picks, mode, prefix, faults, mp, design)
    for c, f in zip(clean, faulty, strict=True):
        if f.finish_reason == "error":          # only a sampler or update fault blames one
            assert any(p in ("sampler", "update") for p, _ in faults.fired)
            continue
        assert [o.token_ids for o in f.outputs] == [o.token_ids for o in c.outputs]
    blamed = sum(f.finish_reason == "error" for f in faulty)
    assert failed + blamed <= len(faults.fired)


# ----------------------------------------------------------------- tenants' caches
def test_cache_salts_keep_tenants_from_probing_each_others_prompts(model):
    """The issue's attack: a tenant guesses another's prompt (a PIN) and reads
    num_cached_tokens. With a salt per tenant only the tenant's own requests hit."""
    engine = make_engine(model)
    secret = "Account PIN 4711: the LORD is my shepherd"
    engine.generate([secret], GREEDY)                        # unsalted: shared namespace
    engine.add_request(secret, GREEDY, cache_salt="alice")
    run_all(engine)
    guesses = {pin: f"Account PIN {pin}: the LORD is my shepherd" for pin in (1234, 4711)}

    def probe(text, salt):
        rid = engine.add_request(text, GREEDY, cache_salt=salt)
        return run_all(engine)[0][rid].num_cached_tokens

    # without salts the side channel is there: the right guess hits far more (the detector)
    unsalted = {pin: probe(text, None) for pin, text in guesses.items()}
    assert unsalted[4711] >= 32 > unsalted[1234] + 16
    # salted, a guess (each in a fresh namespace of mallory's) hits nothing, right or wrong
    salted = {pin: probe(text, f"mallory-{pin}") for pin, text in guesses.items()}
    assert salted == {1234: 0, 4711: 0}
    assert probe(secret, "alice") >= 32                      # alice's own prefix is cached
    engine.check_invariants()


def test_a_failed_v1_step_changes_nothing_and_the_run_goes_on(model, monkeypatch):
    """The same all-or-nothing step for the V1 design: a forward that fails after writing the
    cache, in steps that evict cached blocks and preempt, leaves every table, block, queue,
    metric and meaningful slot as it was."""
    engine = make_engine(model, blocks=14, budget=32, design="v1")
    for p in ("In the beginning God", "And the earth was without form"):
        engine.generate(p, SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request("And God said, Let there be light", GREEDY)
    engine.add_request("Blessed are the meek: for they", SamplingParams(max_tokens=16, n=2,
                                                                       temperature=0.0))
    engine.step()
    real = engine.runner.execute_model

    def forward(entries):
        real(entries)
        raise RuntimeError("injected after the forward")

    for _ in range(6):
        before = v1_state(engine)
        monkeypatch.setattr(engine.runner, "execute_model", forward)
        with pytest.raises(StepFailed):
            engine.step()
        assert same_state(before, v1_state(engine))
        monkeypatch.setattr(engine.runner, "execute_model", real)
        engine.step()
        engine.check_invariants()
    outs, _ = run_all(engine)
    assert engine.scheduler.num_preemptions > 0 and all(o.finish_reason == "length"
                                                        for o in outs.values())


# ------------------------------------- one transaction per step (what the audit found)
def test_a_failure_before_the_backup_puts_back_nothing_of_an_earlier_step(model, monkeypatch):
    """A step that fails inside ``schedule()`` (before it backs up anything) must not write
    an earlier step's backup into the cache: its transaction starts empty. Found by an outside
    audit (a stale ``_backup`` overwrote valid K/V; wrong tokens, silently)."""
    engine = pressured_engine(model)
    backups = []
    real_protect = engine._protect

    def protect(out, txn):
        real_protect(out, txn)
        backups.append(txn.backup)

    monkeypatch.setattr(engine, "_protect", protect)
    while not any(b.gpu_blocks for b in backups):        # a step that backed blocks up
        engine.step()
    before = state(engine)
    real_schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule",
                        lambda: (_ for _ in ()).throw(RuntimeError("injected in schedule")))
    with pytest.raises(StepFailed, match="injected in schedule"):
        engine.step()
    assert same_state(before, state(engine))             # the cache contents included
    monkeypatch.setattr(engine.scheduler, "schedule", real_schedule)
    outs, _ = run_all(engine)
    assert all(o.finish_reason == "length" for o in outs.values())


@pytest.mark.parametrize("design", ["v0", "v1", "v1-radix"])
def test_a_failure_building_an_output_is_undone_and_the_engine_goes_on(model, monkeypatch,
                                                                        design):
    """Building a finished request's output fails once (after ``scheduler.update`` finished
    it): the step is rolled back with the engine's own maps, the retry finishes the request
    with the clean run's tokens. Before, the request had already left the engine's maps and
    every later step raised KeyError (an outside audit's hypothesis test, shrunk to a 6-block
    pool and one request with max_tokens=1)."""
    clean = make_engine(model, blocks=6, design=design)
    want = clean.generate("And God", SamplingParams(max_tokens=1, temperature=0.0))[0]
    engine = make_engine(model, blocks=6, design=design)
    rid = engine.add_request("And God", SamplingParams(max_tokens=1, temperature=0.0))
    real, calls = llm_engine.request_output, []

    def once(req, tokenizer):
        calls.append(req.request_id)
        if len(calls) == 1:
            raise RuntimeError("injected while building an output")
        return real(req, tokenizer)

    monkeypatch.setattr(llm_engine, "request_output", once)
    with pytest.raises(StepFailed, match="building an output"):
        engine.step()
    engine.check_invariants()
    assert rid in engine._requests and engine.has_unfinished_requests()
    outs = engine.step()
    assert [o.request_id for o in outs] == [rid]
    assert outs[0].outputs[0].token_ids == want.outputs[0].token_ids
    assert engine.abort_request(rid) is False and not engine._requests
    assert engine.block_manager.num_free_gpu_blocks == engine.block_manager.num_gpu_blocks


@pytest.mark.parametrize("design", ["v0", "v1"])
def test_abort_from_another_thread_mid_step_takes_effect_after_the_step(model, monkeypatch,
                                                                          design):
    """A server aborts a request whose client went away while ``step()`` runs in another
    thread: the abort waits for the step to end, then takes effect; no KeyError, no wedged
    engine, the other request's tokens as in a clean run."""
    import threading

    clean = make_engine(model, design=design)
    want = clean.generate(["And God said", "In the beginning"], GREEDY)
    engine = make_engine(model, design=design)
    a = engine.add_request("And God said", GREEDY)
    b = engine.add_request("In the beginning", GREEDY)
    engine.step()
    inside, release, result = threading.Event(), threading.Event(), {}
    real = engine.runner.execute_model

    def forward(entries):
        inside.set()
        release.wait(5)
        return real(entries)

    monkeypatch.setattr(engine.runner, "execute_model", forward)
    stepper = threading.Thread(target=lambda: result.setdefault("step", engine.step()))
    stepper.start()
    assert inside.wait(5)
    aborter = threading.Thread(target=lambda: result.setdefault("abort", engine.abort_request(a)))
    aborter.start()
    aborter.join(0.3)
    assert aborter.is_alive(), "the abort did not wait for the running step"
    release.set()
    stepper.join(5)
    aborter.join(5)
    assert result["abort"] is True
    monkeypatch.setattr(engine.runner, "execute_model", real)
    outs, _ = run_all(engine)
    assert a not in outs and outs[b].outputs[0].token_ids == want[1].outputs[0].token_ids
    engine.check_invariants()
    assert not engine._requests and not engine._seeds


def test_a_step_transaction_is_closed_once(model):
    engine = LLMEngine(model, cache_config=CacheConfig(block_size=4, num_gpu_blocks=16))
    for end in ("commit", "rollback"):
        txn = engine._begin()
        getattr(txn, end)()
        for again in ("commit", "rollback"):
            with pytest.raises(RuntimeError, match="already committed or rolled back"):
                getattr(txn, again)()
        with pytest.raises(RuntimeError, match="already committed or rolled back"):
            txn.checkpoint.touch(engine.scheduler)


def test_a_cache_that_cannot_be_put_back_stops_the_engine(model, monkeypatch):
    """A failed step whose blocks at risk cannot be copied back (the copy fails too) must
    not go on with K/V that may be wrong: that step and every later one raise
    ``RollbackFailed``; without the guard the engine would step on (checked first)."""
    real_put_back, real_at_risk = rollback.put_back, llm_engine.blocks_at_risk

    def failing_run(guard: bool):
        engine = LLMEngine(model, cache_config=CacheConfig(block_size=4, num_gpu_blocks=64))
        engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0))
        engine.step()
        real_forward = engine.runner.execute_model
        monkeypatch.setattr(llm_engine, "blocks_at_risk", lambda *a: ([0], []))  # at risk
        monkeypatch.setattr(engine.runner, "execute_model",
                            lambda *a: (_ for _ in ()).throw(RuntimeError("device fault")))
        monkeypatch.setattr(rollback, "put_back",
                            (lambda *a: (_ for _ in ()).throw(RuntimeError("copy failed")))
                            if guard else (lambda *a: None))
        try:
            engine.step()
        except Exception as exc:
            first = exc
        else:
            first = None
        monkeypatch.setattr(engine.runner, "execute_model", real_forward)
        monkeypatch.setattr(rollback, "put_back", real_put_back)
        monkeypatch.setattr(llm_engine, "blocks_at_risk", real_at_risk)
        return engine, first

    engine, first = failing_run(guard=False)                      # the copy "succeeds"
    assert not isinstance(first, rollback.RollbackFailed)
    engine.step()                                                # and the engine goes on
    engine, first = failing_run(guard=True)
    assert isinstance(first, rollback.RollbackFailed), first
    with pytest.raises(rollback.RollbackFailed, match="takes no more steps"):
        engine.step()
    engine.check_invariants()                    # the bookkeeping was put back all the same
