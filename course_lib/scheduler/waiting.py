"""The waiting queue of a scheduler, able to undo what a step did to it.

Both schedulers (V0's ``Scheduler``, ``SchedulerV1``) keep their waiting requests in a
:class:`WaitingQueue`. A step only ever moves requests in it in three ways: takes the first
out (admitted or ignored), puts a preempted one back at the front, or takes one out from
anywhere (finished from the queue). While a step's transaction is open (:meth:`begin_log`)
the queue logs those moves; :meth:`undo` puts them back, last first. So a failed step is
undone without ever copying the queue: the cost of a step's transaction does not grow with
the number of requests waiting.
"""

from __future__ import annotations

from collections import deque

Move = tuple[str, object, int]          # ("pop" | "push" | "remove", item, index)


class WaitingQueue(deque):
    """A deque whose moves a step makes are logged while a log is open."""

    def __init__(self, items=()) -> None:
        super().__init__(items)
        self.log: list[Move] | None = None

    def begin_log(self) -> list[Move]:
        """Start a new log (a step's transaction begins; the last step's log is dropped);
        returns it, to undo later."""
        self.log = []
        return self.log

    def pop_front(self) -> object:
        """The first item, taken out."""
        item = self.popleft()
        if self.log is not None:
            self.log.append(("pop", item, 0))
        return item

    def push_front(self, item: object) -> None:
        """Put an item first in line (a preempted request)."""
        self.appendleft(item)
        if self.log is not None:
            self.log.append(("push", item, 0))

    def remove_at(self, index: int) -> object:
        """Take the item at ``index`` out (a request finished while it waits)."""
        item = self[index]
        del self[index]
        if self.log is not None:
            self.log.append(("remove", item, index))
        return item

    def undo(self, log: list[Move]) -> None:
        """Undo the moves of ``log``, last first, and stop logging."""
        for move, item, index in reversed(log):
            if move == "pop":
                self.appendleft(item)
            elif move == "push":
                self.popleft()
            else:
                self.insert(index, item)
        self.log = None
