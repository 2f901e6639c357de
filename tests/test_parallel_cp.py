"""Context-parallel decode on real torch.distributed ranks (gloo on CPU), and the launcher."""

from __future__ import annotations

import os
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course_lib.kernels.reference import paged_attention_ref
from course_lib.parallel.cp_decode import (
    CPCase,
    check_against_single_rank,
    run_case,
    single_rank_decode,
)
from course_lib.parallel.launch import (
    RankFailedError,
    check_world_size,
    failing_worker,
    launch,
    rank_sum_worker,
)
from course_lib.parallel.rank_cache import RankKVCache

pytestmark = pytest.mark.ch09


# ---------------------------------------------------------------- one process

def test_single_rank_answer_equals_the_kernels_paged_reference():
    """The one-rank answer (our partial attention over one paged cache) is the kernels' spec."""
    case = CPCase(dtype="float32", prompt_len=13, num_steps=2)
    got = single_rank_decode(case)
    cache = RankKVCache(case.num_kv_heads, case.head_dim, case.block_size, case.num_gpu_blocks)
    tokens = [case.token(p) for p in range(case.prompt_len + case.num_steps)]
    cache.append(0, list(range(len(tokens))), torch.stack([t[1] for t in tokens]),
                 torch.stack([t[2] for t in tokens]))
    table = torch.tensor([cache.manager.get_block_table(0)])
    q = tokens[-1][0][None]
    want = paged_attention_ref(q, cache.key_cache, cache.value_cache, table,
                               torch.tensor([len(tokens)]), None, case.scale)[0]
    torch.testing.assert_close(got["outputs"][-1], want, rtol=1e-5, atol=1e-5)


def test_rank_cache_keeps_its_block_manager_in_step():
    cache = RankKVCache(2, 4, block_size=4, num_gpu_blocks=3, dtype=torch.float64)
    k = torch.arange(40, dtype=torch.float64).reshape(5, 2, 4)
    cache.append(7, [10, 11, 12, 13, 14], k, -k)
    cache.append(7, [], k[:0], k[:0])
    cache.append(7, [15], k[:1], k[:1])
    assert cache.num_tokens(7) == 6 and len(cache.manager.get_block_table(7)) == 2
    lk, lv = cache.local_kv(7)
    torch.testing.assert_close(lk[:5], k)
    torch.testing.assert_close(lv[:5], -k)
    cache.check_invariants()
    with pytest.raises(ValueError, match="rank 0: no room for 7 more tokens"):
        cache.append(7, list(range(16, 23)), k[:1].expand(7, 2, 4), k[:1].expand(7, 2, 4))
    assert cache.num_tokens(7) == 6     # the failed append changed nothing
    cache.check_invariants()
    cache.free(7)
    assert cache.manager.num_free_gpu_blocks == 3 and cache.num_tokens(7) == 0


def test_placements():
    c = CPCase(prompt_len=10)
    assert [c.rank_of(p, 4) for p in range(12)] == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3]
    i = CPCase(prompt_len=10, placement="interleaved", interleave_size=2)
    assert [i.rank_of(p, 3) for p in range(8)] == [0, 0, 1, 1, 2, 2, 0, 0]
    with pytest.raises(ValueError, match="placement"):
        CPCase(placement="random")


@given(st.integers(1, 60), st.integers(0, 5), st.integers(1, 4),
       st.sampled_from(["contiguous", "interleaved"]), st.integers(1, 8))
def test_placement_partitions_the_tokens(prompt_len, steps, cp, placement, interleave):
    case = CPCase(prompt_len=prompt_len, num_steps=max(steps, 1), placement=placement,
                  interleave_size=interleave)
    n = prompt_len + steps
    owners = [case.rank_of(p, cp) for p in range(n)]
    assert all(0 <= r < cp for r in owners)
    if placement == "contiguous":            # the prompt: ranges in rank order, balanced
        prompt = owners[:prompt_len]
        assert prompt == sorted(prompt)
        sizes = [prompt.count(r) for r in range(cp)]
        assert max(sizes) - min(sizes) <= 1
        assert all(r == cp - 1 for r in owners[prompt_len:])
    else:
        assert all(owners[p] == (p // interleave) % cp for p in range(n))


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), max_size=25),
       st.sampled_from([1, 2, 4]))
def test_rank_cache_stores_what_it_is_given(appends, block_size):
    """Random appends to 3 sequences: every token reads back, the manager stays consistent,
    and a full pool refuses an append without changing anything."""
    cache = RankKVCache(1, 2, block_size, num_gpu_blocks=8, dtype=torch.float64)
    want: dict[int, list[float]] = {0: [], 1: [], 2: []}
    counter = 0
    for seq, n in appends:
        values = [float(counter + i) for i in range(n)]
        k = torch.tensor(values, dtype=torch.float64).reshape(n, 1, 1).expand(n, 1, 2)
        try:
            cache.append(seq, list(range(len(want[seq]), len(want[seq]) + n)), k, -k)
        except ValueError as e:
            assert "no room" in str(e)
        else:
            want[seq].extend(values)
            counter += n
        cache.check_invariants()
        for s, vals in want.items():
            lk, lv = cache.local_kv(s)
            assert lk[:, 0, 0].tolist() == vals and lv[:, 0, 1].tolist() == [-x for x in vals]
            assert cache.positions.get(s, []) == list(range(len(vals)))


def test_a_rank_in_a_one_rank_world_holds_everything():
    r = run_case(CPCase(prompt_len=9, num_steps=2), rank=0, cp_size=1)
    assert r["positions"] == list(range(11)) and r["bytes_sent"] == {"query": 0, "merge": 0}


# ---------------------------------------------------------------- real processes (gloo)

@pytest.mark.slow
def test_cp2_matches_one_rank():
    cases = [CPCase(), CPCase(placement="interleaved", interleave_size=2, dtype="float32",
                              num_heads=8, num_kv_heads=1, prompt_len=30, num_steps=4, seed=3)]
    checks = check_against_single_rank(cases, 2, timeout_s=90)
    assert len(checks) == 4 and all(c.ok for c in checks), [str(c) for c in checks]
    assert checks[0].tokens_per_rank == (10, 14)      # 21 prompt tokens 10 | 11, +3 decoded
    assert checks[2].tokens_per_rank == (18, 16)      # pairs dealt round-robin over 34 tokens
    # bytes on the wire do not depend on the context: q per step, out + LSE(s) per rank per step
    assert checks[0].query_bytes == 3 * 4 * 16 * 8                      # steps x H x d x fp64
    assert checks[0].merge_bytes == 3 * (4 * 16 + 2 * 4) * 8            # all_reduce: max + sum
    assert checks[1].merge_bytes == 3 * (4 * 16 + 4) * 8                # all_gather: out + lse


@pytest.mark.slow
def test_cp4_matches_one_rank_even_with_empty_ranks():
    cases = [CPCase(prompt_len=2, num_steps=3, seed=1),          # ranks 0 and 2 hold nothing
             CPCase(placement="interleaved", interleave_size=4, dtype="float32",
                    prompt_len=37, num_steps=2, seed=2)]
    checks = check_against_single_rank(cases, 4, timeout_s=90)
    assert all(c.ok for c in checks), [str(c) for c in checks]
    assert checks[0].tokens_per_rank == (0, 1, 0, 4)
    assert sum(checks[2].tokens_per_rank) == 39
    assert "match" in str(checks[0])


def test_a_wrong_merge_would_be_caught():
    """The comparison can fail: a check whose ranks disagree or differ is not ok."""
    from course_lib.parallel.cp_decode import CPCheck

    assert not CPCheck(CPCase(), 2, "all_reduce", 1e-3, (1, 1), True).ok
    assert not CPCheck(CPCase(), 2, "all_reduce", 0.0, (1, 1), False).ok
    assert "MISMATCH" in str(CPCheck(CPCase(), 2, "all_reduce", 1e-3, (1, 1), True))


# ---------------------------------------------------------------- failures never hang

@pytest.mark.parametrize("world_size", [0, 9, -1, 2.0, True])
def test_wrong_world_size_is_refused_before_launching(world_size):
    with pytest.raises(ValueError, match="world_size must be an integer"):
        launch(rank_sum_worker, world_size, backend="gloo")


def test_nccl_needs_a_gpu_per_rank():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(ValueError, match="CUDA GPU"):
        check_world_size(2, "nccl")


def test_a_worker_defined_in_main_is_refused():
    def local(rank, world_size):
        return rank
    with pytest.raises(ValueError, match="module-level"):
        launch(local, 2)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failing_rank_is_reported_not_hung(how):
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank \d of 2"):
        launch(failing_worker, 2, (1, how), timeout_s=60)
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_a_hanging_rank_hits_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="did not finish within 4"):
        launch(failing_worker, 2, (1, "hang"), timeout_s=4)
    assert time.monotonic() - t0 < 4 + 15


@pytest.mark.gpu
def test_nccl_when_gpus_are_present():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    assert [r["sum"] for r in launch(rank_sum_worker, 2)] == [1, 1]
    checks = check_against_single_rank([CPCase(dtype="float32")], 2)
    assert all(c.ok for c in checks)


# ------------------------------------------------------------------------ no orphans
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"      # a zombie is dead
    except FileNotFoundError:
        return False


def _pids(pid_dir, world_size: int, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = sorted(pid_dir.glob("rank*.pids"))
        if len(files) == world_size and all(f.read_text().endswith("\n") for f in files):
            return [int(p) for f in files for p in f.read_text().split()]
        time.sleep(0.1)
    raise AssertionError("the ranks did not start")


def _all_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")
def test_a_failed_run_leaves_no_rank_and_no_process_a_rank_started(tmp_path):
    from rank_workers import spawning_worker

    with pytest.raises(RankFailedError, match="fails with a child running"):
        launch(spawning_worker, 2, (str(tmp_path), 1), timeout_s=60)
    pids = _pids(tmp_path, 2, timeout_s=1)
    assert len(pids) == 4 and _all_gone(pids), "orphans survived the run"


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")
def test_ranks_and_their_children_die_with_a_parent_killed_by_sigkill(tmp_path):
    """A Jupyter kernel killed mid-run: nothing of the run may keep running."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(tests)!r})\n"
            "from course_lib.parallel.launch import launch\n"
            "from rank_workers import spawning_worker\n"
            f"launch(spawning_worker, 2, ({str(tmp_path)!r}, -1), timeout_s=600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        pids = _pids(tmp_path, 2)
        assert all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert _all_gone(pids), "ranks or their children outlived the killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()


# A process a rank starts in a new session leads its own process group: killing the rank's
# group misses it. The launcher walks each rank's descendants (/proc) before killing.
def _reap_sleeps(pids: list[int]) -> None:
    """Kill what a failing test leaves behind (the sleeps are orphans otherwise)."""
    import signal

    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"sleep"):
                    os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="descendants are found in /proc")
def test_a_killed_launch_leaves_no_process_a_rank_started_in_a_new_session(tmp_path):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(tests)!r})\n"
            "from course_lib.parallel.launch import launch\n"
            "from rank_workers import new_session_worker\n"
            f"launch(new_session_worker, 2, ({str(tmp_path)!r}, -1), timeout_s=600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code])
    sleeps: list[int] = []
    try:
        pids = _pids(tmp_path, 2)
        sleeps = pids[1::2]
        assert all(_alive(p) for p in pids)
        assert all(os.getsid(s) == s for s in sleeps)           # each leads its own session
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert _all_gone(pids), "a sleep in a new session outlived the killed launch"
    finally:
        if parent.poll() is None:
            parent.kill()
        _reap_sleeps(sleeps)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="descendants are found in /proc")
@pytest.mark.parametrize("fail_rank", [1, -2], ids=["a rank fails", "every rank returns"])
def test_a_launch_that_ends_leaves_no_process_a_rank_started_in_a_new_session(tmp_path,
                                                                             fail_rank):
    from rank_workers import new_session_worker

    try:
        if fail_rank >= 0:
            with pytest.raises(RankFailedError, match="fails with a child in a new session"):
                launch(new_session_worker, 2, (str(tmp_path), fail_rank), timeout_s=60)
        else:
            assert launch(new_session_worker, 2, (str(tmp_path), fail_rank)) == [0, 1]
        pids = _pids(tmp_path, 2, timeout_s=1)
        assert len(pids) == 4 and _all_gone(pids), "a sleep in a new session outlived the run"
    finally:
        _reap_sleeps(_pids(tmp_path, 2, timeout_s=1)[1::2]
                     if len(list(tmp_path.glob("rank*.pids"))) == 2 else [])


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_kv_heads=0), "num_kv_heads must be an integer >= 1, got 0"),
    (dict(num_heads=0), "num_heads must be an integer >= 1, got 0"),
    (dict(head_dim=0), "head_dim must be an integer >= 1"),
    (dict(block_size=0), "block_size must be an integer >= 1"),
    (dict(num_gpu_blocks=0), "num_gpu_blocks must be an integer >= 1"),
    (dict(prompt_len=2.5), "prompt_len must be an integer >= 1, got 2.5"),
    (dict(seed=-1), "seed must be an integer >= 0"),
])
def test_cp_case_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CPCase(**kwargs)


@pytest.mark.parametrize("positions, k_shape, message", [
    ([0, 1], (2, 3, 4), "need k and v of \\[2, 1, 4\\]"),
    ([-1, -2], (2, 1, 4), "positions must be integers >= 0"),
])
def test_a_failed_rank_cache_append_changes_nothing(positions, k_shape, message):
    cache = RankKVCache(num_kv_heads=1, head_dim=4, block_size=4, num_gpu_blocks=2)
    cache.append(7, [0], torch.ones(1, 1, 4), torch.ones(1, 1, 4))
    with pytest.raises(ValueError, match=message):
        cache.append(8, positions, torch.zeros(k_shape), torch.zeros(k_shape))
    assert cache.positions == {7: [0]} and cache.manager.num_free_gpu_blocks == 1
    cache.check_invariants()


@pytest.mark.parametrize("kwargs, message", [
    (dict(timeout_s="x"), "timeout_s must be a number of seconds > 0"),
    (dict(args=5), "args must be a tuple"),
])
def test_launch_rejects_bad_timeout_and_args_before_starting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        launch(rank_sum_worker, 1, **kwargs)
