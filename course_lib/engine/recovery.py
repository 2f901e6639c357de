"""What the engine does once a step has failed: put everything back (``rollback.py`` says
what that is), find the request to blame, and finish that request alone.

Mixed into :class:`~course_lib.engine.LLMEngine`, whose ``step`` (in ``llm_engine.py``)
catches the failure and calls these in that order.
"""

from __future__ import annotations

from ..scheduler import ScheduledSeq
from ..sequence import SequenceStatus
from .outputs import RequestOutput
from .rollback import Checkpoint, put_back


class StepRecovery:
    """Mixed into ``LLMEngine``: ``_rollback``, ``_diagnose`` and ``_fail_request``."""

    def _rollback(self, checkpoint: Checkpoint) -> None:
        """Put the scheduler, the runner's counters and the blocks at risk back as they were
        when ``checkpoint`` was taken."""
        self.scheduler.restore(checkpoint.scheduler)
        self.runner.set_counters(checkpoint.runner_counters)
        if self._backup is not None:
            put_back(self.runner.gpu_caches, self.runner.cpu_caches, self._backup)
        self._backup = None

    def _diagnose(self, checkpoint: Checkpoint) -> tuple[int, BaseException] | None:
        """After a failed step (already rolled back): run it again with one forward per
        request. A request is to blame when its forward fails alone, twice (a transient fault
        rarely strikes twice), while another one's succeeds; if every forward fails (the
        device, not a request) or all succeed (a transient fault), nobody is. The state is
        rolled back again whatever happens."""
        try:
            out = self.scheduler.schedule()
            self._protect(out, checkpoint)
            self.runner.execute_cache_ops(out)
            by_request: dict[int, list[ScheduledSeq]] = {}
            for e in out.scheduled:
                by_request.setdefault(e.request.request_id, []).append(e)
            failures = []
            for rid, entries in by_request.items():
                for attempt in range(2):
                    try:
                        self.runner.execute_model(entries)
                        break
                    except Exception as exc:
                        if attempt:
                            failures.append((rid, exc))
            return failures[0] if 0 < len(failures) < len(by_request) else None
        except Exception:
            return None
        finally:
            self._rollback(checkpoint)

    def _fail_request(self, request_id: int, cause: BaseException) -> RequestOutput:
        """Finish the request whose own work failed, alone; the others go on."""
        req = self._requests[request_id]
        self.scheduler.finish_request(request_id, SequenceStatus.FINISHED_ERROR,
                                      f"failed in step {self.num_steps}: "
                                      f"{type(cause).__name__}: {cause}")
        req.finished_time = self.now()
        self.metrics.update(self.scheduler)
        return self._output(req)
