"""A decode request aborted before it was admitted tells its prefill engine at once.

Its ``request_finished`` is now asked although it holds no block (issue 34: vLLM 0.33.0's
``_free_request`` asks it for every finished request), and the decode side of
``P2PConnector`` answers as NIXL's does (``request_finished`` in ``nixl/pull_scheduler.py``:
an empty read "to avoid stranding the prefill blocks"): the next step's metadata carries a
release (a read request for no block) for the prefill engine's copy. Before issue 34 nothing
was sent, and the prefill engine held the blocks until ``abort_timeout_s`` (120 s)."""

from __future__ import annotations

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.engine.p2p_connector import P2PConnector, RecvSpec
from course_lib.engine.p2p_transport import P2PTransport
from course_lib.scheduler.v1 import SchedulerV1
from course_lib.sequence import SamplingParams
from course_lib.sim.fake_sampler import fake_samples

REMOTE = {"do_remote_prefill": True, "remote_engine_id": 0, "remote_request_id": 5,
          "remote_block_ids": [0, 1, 2]}


def decode_scheduler() -> tuple[SchedulerV1, P2PConnector]:
    conn = P2PConnector("kv_consumer", P2PTransport(1))
    s = SchedulerV1(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64,
                                    max_model_len=256),
                    CacheConfig(8, 64, 0, 0.0, True, "hash"), kv_connector=conn)
    return s, conn


def test_a_decode_request_aborted_while_waiting_releases_the_prefill_blocks():
    s, conn = decode_scheduler()
    s.add_request(0, list(range(10, 30)), SamplingParams(max_tokens=4))    # runs
    s.add_request(1, list(range(40, 60)), SamplingParams(max_tokens=4),
                  kv_transfer_params=conn.check_kv_transfer_params(REMOTE))
    out = s.schedule()                          # max_num_seqs=1: request 1 waits
    s.update(out, fake_samples(out), 0.0)
    assert [q.seq_id for q in s.waiting] == [1]
    assert s.abort_request(1)
    meta = s.schedule().kv_connector_metadata
    assert meta.reqs_to_recv == [RecvSpec(1, 0, 5, 0, [])]      # a release, no block
    assert not meta.reqs_to_drop


def test_a_decode_request_aborted_after_its_load_was_planned_drops_it():
    """Aborted once its blocks were allocated (the load planned): the load is dropped, as
    before, and no second release is planned."""
    s, conn = decode_scheduler()
    s.add_request(1, list(range(40, 60)), SamplingParams(max_tokens=4),
                  kv_transfer_params=conn.check_kv_transfer_params(REMOTE))
    first = s.schedule().kv_connector_metadata           # (its one sequence: seq 0)
    assert [r.seq_id for r in first.reqs_to_recv] == [0] and first.reqs_to_recv[0].block_ids
    assert s.abort_request(1)
    meta = s.schedule().kv_connector_metadata
    assert meta.reqs_to_drop == [0] and not meta.reqs_to_recv
