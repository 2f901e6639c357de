"""Chapter 11's picture of a serving run: the pool, the queues and the batch, step by step.

:class:`RunLog` is an ``on_step`` hook for ``run_trace`` or ``LLMEngine.generate``: after each
step it records what the engine holds (plain numbers, nothing drawn yet). :func:`draw_run`
draws three panels over the steps: KV blocks held against the pool, requests running and
waiting (and swapped), and the tokens each step computed (prefill and decode); every step that
preempted is marked with a red line across the panels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from matplotlib.figure import Figure

from ..engine.llm_engine import LLMEngine
from ..scheduler.output import SchedulerOutput
from .readable import MAX_WIDTH_IN

PREEMPT = "#d62728"


@dataclass(frozen=True)
class StepSample:
    """The engine after one step."""
    step: int
    held_blocks: int          # GPU blocks with a ref count > 0
    running: int              # requests in the running queue
    waiting: int
    swapped: int
    prefill_tokens: int       # tokens the step computed for prompts (recomputation included)
    decode_tokens: int
    preempted: int            # requests preempted in this step
    sharing_saving: float     # 1 - held blocks / table entries (what sharing saved)


@dataclass
class RunLog:
    """``samples[i]``: the engine after its i-th step since the log was attached."""
    samples: list[StepSample] = field(default_factory=list)
    num_gpu_blocks: int = 0

    def __call__(self, engine: LLMEngine, out: SchedulerOutput | None) -> None:
        bm, sched = engine.block_manager, engine.scheduler
        self.num_gpu_blocks = bm.num_gpu_blocks
        usage = bm.usage()
        self.samples.append(StepSample(
            step=len(self.samples),
            held_blocks=bm.num_gpu_blocks - bm.num_free_gpu_blocks,
            running=len(sched.running), waiting=len(sched.waiting),
            swapped=len(getattr(sched, "swapped", ())),
            prefill_tokens=out.num_prefill_tokens if out else 0,
            decode_tokens=out.num_decode_tokens if out else 0,
            preempted=len(out.preempted) if out else 0,
            sharing_saving=usage.sharing_saving))

    @property
    def num_preemptions(self) -> int:
        return sum(s.preempted for s in self.samples)

    def preemption_steps(self) -> list[int]:
        return [s.step for s in self.samples if s.preempted]


def draw_run(log: RunLog, title: str = "") -> Figure:
    """Blocks held against the pool (top) and the request queues (bottom) over the run in
    ``log``; a red triangle above the pool line and a red line through the queues mark each
    step that preempted. Every text at least 9 pt, ``MAX_WIDTH_IN`` wide."""
    if not log.samples:
        raise ValueError("the log is empty: pass it as on_step to run_trace or generate")
    steps = [s.step for s in log.samples]
    fig = Figure(figsize=(MAX_WIDTH_IN, 5.2))
    ax_b, ax_q = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1.1, 1.0]})
    ax_b.fill_between(steps, [s.held_blocks for s in log.samples], step="post", alpha=0.6,
                      color="C0", label="blocks held")
    ax_b.axhline(log.num_gpu_blocks, color="black", lw=1, ls="--",
                 label=f"pool: {log.num_gpu_blocks} blocks")
    marks = log.preemption_steps()
    top = log.num_gpu_blocks * 1.08
    ax_b.plot(marks, [top] * len(marks), "v", color=PREEMPT, ms=7, ls="none",
              label=f"preemption ({log.num_preemptions} in {len(marks)} steps)")
    ax_b.set_ylim(0, log.num_gpu_blocks * 1.45)
    ax_b.set_ylabel("KV blocks", fontsize=10)
    for x in marks:
        ax_q.axvline(x, color=PREEMPT, lw=0.8, alpha=0.35)
    ax_q.step(steps, [s.running for s in log.samples], where="post", color="C2", lw=1.5,
              label="running")
    ax_q.step(steps, [s.waiting for s in log.samples], where="post", color="C1", lw=1.5,
              label="waiting")
    if any(s.swapped for s in log.samples):
        ax_q.step(steps, [s.swapped for s in log.samples], where="post", color="C4", lw=1.5,
                  label="swapped")
    ax_q.set_ylabel("requests", fontsize=10)
    ax_q.set_xlabel("engine step", fontsize=10)
    for ax in (ax_b, ax_q):
        ax.tick_params(labelsize=9.5)
        ax.legend(fontsize=9.5, loc="upper right", ncols=3)
    ax_q.set_ylim(0, max(max(s.running, s.waiting, s.swapped) for s in log.samples) * 1.35 + 1)
    ax_q.set_xlim(0, steps[-1] + 1)
    fig.suptitle(title or f"{len(steps)} steps, {log.num_preemptions} preemptions",
                 fontsize=11)
    fig.tight_layout()
    return fig
