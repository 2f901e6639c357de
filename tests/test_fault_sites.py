"""Fault injection against recovery by recompute (``bench/fault_sites.py``).

Every method of the modules a step runs through is a fault site, found by walking them, never
listed by hand. One fault per run: a site's k-th call during a step raises once; the engine
recovers by recompute (``course_lib/engine/recovery.py``), blaming at most one request
(``finish_reason="error"``). The bar, on every run: every other request gives the clean run's
tokens exactly and its logprobs within 1e-4; every request is answered once; the invariants
hold after every step; each recovery leaves every request as it was when the step began
(preempted by recompute), the KV bookkeeping empty and nothing of the old scheduler kept; no
block is leaked at the end and no run is wedged.

Here a sample, in each design (V0 recompute, V0 swap, V1 hash, V1 radix, V1 + CPU tier, the
P/D pair in one process): one site of each kind, and a few second faults in what handling a
first fault calls. ``bench/chaos.py`` runs every site and every second fault. Then the proofs
that the harness trips on broken recoveries (one that keeps an old pool or manager, one that
keeps a fork of the failed step, one that does not cut outputs back, one that never succeeds:
a wedged engine, an abort that does not wait for the step), and a hypothesis state machine
mixing requests, aborts (between steps, from inside a step, from another thread during the
forward), steps and one-shot faults.
"""

from __future__ import annotations

import inspect
import threading
from collections import Counter

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from memory_helpers import load_fault_sites
from property_budget import examples

from course_lib.engine import llm_engine, recovery
from course_lib.engine.llm_engine import LLMEngine
from course_lib.engine.recovery import RecoveryFailed, StepFailed
from course_lib.memory.v0.fast import FastBlockManager
from course_lib.memory.v1.block_pool import FreeKVCacheBlockQueue
from course_lib.model.loader import load_tiny_model
from course_lib.scheduler.metrics import Metrics
from course_lib.sequence import SamplingParams

fs = load_fault_sites()

pytestmark = pytest.mark.ch10
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


@pytest.fixture(scope="module")
def sites():
    return fs.enumerate_sites()


@pytest.fixture(scope="module")
def recorded(model, sites):
    """``recorded(design)``: the clean run and the calls of every site during its steps,
    computed once per design."""
    cache = {}

    def get(design):
        if design not in cache:
            cache[design] = fs.reach(model, design, sites)
        return cache[design]
    return get


def assert_unbroken(runs, what: str) -> None:
    failed = [r for r in runs if r.problems]
    assert not failed, f"{len(failed)} of {len(runs)} {what} broke:\n" + \
        "\n".join(fs.describe_failure(r) for r in failed)


# ------------------------------------------------------------------- the enumeration
def test_every_method_of_the_step_modules_is_a_site(sites):
    labels = {s.label for s in sites}
    assert len(labels) == len(sites)
    # each class's own methods, properties included, and inherited ones under their owner
    for cls in (FastBlockManager, FreeKVCacheBlockQueue, LLMEngine, Metrics):
        for owner in cls.__mro__[:-1]:
            for name, value in vars(owner).items():
                if inspect.isfunction(value) or isinstance(value, property | staticmethod
                                                           | classmethod):
                    assert f"{owner.__name__}.{name}" in labels or \
                        (owner.__name__, name) in fs.SKIP, f"{owner.__name__}.{name}"
    for label in ("BlockManager.allocate_group", "FastBlockManager.append_decode",
                  "BlockAllocator.allocate", "BlockTable.slot_mapping",
                  "KVCacheManager.allocate_slots", "BlockPool.get_new_blocks",
                  "FreeKVCacheBlockQueue.popleft", "RadixKVCacheManager.allocate_slots",
                  "RadixCache.insert", "Scheduler._preempt", "SchedulerV1._schedule_waiting",
                  "output_processor.apply_samples", "outputs.request_output",
                  "LLMEngine._recover_now", "ModelRunner.execute_model", "sampler.sample",
                  "logprobs.top_logprobs", "recovery.recover", "recovery.restore",
                  "recovery.find_culprit", "Counters.carry_to", "Metrics.record_step",
                  "Metrics.record_recovery", "Request.unfinished_seqs",
                  "BlockManager.num_free_gpu_blocks", "CPUOffloadConnector.reset_cache",
                  "P2PConnector.reset_cache"):
        assert label in labels, label
    assert {s.kind for s in sites} == set(fs.KINDS)
    assert not [s for s in sites if "rollback" in s.label.lower()
                or "checkpoint" in s.label.lower()]


def test_a_fault_reaches_every_binding_and_counts_only_steps(model, sites):
    """``from .sampler import sample`` binds ``llm_engine.sample``: a fault at
    ``sampler.sample`` strikes there; calls outside a step are not counted; everything is put
    back when the injector leaves."""
    from course_lib.engine import sampler
    site = next(s for s in sites if s.label == "sampler.sample")
    bound = vars(llm_engine)          # the engine module's own binding of the name
    before = (sampler.sample, bound["sample"], vars(LLMEngine)["step"])
    inj = fs.Injector([site], [(site.key, 1)])
    with inj:
        assert bound["sample"] is sampler.sample is not before[0]
        engine = fs.make_engine(model, "v0 recompute")
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
        assert inj.calls[site.key] == 0
        engine.step()                             # the sampler is tried twice: no blame
        assert inj.fired == [(site.key, 1, 1)] and inj.calls[site.key] == 2
    assert (sampler.sample, bound["sample"], vars(LLMEngine)["step"]) == before


def test_the_steps_and_the_recoveries_reach_their_core_sites(model, sites, recorded):
    """The harness reaches what every step must run (a site silently not patched would look
    "not reached"), and what a recovery runs only when a step fails."""
    reached = {d: {s.label for s in sites if recorded(d)[1][s.key]} for d in fs.DESIGNS}
    common = {"LLMEngine._step", "ModelRunner.execute_model", "sampler.sample",
              "logprobs.top_logprobs", "outputs.request_output",
              "output_processor.apply_samples", "recovery.record", "recovery.records_of_step",
              "Counters.of", "Metrics.record_step"}
    v0 = {"Scheduler.schedule", "Scheduler._preempt", "Scheduler.update",
          "FastBlockManager.append_decode", "BlockManager.fork", "BlockAllocator.allocate"}
    v1 = {"SchedulerV1.schedule", "SchedulerV1._preempt", "SchedulerV1.update"}
    assert common | v0 <= reached["v0 recompute"]
    assert common | v0 | {"BlockManager.swap_out", "cache_ops.swap_blocks"} \
        <= reached["v0 swap"]
    assert common | v1 | {"KVCacheManager.allocate_slots", "BlockPool.get_new_blocks"} \
        <= reached["v1 hash"]
    assert common | v1 | {"RadixKVCacheManager.allocate_slots", "RadixCache.insert"} \
        <= reached["v1 radix"]
    assert common | v1 | {"CPUOffloadConnector.build_connector_meta",
                          "CPUBlockPool.allocate"} <= reached["v1 cpu tier"]
    assert common | v1 | {"P2PConnector.request_finished", "P2PConnector.get_finished"} \
        <= reached["p/d pair"]
    for d in fs.DESIGNS:
        assert not {"recovery.recover", "LLMEngine._recover_now"} & reached[d]
    design = "v1 cpu tier"
    path = fs.recovery_path(model, design, sites, recorded(design)[1], "forward")
    assert {"LLMEngine._blame", "recovery.find_culprit", "LLMEngine._recover_now",
            "recovery.recover", "recovery.restore", "recovery.requeue", "Counters.carry_to",
            "SchedulerV1.__init__", "KVCacheManager.__init__",
            "CPUOffloadConnector.reset_cache", "Metrics.record_recovery"} <= set(path)


# --------------------------------------------------------------- one fault per site
@pytest.mark.parametrize("design", list(fs.DESIGNS))
def test_one_fault_at_a_site_of_each_kind_breaks_nothing(model, sites, recorded, design):
    """A sample (one reached site of each kind, its first or its middle call; always the
    first on the P/D pair, whose idle steps while blocks travel vary from run to run): the
    full sweep is ``bench/chaos.py``'s."""
    clean, calls = recorded(design)
    runs = []
    for i, site in enumerate(fs.sample_sites(sites, calls, 1, design)):
        k = 1 if i % 2 == 0 or fs.is_pair(design) else (calls[site.key] + 1) // 2
        runs.append(fs.fault_run(model, design, site, k, clean))
    figures = fs.recovery_figures(runs)
    print(f"\n{design}: {len(runs)} fault runs, {figures}")
    assert_unbroken(runs, f"fault runs of {design}")
    assert figures["recoveries"] > 0 and figures["recomputed"] == figures["counted"]


@pytest.mark.parametrize("design", list(fs.DESIGNS))
def test_a_second_fault_while_recovering_breaks_nothing(model, sites, recorded, design):
    """A first fault (a failed forward in some designs, a request whose sampling always
    fails in the others), then one more fault at a few of the sites handling it calls (the
    blame, the recovery, the new scheduler, the connector's reset, the metrics)."""
    clean, calls = recorded(design)
    first = fs.FIRST_FAULTS[list(fs.DESIGNS).index(design) % 2]
    path = fs.recovery_path(model, design, sites, calls, first)
    by_label = {s.label: s for s in sites}
    wanted = ["recovery.restore", "LLMEngine._recover_now", "Metrics.record_recovery"]
    picked = [label for label in wanted if label in path]
    others = [label for label in sorted(path)          # what the new scheduler builds
              if by_label[label].kind in ("manager", "pool", "radix tree", "connector")]
    turn = sum(map(ord, design))                        # designs fault different ones
    picked += [others[(turn + i * len(others) // 2) % len(others)] for i in range(2)
               if others]
    runs = [fs.second_fault_run(model, design, first, by_label[label], path[label], clean,
                                sites, calls) for label in dict.fromkeys(picked)]
    print(f"\n{design}: after a {first} fault, {len(path)} sites handle it; faulted "
          f"{', '.join(dict.fromkeys(picked))}")
    assert len(runs) >= 3
    assert_unbroken(runs, f"second-fault runs of {design}")


def test_a_recovery_that_fails_three_times_is_finished_by_the_next_step(model, sites,
                                                                        recorded):
    """Three faults in a row inside the recovery: ``RecoveryFailed``; the next ``step()``
    recovers first, and the run ends as the clean one."""
    design = "v1 hash"
    clean, calls = recorded(design)
    by_label = {s.label: s for s in sites}
    restore = by_label["recovery.restore"]
    forward = (fs.FORWARD, (calls[fs.FORWARD] + 1) // 2)
    k = fs.recovery_path(model, design, sites, calls, "forward")["recovery.restore"]
    # each try fails at its first restore: the calls k, k + 1, k + 2
    plan = [forward, *((restore.key, k + i) for i in range(3))]
    res = fs.run(model, design, injector=fs.Injector([by_label[fs.FORWARD], restore], plan),
                 max_steps=fs.max_steps_for(clean))
    fs.compare(clean, res)
    assert res.recovery_failed == 1 and len(res.fired) == 4, (res.recovery_failed, res.fired)
    assert not res.problems, res.problems


# ------------------------------------------------------------ the detector trips
def broken_scheduler(monkeypatch, keep: str) -> None:
    """A recovery whose new scheduler keeps a piece of the failed step's: ``"manager"`` (the
    whole block manager) or ``"pool"`` (V0's GPU pool, V1's block pool)."""
    real = LLMEngine._new_scheduler

    def new_scheduler(engine):
        new = real(engine)
        old = getattr(engine, "scheduler", None)      # None while the engine is built
        if old is not None:
            if keep == "manager":
                new.block_manager = old.block_manager
                if hasattr(new, "kv_cache_manager"):
                    new.kv_cache_manager = old.kv_cache_manager
            elif hasattr(new.block_manager, "block_pool"):
                new.block_manager.block_pool = old.block_manager.block_pool
            else:
                new.block_manager.gpu = old.block_manager.gpu
        return new
    monkeypatch.setattr(LLMEngine, "_new_scheduler", new_scheduler)


def forward_fault_run(model, sites, recorded, design: str):
    """A run whose middle forward fails once (nobody to blame: a recovery, then
    ``StepFailed``)."""
    clean, calls = recorded(design)
    site = next(s for s in sites if s.label == fs.FORWARD)
    return fs.fault_run(model, design, site, (calls[fs.FORWARD] + 1) // 2, clean)


@pytest.mark.parametrize("design, keep", [("v0 recompute", "pool"), ("v1 hash", "pool"),
                                          ("v1 radix", "manager")])
def test_harness_sees_a_recovery_that_keeps_old_state(model, sites, recorded, monkeypatch,
                                                      design, keep):
    """The new scheduler given the failed step's pool or block manager: the watch finds the
    objects kept (and the bookkeeping not empty); with the real recovery, nothing is."""
    with monkeypatch.context() as mp:
        broken_scheduler(mp, keep)
        run = forward_fault_run(model, sites, recorded, design)
    print("\n" + fs.describe_failure(run))
    assert fs.KEPT_STATE in run.result.categories(), run.problems
    assert fs.KEPT_STATE not in forward_fault_run(model, sites, recorded, design).result \
        .categories()


def restore_that(monkeypatch, *, keeps_forks: bool = False, keeps_outputs: bool = False
                 ) -> list[int]:
    """A broken ``recovery.restore``: the real one, then the sequences list (forks of the
    failed step included) or the outputs put back as the failed step left them. Returns a
    list that counts the requests it left wrong."""
    real, wrong = recovery.restore, []

    def restore(rec):
        req = rec.request
        seqs = list(req.seqs)
        outs = [(s, list(s.output_token_ids), list(s.output_logprobs), s.cumulative_logprob)
                for s in seqs]
        lost = real(rec)
        if keeps_forks and len(seqs) != len(req.seqs):
            req.seqs = seqs
            wrong.append(req.request_id)
        if keeps_outputs and any(len(o) != len(s.output_token_ids) for s, o, _, _ in outs):
            for s, o, lp, cum in outs:
                s.output_token_ids[:], s.output_logprobs[:], s.cumulative_logprob = o, lp, cum
            wrong.append(req.request_id)
        return lost
    monkeypatch.setattr(recovery, "restore", restore)
    return wrong


@pytest.mark.parametrize("design, broken", [("v0 recompute", "keeps_forks"),
                                            ("v0 swap", "keeps_forks"),
                                            ("v1 hash", "keeps_outputs"),
                                            ("v1 radix", "keeps_outputs")])
def test_harness_sees_a_recovery_that_does_not_restore_requests(model, sites, recorded,
                                                                monkeypatch, design, broken):
    """A fault late in a step (after the samples were applied: forks made, tokens appended),
    at each step in turn until the broken restore leaves a request wrong: the harness reports
    the request not restored. (Only V0 forks in a step: V1 makes a request's n sequences when
    it is added.)"""
    clean, calls = recorded(design)
    site = next(s for s in sites if s.label == "recovery.records_of_step")
    tripped = None
    with monkeypatch.context() as mp:
        wrong = restore_that(mp, **{broken: True})
        for k in range(1, calls[site.key] + 1):
            run = fs.fault_run(model, design, site, k, clean)
            if wrong:
                tripped = run
                break
    assert tripped is not None, f"no fault left a request wrong ({broken})"
    print("\n" + fs.describe_failure(tripped))
    assert fs.NOT_RESTORED in tripped.result.categories(), tripped.problems
    assert not fs.fault_run(model, design, site, tripped.k, clean).problems


def test_harness_sees_a_wedged_engine(model, sites, recorded, monkeypatch):
    """A recovery that never succeeds (its metrics fail every time): after the first fault
    every step raises ``RecoveryFailed``; the harness reports a wedged run."""
    def fails(*args, **kwargs):
        raise RuntimeError("the recovery's metrics fail")
    with monkeypatch.context() as mp:
        mp.setattr(Metrics, "record_recovery", fails)
        run = forward_fault_run(model, sites, recorded, "v0 recompute")
    print("\n" + fs.describe_failure(run))
    assert fs.WEDGED in run.result.categories() and run.result.recovery_failed >= 4


# ---------------------------------------------- requests, aborts, steps and faults
PROMPTS = [[256, *b"In the beginning God created the"], [256, *b"In the beginning God said"],
           [256, *b"And God said, Let there be"], [256, *b"Jesus wept."]]
PARAMS = [SamplingParams(max_tokens=4, temperature=0.0, seed=1),
          SamplingParams(max_tokens=3, n=2, temperature=0.8, seed=2, logprobs=1),
          SamplingParams(max_tokens=5, temperature=0.0, seed=3),
          SamplingParams(max_tokens=3, beam_width=2, seed=4)]
MACHINE_DESIGNS = [d for d in fs.DESIGNS if not fs.is_pair(d)]
REFERENCE: dict = {}         # (design, prompt, params) -> the tokens of a clean run


def params_for(design: str, i: int) -> SamplingParams:
    p = PARAMS[i]
    if fs.DESIGNS[design]["design"] == "v1" and p.use_beam_search:
        return SamplingParams(max_tokens=3, n=2, temperature=0.0, seed=4)
    return p


class StepMachine(RuleBasedStateMachine):
    """Requests come in and are aborted (between steps, from inside a step on its own thread,
    or from another thread while the step is inside the forward), steps run, one-shot faults
    are armed at reached sites. Each step may only return or raise ``StepFailed`` /
    ``RecoveryFailed``; ``abort_request`` never raises; the invariants hold after every step
    and every recovery passes the watch's checks; each request is answered once and never
    after it was aborted, with the tokens it has alone in a clean engine (logprobs within
    1e-4); at the end every block is back and the engine's maps are empty."""

    model = None
    sites: list = []
    reached: dict = {}
    seen: Counter = Counter()        # over every example: what the machine exercised

    @initialize(design=st.sampled_from(MACHINE_DESIGNS))
    def start(self, design):
        self.design = design
        self.injector = fs.Injector(self.sites, hooks={
            "ModelRunner.execute_model": self._in_forward})
        self.watch = fs.RecoveryWatch(self.injector)
        self.injector.__enter__()
        self.watch.__enter__()
        self.engine = fs.make_engine(self.model, design)
        self.added: dict[int, tuple[int, int]] = {}          # request id -> (prompt, params)
        self.answered: dict[int, object] = {}
        self.aborted: set[int] = set()
        self.in_forward: list = []          # what to do inside the next forward
        self.thread: threading.Thread | None = None
        self.thread_result: list = []

    def teardown(self):
        if getattr(self, "injector", None) is None:
            return
        try:
            self.injector.plan.clear()
            self.in_forward.clear()
            for _ in range(300):
                if not self.engine.has_unfinished_requests():
                    break
                self._step()
            assert not self.engine.has_unfinished_requests(), "the engine never drained"
            self.engine.check_invariants()
            left = fs.leaks(self.engine)
            assert not left, f"leaked: {left}"
            maps = {k: sorted(getattr(self.engine, k)) for k in ("_requests", "_seeds",
                                                                 "_records")}
            assert not any(maps.values()), f"engine maps kept: {maps}"
            missing = set(self.added) - self.answered.keys()
            assert not missing, f"requests {sorted(missing)} never answered"
            wrong = {r: self.answered[r].finish_reason for r in self.aborted
                     if self.answered[r].finish_reason != "abort"}
            assert not wrong, f"aborted requests answered otherwise: {wrong}"
            StepMachine.seen.update(
                {"examples": 1, "requests": len(self.added), "aborted": len(self.aborted),
                 "faults fired": len(self.injector.fired),
                 "recoveries": self.watch.recoveries,
                 "errors": sum(o.finish_reason == "error" for o in self.answered.values())})
        finally:
            self.watch.__exit__()
            self.injector.__exit__()

    # -- what happens inside a step (the forward): an abort or an add on the stepping thread,
    #    or an abort from another thread (it waits for the step: one lock)
    def _in_forward(self, *args, **kwargs):
        todo, self.in_forward = self.in_forward, []
        for what, arg in todo:
            if what == "add":
                self._add(*arg)
            elif what == "abort here":
                if self.engine.abort_request(arg):
                    self.aborted_in_step.add(arg)
            else:
                self._abort_from_another_thread(arg)

    def _abort_from_another_thread(self, rid):
        def abort():
            try:
                self.thread_result.append((rid, self.engine.abort_request(rid)))
            except BaseException as exc:          # noqa: BLE001 - reported by the test
                self.thread_result.append((rid, exc))
        self.thread = threading.Thread(target=abort, daemon=True)
        self.thread.start()
        self.thread.join(0.05)        # it runs now, or waits for the step (a lock): either

    def _step(self):
        self.aborted_in_step: set[int] = set()
        try:
            outs = self.engine.step()
        except (StepFailed, RecoveryFailed):
            outs = []
        except Exception as exc:
            raise AssertionError(f"step() raised {type(exc).__name__}: {exc}") from exc
        finally:
            if self.thread is not None:
                self.thread.join(10)
                assert not self.thread.is_alive(), "an abort from another thread never returned"
                self.thread = None
                for rid, result in self.thread_result:
                    assert not isinstance(result, BaseException), \
                        f"abort_request({rid}) from another thread raised {result!r}"
                    if result:
                        self.aborted.add(rid)
                self.thread_result.clear()
        self.engine.check_invariants()
        assert not self.watch.problems, self.watch.problems
        for o in outs:
            assert o.request_id not in self.answered, f"request {o.request_id} answered twice"
            if o.request_id in self.aborted:
                assert o.finish_reason == "abort", f"request {o.request_id} aborted, then " \
                    f"answered {o.finish_reason!r}"
            self.answered[o.request_id] = o
            self._check_tokens(o)
        # an abort asked for inside the step takes effect after it: unless the step
        # finished the request, it is aborted now
        self.aborted |= self.aborted_in_step - self.answered.keys()

    def _check_tokens(self, o):
        if o.finish_reason in ("error", "abort"):
            return
        prompt, params = self.added[o.request_id]
        key = (self.design, prompt, params)
        if key not in REFERENCE:
            self.injector.paused = True          # (no fault, no count, no watch in there)
            try:
                ref = fs.make_engine(self.model, self.design).generate(
                    [PROMPTS[prompt]], params_for(self.design, params))[0]
            finally:
                self.injector.paused = False
            REFERENCE[key] = fs._completions(ref)
        want, got = REFERENCE[key], fs._completions(o)
        assert [c[1] for c in got] == [c[1] for c in want], \
            f"request {o.request_id}: tokens {got} instead of {want}"
        assert fs._close([c[2:4] for c in got], [c[2:4] for c in want], 1e-4), \
            f"request {o.request_id}: logprobs {got} instead of {want}"

    def _add(self, prompt, params):
        rid = self.engine.add_request(PROMPTS[prompt], params_for(self.design, params))
        self.added[rid] = (prompt, params)

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), params=st.integers(0, len(PARAMS) - 1))
    def add(self, prompt, params):
        self._add(prompt, params)

    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from([*self.added, 10_000]))
        if self.engine.abort_request(rid):
            self.aborted.add(rid)

    @rule()
    def step(self):
        self._step()

    @rule(data=st.data(), where=st.sampled_from(["abort here", "abort from another thread",
                                                 "add"]))
    def step_with_a_call_inside(self, data, where):
        if where == "add":
            self.in_forward.append(("add", (data.draw(st.integers(0, len(PROMPTS) - 1)),
                                            data.draw(st.integers(0, len(PARAMS) - 1)))))
        elif self.added:
            self.in_forward.append((where, data.draw(st.sampled_from(list(self.added)))))
        self._step()
        self.in_forward.clear()

    @precondition(lambda self: not self.injector.plan)     # one at a time
    @rule(data=st.data(), later=st.integers(1, 3))
    def arm_a_fault(self, data, later):
        site = data.draw(st.sampled_from(self.reached[self.design]))
        self.injector.plan.add((site.key, self.injector.calls[site.key] + later))


def machine(model, sites, recorded=None):
    StepMachine.model, StepMachine.sites = model, sites
    if recorded is not None:
        StepMachine.reached = {d: [s for s in sites if recorded(d)[1][s.key]]
                               for d in MACHINE_DESIGNS}
    return StepMachine()


def test_harness_sees_an_abort_racing_the_step(model, sites, monkeypatch):
    """An ``abort_request`` that does not wait for the step (no lock, nothing deferred),
    called inside the step while the samples are applied: it frees the request's blocks and
    forgets it while the step still runs on it. The machine reports it (the step commits the
    aborted request again: it stays in the engine's maps, or a later recovery brings it back
    and it is answered after its abort)."""
    monkeypatch.setattr(LLMEngine, "abort_request", lambda engine, rid: engine._abort(rid))
    m = machine(model, sites)
    m.start(design="v0 recompute")
    m.injector.hooks["output_processor.apply_step"] = m.injector.hooks.pop(fs.FORWARD)
    with pytest.raises(AssertionError,
                       match="aborted, then answered|maps kept|never drained|answered twice"
                       ) as caught:
        try:
            m.add(prompt=1, params=0)
            m.add(prompt=2, params=0)
            m.in_forward.append(("abort here", 0))
            m._step()
            m.step()
        finally:
            m.teardown()
    print(f"\n{caught.value}")


@pytest.mark.hypothesis         # a state machine run by hand: `make test-deep` selects it too
def test_requests_aborts_steps_and_faults_in_any_order(model, sites, recorded):
    # no shrinking: a failing run of steps is printed as found (shrinking one takes minutes)
    m = settings(max_examples=examples(15), stateful_step_count=25, deadline=None,
                 phases=[Phase.explicit, Phase.reuse, Phase.generate])(type(machine(
                     model, sites, recorded)))
    StepMachine.seen.clear()
    m.TestCase().runTest()
    print(f"\n{dict(StepMachine.seen)}")
    assert StepMachine.seen["recoveries"] > 0 and StepMachine.seen["aborted"] > 0
