"""Issue 36's doors and answers: every public door checks what it takes, by value, before
anything changes, and every request added gets exactly one final output.

* Numbers of any kind (numpy integers and floats, ``Fraction``, ``Decimal``) are taken by
  value: converted to the plain ``int`` / ``float`` the step computes with, so that a seed
  from ``np.random.randint`` or a temperature of ``Fraction(1, 3)`` samples exactly as the
  plain number does, or refused with a ``ValueError`` naming the value.
* The eleven arguments the issue lists (``DisaggCluster``, ``LLMEngine``, ``SamplingParams``,
  ``CPUOffloadConnector``, ``P2PConnector`` / ``P2PTransport``) are refused with a
  ``ValueError`` naming them; a ``DisaggCluster`` is refused before any process starts.
* A KV connector serves one engine: a second one is refused, and the first goes on.
* A CPU tier built directly (``CPUOffloadConnector(num_cpu_blocks)``) is checked against the
  machine's memory before anything is allocated, as ``kv_offloading_size`` is.
* An aborted request is answered (``finish_reason="abort"``) by the next ``step()``, once;
  ``generate()`` returns every output even when another thread aborts one of its requests.

``kv_transfer_params`` checked field by field is in ``tests/test_p2p_connector.py`` (it needs
a prefill and a decode engine).
"""

from __future__ import annotations

import os
import threading
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.engine.cpu_offload import CPUOffloadConnector
from course_lib.engine.llm_engine import LLMEngine
from course_lib.engine.p2p_connector import P2PConnector
from course_lib.engine.p2p_transport import P2PTransport
from course_lib.model.loader import load_tiny_model
from course_lib.parallel.disagg import DisaggCluster
from course_lib.sequence import SamplingParams

pytestmark = pytest.mark.ch10
torch.set_num_threads(1)

PROMPTS = ["And God said", "In the beginning", "Jesus wept. And"]


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


def make_engine(model, design: str = "v0", connector=None, **cache_kwargs) -> LLMEngine:
    cc = CacheConfig(block_size=4, num_gpu_blocks=48, watermark=0.0,
                     enable_prefix_caching=True, **cache_kwargs)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                         max_model_len=model.config.max_position)
    return LLMEngine(model, sc, cc, design=design, kv_connector=connector, stop_token_ids=())


# ------------------------------------------------------------------ numbers, by value
@pytest.mark.parametrize("given, plain", [
    ({"seed": np.int64(2)}, {"seed": 2}),                       # what np.random.randint returns
    ({"seed": np.uint64(2 ** 64 - 1)}, {"seed": 2 ** 64 - 1}),
    ({"temperature": Fraction(1, 3)}, {"temperature": 1 / 3}),
    ({"top_p": Fraction(1, 3)}, {"top_p": 1 / 3}),
    ({"temperature": Decimal("0.5")}, {"temperature": 0.5}),
    ({"temperature": np.float32(0.5), "top_p": np.float64(0.9)},
     {"temperature": 0.5, "top_p": 0.9}),
    ({"max_tokens": np.int64(5), "n": np.int8(2), "logprobs": np.int32(2)},
     {"max_tokens": 5, "n": 2, "logprobs": 2}),
])
def test_numbers_of_any_kind_sample_as_the_plain_number(model, given, plain):
    """Each is converted when the ``SamplingParams`` is made (equal fields, plain types), and a
    request with it generates the plain number's tokens. Before: the numpy seed overflowed in
    the sampler, the ``Fraction`` failed between a tensor and itself (both ending the request
    with ``finish_reason="error"``), the ``Decimal`` was refused."""
    base = {"max_tokens": 5, "temperature": 0.8, "seed": 7}
    got, want = SamplingParams(**{**base, **given}), SamplingParams(**{**base, **plain})
    assert got == want
    for name in given:
        assert type(getattr(got, name)) is type(getattr(want, name)), name
    engine = make_engine(model)
    a, b = engine.generate(["And God said"] * 2, [got, want])
    assert a.finish_reason == "length" and b.finish_reason == "length"
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": 10 ** 400}, r"temperature must be a finite number, got 1000"),
    ({"temperature": Decimal("NaN")}, r"temperature must be a finite number, got Decimal"),
    ({"temperature": Decimal("sNaN")}, r"temperature must be a finite number, got Decimal"),
    ({"top_p": Fraction(0)}, r"top_p must be in \(0, 1\]"),
    ({"top_p": Fraction(1, 2 ** 151)}, r"top_p must be in \(2\*\*-150, 1\]"),
    ({"seed": np.float64(2.0)}, r"seed must be None or an int in \[0, 2\*\*64\)"),
    ({"seed": np.bool_(True)}, r"seed must be None or an int"),
    ({"max_tokens": np.float32(3)}, r"max_tokens must be an int >= 1"),
    ({"stop_token_ids": torch.tensor(2)}, r"stop_token_ids must be a sequence of ints in >= 0, "
                                          r"got Tensor tensor\(2\)"),
    ({"stop_token_ids": np.array(2)}, r"stop_token_ids must be a sequence of ints in >= 0, "
                                      r"got ndarray"),
    ({"stop_token_ids": [np.float64(2)]}, r"stop_token_ids must be ints in >= 0; item 0 is"),
])
def test_numbers_that_are_not_what_they_must_be_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_numpy_request_id_and_arrival_time_are_plain_numbers_inside(model):
    engine = make_engine(model)
    rid = engine.add_request("And God said", SamplingParams(max_tokens=2),
                             request_id=np.int64(4), arrival_time=Fraction(1, 2))
    assert type(rid) is int and rid == 4
    req = engine._requests[4]
    assert type(req.request_id) is int and type(req.arrival_time) is float
    (out,) = engine.generate("x", SamplingParams(max_tokens=1))    # runs both
    assert type(out.request_id) is int
    with pytest.raises(ValueError, match=r"arrival_time must be a finite number of seconds"):
        engine.add_request("x", arrival_time=10 ** 400)


# ---------------------------------------------------------------- the eleven arguments
@pytest.fixture
def no_processes(monkeypatch):
    """``DisaggCluster`` with its ``_start`` replaced: a refusal must come before it (a
    process started is an ``AssertionError``), and a cluster accepted starts nothing."""
    started = []

    def start(self):
        started.append(self)
        if os.environ.get("_DOORS_ALLOW_START") != "1":
            raise AssertionError("an engine process started before the arguments were checked")

    monkeypatch.setattr(DisaggCluster, "_start", start)
    return started


OFFLOADING = CacheConfig(block_size=16, num_gpu_blocks=64, enable_prefix_caching=True,
                         kv_offloading_size=0.001)


@pytest.mark.parametrize("make, match", [
    (lambda: DisaggCluster(timeout_s="10", device="cpu"), r"timeout_s must be a number of "
                                                          r"seconds > 0, got '10'"),
    (lambda: DisaggCluster(timeout_s=float("nan"), device="cpu"), r"timeout_s"),
    (lambda: DisaggCluster(cache_config={"block_size": 16}, device="cpu"),
     r"cache_config must be None or a CacheConfig, got dict"),
    (lambda: DisaggCluster(scheduler_config={"max_num_seqs": 4}, device="cpu"),
     r"scheduler_config must be None or a SchedulerConfig"),
    (lambda: DisaggCluster(cache_config=OFFLOADING, device="cpu"),
     r"kv_offloading_size=0.001.*P2PConnector"),
    (lambda: DisaggCluster(num_prefill=2.0, device="cpu"), r"num_prefill must be an int"),
    (lambda: DisaggCluster(overrides={0: {"exit_after_layers": 0}}, device="cpu"),
     r"exit_after_layers must be None or an int >= 1, got 0"),
    (lambda: DisaggCluster(overrides={0: {"exit_after_layers": "2"}}, device="cpu"),
     r"exit_after_layers must be None or an int >= 1, got '2'"),
    (lambda: DisaggCluster(lease_s=0, device="cpu"),
     r"lease_s must be a number of seconds > 0, got 0"),
    (lambda: DisaggCluster(lease_s="30", device="cpu"),
     r"lease_s must be a number of seconds > 0, got '30'"),
    (lambda: DisaggCluster(overrides={1: {"fail_layer_send": 0}}, device="cpu"),
     r"fail_layer_send must be None or an int >= 1, got 0"),
])
def test_a_disagg_cluster_is_refused_before_a_process_starts(no_processes, make, match):
    with pytest.raises(ValueError, match=match):
        make()
    assert not no_processes


def test_a_disagg_cluster_takes_numbers_by_value(no_processes, monkeypatch):
    monkeypatch.setenv("_DOORS_ALLOW_START", "1")
    cluster = DisaggCluster(np.int64(1), np.int8(1), timeout_s=Fraction(5),
                            overrides={np.int64(1): {"exit_after_layers": np.int64(2),
                                                     "abort_timeout_s": Decimal("3")}},
                            device="cpu")
    assert len(no_processes) == 1 and cluster.timeout_s == 5.0
    assert type(cluster.num_prefill) is int and type(cluster.timeout_s) is float
    spec = cluster.specs[1]
    assert type(spec.exit_after_layers) is int and spec.exit_after_layers == 2
    assert type(spec.abort_timeout_s) is float and spec.abort_timeout_s == 3.0


@pytest.mark.parametrize("call, match", [
    (lambda c: c.submit(5), r"prompt must be a sequence of ints in >= 0, got int 5"),
    (lambda c: c.submit([]), r"the prompt must hold at least one token"),
    (lambda c: c.submit("And God"), r"prompt must be a sequence of ints"),
    (lambda c: c.submit([1, 2], {"max_tokens": 3}), r"params must be None or a SamplingParams,"
                                                    r" got dict"),
    (lambda c: c.submit([1, 2], SamplingParams(n=2)), r"n=1 and no beam search"),
    (lambda c: c.submit([1, 2], pause_after_prefill="yes"), r"pause_after_prefill must be a "
                                                            r"bool"),
    (lambda c: c.generate([[1, 2], [3, "4"]]), r"prompt 1: prompt must be ints"),
    (lambda c: c.generate([[1, 2]], [None, None]), r"2 SamplingParams for 1 prompts"),
    (lambda c: c.generate([[1, 2]], 5), r"params must be None, a SamplingParams or a list"),
    (lambda c: c.wait([0]), r"request 0 was never submitted"),
    (lambda c: c.resume(3), r"request 3 was never submitted"),
])
def test_a_disagg_clusters_requests_are_checked_before_one_is_sent(no_processes, monkeypatch,
                                                                   call, match):
    monkeypatch.setenv("_DOORS_ALLOW_START", "1")
    cluster = DisaggCluster(1, 1, device="cpu")          # no process (the fixture)
    with pytest.raises(ValueError, match=match):
        call(cluster)
    assert not cluster.routes and cluster._next_id == 0   # nothing was sent


@pytest.mark.parametrize("make, match", [
    (lambda: LLMEngine(kv_connector=object(), design="v1"),
     r"kv_connector must be None or a KVConnectorBase_V1 \(course_lib.engine.kv_connector\), "
     r"got object"),
    (lambda: SamplingParams(stop_token_ids=torch.tensor(2)), r"stop_token_ids must be a "
                                                             r"sequence of ints"),
    (lambda: CPUOffloadConnector(8, load_async="yes"), r"load_async must be a bool, got 'yes'"),
    (lambda: CPUOffloadConnector("8"), r"num_cpu_blocks must be an int >= 1, got '8'"),
    (lambda: CPUOffloadConnector(0), r"num_cpu_blocks must be an int >= 1, got 0"),
    (lambda: P2PConnector("kv_producer", P2PTransport(0), abort_timeout_s="5"),
     r"abort_timeout_s must be a number of seconds > 0, got '5'"),
    (lambda: P2PConnector("kv_producer", P2PTransport(0), abort_timeout_s=None),
     r"abort_timeout_s must be a number of seconds > 0, got None"),
    (lambda: P2PConnector("kv_producer", P2PTransport(0), abort_timeout_s=float("nan")),
     r"abort_timeout_s must be a number of seconds > 0, got nan"),
    (lambda: P2PTransport(0, exit_after_layers=0), r"exit_after_layers must be None or an int"),
    (lambda: P2PTransport(0, exit_after_layers="2"), r"exit_after_layers must be None or an"),
    (lambda: P2PTransport(0, fail_layer_send=True), r"fail_layer_send must be None or an int"),
    (lambda: P2PConnector("kv_consumer", P2PTransport(1), transfer_timeout_s=-1),
     r"transfer_timeout_s must be a number of seconds > 0, got -1"),
    (lambda: P2PConnector("kv_consumer", P2PTransport(1), transfer_timeout_s=float("inf")),
     r"transfer_timeout_s must be a number of seconds > 0, got inf"),
])
def test_the_issues_arguments_are_refused_naming_themselves(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_the_connectors_take_numbers_by_value():
    conn = CPUOffloadConnector(np.int64(8), load_async=np.bool_(True))
    assert conn.cpu_pool.num_blocks == 8 and type(conn.cpu_pool.num_blocks) is int
    assert conn.load_async is True
    p2p = P2PConnector("kv_producer", P2PTransport(0), abort_timeout_s=Fraction(5, 2))
    assert p2p.abort_timeout_s == 2.5 and type(p2p.abort_timeout_s) is float


# ---------------------------------------------------------------- one engine a connector
def test_a_connector_refuses_a_second_engine_and_the_first_goes_on(model):
    """Handed to a second engine, a connector used to be re-bound silently: the first
    engine's scheduler side read the second one's hashes and loaded into its tensors, and its
    every step failed. Now the second engine is refused before it is built, and the first
    one's tokens are those of an engine without a tier."""
    want = make_engine(model, "v1").generate(PROMPTS, SamplingParams(max_tokens=6, seed=1))
    conn = CPUOffloadConnector(32)
    first = make_engine(model, "v1", conn)
    with pytest.raises(ValueError, match=r"kv_connector serves one engine, and another "
                                         r"engine's KV caches are registered with this one"):
        make_engine(model, "v1", conn)
    got = first.generate(PROMPTS, SamplingParams(max_tokens=6, seed=1))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert conn.kv_cache_manager is first.block_manager
    first.check_invariants()


# ---------------------------------------------------------- a CPU tier built directly
def test_a_cpu_tier_built_directly_is_checked_against_the_machines_memory(model, monkeypatch):
    """``CPUOffloadConnector(num_cpu_blocks)`` is checked as ``kv_offloading_size`` is, before
    anything is allocated (the machine is made to look small: 8 MiB). Before: never checked;
    a count past the memory spent its time on a Python list, then failed in torch or was
    killed."""
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 2048 if name == "SC_PHYS_PAGES"
                        else real(name))                  # 2048 pages of 4 KiB: 8 MiB
    assert real("SC_PAGE_SIZE") == 4096
    conn = CPUOffloadConnector(2048)                      # 2048 blocks of 8 KiB: 16 MiB
    with pytest.raises(ValueError, match=r"CPUOffloadConnector\(num_cpu_blocks=2048\) needs "
                                         r"16\.0 MiB of KV cache \(8\.0 KiB per block\), more "
                                         r"than the .* of host memory left"):
        make_engine(model, "v1", conn)
    assert not conn.cpu_caches and not conn.kv_caches and conn.kv_cache_manager is None
    make_engine(model, "v1", CPUOffloadConnector(64))     # 512 KiB: fits
    monkeypatch.setattr(os, "sysconf", real)
    huge = CPUOffloadConnector(2 ** 50)                   # built at once: a counter, no list
    with pytest.raises(ValueError, match=r"num_cpu_blocks=1125899906842624\) needs "
                                         r"8388608\.0 TiB"):
        make_engine(model, "v1", huge)


# ------------------------------------------------------------------ every request answered
@pytest.mark.parametrize("design", ["v0", "v1"])
def test_an_aborted_request_is_answered_once_by_the_next_step(model, design):
    """vLLM 0.33.0 answers an aborted request with a final output whose ``finish_reason`` is
    ``"abort"`` (``OutputProcessor.abort_requests`` in ``vllm/v1/engine/output_processor.py``,
    for a request with an output queue: ``AsyncLLM``'s); the course's engine returns it from
    the next ``step()``, with the tokens the request had, and never answers it again."""
    engine = make_engine(model, design)
    a = engine.add_request("And God said", SamplingParams(max_tokens=8, temperature=0.0))
    b = engine.add_request("In the beginning", SamplingParams(max_tokens=30, n=2, seed=0))
    engine.step(), engine.step()
    had = [list(s.output_token_ids) for s in engine._requests[b].ordered_seqs()]
    assert engine.abort_request(b) is True and engine.abort_request(b) is False
    outs = engine.step()
    (out,) = [o for o in outs if o.request_id == b]
    assert out.finish_reason == "abort" and out.finish_detail == "aborted by the user"
    assert [c.token_ids for c in out.outputs] == had
    assert all(c.finish_reason == "abort" for c in out.outputs)
    answers = [o.request_id for o in outs]
    while engine.has_unfinished_requests():
        answers += [o.request_id for o in engine.step()]
    assert sorted(answers) == [a, b]                      # each answered once
    c = engine.add_request("Jesus wept.")                 # aborted before it ran
    assert engine.abort_request(c) and engine.has_unfinished_requests()
    (out,) = engine.step()
    assert (out.request_id, out.finish_reason, out.outputs[0].token_ids) == (c, "abort", [])
    assert not engine.has_unfinished_requests() and engine.step() == []
    engine.check_invariants()


def test_an_abort_made_inside_a_step_is_answered_by_the_step_after_it(model, monkeypatch):
    engine = make_engine(model)
    a = engine.add_request("And God said", SamplingParams(max_tokens=8, temperature=0.0))
    engine.step()
    real, hooked = engine.runner.execute_model, {}

    def forward(entries):
        if not hooked:
            hooked["abort"] = engine.abort_request(a)
        return real(entries)

    monkeypatch.setattr(engine.runner, "execute_model", forward)
    assert engine.step() == [] and hooked["abort"] is True
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [(a, "abort")]
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("design", ["v0", "v1"])
def test_generate_returns_every_output_when_another_thread_aborts_one(model, design):
    """A server thread aborts one of ``generate``'s requests between two of its steps. Before:
    ``RuntimeError("requests [1] vanished")``, and the two finished outputs were lost. Now
    the aborted one comes back with ``"abort"``, the others as without the abort."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = make_engine(model, design).generate(PROMPTS, params)
    engine = make_engine(model, design)
    done = []

    def on_step(eng, out):
        if eng.num_steps == 2 and not done:
            t = threading.Thread(target=lambda: done.append(eng.abort_request(1)))
            t.start()
            t.join(10)

    outs = engine.generate(PROMPTS, params, on_step=on_step)
    assert done == [True]
    assert [o.request_id for o in outs] == [0, 1, 2]
    assert [o.finish_reason for o in outs] == ["length", "abort", "length"]
    assert outs[1].outputs[0].token_ids == want[1].outputs[0].token_ids[:2]
    for i in (0, 2):
        assert outs[i].outputs[0].token_ids == want[i].outputs[0].token_ids
    assert not engine.has_unfinished_requests()
