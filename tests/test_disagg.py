"""Prefill/decode disaggregation on real processes (issue 24, items 3 and 5):
``course_lib/parallel/disagg.py`` (the processes and the proxy) over
``course_lib/engine/p2p_connector.py`` (the KV connector: control on the gloo world group,
the K/V on a group per (prefill, decode) pair).

Each test starts its engines as processes (seconds each: every one imports torch and loads the
model), so the cases are few and each checks much: tokens identical to one colocated engine,
every block back in every surviving pool, the layers on the pairs' groups, no process left
behind. The CPU tests pass ``device="cpu"`` (the default, ``"auto"``, would take a GPU where
there is one); the CUDA tests at the end skip without GPUs."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal

import pytest
import torch

from course_lib.config import CacheConfig
from course_lib.engine.llm_engine import LLMEngine
from course_lib.model.loader import load_tiny_model
from course_lib.parallel.disagg import DisaggCluster, data_backend_for, resolve_device
from course_lib.sequence import SamplingParams

pytestmark = pytest.mark.ch13

torch.set_num_threads(1)

CACHE = CacheConfig(block_size=16, num_gpu_blocks=256, enable_prefix_caching=True)
IMPL = "torch"           # the same attention on both sides of every comparison


def _prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    """``n`` prompts of 20-70 tokens; the first ``shared`` tokens common to all."""
    rng = random.Random(seed)
    head = [1] + [rng.randrange(3, 200) for _ in range(shared)]
    return [head + [rng.randrange(3, 200) for _ in range(rng.randrange(20, 70))]
            for _ in range(n)]


def _colocated(prompts, params, device: str = "cpu") -> list[list[int]]:
    engine = LLMEngine(load_tiny_model(device=device), None, CACHE, attn_impl=IMPL,
                       design="v1")
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


def _no_leak(stats: dict) -> None:
    for rank, s in stats.items():
        assert s["num_free_blocks"] == s["num_gpu_blocks"], (rank, s)
        assert s["num_delayed_frees"] == 0 and s["num_held_requests"] == 0, (rank, s)


def _layers_on_pair_groups(stats: dict, prefill: list[int], decode: list[int]) -> None:
    """Each engine's pair groups are the two ranks alone (as torch.distributed reports them),
    its layer messages went on them and on nothing else, and each pair moved as many layer
    messages on the prefill side as on the decode side."""
    for p in prefill:
        for d in decode:
            pair = f"pair {p}-{d}"
            assert stats[p]["data_groups"][d] == stats[d]["data_groups"][p] == [p, d]
            assert stats[p]["layer_messages"].get(pair) == stats[d]["layer_messages"].get(pair)
    for rank in prefill + decode:
        peers = decode if rank in prefill else prefill
        assert set(stats[rank]["data_groups"]) == set(peers), stats[rank]
        assert set(stats[rank]["layer_messages"]) <= \
            {f"pair {min(rank, q)}-{max(rank, q)}" for q in peers}, stats[rank]
        assert "world" not in stats[rank]["layer_messages"]


def _our_processes() -> list:
    return [p for p in mp.active_children() if p.name.startswith(("kv_producer", "kv_consumer"))]


GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234)


def test_1p1d_matches_one_engine_and_frees_prefill_blocks_after_the_send():
    prompts = _prompts(5, seed=1, shared=40)       # a shared prefix: local hits on both sides
    with DisaggCluster(1, 1, cache_config=CACHE, attn_impl=IMPL, device="cpu") as cluster:
        assert cluster.data_backend == "gloo" and cluster.data_path() == "gloo (CPU memory)"
        # one request, stopped between its prefill and its decode: the prefill side holds it
        rid = cluster.submit(prompts[0], GREEDY, pause_after_prefill=True)
        cluster.wait([rid], prefilled=True)
        held = cluster.stats()[0]
        assert held["num_held_requests"] == 1 and held["num_delayed_frees"] == 1
        blocks = len(cluster.routes[rid].kv_transfer_params["remote_block_ids"])
        assert held["num_free_blocks"] == held["num_gpu_blocks"] - blocks   # still held
        cluster.resume(rid)
        first = cluster.wait([rid])[0]
        outs = cluster.generate(prompts[1:], [GREEDY, SEEDED, GREEDY, SEEDED])
        stats = cluster.settle()
        _no_leak(stats)
        assert stats[0]["num_sent_blocks"] == stats[1]["num_recv_blocks"] > 0
        assert stats[0]["num_failed_sends"] == stats[1]["num_failed_recvs"] == 0
        assert [(s["device"], s["data_backend"]) for s in stats.values()] == [("cpu", "gloo")] * 2
        _layers_on_pair_groups(stats, [0], [1])
        assert stats[0]["layer_messages"]["pair 0-1"] > 0
        hops = [(h.where, h.what) for h in cluster.timeline(rid)]
        order = [("prefill 0", "prefill done, first token sampled"),
                 ("decode 0", "read request"), ("prefill 0", "send"),
                 ("prefill 0", "sent, blocks freed"), ("decode 0", "finished")]
        assert [h for h in hops if h in order] == order, hops
        assert hops.index(("decode 0", "loaded")) < hops.index(("decode 0", "finished"))
    assert not _our_processes()
    want = _colocated(prompts, [GREEDY, GREEDY, SEEDED, GREEDY, SEEDED])
    assert [first.outputs[0].token_ids] + [o.outputs[0].token_ids for o in outs] == want


def test_2p1d_spreads_prefills_and_matches_one_engine():
    prompts = _prompts(6, seed=2)
    with DisaggCluster(2, 1, cache_config=CACHE, attn_impl=IMPL, device="cpu") as cluster:
        outs = cluster.generate(prompts, SEEDED)
        stats = cluster.settle()
        _no_leak(stats)
        _layers_on_pair_groups(stats, [0, 1], [2])
        assert set(stats[2]["layer_messages"]) == {"pair 0-2", "pair 1-2"}
        assert stats[0]["num_sent_blocks"] > 0 and stats[1]["num_sent_blocks"] > 0
        assert stats[2]["num_recv_blocks"] == stats[0]["num_sent_blocks"] + \
            stats[1]["num_sent_blocks"]
        assert {cluster.routes[o.request_id].prefill for o in outs} == {0, 1}
    assert [o.outputs[0].token_ids for o in outs] == _colocated(prompts, SEEDED)


@pytest.mark.parametrize("field, value, said", [
    ("block_size", 8, "block_size: 16 vs 8"),
    ("dtype", "float64", "differ in dtype: float32 vs float64")])
def test_engines_that_cannot_exchange_blocks_are_refused_at_connect_time(field, value, said):
    with pytest.raises(ValueError, match=said):
        DisaggCluster(1, 1, cache_config=CACHE, attn_impl=IMPL, device="cpu",
                      overrides={1: {field: value}})
    assert not _our_processes()


def test_a_prefill_engine_killed_mid_transfer_costs_a_recompute_not_a_request():
    prompts = _prompts(6, seed=3)
    # rank 0 exits once its first send has put one layer on the wire
    with DisaggCluster(2, 1, cache_config=CACHE, attn_impl=IMPL, device="cpu",
                       overrides={0: {"exit_after_layers": 1}}) as cluster:
        outs = cluster.generate(prompts, SEEDED)
        assert list(cluster.dead) == [0]
        stats = cluster.settle()
        _no_leak(stats)                                  # the survivors hold nothing
        assert stats[2]["num_failed_recvs"] >= 1         # the decode side recomputed
    assert not _our_processes()
    assert all(o.finish_reason == "length" for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == _colocated(prompts, SEEDED)


def test_a_decode_engine_killed_mid_transfer():
    prompts = _prompts(4, seed=4)
    # alone: its requests fail, each alone, and the prefill side frees what it held for them
    with DisaggCluster(1, 1, cache_config=CACHE, attn_impl=IMPL, device="cpu",
                       overrides={1: {"exit_after_layers": 1}}) as cluster:
        outs = cluster.generate(prompts, GREEDY)
        assert list(cluster.dead) == [1]
        assert {o.finish_reason for o in outs} == {"error"}
        assert all("decode 0 (rank 1) died" in o.finish_detail for o in outs)
        stats = cluster.settle()
        _no_leak(stats)
        assert stats[0]["num_failed_sends"] == 1 and stats[0]["num_aborted"] == len(prompts) - 1
    assert not _our_processes()
    # beside another decode engine: its requests are sent there and recomputed
    with DisaggCluster(1, 2, cache_config=CACHE, attn_impl=IMPL, device="cpu",
                       overrides={1: {"exit_after_layers": 1}}) as cluster:
        outs = cluster.generate(prompts, GREEDY)
        assert list(cluster.dead) == [1]
        _no_leak(cluster.settle())
    assert not _our_processes()
    assert [o.outputs[0].token_ids for o in outs] == _colocated(prompts, GREEDY)


def test_a_prefill_engine_that_stops_answering_is_fenced_and_its_requests_rerouted():
    """A prefill engine stopped (SIGSTOP: alive, silent) while it holds a prefilled request
    and has more in its pipe: within its lease the proxy kills it, the decode engine's read
    request waiting on it fails (its connection closed) and that request is recomputed, the
    requests it never started go to the other prefill engine; every request ends with the
    colocated engine's tokens, nothing is held, no process is left."""
    prompts = _prompts(6, seed=5)
    with DisaggCluster(2, 1, cache_config=CACHE, attn_impl=IMPL, device="cpu",
                       lease_s=4.0, timeout_s=60) as cluster:
        first = cluster.submit(prompts[0], SEEDED, pause_after_prefill=True)
        cluster.wait([first], prefilled=True)
        stopped = cluster.routes[first].prefill
        os.kill(cluster._procs[stopped].pid, signal.SIGSTOP)
        cluster.resume(first)                      # its blocks are on the stopped engine
        rest = [cluster.submit(p, SEEDED) for p in prompts[1:]]   # some of them too
        outs = cluster.wait([first, *rest])
        assert list(cluster.dead) == [stopped]
        assert "stopped answering" in cluster.dead[stopped]
        stats = cluster.settle()
        _no_leak(stats)
        assert stats[2]["num_failed_recvs"] >= 1            # the first one, recomputed
        assert {cluster.routes[r].prefill for r in rest} == {1 - stopped}
    assert not _our_processes()
    assert [o.outputs[0].token_ids for o in outs] == _colocated(prompts, SEEDED)


def test_one_failed_send_fails_one_transfer_and_the_pair_goes_on():
    """Rank 0's second layer send fails once: that request is recomputed by the decode
    engine, the next ones move their blocks over the same pair, no engine is lost."""
    prompts = _prompts(5, seed=6)
    with DisaggCluster(1, 1, cache_config=CACHE, attn_impl=IMPL, device="cpu",
                       overrides={0: {"fail_layer_send": 2}}, timeout_s=60) as cluster:
        outs = [cluster.generate([p], GREEDY)[0] for p in prompts]    # one after another
        assert not cluster.dead
        stats = cluster.settle()
        _no_leak(stats)
        assert stats[0]["num_failed_sends"] == stats[1]["num_failed_recvs"] == 1
        assert stats[1]["num_recv_blocks"] == stats[0]["num_sent_blocks"] > 0
    assert not _our_processes()
    assert [o.outputs[0].token_ids for o in outs] == _colocated(prompts, GREEDY)


def test_bad_deployments_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="num_prefill"):
        DisaggCluster(0, 1)
    with pytest.raises(ValueError, match="num_decode"):
        DisaggCluster(1, 9)
    with pytest.raises(ValueError, match="the ranks are 0..1"):
        DisaggCluster(1, 1, overrides={5: {"block_size": 8}})
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        DisaggCluster(1, 1, cache_config=CacheConfig(enable_prefix_caching=False))
    with pytest.raises(ValueError, match=r"device must be one of \('cpu', 'cuda', 'auto'\), "
                                         "got 'gpu'"):
        DisaggCluster(1, 1, device="gpu")
    with pytest.raises(ValueError, match="device must be one of"):
        DisaggCluster(1, 1, overrides={1: {"device": "tpu"}})
    assert not _our_processes()


@pytest.mark.parametrize("overrides, said", [
    ({0: {"kv_role": "kv_consumer"}}, r"overrides\[0\] names \['kv_role'\]"),
    ({1: {"rank": 0}}, r"overrides\[1\] names \['rank'\]"),
    ({0: {"bogus": 1}}, r"names \['bogus'\]; an override may change"),
    ({0: {"dtype": "int8"}},
     r"dtype must be one of \('float32', 'float64', 'float16', 'bfloat16'\)"),
    ({0: {"attn_impl": "flash"}}, r"attn_impl must be one of"),
    ({0: {"exit_after_layers": "x"}}, r"exit_after_layers must be None or an int >= 1"),
    ({0: {"exit_after_layers": 0}}, r"exit_after_layers must be None or an int >= 1"),
    ({1: {"pair_timeout_s": -1}}, r"pair_timeout_s must be a number of seconds > 0"),
    ({1: {"abort_timeout_s": True}}, r"abort_timeout_s must be a number of seconds > 0"),
    ({1: {"scheduler_config": {}}}, r"scheduler_config must be None or a SchedulerConfig"),
    ({1: "fast"}, r"overrides\[1\] must be a dict"),
])
def test_bad_overrides_are_refused_before_any_process_starts(overrides, said):
    """A rank given another rank or role would start and never find its peers (it hung until
    the start timeout); a bad dtype or fault failed only inside the process, or not at all."""
    with pytest.raises(ValueError, match=said):
        DisaggCluster(1, 1, overrides=overrides)
    with pytest.raises(ValueError, match="attn_impl must be one of"):
        DisaggCluster(1, 1, attn_impl="flash")
    assert not _our_processes()


def test_cuda_without_cuda_is_refused_before_any_process_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda' but CUDA is not available"):
        DisaggCluster(1, 1, device="cuda")
    assert resolve_device("auto") == "cpu"
    assert not _our_processes()


@pytest.mark.parametrize("devices, gpus, backend", [
    (["cuda", "cuda"], 2, "nccl"), (["cuda", "cuda", "cuda"], 2, "gloo"),   # a GPU per rank
    (["cuda", "cpu"], 8, "gloo"), (["cpu", "cpu"], 8, "gloo")])
def test_nccl_only_with_a_gpu_per_engine(monkeypatch, devices, gpus, backend):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert data_backend_for(devices) == backend


# ------------------------------------------------------------ on GPUs (skipped without)
CUDA_PARAMS = [GREEDY, SEEDED] * 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_1p1d_on_cuda_matches_one_engine_on_the_gpu():
    """Engines on CUDA (rank r on cuda:(r % device_count)); with one GPU the layers are
    staged through CPU memory on gloo, with two or more they go GPU to GPU on NCCL."""
    prompts = _prompts(4, seed=5, shared=20)
    gpus = torch.cuda.device_count()
    with DisaggCluster(1, 1, cache_config=CACHE, attn_impl=IMPL, device="cuda") as cluster:
        outs = cluster.generate(prompts, CUDA_PARAMS)
        stats = cluster.settle()
        _no_leak(stats)
        backend = "nccl" if gpus >= 2 else "gloo"
        assert cluster.data_backend == backend
        assert [(s["device"], s["data_backend"]) for s in stats.values()] == \
            [("cuda:0", backend), (f"cuda:{1 % gpus}", backend)]
        assert stats[0]["num_sent_blocks"] == stats[1]["num_recv_blocks"] > 0
        _layers_on_pair_groups(stats, [0], [1])
    assert not _our_processes()
    assert [o.outputs[0].token_ids for o in outs] == _colocated(prompts, CUDA_PARAMS, "cuda:0")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL)")
def test_1p1d_over_nccl_and_a_prefill_engine_killed_mid_transfer():
    """NCCL between two GPUs; then the prefill engine dies after one layer of a request's
    transfer: NCCL does not notice, the decode side's receive times out (``pair_timeout_s``,
    blocking wait), the load fails and the decode engine computes the prompt itself: the same
    tokens."""
    prompts = _prompts(4, seed=6)
    want = _colocated(prompts, CUDA_PARAMS, "cuda:0")
    with DisaggCluster(1, 1, cache_config=CACHE, attn_impl=IMPL, device="cuda") as cluster:
        assert cluster.data_backend == "nccl" and cluster.data_path() == "nccl (GPU to GPU)"
        outs = cluster.generate(prompts, CUDA_PARAMS)
        stats = cluster.settle()
        _no_leak(stats)
        _layers_on_pair_groups(stats, [0], [1])
        assert stats[1]["layer_messages"]["pair 0-1"] > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    with DisaggCluster(1, 1, cache_config=CACHE, attn_impl=IMPL, device="cuda",
                       overrides={0: {"exit_after_layers": 1},
                                  1: {"pair_timeout_s": 10.0}}) as cluster:
        # one request: with the only prefill engine dead, a request not yet prefilled fails
        out = cluster.generate(prompts[:1], CUDA_PARAMS[:1])[0]
        assert list(cluster.dead) == [0]
        stats = cluster.settle()
        _no_leak(stats)
        assert stats[1]["num_failed_recvs"] == 1
    assert not _our_processes()
    assert out.outputs[0].token_ids == want[0]
