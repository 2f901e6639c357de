"""The P/D connector (``course_lib/engine/p2p_connector.py``, over
``course_lib/engine/p2p_transport.py``) in one process, step by step: a prefill engine and a
decode engine whose transports talk through an in-process stand-in for ``torch.distributed``
(queues per (source, destination, tag)), driven the way ``course_lib/parallel/disagg.py``'s
processes drive them. ``tests/test_disagg.py`` runs the real processes; here every call the
engines' steps make into the connector can be faulted, and the engine recovers by recompute
(``engine/recovery.py``, which calls the connector's ``reset_cache``): the requests then
finish with the clean run's tokens, every block comes back, and both engines keep their
invariants after every step. A reset in the middle of transfers is checked on each side: on
the decode side (a load under way, a read request not sent) the prefill side is told to free
its blocks and the requests are computed locally; on the prefill side (a read request
waiting, blocks held) the decode side's loads fail and it recomputes, nothing is sent from
the rebuilt pool. A reset that forgets the release, or keeps the held blocks, is caught."""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from course_lib.config import CacheConfig
from course_lib.engine.llm_engine import LLMEngine
from course_lib.engine.p2p_connector import KVLayout, P2PConnector
from course_lib.engine.p2p_transport import P2PTransport
from course_lib.engine.recovery import StepFailed
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
            e.kv_connector.transport.close()


PAIR = Group(0, 1)


def make_pair(model, data_groups: bool = True, transport_kw: dict | None = None,
              connector_kw: dict | None = None) -> tuple[LLMEngine, LLMEngine]:
    """Two engines on one hub; their layer messages on ``PAIR`` (``data_groups=False``: on
    the world group, as the connector does without ``data_groups``). ``transport_kw`` and
    ``connector_kw``: rank -> more arguments for that engine's transport or connector."""
    hub = Hub()
    engines = [LLMEngine(model, None, CACHE, attn_impl="torch", design="v1",
                         kv_connector=P2PConnector(ROLES[r], P2PTransport(
                             r, comm=Loopback(hub, r),
                             data_groups={1 - r: PAIR} if data_groups else None,
                             **(transport_kw or {}).get(r, {})),
                             **(connector_kw or {}).get(r, {})))
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


FAILED_STEPS: list[str] = []          # the steps recovered, by drive (tests read and clear it)


def drive(model, *, max_loops: int = 4000, data_groups: bool = True, **pair_kw: dict
          ) -> tuple[dict[int, list[int] | str], list]:
    """The proxy and both processes' loops, interleaved in one thread: each request's prefill
    on engine 0, its decode on engine 1. Returns each request's tokens (or ``"error"``) and
    the engines. A step that fails and is recovered (``StepFailed``) is simply taken again.
    ``pair_kw``: :func:`make_pair`'s ``transport_kw`` and ``connector_kw``."""
    prefill, decode = make_pair(model, data_groups, **pair_kw)
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
    assert_layers_on_the_pair_group(prefill.transport.comm.hub)
    sent = sum(1 for op, *_, dim in prefill.transport.comm.hub.log if op == "send" and dim == 5)
    assert prefill.transport.layer_messages == decode.transport.layer_messages == \
        {"pair 0-1": sent} and sent > 0


def test_the_pair_group_detector_trips_on_layers_sent_on_the_world_group(model):
    """Proof that the check above can fail: connectors without ``data_groups`` put their
    layers on the world group (the same tokens: only the group differs)."""
    done, engines = drive(model, data_groups=False)
    assert done == colocated(model)
    hub = engines[0].kv_connector.transport.comm.hub
    with pytest.raises(AssertionError, match="None"):
        assert_layers_on_the_pair_group(hub)
    assert set(engines[0].kv_connector.transport.layer_messages) == {"world"}


def test_bad_data_paths_are_refused(model):
    with pytest.raises(ValueError, match="data_backend must be one of"):
        P2PTransport(0, data_backend="mpi")
    with pytest.raises(ValueError, match="transport must be a P2PTransport"):
        P2PConnector("kv_producer", 0)
    hub = Hub()
    engines = [LLMEngine(model, None, CACHE, attn_impl="torch", design="v1",
                         kv_connector=P2PConnector(ROLES[r], P2PTransport(
                             r, comm=Loopback(hub, r), **kw)))
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


def peers_alive(engines: list[LLMEngine]) -> bool:
    return all(t.dead is None for e in engines for t in e.kv_connector.transport._peers.values())


def test_one_failed_layer_send_fails_that_transfer_only(model):
    """The prefill side's third layer message raises once: that request's load fails and it
    is computed on the decode side, the pair stays up (nobody is marked dead, nobody waits for
    a layer that never comes), and the next transfers move their blocks as usual."""
    done, engines = drive(model, transport_kw={0: {"fail_layer_send": 3}})
    assert done == colocated(model)
    assert_clean(engines)
    prefill, decode = (e.kv_connector for e in engines)
    assert prefill.num_failed_sends == decode.num_failed_recvs == 1
    assert peers_alive(engines)
    assert decode.num_recv_blocks == prefill.num_sent_blocks > 0      # the others went through
    assert prefill.transport.layer_messages == decode.transport.layer_messages


def test_the_failed_send_detector_trips_on_a_pair_marked_dead(model):
    """Proof that the check above can fail: a failure that takes the pair down (what every
    failed send did before the trailer) shows as a dead peer."""
    done, engines = drive(model, transport_kw={0: {"fail_layer_send": 3}})
    engines[0].kv_connector.transport._peers[1].dead = "ConnectionError: gone"
    assert not peers_alive(engines)


def test_a_transfer_that_takes_too_long_fails_and_the_request_is_recomputed(model, monkeypatch):
    """The prefill side stops answering for a while (its first answer 1 s late): the decode
    side gives up on that load after its transfer_timeout_s, computes the request itself, and
    the late layers are not copied; the pair then goes on (the later loads arrive)."""
    send_work, slept = P2PTransport._send_work, []

    def slow_first(self, t):
        if not slept:
            slept.append(t.request_id)
            time.sleep(1.0)
        send_work(self, t)
    monkeypatch.setattr(P2PTransport, "_send_work", slow_first)
    done, engines = drive(model, connector_kw={1: {"transfer_timeout_s": 0.2}})
    assert done == colocated(model)
    assert_clean(engines)
    prefill, decode = (e.kv_connector for e in engines)
    assert slept and decode.num_failed_recvs >= 1      # (and the loads queued behind it)
    assert peers_alive(engines)


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
def test_a_fault_in_any_step_call_is_recovered(model, monkeypatch, cls, name):
    """Each call a step makes into the connector (or that the connector's reports make),
    faulted at its first and a middle call: the step is recovered by recompute (the
    connector reset), and the run ends as the clean one (a fault that repeats would blame
    one request: ``"error"``, the others unchanged)."""
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


# ---------------------------------------------------------------- a reset mid-transfer
def p2p_state(conn: P2PConnector) -> tuple:
    """Everything the connector holds for requests and steps (the loads to start as
    ``(seq id, remote request id, block ids)``: a release has none)."""
    return (dict(conn._lookup), dict(conn._reqs_to_send), list(conn._reqs_to_recv),
            list(conn._reqs_to_drop), conn._built, conn._bound, dict(conn._held),
            list(conn._asked), set(conn._sending), list(conn._released),
            [(s.seq_id, s.remote_request_id, s.block_ids) for s in conn._to_start],
            set(conn._recving), set(conn._load_errors), conn.has_connector_metadata(),
            set(conn._abandoned))


def step(engine: LLMEngine, check: bool = True) -> list:
    try:
        outs = engine.step()
    except StepFailed:
        outs = []
    if check:
        engine.check_invariants()
    return outs


def prefill_requests(prefill: LLMEngine, rids) -> dict[int, dict]:
    """The prefill of requests ``rids``: their ``kv_transfer_params``, once they finished."""
    for rid in rids:
        prefill.add_request(PROMPTS[rid], replace(PARAMS[rid], max_tokens=1), request_id=rid,
                            kv_transfer_params={"do_remote_decode": True})
    params: dict[int, dict] = {}
    while len(params) < len(rids):
        params.update((o.request_id, o.kv_transfer_params) for o in step(prefill))
    return params


def fault_next_call(monkeypatch, conn: P2PConnector, name: str) -> None:
    """The next call of ``conn.name`` (this engine's alone) raises; later ones do not."""
    real, struck = getattr(conn, name), []

    def faulty(*args, **kwargs):
        if not struck:
            struck.append(name)
            raise RuntimeError(f"fault injected in {name}")
        return real(*args, **kwargs)
    monkeypatch.setattr(conn, name, faulty)


def reset_twice(monkeypatch, conn: P2PConnector, reset) -> list[tuple]:
    """The engine's recovery calls ``reset`` twice on ``conn`` (a recovery run again); the
    connector's state after each call."""
    states: list[tuple] = []

    def twice() -> None:
        for _ in range(2):
            reset(conn)
            states.append(p2p_state(conn))
    monkeypatch.setattr(conn, "reset_cache", twice)
    return states


def finish(prefill: LLMEngine, decode: LLMEngine, rids: set[int], max_loops: int,
           check: bool = True) -> dict[int, list[int]]:
    """Both processes' loops until the decode engine answered ``rids`` and neither engine has
    anything left to do (or ``max_loops``); the decode engine's tokens."""
    done: dict[int, list[int]] = {}
    for _ in range(max_loops):
        for engine in (prefill, decode):
            engine.kv_connector.serve_transfers()
            if engine.has_unfinished_requests() or engine.kv_connector.busy():
                for out in step(engine, check):
                    if engine is decode:
                        done[out.request_id] = out.outputs[0].token_ids
        if set(done) >= rids and not any(e.has_unfinished_requests() or e.kv_connector.busy()
                                         for e in (prefill, decode)):
            break
        time.sleep(0.0005)
    return done


def decode_reset_run(model, monkeypatch, reset=P2PConnector.reset_cache, max_loops=3000):
    """The decode engine fails a step, and recovers, while request 0's load is under way (its
    read request left) and request 1 waits for its blocks (its read request not sent)."""
    prefill, decode = make_pair(model)
    params = prefill_requests(prefill, (0, 1))
    decode.add_request(PROMPTS[0], PARAMS[0], request_id=0, kv_transfer_params=params[0])
    step(decode)                                  # request 0 waits for its blocks
    decode.kv_connector.serve_transfers()         # its read request leaves
    decode.add_request(PROMPTS[1], PARAMS[1], request_id=1, kv_transfer_params=params[1])
    states = reset_twice(monkeypatch, decode.kv_connector, reset)
    fault_next_call(monkeypatch, decode.kv_connector, "get_finished")
    waiting = step(decode) or decode.scheduler.waiting    # request 1 planned, then the fault
    assert len(states) == 2 and waiting                   # recovered: both wait again
    return finish(prefill, decode, {0, 1}, max_loops), prefill, decode, params, states


def test_a_decode_side_reset_releases_the_remote_blocks_and_recomputes(model, monkeypatch):
    want = colocated(model)
    done, prefill, decode, params, states = decode_reset_run(model, monkeypatch)
    # right after the reset: nothing but the release of request 1 (decode seq 1), whose read
    # request never left; request 0's load under way let go; both abandoned (computed here);
    # a second reset the same
    assert states[0] == ({}, {}, [], [], None, None, {}, [], set(), [],
                         [(1, params[1]["remote_request_id"], [])], set(), set(), False,
                         {0, 1})
    assert states[1] == states[0]
    assert done == {0: want[0], 1: want[1]}
    conn = decode.kv_connector
    assert conn.num_recv_blocks == 0 and conn.num_failed_recvs == 0     # computed here
    assert_clean([prefill, decode])                  # the prefill side freed both requests
    assert prefill.kv_connector.num_aborted == 0     # freed at once, not by the timeout


def test_the_decode_reset_detector_trips_on_a_reset_that_forgets_the_release(model,
                                                                             monkeypatch):
    """Proof that the test above can fail: a reset that drops the read request not sent
    instead of releasing it leaves the prefill side holding request 1's blocks (until its
    abort timeout, 120 s)."""
    def forgets(conn: P2PConnector) -> None:
        P2PConnector.reset_cache(conn)
        conn._to_start = []

    done, prefill, decode, _, _ = decode_reset_run(model, monkeypatch, forgets, max_loops=400)
    assert done == {r: t for r, t in colocated(model).items() if r in (0, 1)}
    assert prefill.kv_connector.num_held_requests == 1
    with pytest.raises(AssertionError):
        assert_clean([prefill])


def wait_for_read_requests(prefill: LLMEngine, n: int) -> None:
    transport = prefill.kv_connector.transport
    for _ in range(2000):
        with transport._lock:
            if len(transport._inbox) >= n:
                return
        time.sleep(0.005)
    raise TimeoutError("the read request did not arrive")


def prefill_reset_run(model, monkeypatch, reset=P2PConnector.reset_cache, check=True):
    """The prefill engine holds both requests' blocks; request 0's read request has arrived,
    unanswered, request 1's is still to come; the prefill engine fails a step and recovers."""
    prefill, decode = make_pair(model)
    params = prefill_requests(prefill, (0, 1))
    step(prefill)                                 # both held from this step on
    assert prefill.kv_connector.num_held_requests == 2
    decode.add_request(PROMPTS[0], PARAMS[0], request_id=0, kv_transfer_params=params[0])
    step(decode)
    decode.kv_connector.serve_transfers()
    wait_for_read_requests(prefill, 1)
    states = reset_twice(monkeypatch, prefill.kv_connector, reset)
    fault_next_call(monkeypatch, prefill.kv_connector, "get_finished")
    step(prefill, check)
    assert len(states) == 2
    decode.add_request(PROMPTS[1], PARAMS[1], request_id=1, kv_transfer_params=params[1])
    return finish(prefill, decode, {0, 1}, 3000, check), prefill, decode, states


def test_a_prefill_side_reset_fails_the_reads_and_the_decode_side_recomputes(model,
                                                                            monkeypatch):
    want = colocated(model)
    done, prefill, decode, states = prefill_reset_run(model, monkeypatch)
    # right after the reset: nothing held; the read request stays in the transport's inbox,
    # to be answered; a second reset the same
    assert states[0] == ({}, {}, [], [], None, None, {}, [], set(), [], [], set(), set(),
                         False, set())
    assert states[1] == states[0]
    assert done == {0: want[0], 1: want[1]}
    hub = prefill.kv_connector.transport.comm.hub
    assert prefill.kv_connector.num_sent_blocks == 0 and not any(
        op == "send" and src == 0 and dim == 5 for op, src, _, _, dim in hub.log)
    conn = decode.kv_connector
    assert conn.num_failed_recvs == 2 and conn.num_recv_blocks == 0   # told: gone
    assert_clean([prefill, decode])


def test_the_prefill_reset_detector_trips_on_a_reset_that_keeps_the_held_blocks(model,
                                                                                monkeypatch):
    """Proof that the test above can fail: a reset that keeps the held requests breaks the
    prefill engine's invariants (held requests whose blocks the rebuilt pool does not keep),
    and, unchecked, sends them from the rebuilt pool's blocks."""
    def keeps(conn: P2PConnector) -> None:
        held = dict(conn._held)
        P2PConnector.reset_cache(conn)
        conn._held = held

    with pytest.raises(AssertionError, match="have no blocks kept"):
        prefill_reset_run(model, monkeypatch, keeps)
    _, prefill, decode, _ = prefill_reset_run(model, monkeypatch, keeps, check=False)
    assert prefill.kv_connector.num_sent_blocks > 0 and decode.kv_connector.num_failed_recvs < 2


# ------------------------------------------------------- kv_transfer_params, at the door
GOOD_DECODE = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": 0,
               "remote_request_id": 3, "remote_block_ids": [0, 1, 2]}


@pytest.mark.parametrize("engine, params, match", [
    (1, {"do_remote_prefill": True}, r"'remote_engine_id' must be the rank of a prefill "
                                     r"engine \(one of \[0\]\), got None"),
    (1, {**GOOD_DECODE, "remote_engine_id": "0"}, r"'remote_engine_id' .* got '0'"),
    (1, {**GOOD_DECODE, "remote_engine_id": 1}, r"'remote_engine_id' .* got 1"),   # itself
    (1, {**GOOD_DECODE, "remote_engine_id": True}, r"'remote_engine_id' .* got True"),
    (1, {**GOOD_DECODE, "remote_request_id": 1.5}, r"'remote_request_id' must be an int in "
                                                   r"\[0, 2\*\*63\), got 1.5"),
    (1, {**GOOD_DECODE, "remote_request_id": None}, r"'remote_request_id' .* got None"),
    (1, {**GOOD_DECODE, "remote_block_ids": "012"}, r"'remote_block_ids' must be a list of "
                                                    r"block ids"),
    (1, {**GOOD_DECODE, "remote_block_ids": [0, -1]}, r"'remote_block_ids' must be a list .*"
                                                      r"item 1 is -1"),
    (1, {**GOOD_DECODE, "remote_block_ids": []}, r"'remote_block_ids' must be a list of "
                                                 r"block ids \(ints >= 0, at least one\), "
                                                 r"got \[\]$"),
    (1, {**GOOD_DECODE, "do_remote_prefill": "yes"}, r"'do_remote_prefill' must be a bool"),
    (1, {"do_remote_decode": True}, r"a decode engine \(kv_consumer\) sends no blocks: "
                                    r"'do_remote_decode' must be False"),
    (0, {"do_remote_decode": 1}, r"'do_remote_decode' must be a bool, got 1"),
    (0, GOOD_DECODE, r"a prefill engine \(kv_producer\) loads no blocks: 'do_remote_prefill' "
                     r"must be False"),
    (0, {"do_remote_decode": True, "remote_hots": "x"}, r"kv_transfer_params has \['remote_"
                                                        r"hots'\]; P2PConnector reads"),
])
def test_kv_transfer_params_are_checked_field_by_field_for_the_role(model, engine, params,
                                                                     match):
    """The issue's repro first: a decode engine used to accept ``do_remote_prefill`` without
    the ids of the blocks to load; its next ``schedule()`` raised in
    ``update_state_after_alloc``, the recovery found no culprit, and every later step raised
    ``StepFailed`` (one request denied service to all). Now each field the connector will read
    for its role is checked at ``add_request``, and nothing is queued."""
    engines = make_pair(model)
    with pytest.raises(ValueError, match=match):
        engines[engine].add_request(PROMPTS[0], PARAMS[0], kv_transfer_params=params)
    assert not engines[engine].has_unfinished_requests()
    assert not engines[engine].kv_connector.busy()


def test_kv_transfer_params_take_numbers_by_value_and_are_copied(model):
    """numpy ids (what a proxy that kept them in an array hands on) are plain ints inside, and
    the engine keeps its own copy: the caller's dict changed later changes nothing."""
    import numpy as np

    prefill, decode = make_pair(model)
    given = {"do_remote_prefill": np.bool_(True), "remote_engine_id": np.int64(0),
             "remote_request_id": np.int32(3), "remote_block_ids": np.array([4, 5])}
    decode.add_request(PROMPTS[0], PARAMS[0], request_id=9, kv_transfer_params=given)
    kept = decode._requests[9].seqs[0].kv_transfer_params
    assert kept == {"do_remote_prefill": True, "remote_engine_id": 0, "remote_request_id": 3,
                    "remote_block_ids": [4, 5]}
    assert [type(kept[k]) for k in ("do_remote_prefill", "remote_engine_id",
                                    "remote_request_id")] == [bool, int, int]
    given["remote_engine_id"] = 7
    assert kept["remote_engine_id"] == 0
    assert decode.abort_request(9)
    assert [o.finish_reason for o in decode.step()] == ["abort"]
