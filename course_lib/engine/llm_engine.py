"""LLMEngine: the serving loop that ties the scheduler, the block manager, the kernels and the
model together (vLLM v0's ``LLMEngine``, in one page).

One :meth:`LLMEngine.step`:

1. ``scheduler.schedule()`` picks the batch and changes the block tables (allocate, append,
   copy-on-write, swap, preempt), returning a :class:`~course_lib.scheduler.output.SchedulerOutput`.
2. The :class:`~course_lib.engine.model_runner.ModelRunner` executes its cache ops (swap-out,
   swap-in, CoW copies: that order), then the forward pass over the scheduled tokens.
3. The sampler turns each sampling entry's logits into (token, logprob) candidates.
4. ``scheduler.update()`` appends the tokens, forks parallel samples and beams (sharing
   blocks), and finishes and frees sequences that drew a stop token (the engine adds its
   ``stop_token_ids``, EOS by default, to each request's ``SamplingParams``) or hit a limit.
5. :class:`~course_lib.scheduler.metrics.Metrics` (vLLM's Prometheus names) are updated.

:meth:`LLMEngine.generate` runs prompts to completion and returns them in order.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tqdm.auto import tqdm

from ..config import CacheConfig, SchedulerConfig
from ..model import EOS_ID, ByteTokenizer, TinyLlama
from ..scheduler import Scheduler, SchedulerOutput
from ..scheduler.metrics import Metrics
from ..sequence import Request, SamplingParams
from .model_runner import ModelRunner
from .sampler import sample


@dataclass
class CompletionOutput:
    """One generated sequence: sample ``index`` (parallel sampling) or the ``index``-th best
    beam (beam search)."""

    index: int
    token_ids: list[int]
    text: str
    cumulative_logprob: float
    finish_reason: str | None  # "stop" (EOS or a stop token), "length", "abort", "ignored"


@dataclass
class RequestOutput:
    """A finished request: its prompt, its outputs and its timings (seconds)."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int    # prompt tokens found in the prefix cache
    num_preemptions: int
    ttft: float | None        # arrival -> first token
    latency: float | None     # arrival -> finished
    finish_reason: str | None = None   # the request's code (see CompletionOutput)
    finish_detail: str | None = None   # why it was aborted or ignored, in a sentence

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""


class LLMEngine:
    """Paged-KV serving of one model. Defaults fit the tiny model on a CPU.

    ``scheduler_config.max_model_len`` defaults to (and may not exceed) the model's context.
    ``cache_config.num_cpu_blocks > 0`` gives swap space (needed for ``preemption_mode="swap"``).
    ``attn_impl``: ``"auto"``, ``"triton"``, ``"reference"`` or ``"torch"``
    (:func:`course_lib.kernels.backends.get_attn_backend` resolves it once). ``stop_token_ids``
    are added to every request's ``SamplingParams.stop_token_ids``: a sequence that samples one
    stops (the token is kept), as ``generate_contiguous`` does; beam search ignores them (the
    scheduler's beam step keeps ``beam_width`` live beams).
    ``clock``: seconds, for the timestamps (tests may pass a fake one).
    """

    def __init__(self, model: TinyLlama | None = None,
                 scheduler_config: SchedulerConfig | None = None,
                 cache_config: CacheConfig | None = None, *, attn_impl: str = "auto",
                 stop_token_ids: Sequence[int] = (EOS_ID,),
                 clock: Callable[[], float] = time.perf_counter,
                 model_name: str = "tiny-llama") -> None:
        if model is None:
            from ..model import load_tiny_model

            model = load_tiny_model()
        context = model.config.max_position
        if scheduler_config is None:
            scheduler_config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                               max_model_len=context)
        if scheduler_config.max_model_len > context:
            raise ValueError(f"max_model_len={scheduler_config.max_model_len} is past the "
                             f"model's context ({context}); use max_model_len <= {context}")
        cache_config = cache_config or CacheConfig(block_size=16, num_gpu_blocks=256)
        self.model = model
        self.tokenizer = ByteTokenizer()
        self.scheduler = Scheduler(scheduler_config, cache_config)
        self.block_manager = self.scheduler.block_manager
        self.runner = ModelRunner(model, cache_config.block_size, cache_config.num_gpu_blocks,
                                  cache_config.num_cpu_blocks, attn_impl)
        self.metrics = Metrics(self.scheduler, model_name)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.clock = clock
        self._t0 = clock()
        self._next_request_id = 0
        self._seeds: dict[int, int] = {}
        self._requests: dict[int, Request] = {}
        self.last_output: SchedulerOutput | None = None
        self.num_steps = 0

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated so far: one per sample, one per kept beam, per step."""
        return self.scheduler.num_generated_tokens

    def now(self) -> float:
        """Seconds since the engine started."""
        return self.clock() - self._t0

    # ----------------------------------------------------------------------- requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: int | None = None, arrival_time: float | None = None) -> int:
        """Queue a prompt (text is encoded with BOS, or token ids as given); returns its id."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt must hold at least one token")
        vocab = self.model.config.vocab_size
        if not all(0 <= int(t) < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
        params = params or SamplingParams()
        extra = tuple(t for t in sorted(self.stop_token_ids) if t not in params.stop_token_ids)
        if extra:                              # the engine's stop tokens (EOS) join the request's
            params = replace(params, stop_token_ids=params.stop_token_ids + extra)
        if request_id is None:
            request_id = self._next_request_id
        if request_id in self._requests:
            raise ValueError(f"request id {request_id} is already in use")
        self._next_request_id = max(self._next_request_id, request_id + 1)
        req = self.scheduler.add_request(request_id, ids, params,
                                         self.now() if arrival_time is None else arrival_time)
        self._requests[request_id] = req
        self._seeds[request_id] = params.seed if params.seed is not None \
            else random.getrandbits(62)
        return request_id

    def abort_request(self, request_id: int) -> bool:
        """Stop a request wherever it is and free its blocks; False if it is not running."""
        done = self.scheduler.abort_request(request_id)
        if done:
            req = self._requests.pop(request_id)
            req.finished_time = self.now()
            self._seeds.pop(request_id, None)
        return done

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the cache ops and the model, sample, update; returns the requests
        that finished in this step."""
        sched = self.scheduler
        out = sched.schedule()
        self.runner.execute_cache_ops(out)
        logits = self.runner.execute_model(out.scheduled)
        samples = {e.seq.seq_id: sample(e, logits[e.seq.seq_id],
                                        self._seeds[e.request.request_id])
                   for e in out.scheduled if e.num_candidates}
        now = self.now()
        finished = sched.update(out, samples, now)
        self.num_steps += 1
        self.metrics.update(sched)
        self.metrics.observe_finished(finished)
        self.last_output = out
        return [self._output(r) for r in finished]

    def _output(self, req: Request) -> RequestOutput:
        self._requests.pop(req.request_id, None)
        self._seeds.pop(req.request_id, None)
        seqs = req.ordered_seqs()
        outs = [CompletionOutput(i if req.sampling_params.use_beam_search else s.index,
                                 list(s.output_token_ids),
                                 self.tokenizer.decode(s.output_token_ids),
                                 s.cumulative_logprob, s.status.finish_reason)
                for i, s in enumerate(seqs)]
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        latency = None if req.finished_time is None else req.finished_time - req.arrival_time
        return RequestOutput(req.request_id, list(req.prompt_token_ids), outs,
                             req.num_cached_tokens, req.num_preemptions, ttft, latency,
                             req.finish_reason, req.finish_detail)

    # ----------------------------------------------------------------------- generate
    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 progress: bool = False,
                 on_step: Callable[[LLMEngine, SchedulerOutput], None] | None = None
                 ) -> list[RequestOutput]:
        """Run ``prompts`` (all arriving now) to completion; outputs in the prompts' order.
        ``on_step(engine, scheduler_output)`` is called after every step (for drawings)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"one SamplingParams per prompt: {len(prompts)} prompts, "
                             f"{len(params)} params")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        wanted = set(ids)
        done: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not progress, desc="generate", unit="req")
        while wanted - done.keys():
            if not self.has_unfinished_requests():
                raise RuntimeError(f"requests {sorted(wanted - done.keys())} vanished")
            for o in self.step():
                if o.request_id in wanted:
                    done[o.request_id] = o
                    bar.update(1)
            if on_step is not None:
                on_step(self, self.last_output)
        bar.close()
        return [done[i] for i in ids]

    # ------------------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """The scheduler's queues, the block tables and the pools agree (the scheduler's
        check includes the block manager's)."""
        self.scheduler.check_invariants()
