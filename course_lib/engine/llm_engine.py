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

If anything in a step raises, the step emits nothing and is recovered by recompute
(:mod:`course_lib.engine.recovery`, chapter 07's mechanism): the request to blame (its sampling
or output processing failed, or its forward alone fails when the step is run again one
request at a time) is finished alone with ``finish_reason="error"`` and returned; every other
request goes back to what it had at the end of the last step, the KV bookkeeping is rebuilt
empty, and they are all recomputed, to the same tokens. With nobody to blame, ``StepFailed``
is raised (after the recovery: call ``step()`` again).

Requests are checked when they are added (:meth:`LLMEngine.add_request`), so that bad input
fails at once and names itself instead of failing a step later.

:meth:`LLMEngine.generate` runs prompts to completion and returns them in order.

:class:`LLMEngine` reads top to bottom: construction, requests in, :meth:`LLMEngine.step`,
what follows a failed step (blame, recover), ``generate``. Its collaborators are plain
functions and data in their own modules: the checks on what comes in (``inputs.py``), what
comes out (``outputs.py``, with the top-k ``logprobs`` in ``logprobs.py``), the recovery of a
failed step (``recovery.py``), the cache tensors and the forward pass (``model_runner.py``)
and the sampler (``sampler.py``).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from ..config import CacheConfig, SchedulerConfig
from ..model.llama import TinyLlama
from ..model.tokenizer import EOS_ID, ByteTokenizer
from ..scheduler.metrics import Metrics
from ..scheduler.output import ScheduledSeq, SchedulerOutput
from ..scheduler.scheduler import Scheduler
from ..scheduler.v1 import SchedulerV1
from ..sequence import (
    Request,
    RequestFailed,
    SamplingParams,
    SequenceStatus,
    token_ids_or_error,
)
from ..sizing.units import GiB, format_bytes
from .cpu_offload import CPUOffloadConnector
from .inputs import check_request_id, generate_inputs, prompt_token_ids, request_params
from .kv_connector import KVConnectorBase_V1
from .logprobs import attach_logprobs, top_logprobs
from .model_runner import ModelRunner
from .outputs import RequestOutput, request_output
from .recovery import (
    Counters,
    RecoveryFailed,
    RequestRecord,
    StepFailed,
    find_culprit,
    record,
    records_of_step,
    recover,
)
from .sampler import sample

if TYPE_CHECKING:
    import torch

# ``_sample_twice`` calls ``sample`` by this module's name, so that tests and
# ``bench/chaos.py`` can replace it here.
__all__ = ["DESIGNS", "LLMEngine"]

# The engine's core, by vLLM generation: "v0" is the paper's and vLLM V0's design (block
# manager with copy-on-write and swap, prefill and decode phases); "v1" is vLLM V1's (the
# KVCacheManager with its free-block queue, one token budget, recompute only, n child
# sequences). The model runner, sampler and model are the same.
DESIGNS = {"v0": Scheduler, "v1": SchedulerV1}


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
    ``design``: ``"v0"`` (the default: vLLM V0's block manager and scheduler, the paper's
    design) or ``"v1"`` (vLLM V1's ``KVCacheManager`` and scheduler); see :data:`DESIGNS`.
    ``kv_connector``: a KV connector (V1 only, :mod:`course_lib.engine.kv_connector`), handed
    to the scheduler (its scheduler side) and the runner (its worker side); None by default,
    or a CPU offload tier when ``cache_config.kv_offloading_size`` is set
    (:class:`~course_lib.engine.cpu_offload.CPUOffloadConnector`). Without one nothing changes.
    """

    def __init__(self, model: TinyLlama | None = None,
                 scheduler_config: SchedulerConfig | None = None,
                 cache_config: CacheConfig | None = None, *, attn_impl: str = "auto",
                 stop_token_ids: Sequence[int] = (EOS_ID,),
                 clock: Callable[[], float] = time.perf_counter,
                 model_name: str = "tiny-llama", design: str = "v0",
                 kv_connector: KVConnectorBase_V1 | None = None) -> None:
        if model is None:
            from ..model.loader import load_tiny_model

            model = load_tiny_model()
        self._check_arguments(model, scheduler_config, cache_config, clock, kv_connector)
        context = model.config.max_position
        if scheduler_config is None:
            scheduler_config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                               max_model_len=context)
        if scheduler_config.max_model_len > context:
            raise ValueError(f"max_model_len={scheduler_config.max_model_len} is past the "
                             f"model's context ({context}); use max_model_len <= {context}")
        cache_config = cache_config or CacheConfig(block_size=16, num_gpu_blocks=256)
        if design not in DESIGNS:
            raise ValueError(f"design must be one of {tuple(DESIGNS)}, got {design!r}")
        self._check_hybrid(model, cache_config, design, kv_connector)
        self._check_kv_memory(model, cache_config, design, kv_connector)
        self.design = design
        self.model = model
        self.tokenizer = ByteTokenizer()
        kv_connector = self._kv_connector(model, cache_config, design, kv_connector)
        self.scheduler_config, self.cache_config = scheduler_config, cache_config
        self.kv_connector = kv_connector
        self.scheduler = self._new_scheduler()
        # the runner's swap space is the block manager's CPU pool (V1's manager has none)
        self.runner = ModelRunner(
            model, replace(cache_config, num_cpu_blocks=self.block_manager.num_cpu_blocks),
            attn_impl)
        if kv_connector is not None:                 # the worker side: the runner's tensors
            self.runner.kv_connector = kv_connector
            kv_connector.register_kv_caches(self.runner.gpu_caches)
        self._check_block_size()
        self.metrics = Metrics(self.scheduler, model_name)
        self.stop_token_ids = frozenset(token_ids_or_error(
            stop_token_ids, model.config.vocab_size, "stop_token_ids"))
        self.clock = clock
        self._t0 = clock()
        self._next_request_id = 0
        self._seeds: dict[int, int] = {}
        self._requests: dict[int, Request] = {}      # unfinished requests, by id
        self.last_output: SchedulerOutput | None = None
        self.num_steps = 0
        self.num_recoveries = 0
        # what the last completed step committed (recovery.py): each unfinished request's
        # record, and the counters; a recovery puts everything back to these
        self._records: dict[int, RequestRecord] = {}
        self._counters = Counters.of(self.scheduler, self.runner)
        self._recovery: dict[int, tuple[SequenceStatus, str]] | None = None   # one due
        self._unreturned: list[RequestOutput] = []   # finished by a recovery, not yet returned
        self._lock = threading.RLock()       # a step, and requests coming in or aborted
        self._stepping = False               # a step runs (add / abort from inside wait)
        self._deferred: list[Callable[[], object]] = []     # adds and aborts made in a step
        self._deferred_ids: set[int] = set()

    def _new_scheduler(self) -> Scheduler | SchedulerV1:
        """An empty scheduler of the engine's design, with its empty block manager (the
        constructor's, and a recovery's)."""
        if self.design == "v0":
            return DESIGNS["v0"](self.scheduler_config, self.cache_config)
        # a hybrid model's KV-cache groups (chapter 14), the runner's layout too
        groups = self.model.config.kv_cache_groups(
            self.cache_config.block_size, next(self.model.parameters()).element_size())
        return SchedulerV1(self.scheduler_config, self.cache_config, self.kv_connector,
                           kv_cache_groups=groups)

    @property
    def block_manager(self):
        """The scheduler's block manager (V0's ``BlockManager``, V1's ``KVCacheManager`` or
        the radix manager); a recovery replaces it with an empty one."""
        return self.scheduler.block_manager

    @staticmethod
    def _check_arguments(model: object, scheduler_config: object, cache_config: object,
                         clock: object, kv_connector: object) -> None:
        """What the constructor reads before anything is built, checked with an error that
        names the argument (a dict for a config would otherwise fail deep inside with an
        ``AttributeError``). A KV connector serves one engine: the course hands one object
        both roles (``engine/kv_connector.py``), so a second engine would re-bind it to its
        own manager and tensors under the first one, whose every step would then fail; its
        caches, registered by the engine it serves, mark it taken."""
        for name, value, cls in (("model", model, TinyLlama),
                                 ("scheduler_config", scheduler_config, SchedulerConfig),
                                 ("cache_config", cache_config, CacheConfig)):
            if value is not None and not isinstance(value, cls):
                raise ValueError(f"{name} must be None or a {cls.__name__}, got "
                                 f"{type(value).__name__} {value!r:.60}")
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds (e.g. "
                             f"time.perf_counter), got {type(clock).__name__} {clock!r:.60}")
        if kv_connector is not None and not isinstance(kv_connector, KVConnectorBase_V1):
            raise ValueError(f"kv_connector must be None or a KVConnectorBase_V1 "
                             f"(course_lib.engine.kv_connector), got "
                             f"{type(kv_connector).__name__} {kv_connector!r:.60}")
        if kv_connector is not None and kv_connector.kv_caches:
            raise ValueError("a kv_connector serves one engine, and another engine's KV caches "
                             "are registered with this one: build a new connector for each "
                             "engine")

    @staticmethod
    def _check_hybrid(model: TinyLlama, cache_config: CacheConfig, design: str,
                      kv_connector: KVConnectorBase_V1 | None) -> None:
        """A model with sliding-window layers (chapter 14) runs on V1's hash-based
        ``KVCacheManager`` only: its KV-cache coordinator is what gives each kind of layer its
        own block table, with the null block where a window has passed. V0's block manager,
        the radix tree and the KV connectors (which copy whole tables) know full attention
        only in this course."""
        if not model.config.layer_types or set(model.config.layer_types) == {"full_attention"}:
            return
        why = ("design='v0'" if design != "v1" else
               "CacheConfig(prefix_cache='radix')" if cache_config.prefix_cache == "radix" else
               "a kv_connector" if kv_connector is not None else
               "CacheConfig(kv_offloading_size=...)"
               if cache_config.kv_offloading_size is not None else None)
        if why is not None:
            raise ValueError(f"the model has sliding-window layers (layer_types "
                             f"{model.config.layer_types}): "
                             f"it runs with design='v1' and the hash prefix cache, without "
                             f"KV connectors; got {why}")

    @staticmethod
    def _kv_connector(model: TinyLlama, cache_config: CacheConfig, design: str,
                      kv_connector: KVConnectorBase_V1 | None) -> KVConnectorBase_V1 | None:
        """The connector given, or the CPU offload tier ``kv_offloading_size`` asks for
        (sized by the model's bytes per block), or None."""
        size = cache_config.kv_offloading_size
        if kv_connector is None and size is None:
            return None
        if design != "v1":
            raise ValueError("a KV connector (or kv_offloading_size) needs design='v1': the V0 "
                             "design has its own CPU tier, swap space (num_cpu_blocks)")
        if kv_connector is not None and size is not None:
            raise ValueError("give kv_connector or CacheConfig.kv_offloading_size, not both")
        if kv_connector is None:
            kv_connector = CPUOffloadConnector.from_kv_offloading_size(
                size, LLMEngine._block_bytes(model, cache_config.block_size))
        return kv_connector

    @staticmethod
    def _block_bytes(model: TinyLlama, block_size: int) -> int:
        """Bytes of one KV block of ``model``, all layers, K and V."""
        cfg, param = model.config, next(model.parameters())
        # a hybrid model's groups share the tensors: a block is one group's layers
        groups = cfg.kv_cache_groups(block_size, param.element_size())
        num_layers = max(len(g.layer_names) for g in groups)
        return (2 * num_layers * block_size * cfg.num_kv_heads * cfg.head_dim
                * param.element_size())

    @staticmethod
    def _check_kv_memory(model: TinyLlama, cache_config: CacheConfig, design: str,
                         kv_connector: KVConnectorBase_V1 | None = None) -> None:
        """``ValueError`` when the pools asked for cannot fit the machine, before any is
        built: a typo such as ``num_gpu_blocks=10**9`` would otherwise build a billion-entry
        free list and get the process killed for memory, with no message. vLLM 0.33.0 meets
        no such count: it derives its block count from the memory it profiles
        (``vllm/v1/core/kv_cache_planning.py``: available bytes // bytes per block, unless
        ``num_gpu_blocks_override``); the course takes a count, so it checks the count
        against the memory instead. Counted: the GPU pool on the model's device
        (its free memory on CUDA), and in host memory the V0 swap space (``num_cpu_blocks``;
        V1 has none) and the CPU offload tier (``kv_offloading_size``, or the
        ``num_cpu_blocks`` of a :class:`CPUOffloadConnector` given: its tensors are allocated
        only when the engine registers its caches, after this check)."""
        import torch

        block = LLMEngine._block_bytes(model, cache_config.block_size)
        device = next(model.parameters()).device
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        swap = cache_config.num_cpu_blocks * block if design == "v0" else 0
        tier = round((cache_config.kv_offloading_size or 0) * GiB)
        tier_name = f"kv_offloading_size={cache_config.kv_offloading_size!r}"
        if isinstance(kv_connector, CPUOffloadConnector):
            tier = kv_connector.cpu_pool.num_blocks * block
            tier_name = f"CPUOffloadConnector(num_cpu_blocks={kv_connector.cpu_pool.num_blocks})"
        gpu = f"num_gpu_blocks={cache_config.num_gpu_blocks!r}"
        if device.type == "cuda":
            pools = [(gpu, cache_config.num_gpu_blocks * block,
                      torch.cuda.mem_get_info(device)[0], f"free memory of {device}")]
        else:
            pools = [(gpu, cache_config.num_gpu_blocks * block, host,
                      "host memory (the model is on the CPU)")]
            host -= pools[0][1]
        pools += [(f"num_cpu_blocks={cache_config.num_cpu_blocks!r}", swap, host,
                   "host memory left"),
                  (tier_name, tier, host - swap, "host memory left")]
        for name, need, limit, where in pools:
            if need > limit:
                raise ValueError(f"{name} needs {format_bytes(need)} of KV cache "
                                 f"({format_bytes(block)} per block), more than the "
                                 f"{format_bytes(max(limit, 0))} of {where}")

    def _check_block_size(self) -> None:
        """The block manager's tables and the runner's tensors must agree on a block's size
        (dimension 1 of every ``[num_blocks, block_size, num_kv_heads, head_dim]`` cache):
        otherwise token ``t`` of a table lands in another slot than the one attention reads."""
        block_size = self.block_manager.block_size
        for cache in (c for layer in self.runner.gpu_caches for c in layer):   # K, V per layer
            if cache.shape[1] != block_size:
                raise ValueError(f"the block manager's block_size={block_size}, but the "
                                 f"runner's KV cache tensors hold {cache.shape[1]} tokens per "
                                 f"block (dimension 1 of {tuple(cache.shape)})")

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated so far: one per sample, one per kept beam, per step."""
        return self.scheduler.num_generated_tokens

    def now(self) -> float:
        """Seconds since the engine started."""
        return self.clock() - self._t0

    # ----------------------------------------------------------------------- requests
    def _check_prompt(self, prompt: str | Sequence[int]) -> tuple[int, ...]:
        """Text (encoded with BOS) or token ids: ints in the vocabulary, at least one; in the
        V1 design also shorter than ``max_model_len`` (vLLM 0.33.0 refuses a longer prompt at
        the door, ``SchedulerV1.check_prompt_len``; the V0 design finishes it as ignored)."""
        ids = prompt_token_ids(prompt, self.tokenizer, self.model.config.vocab_size)
        if self.design == "v1":
            self.scheduler.check_prompt_len(len(ids))
        return ids

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: int | None = None, arrival_time: float | None = None, *,
                    cache_salt: str | None = None, kv_transfer_params: dict | None = None
                    ) -> int:
        """Queue a prompt (text is encoded with BOS, or token ids as given); returns its id.

        Everything is checked before anything is queued (``ValueError`` naming the bad value):
        token ids in the vocabulary, the sampling parameters (``SamplingParams`` checks its own
        values), a new int ``request_id``, a finite ``arrival_time`` (numbers of any kind, by
        value: kept as Python ints and floats). ``cache_salt`` (vLLM's
        name) gives the request its own prefix-cache namespace: only requests with an equal
        salt share cached blocks, so one tenant cannot learn another's prompts from
        ``num_cached_tokens``. ``kv_transfer_params`` (vLLM's name, V1 with a KV connector
        only): the connector's parameters for this request, e.g. a prefill/decode
        disaggregation's ``do_remote_decode`` (:mod:`course_lib.engine.p2p_connector`),
        checked field by field by the connector for the role it plays
        (``check_kv_transfer_params``); the engine keeps the checked copy.

        Called while a step runs: from another thread it waits for the step to end; from
        inside the step (a hook on the stepping thread) it is queued for after the step."""
        with self._lock:                      # not while a step runs (another thread)
            ids = self._check_prompt(prompt)
            params = request_params(params, self.stop_token_ids, self.model.config.vocab_size)
            if request_id is None:
                request_id = self._next_request_id
            request_id = check_request_id(request_id, self._requests.keys() | self._deferred_ids)
            if kv_transfer_params is not None and self.design != "v1":
                raise ValueError("kv_transfer_params need design='v1' with a KV connector")
            if self.design == "v1":
                self.scheduler.check_request(params, kv_transfer_params)
            if kv_transfer_params is not None:       # each field, for the connector's role
                kv_transfer_params = self.kv_connector.check_kv_transfer_params(
                    kv_transfer_params)
            extra = {} if kv_transfer_params is None else \
                {"kv_transfer_params": kv_transfer_params}
            arrival = self.now() if arrival_time is None else arrival_time
            Request(request_id, ids, params, arrival, cache_salt=cache_salt)   # its checks
            if self._stepping:
                self._deferred.append(partial(self._add, request_id, ids, params, arrival,
                                              cache_salt, extra, deferred=True))
                self._deferred_ids.add(request_id)
                self._next_request_id = max(self._next_request_id, request_id + 1)
            else:
                self._add(request_id, ids, params, arrival, cache_salt, extra)
            return request_id

    def _add(self, request_id: int, ids: tuple[int, ...], params: SamplingParams,
             arrival: float, cache_salt: str | None, extra: dict, deferred: bool = False
             ) -> None:
        """Queue a checked request in the scheduler and commit its record. If queueing fails
        half-way (an ``n > 1`` request's children, say), the engine recovers: the request
        never was, and the error is raised; for an add deferred from inside a step (its
        caller has its id already), the request is answered instead, finished with
        ``finish_reason="error"``."""
        self._deferred_ids.discard(request_id)
        try:
            req = self.scheduler.add_request(request_id, ids, params, arrival, cache_salt,
                                             **extra)
        except BaseException as exc:
            self._recovery = {}                   # due: the add may have been half made
            self._recover_now()
            if not deferred or not isinstance(exc, Exception):
                raise
            req = Request(request_id, ids, params, arrival, cache_salt=cache_salt)
            req.finish_reason, req.finished_time = "error", self.now()
            req.finish_detail = f"could not be queued: {type(exc).__name__}: {exc}"
            self._unreturned.append(request_output(req, self.tokenizer))
            return
        self._next_request_id = max(self._next_request_id, request_id + 1)
        self._requests[request_id] = req
        self._seeds[request_id] = params.seed if params.seed is not None \
            else random.getrandbits(62)
        self._records[request_id] = record(req)
        self._counters = replace(self._counters, next_seq_id=self.scheduler.next_seq_id)

    def abort_request(self, request_id: int) -> bool:
        """Stop a request wherever it is and free its blocks; False if it is not here. Its
        final output (``finish_reason="abort"``, the tokens it had) is returned by the next
        :meth:`step`: every request added is answered exactly once. vLLM 0.33.0 answers an
        abort the same way where a client waits on the request (``AsyncLLM``, the server):
        ``OutputProcessor.abort_requests`` (``vllm/v1/engine/output_processor.py``) puts a
        final ``RequestOutput`` with ``FinishReason.ABORT`` on the request's queue at once;
        its offline ``LLMEngine`` (``vllm/v1/engine/llm_engine.py``, ``abort_request``)
        registers no queue and answers nothing. The course's one way out is ``step()``.

        Called while a step runs: from another thread it waits for the step to end; from
        inside the step it takes effect after it (True if the request is here now; it is then
        answered by the next step, unless the running step finishes it first)."""
        with self._lock:
            if self._stepping:
                self._deferred.append(partial(self._abort, request_id))
                return request_id in self._requests or request_id in self._deferred_ids
            return self._abort(request_id)

    def _abort(self, request_id: int) -> bool:
        req = self._requests.get(request_id)
        if req is None:
            return False
        try:
            self.scheduler.abort_request(request_id)
            req.finished_time = self.now()
            self.metrics.forget(req)
            answer = request_output(req, self.tokenizer)
        except BaseException as exc:           # recovered, with the request aborted and
            self._recovery = {request_id: (SequenceStatus.FINISHED_ABORTED,   # answered
                                           "aborted by the user")}
            self._recover_now()
            if not isinstance(exc, Exception):
                raise
            return True
        self._records.pop(request_id, None)
        self._requests.pop(request_id, None)
        self._seeds.pop(request_id, None)
        self._unreturned.append(answer)
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or answers (an abort's, a recovery's) the next ``step()`` returns:
        a loop ``while engine.has_unfinished_requests(): engine.step()`` answers every
        request."""
        return self.scheduler.has_unfinished_requests() or bool(self._deferred) \
            or self._recovery is not None or bool(self._unreturned)

    # --------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the cache ops and the model, sample, update; returns the requests
        that finished in this step. If anything in it fails, the step emits nothing and is
        recovered by recompute (module docstring): the request to blame, if one is found, is
        returned finished with ``finish_reason="error"``; else ``StepFailed`` is raised.

        ``add_request`` and ``abort_request`` called from another thread while a step runs
        wait for it to end (one lock); called from inside the step they take effect after it:
        a request is never changed under a running step."""
        with self._lock:
            if self._recovery is not None:           # an interrupted recovery, finished now
                try:
                    self._recover_now()
                except RecoveryFailed:
                    raise
                except Exception as exc:             # even one before it began: still due
                    raise RecoveryFailed(f"recovering failed ({type(exc).__name__}: {exc}); "
                                         "the next step() tries again") from exc
            while self._deferred:                    # adds and aborts made in the last step
                self._deferred.pop(0)()
            scheduled: list[tuple[SchedulerOutput, list[int]]] = []
            self._stepping = True
            try:
                outputs = self._step(scheduled)
            except BaseException as exc:
                self._stepping = False
                self._recovery = to_finish = {}       # due from here, whatever happens next
                if isinstance(exc, Exception):
                    try:
                        to_finish = self._blame(exc, scheduled)
                    except Exception:                # blame nobody
                        to_finish = {}
                self._recovery = to_finish
                try:
                    self._recover_now()
                except RecoveryFailed:
                    raise
                except Exception as again:           # even one before it began: still due
                    raise RecoveryFailed(f"recovering failed ({type(again).__name__}: "
                                         f"{again}); the next step() tries again") from again
                if not isinstance(exc, Exception):      # KeyboardInterrupt: recovered
                    raise
                if not to_finish:
                    raise StepFailed(f"step {self.num_steps} failed ({type(exc).__name__}: "
                                     f"{exc}) and was recovered by recompute; no request's "
                                     f"work fails alone while the others' succeed") from exc
                outputs = []
            finally:
                self._stepping = False
            outputs, self._unreturned = self._unreturned + outputs, []
            return outputs

    def _step(self, scheduled: list[tuple[SchedulerOutput, list[int]]]) -> list[RequestOutput]:
        """The step itself, ending with its commit; ``scheduled`` gets the schedule and each
        entry's computed tokens, for :func:`~course_lib.engine.recovery.find_culprit` if the
        step fails. Returns the outputs of the requests finished now."""
        sched = self.scheduler
        out = sched.schedule()
        scheduled.append((out, [e.seq.num_computed_tokens for e in out.scheduled]))
        self.runner.execute_cache_ops(out)
        logits = self._execute_model(out, out.scheduled)
        samples = {}
        for e in out.scheduled:
            if e.num_candidates:
                rid = e.request.request_id
                try:
                    samples[e.seq.seq_id] = self._sample_twice(e, logits[e.seq.seq_id])
                except Exception as exc:          # this request's sampling: it alone failed
                    raise RequestFailed(rid, exc) from exc
        tops = top_logprobs(out, logits)
        now = self.now()
        finished = sched.update(out, samples, now)
        if self.kv_connector is not None:          # the worker side's finished transfers
            conn = self.kv_connector
            sched.update_from_kv_xfer_finished(
                *conn.get_finished({s.seq_id for r in finished for s in r.seqs}),
                conn.get_block_ids_with_load_errors())
        attach_logprobs(out, tops)
        outputs = [request_output(r, self.tokenizer) for r in finished]
        records = records_of_step(sched, out, finished, self._requests)
        counters = Counters.of(sched, self.runner)
        self.metrics.record_step(sched, [e.request for e in out.scheduled if e.num_candidates],
                                 finished, now)       # all or nothing, and the last to fail
        # the commit: plain assignments, nothing that can fail
        self._records.update(records)
        for req in finished:
            self._records.pop(req.request_id, None)
            self._requests.pop(req.request_id, None)
            self._seeds.pop(req.request_id, None)
        self._counters = counters
        self.num_steps += 1
        self.last_output = out
        return outputs

    def _execute_model(self, out: SchedulerOutput, entries: list[ScheduledSeq]
                       ) -> dict[int, torch.Tensor]:
        """The forward over ``entries``, with the step's KV-connector metadata bound for it
        (and cleared after, whatever happens)."""
        conn = self.kv_connector
        if conn is None:
            return self.runner.execute_model(entries)
        conn.bind_connector_metadata(out.kv_connector_metadata)
        try:
            return self.runner.execute_model(entries)
        finally:
            conn.clear_connector_metadata()

    def _sample_twice(self, entry: ScheduledSeq, logits) -> list[tuple[int, float]]:
        """Sample (a seeded, pure function of the logits); a failure is tried once more, so
        that only a failure that repeats is blamed on the request."""
        seed = self._seeds[entry.request.request_id]
        try:
            return sample(entry, logits, seed)
        except Exception:
            return sample(entry, logits, seed)

    # ---------------------------------------------------------------- after a failed step
    def _blame(self, exc: Exception, scheduled: list[tuple[SchedulerOutput, list[int]]]
               ) -> dict[int, tuple[SequenceStatus, str]]:
        """The request to finish alone for a failed step: the one its exception names, or the
        one whose forward alone fails when the schedule is run again request by request
        (without the KV connector: no transfer is made twice). Nobody, if none is found."""
        culprit = None
        if isinstance(exc, RequestFailed):
            culprit = exc.request_id, exc.cause
        elif scheduled:
            try:
                culprit = find_culprit(*scheduled[0],
                                       lambda out, entries: self.runner.execute_model(entries))
            except Exception:
                culprit = None
        if culprit is None or culprit[0] not in self._records:
            return {}
        rid, cause = culprit
        return {rid: (SequenceStatus.FINISHED_ERROR,
                      f"failed in step {self.num_steps}: {type(cause).__name__}: {cause}")}

    def _recover_now(self) -> None:
        """The recovery that is due (``self._recovery``: the requests to finish alone, their
        outputs returned by the next ``step()``; ``recovery.recover``), tried up to three
        times, then ``RecoveryFailed`` (it stays due). Installs the new scheduler, commits a
        fresh record of every request (all now wait, nothing computed) and marks the recovery
        done. A ``KeyboardInterrupt`` in it leaves it due."""
        to_finish, conn = self._recovery, self.kv_connector
        for attempt in range(3):
            try:
                done = recover(self._records, self._counters, to_finish, self._new_scheduler,
                               self.runner, conn.reset_cache if conn is not None else None,
                               self.now())
                outputs = [request_output(r, self.tokenizer) for r in done.finished]
                ended = {r.request_id for r in done.finished}
                records = {rid: record(rec.request) for rid, rec in self._records.items()
                           if rid not in ended}
                self.metrics.record_recovery(done.scheduler, done.recomputed_tokens,
                                             done.finished)
                break
            except Exception as exc:
                if attempt == 2:
                    raise RecoveryFailed(f"recovering from a failed step failed three times "
                                         f"({type(exc).__name__}: {exc}); the next step() "
                                         f"tries again") from exc
        # installed: plain assignments, nothing that can fail
        self.scheduler = done.scheduler
        for rid in ended:
            self._requests.pop(rid, None)
            self._seeds.pop(rid, None)
        self._records = records
        self._unreturned += outputs
        self.num_recoveries += 1
        self._recovery = None

    # ----------------------------------------------------------------------- generate
    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 progress: bool = False,
                 on_step: Callable[[LLMEngine, SchedulerOutput], None] | None = None
                 ) -> list[RequestOutput]:
        """Run ``prompts`` (all arriving now) to completion; outputs in the prompts' order,
        one per prompt: a request another thread aborts comes back with
        ``finish_reason="abort"`` (:meth:`abort_request`). ``on_step(engine,
        scheduler_output)`` is called after every step (for drawings)."""
        prompts, params = generate_inputs(prompts, params, self._check_prompt, on_step=on_step,
                                          vocab_size=self.model.config.vocab_size)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        wanted = set(ids)
        done: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not progress, desc="generate", unit="req")
        while wanted - done.keys():
            if not self.has_unfinished_requests():     # a bug: every request is answered
                raise RuntimeError(f"requests {sorted(wanted - done.keys())} were never "
                                   f"answered")
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
