"""Start ``world_size`` real processes joined by ``torch.distributed``, run one function, collect.

:func:`launch` is a tiny torchrun for a notebook or a test: it spawns the ranks with the
``spawn`` start method (fresh interpreters: safe with threads, CUDA and Jupyter), joins them in
one process group over TCP on 127.0.0.1 (a free port), runs ``worker(rank, world_size, *args)``
in each and returns the ranks' results in rank order.

* backend: ``gloo`` on CPU; ``nccl`` when CUDA has a GPU per rank (rank r uses ``cuda:r``).
* Nothing hangs: collectives time out after ``timeout_s`` (``init_process_group(timeout=)``)
  and the parent waits at most ``timeout_s`` in all. A rank that raises (or dies) makes the
  parent stop the others and raise :class:`RankFailedError` with that rank's traceback.
* ``worker`` must be importable by name (a module-level function of a module, not of a
  notebook cell): spawned interpreters re-import it. Results travel back as ``torch.save``
  bytes, so tensors, lists, dicts and numbers are fine.
* No orphans: each rank leads its own process group, so that whatever it starts belongs to
  it. When the run ends, however it ends, the parent kills every rank's whole group; and a
  watchdog thread in each rank kills its group as soon as the parent is gone, whatever
  killed the parent (even ``SIGKILL``, e.g. a Jupyter kernel killed mid-run). A process
  started in a new session (``start_new_session=True``, a daemon) leads a group of its own,
  out of reach of a group kill: so every kill also finds the rank's descendants by walking
  ``/proc`` (:func:`descendants`) *before* anything dies (an orphan is re-parented and lost
  to the walk), stops them, and kills them; and a rank that ends kills what it started.
  Without ``/proc`` (macOS) only the groups are killed.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

MAX_CPU_WORLD_SIZE = 8   # gloo ranks on one CPU machine: more only thrash the cores


class RankFailedError(RuntimeError):
    """A rank raised, died, or did not finish in time; the message names it and why."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_backend(world_size: int) -> str:
    """``"nccl"`` if CUDA has at least ``world_size`` GPUs, else ``"gloo"``."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def check_world_size(world_size: int, backend: str) -> None:
    """Raise ValueError (before any process starts) unless ``world_size`` ranks can run."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        import torch

        limit = torch.cuda.device_count()
        where = f"this machine has {limit} CUDA GPU(s), nccl needs one per rank"
    else:
        limit, where = MAX_CPU_WORLD_SIZE, "gloo ranks on one CPU machine"
    if isinstance(world_size, bool) or not isinstance(world_size, int) \
            or not 1 <= world_size <= limit:
        raise ValueError(f"world_size must be an integer in [1, {limit}] ({where}), "
                         f"got {world_size!r}")


WATCHDOG_PERIOD_S = 0.1


def _children() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, for every process in ``/proc`` ({} without it)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    kids: dict[int, list[int]] = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:                       # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so cut at the last
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            kids.setdefault(int(fields[1]), []).append(int(name))
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its children, theirs, ...), whatever their session or
    process group, from one walk of ``/proc``; [] where there is no ``/proc``."""
    kids, found, todo = _children(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_tree(pid: int, *, group: bool = True) -> None:
    """SIGKILL every descendant of ``pid`` and (``group``) its process group. The
    descendants are stopped first (SIGSTOP: a stopped process starts no more), walk after
    walk until one finds no new process, so that none escapes by forking meanwhile; one
    that leads a group of its own takes its group along. ``pid`` itself is stopped first
    unless it is this process (a rank cleaning up after itself: it must live to exit)."""
    me = pid == os.getpid()
    if not me:
        _signal(pid, signal.SIGSTOP)
        _signal(pid, signal.SIGSTOP, group=True)
    stopped: set[int] = set()
    for _ in range(100):                      # a fork bomb does not keep us here forever
        new = [p for p in descendants(pid) if p not in stopped]
        if not new:
            break
        for p in new:
            _signal(p, signal.SIGSTOP)
        stopped.update(new)
    leaders = set()
    for p in stopped:
        try:
            if os.getpgid(p) == p:            # e.g. started with start_new_session=True
                leaders.add(p)
        except (ProcessLookupError, PermissionError):
            pass
    for p in stopped:
        _signal(p, signal.SIGKILL)
    for p in leaders - {os.getpgrp()}:
        _signal(p, signal.SIGKILL, group=True)
    if group and not me:
        _signal(pid, signal.SIGKILL, group=True)
        _signal(pid, signal.SIGKILL)


def _die_with_parent(parent_pid: int) -> None:
    """In a rank: lead a new process group (what the rank starts joins it), and kill that
    whole group and every descendant (:func:`_kill_tree`) as soon as the parent process is
    gone. A thread, so that it runs while the main thread waits in a collective."""
    os.setpgid(0, 0)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_PERIOD_S)
        _kill_tree(os.getpid(), group=False)          # its descendants, in any session
        os.killpg(0, signal.SIGKILL)                  # then its group, itself included

    if os.getppid() != parent_pid:          # the parent died before we started
        os.killpg(0, signal.SIGKILL)
    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def _kill_group(proc: Any) -> None:
    """Kill a rank and everything in its process group (it may have died already)."""
    if proc.pid is None:
        return
    _signal(proc.pid, signal.SIGKILL, group=True)


def _entry(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
           worker: Callable[..., Any], args: tuple, results: Any, parent_pid: int) -> None:
    """Body of one spawned rank: join the group, run the worker, report, leave.

    A failure is reported (with the time it happened) *before* the rank leaves the group, so
    the root cause is stamped earlier than the errors it then causes on its peers.
    """
    _die_with_parent(parent_pid)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # gloo: stay on the loopback interface
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        value = worker(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, "ok", buf.getvalue(), time.time()))
    except BaseException as exc:  # report every failure; the parent decides what to raise
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                     time.time()))
        # delivered before this rank leaves the group: the root cause reaches the parent
        # before the errors its departure causes on the peers (or a crash on the way out)
        results.close()
        results.join_thread()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _kill_tree(os.getpid(), group=False)   # what the worker started dies with the rank


def _earliest_error(results: Any, rank: int, payload: str, stamp: float,
                    grace_s: float = 1.0) -> tuple[int, str]:
    """The first failure in time among those reported within ``grace_s``: a rank that raises
    makes its peers fail too (connection reset), and the queue may deliver theirs first."""
    first = (stamp, rank, payload)
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            r, status, p, t = results.get(timeout=max(0.01, end - time.monotonic()))
        except queue.Empty:
            break
        if status == "error" and t < first[0]:
            first = (t, r, p)
    return first[1], first[2]


def launch(worker: Callable[..., Any], world_size: int, args: tuple = (), *,
           backend: str = "auto", timeout_s: float = 60.0, progress: bool = False) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` processes; results by rank.

    ``progress=True`` shows a bar of the ranks that have finished, its clock ticking while
    they start (each spawned interpreter imports torch: seconds on a laptop).

    Raises ValueError for an impossible ``world_size`` / ``backend`` before starting anything;
    :class:`RankFailedError` if a rank raises, exits without a result, or the whole run takes
    longer than ``timeout_s`` seconds (the survivors are terminated first).
    """
    if backend == "auto":
        backend = pick_backend(world_size) if isinstance(world_size, int) else "gloo"
    check_world_size(world_size, backend)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    if not isinstance(args, (tuple, list)):
        raise ValueError(f"args must be a tuple of the worker's extra arguments, got "
                         f"{type(args).__name__} {args!r}")
    if getattr(worker, "__module__", "__main__") == "__main__" or "<locals>" in getattr(
            worker, "__qualname__", "<locals>"):
        raise ValueError(f"worker {worker!r} must be a module-level function of an importable "
                         "module (spawned ranks re-import it), not one defined in __main__ or "
                         "a notebook cell")
    for attempt in range(2):
        try:
            return _launch_once(worker, world_size, args, backend, timeout_s, progress)
        except RankFailedError as exc:   # the free port was taken before rank 0 bound it
            if attempt or "address already in use" not in str(exc).lower():
                raise
    raise AssertionError("unreachable")


def _launch_once(worker: Callable[..., Any], world_size: int, args: tuple, backend: str,
                 timeout_s: float, progress: bool) -> list[Any]:
    from tqdm.auto import tqdm

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, name=f"cp-rank-{r}", daemon=True,
                         args=(r, world_size, port, backend, timeout_s, worker, args, results,
                               os.getpid()))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    done: dict[int, Any] = {}
    bar = tqdm(total=world_size, disable=not progress, desc="ranks finished",
               unit="rank")
    try:
        while len(done) < world_size:
            try:
                rank, status, payload, stamp = results.get(timeout=0.2)
            except queue.Empty:
                bar.refresh()                   # the clock moves while the ranks start
                dead = [r for r, p in enumerate(procs)
                        if r not in done and p.exitcode is not None]
                if dead:
                    # a rank that exited may still have a result in flight: look once more
                    try:
                        rank, status, payload, stamp = results.get(timeout=1.0)
                    except queue.Empty:
                        raise RankFailedError(
                            f"rank {dead[0]} of {world_size} exited with code "
                            f"{procs[dead[0]].exitcode} without a result") from None
                elif time.monotonic() > deadline:
                    waiting = [r for r in range(world_size) if r not in done]
                    raise RankFailedError(
                        f"ranks {waiting} of {world_size} did not finish within {timeout_s} s "
                        f"(backend {backend}); a peer may be stuck in a collective") from None
                else:
                    continue
            if status == "error":
                rank, payload = _earliest_error(results, rank, payload, stamp)
                dead = [f"rank {r} had exited with code {p.exitcode}" for r, p in
                        enumerate(procs) if r != rank and p.exitcode not in (None, 0)]
                note = f" ({'; '.join(dead)})" if dead else ""
                raise RankFailedError(f"rank {rank} of {world_size} failed{note}: {payload}")
            import torch

            done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            bar.update()
    finally:
        bar.close()
        for p in procs:                         # its descendants are found while it lives
            if p.is_alive() and len(done) < world_size and p.pid is not None:
                _kill_tree(p.pid)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive() and p.pid is not None:
                _kill_tree(p.pid)               # stuck on its way out
            _kill_group(p)                      # the rank, if still there, and its children
            p.join(timeout=5)
        results.close()
    return [done[r] for r in range(world_size)]


# ---------------------------------------------------------------- small workers to launch

def rank_sum_worker(rank: int, world_size: int) -> dict:
    """All-reduce each rank's id: every rank gets 0 + 1 + ... + (world_size - 1)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return {"rank": rank, "backend": dist.get_backend(), "sum": int(t.item())}


def failing_worker(rank: int, world_size: int, bad_rank: int, how: str = "raise") -> int:
    """Rank ``bad_rank`` fails (``how``: "raise", "exit" = dies without a word, "hang" =
    sleeps); the others wait for it in an all-reduce. Shows that :func:`launch` never hangs."""
    import torch
    import torch.distributed as dist

    if rank == bad_rank:
        if how == "raise":
            raise RuntimeError(f"rank {rank} was told to fail")
        if how == "exit":
            os._exit(3)
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())
