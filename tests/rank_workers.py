"""Workers for tests of course_lib.parallel.launch (module level: spawned ranks import them)."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def spawning_worker(rank: int, world_size: int, pid_dir: str, fail_rank: int) -> int:
    """Each rank starts a long-lived child process and records both pids, then rank
    ``fail_rank`` raises (-1: nobody does) and the others sleep."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(pid_dir, f"rank{rank}.pids"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}\n")
    time.sleep(1.0)                          # every rank has written its file
    if rank == fail_rank:
        raise RuntimeError(f"rank {rank} fails with a child running")
    time.sleep(600)
    return rank


def new_session_worker(rank: int, world_size: int, pid_dir: str, fail_rank: int) -> int:
    """Each rank starts ``sleep 1000`` in a new session (its own process group, out of reach
    of a kill of the rank's group) and records both pids, then rank ``fail_rank`` raises
    (-1: nobody does; -2: every rank returns at once, leaving its sleep behind) and the
    others sleep."""
    child = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    with open(os.path.join(pid_dir, f"rank{rank}.pids"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}\n")
    if fail_rank == -2:
        return rank
    time.sleep(1.0)                          # every rank has written its file
    if rank == fail_rank:
        raise RuntimeError(f"rank {rank} fails with a child in a new session")
    time.sleep(600)
    return rank
