"""The P/D connector (``course_lib/engine/p2p_connector.py``) in one process, step by step:
a prefill engine and a decode engine whose connectors talk through an in-process stand-in
for ``torch.distributed`` (queues per (source, destination, tag)), driven the way
``course_lib/parallel/disagg.py``'s processes drive them. ``tests/test_disagg.py`` runs the
real processes; here every call the engines' steps make into the connector can be faulted,
and a failed step must leave both engines as they were (the all-or-nothing step,
``engine/rollback.py``): the requests then finish with the clean run's tokens, every block
comes back, and both engines keep their invariants after every step."""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from course_lib.config import CacheConfig
from course_lib.engine import rollback
from course_lib.engine.llm_engine import LLMEngine
from course_lib.engine.p2p_connector import KVLayout, P2PConnector
from course_lib.engine.rollback import StepFailed
from course_lib.memory.v1.kv_cache_manager import KVCacheManager
from course_lib.model.loader import load_tiny_model
from course_lib.scheduler.v1 import SchedulerV1
from course_lib.sequence import SamplingParams

pytestmark = pytest.mark.ch13

torch.set_num_threads(1)

CACHE = CacheConfig(block_size=8, num_gpu_blocks=64, enable_prefix_caching=True)
ROLES = {0: "kv_producer", 1: "kv_consumer"}


class Group:
    """Stands for a ``torch.distributed`` group of two ranks (what ``data_groups`` holds)."""

    def __init__(self, *ranks: int) -> None:
        self.ranks = ranks

    def __repr__(self) -> str:
        return f"Group{self.ranks}"


class Hub:
    """Messages between the ranks of one process: a queue per (src, dst, tag). Every send and
    receive is logged with the group it was given: ``(op, src, dst, group, tensor.dim())``."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int, int], queue.Queue] = defaultdict(queue.Queue)
        self.lock = threading.Lock()
        self.objects: dict[int, object] = {}
        self.closed = False
        self.log: list[tuple[str, int, int, object, int]] = []

    def queue(self, key: tuple[int, int, int]) -> queue.Queue:
        with self.lock:
            return self.queues[key]


class Loopback:
    """``torch.distributed``'s four calls the connector makes, for one rank of a ``Hub``."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def get_world_size(self) -> int:
        return 2

    def all_gather_object(self, out: list, obj: object) -> None:
        self.hub.objects[self.rank] = obj
        out[:] = [self.hub.objects[r] for r in range(2)]

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, group: object = None) -> None:
        self.hub.log.append(("send", self.rank, dst, group, tensor.dim()))
        self.hub.queue((self.rank, dst, tag)).put(tensor.clone())

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0, group: object = None) -> None:
        self.hub.log.append(("recv", src, self.rank, group, tensor.dim()))
        q = self.hub.queue((src, self.rank, tag))
        for _ in range(400):                  # 20 s, in steps that notice a closed hub
            if self.hub.closed:
                raise ConnectionError("the hub is closed")
            try:
                tensor.copy_(q.get(timeout=0.05))
                return
            except queue.Empty:
                continue
        raise TimeoutError(f"no message from rank {src} with tag {tag} in 20 s")


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


OPEN: list[tuple[Hub, list[LLMEngine]]] = []    # closed after each test (fixture below)


@pytest.fixture(autouse=True)
def close_pairs():
    """Stop every pair's threads after each test: none outlives the test session."""
    yield
    while OPEN:
        hub, engines = OPEN.pop()
        hub.closed = True
        for e in engines:
            e.kv_connector.close()


PAIR = Group(0, 1)


def make_pair(model, data_groups: bool = True) -> tuple[LLMEngine, LLMEngine]:
    """Two engines on one hub; their layer messages on ``PAIR`` (``data_groups=False``: on
    the world group, as the connector does without ``data_groups``)."""
    hub = Hub()
    engines = [LLMEngine(model, None, CACHE, attn_impl="torch", design="v1",
                         kv_connector=P2PConnector(
                             ROLES[r], r, transport=Loopback(hub, r),
                             data_groups={1 - r: PAIR} if data_groups else None))
               for r in (0, 1)]
    for r, e in enumerate(engines):     # what every rank says in the all-gather
        hub.objects[r] = (ROLES[r], KVLayout.of(e.runner.gpu_caches))
    for e in engines:
        e.kv_connector.connect(ROLES)
    OPEN.append((hub, engines))
    return engines[0], engines[1]


PROMPTS = [[1] + [(7 * i + 3 * j) % 180 + 3 for j in range(n)]
           for i, n in enumerate((29, 33, 17, 40))]
PARAMS = [SamplingParams(max_tokens=5, temperature=0.0),
          SamplingParams(max_tokens=4, temperature=0.8, seed=3)] * 2


FAILED_STEPS: list[str] = []          # the steps undone, by drive (tests read and clear it)


def drive(model, *, max_loops: int = 4000, data_groups: bool = True
          ) -> tuple[dict[int, list[int] | str], list]:
    """The proxy and both processes' loops, interleaved in one thread: each request's prefill
    on engine 0, its decode on engine 1. Returns each request's tokens (or ``"error"``) and
    the engines. A step that fails and is undone (``StepFailed``) is simply taken again."""
    prefill, decode = make_pair(model, data_groups)
    done: dict[int, list[int] | str] = {}
    for rid, (prompt, p) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        prefill.add_request(prompt, replace(p, max_tokens=1), request_id=rid,
                            kv_transfer_params={"do_remote_decode": True})
    for _ in range(max_loops):
        for engine in (prefill, decode):
            engine.kv_connector.serve_transfers()
            if not (engine.has_unfinished_requests() or engine.kv_connector.busy()):
                continue
            try:
                outs = engine.step()
            except StepFailed as exc:
                FAILED_STEPS.append(str(exc))
                continue
            engine.check_invariants()
            for out in outs:
                if out.finish_reason == "error":
                    done[out.request_id] = "error"
                elif engine is prefill:
                    decode.add_request(PROMPTS[out.request_id], PARAMS[out.request_id],
                                       request_id=out.request_id,
                                       kv_transfer_params=out.kv_transfer_params)
                else:
                    done[out.request_id] = out.outputs[0].token_ids
        if len(done) == len(PROMPTS) and not any(
                e.has_unfinished_requests() or e.kv_connector.busy() for e in (prefill, decode)):
            break
        time.sleep(0.0005)                   # the peers' threads move the blocks
    return done, [prefill, decode]


def colocated(model) -> dict[int, list[int]]:
    engine = LLMEngine(model, None, CACHE, attn_impl="torch", design="v1")
    outs = engine.generate(PROMPTS, PARAMS)
    return {o.request_id: o.outputs[0].token_ids for o in outs}


def assert_clean(engines: list[LLMEngine]) -> None:
    for e in engines:
        kvm = e.scheduler.kv_cache_manager
        assert kvm.num_free_gpu_blocks == kvm.num_gpu_blocks and not kvm.delayed_frees
        assert not e.kv_connector.busy()


def assert_layers_on_the_pair_group(hub: Hub) -> None:
    """Every K/V layer message (a 5-d tensor ``[2, n, bs, h, d]``), sent and received, went on
    the pair's group; every control message (1-d: read request, status) on the world group."""
    layers = {(op, group) for op, _, _, group, dim in hub.log if dim == 5}
    control = {group for _, _, _, group, dim in hub.log if dim == 1}
    assert layers == {("send", PAIR), ("recv", PAIR)}, layers
    assert control == {None}, control


def test_two_engines_in_one_process_give_the_colocated_tokens(model):
    done, engines = drive(model)
    assert done == colocated(model)
    assert_clean(engines)
    prefill, decode = (e.kv_connector for e in engines)
    assert prefill.num_sent_blocks == decode.num_recv_blocks > 0
    assert_layers_on_the_pair_group(prefill.transport.hub)
    sent = sum(1 for op, *_, dim in prefill.transport.hub.log if op == "send" and dim == 5)
    assert prefill.layer_messages == decode.layer_messages == {"pair 0-1": sent} and sent > 0


def test_the_pair_group_detector_trips_on_layers_sent_on_the_world_group(model):
    """Proof that the check above can fail: connectors without ``data_groups`` put their
    layers on the world group (the same tokens: only the group differs)."""
    done, engines = drive(model, data_groups=False)
    assert done == colocated(model)
    hub = engines[0].kv_connector.transport.hub
    with pytest.raises(AssertionError, match="None"):
        assert_layers_on_the_pair_group(hub)
    assert set(engines[0].kv_connector.layer_messages) == {"world"}


def test_bad_data_paths_are_refused(model):
    with pytest.raises(ValueError, match="data_backend must be one of"):
        P2PConnector("kv_producer", 0, data_backend="mpi")
    hub = Hub()
    engines = [LLMEngine(model, None, CACHE, attn_impl="torch", design="v1",
                         kv_connector=P2PConnector(ROLES[r], r, transport=Loopback(hub, r),
                                                   **kw))
               for r, kw in ((0, {"data_groups": {5: PAIR}}),
                             (1, {"data_backend": "nccl"}))]
    for r, e in enumerate(engines):
        hub.objects[r] = (ROLES[r], KVLayout.of(e.runner.gpu_caches))
    with pytest.raises(ValueError, match=r"data_groups must name each peer .*\[1\]\), got \[5\]"):
        engines[0].kv_connector.connect(ROLES)
    with pytest.raises(ValueError, match="data_backend='nccl' moves GPU memory.*cpu"):
        engines[1].kv_connector.connect(ROLES)


SITES = [(P2PConnector, name) for name in (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "request_finished", "bind_connector_metadata", "get_finished",
    "get_block_ids_with_load_errors", "_copy_in", "_finished_sending")] + [
    (KVCacheManager, "cache_blocks"), (SchedulerV1, "update_from_kv_xfer_finished"),
    (SchedulerV1, "_update_waiting_for_remote_kv")]


def fault_once(monkeypatch, cls: type, name: str, k: int) -> list[int]:
    """Make the ``k``-th call of ``cls.name`` (counting both engines) raise, once; the calls
    seen so far (a list of one count)."""
    real, seen = getattr(cls, name), [0]

    def faulty(*args, **kwargs):
        seen[0] += 1
        if seen[0] == k:
            raise RuntimeError(f"fault injected in {cls.__name__}.{name}, call {k}")
        return real(*args, **kwargs)
    monkeypatch.setattr(cls, name, faulty)
    return seen


@pytest.mark.parametrize("cls, name", SITES, ids=[f"{c.__name__}.{n}" for c, n in SITES])
def test_a_fault_in_any_step_call_is_undone(model, monkeypatch, cls, name):
    """Each call a step makes into the connector (or that the connector's reports make),
    faulted at its first and a middle call: the step is undone, taken again, and the run ends
    as the clean one (a fault that repeats would blame one request: ``"error"``, the others
    unchanged)."""
    want = colocated(model)
    seen = fault_once(monkeypatch, cls, name, 10 ** 9)        # count the calls
    drive(model)
    calls = seen[0]
    assert calls > 0, f"{cls.__name__}.{name} is never called"
    monkeypatch.undo()
    for k in sorted({1, (calls + 1) // 2}):
        fault_once(monkeypatch, cls, name, k)
        FAILED_STEPS.clear()
        done, engines = drive(model)
        monkeypatch.undo()
        errors = [r for r, t in done.items() if t == "error"]
        assert len(FAILED_STEPS) + len(errors) == 1, (FAILED_STEPS, errors)   # it struck
        assert set(done) == set(want)
        assert {r: t for r, t in done.items() if t != "error"} == \
            {r: want[r] for r, t in done.items() if t != "error"}, (k, done)
        assert_clean(engines)


def test_the_detector_without_the_connector_in_the_checkpoint(model, monkeypatch):
    """Proof that the test above can fail: with the connector left out of the step's
    checkpoint, a fault while a load is copied in (after ``get_finished`` took it off the
    loads under way) loses the load: its request never runs, its blocks stay held."""
    monkeypatch.setattr(rollback, "begin_connector", lambda checkpoint, connector: None)
    fault_once(monkeypatch, P2PConnector, "_copy_in", 1)
    done, engines = drive(model, max_loops=1500)
    with pytest.raises(AssertionError):
        assert done == colocated(model)
        assert_clean(engines)
