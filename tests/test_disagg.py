"""Prefill/decode disaggregation on real processes (issue 24, items 3 and 5):
``course_lib/parallel/disagg.py`` (the processes and the proxy) over
``course_lib/engine/p2p_connector.py`` (the KV connector, torch.distributed with gloo).

Each test starts its engines as processes (seconds each: every one imports torch and loads the
model), so the cases are few and each checks much: tokens identical to one colocated engine,
every block back in every surviving pool, no process left behind."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest
import torch

from course_lib.config import CacheConfig
from course_lib.engine.llm_engine import LLMEngine
from course_lib.model.loader import load_tiny_model
from course_lib.parallel.disagg import DisaggCluster
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


def _colocated(prompts, params) -> list[list[int]]:
    engine = LLMEngine(load_tiny_model(), None, CACHE, attn_impl=IMPL, design="v1")
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


def _no_leak(stats: dict) -> None:
    for rank, s in stats.items():
        assert s["num_free_blocks"] == s["num_gpu_blocks"], (rank, s)
        assert s["num_delayed_frees"] == 0 and s["num_held_requests"] == 0, (rank, s)


def _our_processes() -> list:
    return [p for p in mp.active_children() if p.name.startswith(("kv_producer", "kv_consumer"))]


GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234)


def test_1p1d_matches_one_engine_and_frees_prefill_blocks_after_the_send():
    prompts = _prompts(5, seed=1, shared=40)       # a shared prefix: local hits on both sides
    with DisaggCluster(1, 1, cache_config=CACHE, attn_impl=IMPL) as cluster:
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
    with DisaggCluster(2, 1, cache_config=CACHE, attn_impl=IMPL) as cluster:
        outs = cluster.generate(prompts, SEEDED)
        stats = cluster.settle()
        _no_leak(stats)
        assert stats[0]["num_sent_blocks"] > 0 and stats[1]["num_sent_blocks"] > 0
        assert stats[2]["num_recv_blocks"] == stats[0]["num_sent_blocks"] + \
            stats[1]["num_sent_blocks"]
        assert {cluster.routes[o.request_id].prefill for o in outs} == {0, 1}
    assert [o.outputs[0].token_ids for o in outs] == _colocated(prompts, SEEDED)


@pytest.mark.parametrize("field, value, said", [("block_size", 8, "block_size: 16 vs 8"),
                                                ("dtype", "float64", "dtype")])
def test_engines_that_cannot_exchange_blocks_are_refused_at_connect_time(field, value, said):
    with pytest.raises(ValueError, match=said):
        DisaggCluster(1, 1, cache_config=CACHE, attn_impl=IMPL,
                      overrides={1: {field: value}})
    assert not _our_processes()


def test_a_prefill_engine_killed_mid_transfer_costs_a_recompute_not_a_request():
    prompts = _prompts(6, seed=3)
    # rank 0 exits once its first send has put one layer on the wire
    with DisaggCluster(2, 1, cache_config=CACHE, attn_impl=IMPL,
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
    with DisaggCluster(1, 1, cache_config=CACHE, attn_impl=IMPL,
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
    with DisaggCluster(1, 2, cache_config=CACHE, attn_impl=IMPL,
                       overrides={1: {"exit_after_layers": 1}}) as cluster:
        outs = cluster.generate(prompts, GREEDY)
        assert list(cluster.dead) == [1]
        _no_leak(cluster.settle())
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
    assert not _our_processes()
