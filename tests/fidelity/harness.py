"""Lockstep runs: one operation sequence applied to the course's object and to the real one
(vLLM 0.33.0's, SGLang 0.5.23's), their answers compared after every operation.

A *twin* wraps one side: ``apply(op)`` performs the operation and returns its answer as plain
data (ids, lengths, lists, flags), or ``("raises", ExceptionType, message)``; ``state()``
returns what is compared after the operation (free-queue order, reference counts, hashes,
counters, ...). Both twins of a pair return the same shapes, the real side's ids already
mapped to the course's (vLLM's block ``i + 1`` is the course's block ``i``: vLLM's block 0 is
its null block). :func:`run_lockstep` raises :class:`Mismatch` at the first operation whose
answer or state differs, naming the sequence so far, both answers and the first difference.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any


class Mismatch(AssertionError):
    """The course and the real code answered differently."""


def raised(exc: BaseException) -> tuple:
    """An exception as an answer: its type name and message, with object reprs (which differ
    between the two codes and say nothing about behaviour) cut down to their class name."""
    message = re.sub(r"KVCacheBlock\(.*\)", "KVCacheBlock(...)", str(exc))
    return ("raises", type(exc).__name__, message)


def attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:            # noqa: BLE001 (the exception is the answer)
        return raised(exc)


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two answers first differ, as a path (``state.free_queue[3]``), or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                return f"{path}[{key!r}] (only in {'course' if key in a else 'real'})"
            where = first_difference(a[key], b[key], f"{path}[{key!r}]")
            if where:
                return where
        return None
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) \
            and type(a) is type(b):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            where = first_difference(x, y, f"{path}[{i}]")
            if where:
                return where
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        return None
    return None if a == b else (path or "the answer")


def _short(value: Any, limit: int = 1500) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def run_lockstep(name: str, ops: Iterable, course, real) -> None:
    """Apply ``ops`` to both twins; raise :class:`Mismatch` at the first difference."""
    done = []
    for op in ops:
        done.append(op)
        a = {"answer": course.apply(op), "state": course.state()}
        b = {"answer": real.apply(op), "state": real.state()}
        where = first_difference(a, b)
        if where is not None:
            raise Mismatch(
                f"{name}: the course and the real code differ after operation "
                f"{len(done) - 1} ({op!r})\n"
                f"  operations: {done!r}\n"
                f"  first difference: {where}\n"
                f"  course: {_short(a)}\n"
                f"  real:   {_short(b)}")
