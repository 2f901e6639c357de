"""A failed step is recovered by recompute, and no request can hurt another (fault injection
and bad input).

Faults are injected where a real engine fails: the model's forward (a CUDA error), the
sampler (bad logits), each cache operation (a swap, a copy-on-write copy), the output
processing, the recovery itself, a Ctrl-C. After each one the engine must be consistent, the
failed step must have emitted nothing, and every request not to blame must produce exactly the
tokens of a run without faults (``engine/recovery.py``: each is recomputed from its committed
tokens). The whole sweep, a fault at every method a step calls, is ``bench/chaos.py``
(``tests/test_fault_sites.py`` runs a sample of it).
"""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.engine import llm_engine, model_runner, recovery
from course_lib.engine.llm_engine import LLMEngine
from course_lib.engine.recovery import RecoveryFailed, StepFailed
from course_lib.model.loader import load_tiny_model
from course_lib.scheduler.v1 import SchedulerV1
from course_lib.sequence import SamplingParams, SequenceStatus

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


def tokens(outs) -> dict:
    """Each output's sequences' tokens, by request id."""
    return {rid: [c.token_ids for c in o.outputs] for rid, o in outs.items()}


def committed_view(engine: LLMEngine) -> dict:
    """What the engine has emitted and committed, per unfinished request: its sequences'
    output tokens. A failed step must leave exactly this behind."""
    return {rid: [list(s.output_token_ids) for s in r.seqs]
            for rid, r in engine._requests.items()}


def recomputing(engine: LLMEngine) -> bool:
    """Right after a recovery: every unfinished sequence waits with nothing computed, and the
    pool holds no sequence's blocks."""
    return all(s.status == SequenceStatus.WAITING and s.num_computed_tokens == 0
               for r in engine._requests.values() for s in r.unfinished_seqs) \
        and not engine.block_manager.seq_ids()


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


def test_an_interrupt_mid_step_is_recovered_and_raised(model, monkeypatch):
    """Ctrl-C (Jupyter's "interrupt kernel") lands in the forward: the step emits nothing, the
    engine recovers before the interrupt reaches the caller, and the run then ends with the
    clean run's tokens."""
    want = make_engine(model).generate("And God said", GREEDY)[0]
    engine = make_engine(model)
    rid = engine.add_request("And God said", GREEDY)
    engine.step(), engine.step()
    before = committed_view(engine)
    real = engine.runner.execute_model
    monkeypatch.setattr(engine.runner, "execute_model",
                        lambda entries: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert committed_view(engine) == before and recomputing(engine)
    engine.check_invariants()
    monkeypatch.setattr(engine.runner, "execute_model", real)
    outs, failed = run_all(engine)
    assert failed == 0 and tokens(outs)[rid] == [want.outputs[0].token_ids]


# ------------------------------------------------- a failed step is recovered by recompute
def pressured_engine(model, design: str = "v0"):
    """An engine whose steps evict cached blocks, fork samples and preempt."""
    engine = make_engine(model, blocks=14, budget=32, design=design)
    for p in ("In the beginning God", "And the earth was without form"):
        engine.generate(p, SamplingParams(max_tokens=4, temperature=0.0))   # cached blocks
    engine.add_request("And God said, Let there be light", GREEDY)
    engine.add_request("Blessed are the meek: for they", SamplingParams(
        max_tokens=16, n=2, temperature=0.8, seed=3, logprobs=2))
    return engine


def fail_steps(engine, monkeypatch, where: str, steps: int = 6) -> None:
    """Make every other step fail, ``steps`` times: ``where="forward"`` after the forward wrote
    the cache, ``where="update"`` after the scheduler's update appended the sampled tokens,
    forked samples and beams and freed finished sequences. After each failure the engine has
    emitted nothing and recomputes everything."""
    real_forward, real_attach = engine.runner.execute_model, llm_engine.attach_logprobs

    def forward(entries):
        real_forward(entries)                            # the cache writes happen
        raise RuntimeError("injected after the forward")

    def attach(*args):
        raise RuntimeError("injected after the update")

    for _ in range(steps):
        before = committed_view(engine)
        if where == "forward":
            monkeypatch.setattr(engine.runner, "execute_model", forward)
        else:
            monkeypatch.setattr(llm_engine, "attach_logprobs", attach)
        with pytest.raises(StepFailed, match=f"injected after the {where}"):
            engine.step()
        assert committed_view(engine) == before and recomputing(engine)
        engine.check_invariants()
        monkeypatch.setattr(engine.runner, "execute_model", real_forward)
        monkeypatch.setattr(llm_engine, "attach_logprobs", real_attach)
        engine.step()                                    # a good step, then fail the next
        engine.check_invariants()


@pytest.mark.parametrize("where", ["forward", "update"])
@pytest.mark.parametrize("design", ["v0", "v1", "v1-radix"])
def test_failed_steps_are_recovered_to_the_clean_runs_tokens(model, monkeypatch, design, where):
    clean, _ = run_all(pressured_engine(model, design))
    engine = pressured_engine(model, design)
    fail_steps(engine, monkeypatch, where)
    outs, failed = run_all(engine)
    assert failed == 0 and tokens(outs) == tokens(clean)
    for rid, o in outs.items():                          # a recomputed prefill rounds apart
        for a, b in zip(o.outputs, clean[rid].outputs, strict=True):
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
    assert engine.num_recoveries == 6
    assert engine.metrics.value("course:engine_recoveries_total") == 6
    assert engine.metrics.value("course:recomputed_tokens_total") > 0
    bm = engine.block_manager
    assert not bm.seq_ids() and bm.num_free_gpu_blocks == bm.num_gpu_blocks


def test_the_detector_sees_a_recovery_that_keeps_the_failed_steps_tokens(model, monkeypatch):
    """The checks above can fail: a recovery that does not cut outputs back to what was
    committed leaves the failed step's tokens behind, and ``fail_steps`` sees them."""
    real_restore = recovery.restore

    def keeps_tokens(rec):
        lengths = [len(s.seq.output_token_ids) for s in rec.seqs]
        lost = real_restore(rec)
        for s, n in zip(rec.seqs, lengths, strict=True):     # the failed step's token back
            s.seq.output_token_ids.extend([7] * (n - len(s.seq.output_token_ids)))
        return lost

    clean, _ = run_all(pressured_engine(model))
    engine = pressured_engine(model)
    engine.step()
    monkeypatch.setattr(recovery, "restore", keeps_tokens)
    with pytest.raises(AssertionError):
        fail_steps(engine, monkeypatch, "update", steps=2)


def test_a_fault_while_recovering_runs_the_recovery_again(model, monkeypatch):
    """Faults inside the recovery (building the new scheduler) make it start again from what
    was committed; three in a row raise RecoveryFailed, the recovery stays due, and the next
    step runs it first. The tokens are the clean run's."""
    clean, _ = run_all(pressured_engine(model))
    engine = pressured_engine(model)
    engine.step(), engine.step()
    real_forward, real_requeue = engine.runner.execute_model, recovery.requeue
    fails = {"left": 0}

    def requeue(scheduler, requests):
        real_requeue(scheduler, requests)                # half done, then the fault
        if fails["left"]:
            fails["left"] -= 1
            raise RuntimeError("injected while recovering")

    monkeypatch.setattr(recovery, "requeue", requeue)
    monkeypatch.setattr(engine.runner, "execute_model",
                        lambda entries: (_ for _ in ()).throw(RuntimeError("device fault")))
    fails["left"] = 2                                    # recovered at the third try
    with pytest.raises(StepFailed):
        engine.step()
    assert recomputing(engine) and engine._recovery is None
    fails["left"] = 3                                    # three in a row: still due
    with pytest.raises(RecoveryFailed, match="three times"):
        engine.step()
    assert engine._recovery is not None and engine.has_unfinished_requests()
    monkeypatch.setattr(engine.runner, "execute_model", real_forward)
    outs, failed = run_all(engine)                       # the first step recovers first
    assert failed == 0 and tokens(outs) == tokens(clean) and engine._recovery is None


def test_an_interrupt_while_recovering_leaves_the_recovery_due(model, monkeypatch):
    """A second Ctrl-C lands while a failed step is recovered: the interrupt reaches the
    caller, the recovery stays due (never half done for good), and the next step finishes it
    before anything else."""
    clean, _ = run_all(pressured_engine(model, "v1"))
    engine = pressured_engine(model, "v1")
    engine.step()
    real_forward, real_new = engine.runner.execute_model, engine._new_scheduler
    monkeypatch.setattr(engine.runner, "execute_model",
                        lambda entries: (_ for _ in ()).throw(RuntimeError("device fault")))
    monkeypatch.setattr(engine, "_new_scheduler",
                        lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine._recovery is not None
    monkeypatch.setattr(engine, "_new_scheduler", real_new)
    monkeypatch.setattr(engine.runner, "execute_model", real_forward)
    outs, failed = run_all(engine)
    assert failed == 0 and tokens(outs) == tokens(clean)


@pytest.mark.parametrize("design", ["v0", "v1", "v1-radix"])
def test_a_failure_building_an_output_emits_nothing_and_the_engine_goes_on(model, monkeypatch,
                                                                           design):
    """Building a finished request's output fails once (after ``scheduler.update`` finished
    it): the step emits nothing, the request is recomputed, and the next steps finish it with
    the clean run's tokens. (An outside audit's hypothesis test, shrunk to a 6-block pool and
    one request with max_tokens=1, once found every later step raising KeyError here.)"""
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
    outs, _ = run_all(engine)
    assert list(outs) == [rid]
    assert outs[rid].outputs[0].token_ids == want.outputs[0].token_ids
    assert engine.abort_request(rid) is False and not engine._requests
    assert engine.block_manager.num_free_gpu_blocks == engine.block_manager.num_gpu_blocks


def test_a_token_is_observed_once_whatever_fails(model, monkeypatch):
    """A step that fails after its metrics would have been read (building the outputs) and
    is recomputed observes no latency twice: as many inter-token latencies as a clean run
    (tokens - requests), however many steps failed."""
    def itl_count(engine):
        return engine.metrics.value("vllm:time_per_output_token_seconds_count")

    clean = make_engine(model)
    clean.generate(["And God said", "In the beginning"], GREEDY)
    engine = make_engine(model)
    ids = [engine.add_request(p, GREEDY) for p in ("And God said", "In the beginning")]
    real, calls = recovery.Counters.of, []

    def fails_twice(scheduler, runner):                # after everything but the commit
        calls.append(1)
        if len(calls) in (3, 6):
            raise RuntimeError("injected before the commit")
        return real(scheduler, runner)

    monkeypatch.setattr(recovery.Counters, "of", staticmethod(fails_twice))
    outs, failed = run_all(engine)
    assert failed == 2 and sorted(outs) == ids
    assert itl_count(engine) == itl_count(clean) == 2 * (GREEDY.max_tokens - 1)


# ---------------------------------------------- requests in and out while a step runs
@pytest.mark.parametrize("design", ["v0", "v1"])
def test_abort_and_add_from_inside_a_step_take_effect_after_it(model, monkeypatch, design):
    """The issue's repro: ``abort_request`` called on the stepping thread during a step (a
    hook, a signal handler, a connector) used to free the request's blocks mid-step, and every
    later step then failed. Now it and an ``add_request`` made there wait for the step to
    end; the other requests' tokens are a clean run's."""
    want = make_engine(model, design=design).generate(["And God said", "Jesus wept."], GREEDY)
    engine = make_engine(model, design=design)
    a = engine.add_request("And God said", GREEDY)
    b = engine.add_request("In the beginning", GREEDY)
    engine.step()
    real, hooked = engine.runner.execute_model, {}

    def forward(entries):
        if not hooked:                                   # once, in the middle of the step
            hooked["abort"] = engine.abort_request(b)
            hooked["add"] = engine.add_request("Jesus wept.", GREEDY)
            assert b in engine._requests and hooked["add"] not in engine._requests
        return real(entries)

    monkeypatch.setattr(engine.runner, "execute_model", forward)
    engine.step()
    assert hooked["abort"] is True and engine.has_unfinished_requests()
    outs, failed = run_all(engine)
    assert failed == 0 and outs[b].finish_reason == "abort"      # answered, by the next step
    assert tokens(outs) == {a: [want[0].outputs[0].token_ids], b: tokens(outs)[b],
                            hooked["add"]: [want[1].outputs[0].token_ids]}
    assert not engine._requests and not engine.block_manager.seq_ids()


def test_an_add_that_fails_half_way_leaves_no_trace(model, monkeypatch):
    """V1 queues an ``n > 1`` request as n child sequences; a fault while making child k > 0
    used to leave the first ones queued for a request the engine did not know, and the engine
    then made no progress. Now the add raises, nothing of the request is left, and the others
    run to the clean run's tokens."""
    want = make_engine(model, design="v1").generate("And God said", GREEDY)[0]
    engine = make_engine(model, design="v1")
    a = engine.add_request("And God said", GREEDY)
    engine.step()
    real, made = SchedulerV1.add_request, []

    def add(self, *args, **kwargs):
        from course_lib import sequence
        orig = sequence.Sequence.__init__

        def init(seq, *a, **k):
            made.append(1)
            if len(made) == 3:
                raise MemoryError("injected at the third child")
            orig(seq, *a, **k)

        monkeypatch.setattr(sequence.Sequence, "__init__", init)
        try:
            return real(self, *args, **kwargs)
        finally:
            monkeypatch.setattr(sequence.Sequence, "__init__", orig)

    monkeypatch.setattr(SchedulerV1, "add_request", add)
    with pytest.raises(MemoryError):
        engine.add_request("In the beginning", SamplingParams(max_tokens=4, n=4))
    assert list(engine._requests) == [a] and len(made) == 3
    monkeypatch.setattr(SchedulerV1, "add_request", real)
    outs, failed = run_all(engine)
    assert failed == 0 and tokens(outs) == {a: [want.outputs[0].token_ids]}


@pytest.mark.parametrize("design", ["v0", "v1"])
def test_an_abort_that_fails_half_way_still_aborts(model, monkeypatch, design):
    """Aborting a waiting request faults half-way (its blocks or queue entry half gone): the
    engine recovers with that request aborted (and answered so by the next step), and the
    others go on to clean tokens."""
    want = make_engine(model, design=design).generate("And God said", GREEDY)[0]
    engine = make_engine(model, design=design)
    a = engine.add_request("And God said", GREEDY)
    engine.step()
    b = engine.add_request("In the beginning", SamplingParams(max_tokens=8, n=2,
                                                              temperature=0.0))
    sched = engine.scheduler
    real = type(sched).finish_request

    def half(self, request_id, status, detail):
        real(self, request_id, status, detail)
        raise RuntimeError("injected after the abort freed the request")

    monkeypatch.setattr(type(sched), "finish_request", half)
    assert engine.abort_request(b) is True
    monkeypatch.setattr(type(sched), "finish_request", real)
    assert list(engine._requests) == [a] and engine.num_recoveries == 1
    outs, failed = run_all(engine)
    assert failed == 0 and tokens(outs)[a] == [want.outputs[0].token_ids]
    assert set(outs) == {a, b} and all(t == [] for t in tokens(outs)[b])     # it never ran
    assert outs[b].finish_reason == "abort" and outs[b].finish_detail == "aborted by the user"


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
        cls = type(engine.scheduler)           # the class: a recovery builds a new scheduler
        monkeypatch.setattr(cls, "update", self.wrap("update", cls.update))


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


@pytest.mark.parametrize("design", ["v0", "v1"])
def test_abort_from_another_thread_mid_step_takes_effect_after_the_step(model, monkeypatch,
                                                                          design):
    """A server aborts a request whose client went away while ``step()`` runs in another
    thread: the abort waits for the step to end, then takes effect; no KeyError, no wedged
    engine, the other request's tokens as in a clean run."""

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
    assert outs[a].finish_reason == "abort"
    assert outs[b].outputs[0].token_ids == want[1].outputs[0].token_ids
    engine.check_invariants()
    assert not engine._requests and not engine._seeds


