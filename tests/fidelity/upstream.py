"""Import vLLM 0.33.0's and SGLang 0.5.23's pure-Python KV-cache modules from the fetched
sources (tests/fidelity/fetch.py), without torch, CUDA or the rest of either package.

How: a meta-path finder serves three kinds of module while :func:`load` runs.

* **Real**: the modules the algorithm lives in (``REAL_VLLM`` / ``REAL_SGLANG``) are executed
  from the extracted files, unchanged.
* **Packages** above them (``vllm``, ``vllm.v1``, ...): empty packages, so that importing
  ``vllm.v1.core.block_pool`` does not run ``vllm/__init__.py`` (which imports torch and the
  engine); one that re-exports a real module's names (``REEXPORTS``) gives them from it.
* **Stubs**: every other module they import (``torch``, ``vllm.config``, ``vllm.v1.request``,
  ``sglang.srt.observability...``): a module whose every attribute is a placeholder class
  (:class:`Placeholder`), except the few names below that the algorithm does read
  (``OVERRIDES``: a logger, ``envs`` flags, a list-backed stand-in for the torch tensor that
  SGLang's radix tree slices and clones). For vLLM's scheduler (:func:`load_vllm_scheduler`,
  ``REAL_VLLM_SCHEDULER``: the scheduler, its request, queues, outputs and the connector's
  base class are real) a few more: plain records for the engine's output structs and enums
  (msgspec in vLLM), ``ConstantList``, a null profiler scope, the null KV-event publisher, a
  connector factory that builds the harness's connector, and the multimodal and prompt-length
  helpers for a text-only request (each asserts it is given no multimodal input).

A placeholder only has to exist: it is an import, an annotation, a default argument, a type
in an ``isinstance`` check the course's operations never satisfy (KV events, metrics, Mamba,
sliding windows, hybrid models). A placeholder that is *called* in a code path the harness
uses fails loudly (:class:`Placeholder` raises), so a stub can never stand in for the real
algorithm silently.

The third-party stubs (torch, msgspec, zmq, ...) leave ``sys.modules`` when loading ends, so
a real torch imported later in the same process is the real one, and a real one imported
before is set aside while loading (the course's CPU tier imports torch and numpy); the loaded
``vllm.*`` and ``sglang.*`` modules stay (they name themselves as the real ones do). The
offloading connector's modules (:func:`load_vllm_offloading`) get the real numpy: its
transfer specs hold their block ids in numpy arrays.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.abc
import importlib.util
import logging
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REAL_VLLM = (
    "vllm.utils.math_utils",
    "vllm.utils.hashing",
    "vllm.v1.kv_cache_spec_registry",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.metrics.stats",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.kv_cache_metrics",
    "vllm.v1.core.block_pool",
    "vllm.v1.core.single_type_kv_cache_manager",
    "vllm.v1.core.kv_cache_coordinator",
    "vllm.v1.core.kv_cache_manager",
)
# vLLM 0.33.0's V1 scheduler (``Scheduler`` in vllm/v1/core/sched/scheduler.py) with what it
# runs on: its request, queues, output records, the connector's base class, the encoder cache
# manager (empty: no multimodal inputs), over the KV-cache modules above.
REAL_VLLM_SCHEDULER = REAL_VLLM + (
    "vllm.v1.structured_output.request",
    "vllm.v1.request",
    "vllm.v1.core.sched.interface",
    "vllm.v1.core.sched.output",
    "vllm.v1.core.sched.request_queue",
    "vllm.v1.core.sched.utils",
    "vllm.v1.outputs",
    "vllm.v1.core.encoder_cache_manager",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "vllm.v1.core.sched.scheduler",
)
# vLLM 0.33.0's offloading connector, scheduler side (``OffloadingConnectorScheduler`` in
# vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py) with the CPU tier's
# manager (``CPUOffloadingManager`` in vllm/v1/kv_offload/cpu/manager.py, its ``lru`` policy),
# the spec base class, the transfer records and the stats records it fills, over the scheduler.
REAL_VLLM_OFFLOADING = REAL_VLLM_SCHEDULER + (
    "vllm.v1.metrics.cache_hit_source",
    "vllm.v1.kv_offload.config",
    "vllm.v1.kv_offload.base",
    "vllm.v1.kv_offload.cpu.common",
    "vllm.v1.kv_offload.cpu.policies.base",
    "vllm.v1.kv_offload.cpu.policies.lru",
    "vllm.v1.kv_offload.cpu.policies.factory",
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
    "vllm.v1.kv_offload.cpu.manager",
    "vllm.distributed.kv_transfer.kv_connector.utils",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.events",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
)
REAL_SGLANG = (
    "sglang.srt.mem_cache.evict_policy",
    "sglang.srt.mem_cache.utils",
    "sglang.srt.mem_cache.events",
    "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.radix_cache",
)
REAL_SGLANG_ALLOCATORS = (             # TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator
    "sglang.srt.mem_cache.allocator.base",
    "sglang.srt.mem_cache.allocator.token",
    "sglang.srt.mem_cache.allocator.paged",
)
STUBBED_ROOTS = ("torch", "triton", "msgspec", "zmq", "numpy", "cbor2_", "sgl_kernel",
                 "transformers", "PIL", "psutil", "prometheus_client", "pydantic")


class _PlaceholderType(type):
    def __getattr__(cls, name: str) -> Any:       # Enum.MEMBER, Class.CONSTANT
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{cls.__module__}.{cls.__qualname__}", name)
        setattr(cls, name, value)
        return value


class Placeholder(metaclass=_PlaceholderType):
    """What a stubbed module's attributes are: a class, so that it can be subclassed, used in
    ``X | Y`` and ``isinstance``; its attributes are placeholders too (``Enum.MEMBER``);
    subscripting it (``Foo[int]``) gives itself; calling it raises: the harness must not be
    running stubbed code."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__module__}.{type(self).__qualname__} is a stub: "
                           "the fidelity harness reached code it does not load for real")

    def __class_getitem__(cls, item):
        return cls

    def __init_subclass__(cls, **kwargs):          # accept class keywords (total=False, ...)
        pass


def _placeholder(module: str, name: str) -> type:
    return type(name, (Placeholder,), {"__module__": module, "__qualname__": name})


class _StubModule(types.ModuleType):
    def __init__(self, name: str, overrides: dict[str, Any]) -> None:
        super().__init__(name)
        self.__path__ = []                          # a package: submodules are stubs too
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(self.__name__, name)
        setattr(self, name, value)
        return value


# ------------------------------------------------------------------ what the algorithm reads
class _Logger(logging.LoggerAdapter):
    """vLLM's logger: a stdlib logger with ``*_once`` methods."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(name), {})

    def warning_once(self, msg, *args, **kwargs):
        self.warning(msg, *args)

    def info_once(self, msg, *args, **kwargs):
        self.info(msg, *args)

    def debug_once(self, msg, *args, **kwargs):
        self.debug(msg, *args)


class Tensor(list):
    """The slice of torch's 1-D int64 tensor SGLang's radix tree and allocators use: slicing
    gives a tensor, ``clone``, ``to``, ``tolist``, ``len``, ``numel``, ``t // k``, and the one
    broadcast of the paged ``alloc``, ``(pages[:, None] * k + arange(k)).reshape(-1)``
    (``+`` and ``*`` of two tensors stay the list's: nothing the harness loads adds them)."""

    def __getitem__(self, idx):
        if idx == (slice(None), None):
            return _Column(self)
        out = super().__getitem__(idx)
        return Tensor(out) if isinstance(idx, slice) else out

    def numel(self) -> int:
        return len(self)

    def __floordiv__(self, k: int) -> Tensor:
        return Tensor(x // k for x in self)

    def reshape(self, *shape) -> Tensor:
        assert shape == (-1,), shape
        return Tensor(self)

    def clone(self) -> Tensor:
        return Tensor(self)

    def to(self, *args, **kwargs) -> Tensor:
        return Tensor(self)

    def tolist(self) -> list:
        return list(self)


class _Column:
    """``t[:, None]``, a column: times a number, then plus a row, gives the rows flattened
    (what ``.reshape(-1)`` of the 2-D result would)."""

    def __init__(self, values) -> None:
        self.values = list(values)

    def __mul__(self, k: int) -> _Column:
        return _Column(x * k for x in self.values)

    def __add__(self, row) -> Tensor:
        return Tensor(x + y for x in self.values for y in row)


def _torch() -> dict[str, Any]:
    def tensor(data, dtype=None, device=None):
        return Tensor(data)

    def arange(start, end=None, dtype=None, device=None):
        return Tensor(range(start) if end is None else range(start, end))

    def unique(t):
        return Tensor(sorted(set(t)))

    def sort(t):
        order = sorted(range(len(t)), key=t.__getitem__)
        return Tensor(t[i] for i in order), Tensor(order)

    def empty(shape, dtype=None, device=None):
        assert tuple(shape) == (0,), shape
        return Tensor()

    def cat(values):
        return Tensor(x for v in values for x in v)

    class device(str):                             # noqa: N801 (torch's name)
        pass

    class iinfo:                                   # noqa: N801 (torch's name)
        def __init__(self, dtype):
            self.max, self.min = 2**63 - 1, -2**63

    return {"Tensor": Tensor, "tensor": tensor, "empty": empty, "cat": cat, "device": device,
            "iinfo": iinfo, "int64": "int64", "int32": "int32", "dtype": type("dtype", (), {}),
            "arange": arange, "unique": unique, "sort": sort}


class _VllmEnvs(types.ModuleType):
    """``vllm.envs``: every flag off (None) except those the modules read, at their defaults."""

    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _SglangEnvs:
    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"sglang envs.{name} is stubbed")


# ----------------------------------------- what vLLM's scheduler reads (load_vllm_scheduler)
class _ConstantList(Sequence):
    """``vllm.v1.utils.ConstantList``: a read-only view of a list (the request's tokens)."""

    def __init__(self, x: list) -> None:
        self._x = x

    def __getitem__(self, item):
        return self._x[item]

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self):
        return iter(self._x)

    def __contains__(self, item) -> bool:
        return item in self._x

    def copy(self) -> list:
        return self._x.copy()


class _EngineCoreEventType(enum.IntEnum):      # vllm/v1/engine/__init__.py's
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class _FinishReason(enum.IntEnum):             # vllm/v1/engine/__init__.py's
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4


class _Record(types.SimpleNamespace):
    """``EngineCoreOutput`` / ``EngineCoreOutputs`` (msgspec structs in vLLM): the fields as
    given, for the harness to read."""

    def __init__(self, **fields) -> None:
        super().__init__(**fields)


class _EventPublisherFactory:
    """``vllm.distributed.kv_events.EventPublisherFactory``: no ``kv_events_config``, so the
    scheduler gets vLLM's null publisher; the harness makes no KV events (publishing one is a
    path it does not load for real)."""

    @staticmethod
    def create(config, data_parallel_rank: int = 0):
        assert config is None, config

        class NullEventPublisher:
            def publish(self, events):
                raise RuntimeError("the fidelity harness makes no KV-cache events")

            def shutdown(self):
                pass

        return NullEventPublisher()


class _KVConnectorFactory:
    """``KVConnectorFactory.create_connector``: the connector class named by the config's
    ``kv_transfer_config.kv_connector``, here the harness's scripted one, given as the class
    itself (``kv_transfer_config.connector_class``): vLLM imports it by name from a registry."""

    @staticmethod
    def create_connector(config, role, kv_cache_config):
        return config.kv_transfer_config.connector_class(config, role, kv_cache_config)


def _length_from_prompt_token_ids_or_embeds(prompt_token_ids, prompt_embeds) -> int:
    """``vllm.utils.length_from_prompt_token_ids_or_embeds``, for token ids (no embeddings)."""
    assert prompt_embeds is None
    return len(prompt_token_ids)


def _strip_covered_mm_data(mm_features, num_computed_tokens, uses_mrope=False):
    """``vllm.multimodal.utils.strip_covered_mm_data`` for a request with no multimodal
    inputs (the only kind the harness makes): it returns them as they are."""
    assert not mm_features, "the fidelity harness makes no multimodal requests"
    return mm_features


# Package modules (empty, above the real modules) that re-export names of a real module:
# ``from package import Name`` imports the real module and gives its ``Name``.
REEXPORTS: dict[str, dict[str, str]] = {
    # kv_connector/v1/__init__.py also imports DecodeBenchConnector (torch): not loaded
    "vllm.distributed.kv_transfer.kv_connector.v1": dict.fromkeys(
        ("KVConnectorBase_V1", "KVConnectorRole", "SupportsHMA", "supports_hma"),
        "vllm.distributed.kv_transfer.kv_connector.v1.base"),
}


class _Package(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        source = REEXPORTS.get(self.__name__, {}).get(name)
        if source is None:
            raise AttributeError(name)
        value = getattr(importlib.import_module(source), name)
        setattr(self, name, value)
        return value


OVERRIDES: dict[str, dict[str, Any]] = {
    "vllm.logger": {"init_logger": _Logger},
    # no engine config: KVCacheSpecRegistry registers the built-in specs without one
    "vllm.config": {"get_current_vllm_config_or_none": lambda: None},
    # vllm.platforms.interface.Platform.register_custom_kv_cache_specs: none by default
    "vllm.platforms": {"current_platform": types.SimpleNamespace(
        register_custom_kv_cache_specs=lambda vllm_config: None)},
    "torch": _torch(),
    "sglang.srt.environ": {"envs": _SglangEnvs()},
    # allocator/paged.py, at import and in __init__: not ROCm, SGLANG_DEBUG_MEMORY_POOL unset
    "sglang.srt.utils": {"is_hip": lambda: False,
                         "get_bool_env_var": lambda name, default="false": False},
    # vLLM's scheduler (load_vllm_scheduler)
    "vllm.utils": {"length_from_prompt_token_ids_or_embeds":
                   _length_from_prompt_token_ids_or_embeds},
    "vllm.v1.utils": {"ConstantList": _ConstantList,
                      "record_function_or_nullcontext": lambda name: contextlib.nullcontext()},
    "vllm.v1.engine": {"EngineCoreEventType": _EngineCoreEventType,
                       "FinishReason": _FinishReason,
                       "EngineCoreOutput": _Record, "EngineCoreOutputs": _Record},
    "vllm.distributed.kv_events": {"EventPublisherFactory": _EventPublisherFactory},
    "vllm.multimodal.utils": {"strip_covered_mm_data": _strip_covered_mm_data},
    "vllm.distributed.kv_transfer.kv_connector.factory": {
        "KVConnectorFactory": _KVConnectorFactory},
}
MODULE_OVERRIDES = {"vllm.envs": lambda: _VllmEnvs("vllm.envs")}


# ------------------------------------------------------------------------------- the finder
class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: dict[str, Path], real: set[str],
                 real_roots: tuple[str, ...] = ()) -> None:
        self.roots, self.real, self.real_roots = roots, real, real_roots
        self.packages = {n.rsplit(".", i)[0] for n in real for i in range(1, n.count(".") + 1)}

    def _ours(self, name: str) -> bool:
        top = name.split(".")[0]
        return top in self.roots or top in STUBBED_ROOTS and top not in self.real_roots

    def find_spec(self, name, path=None, target=None):
        if not self._ours(name):
            return None
        if name in self.real:
            top = name.split(".")[0]
            file = self.roots[top] / (name.replace(".", "/") + ".py")
            return importlib.util.spec_from_file_location(name, file)
        return importlib.util.spec_from_loader(name, self, is_package=True)

    def create_module(self, spec):
        name = spec.name
        if name in MODULE_OVERRIDES:
            return MODULE_OVERRIDES[name]()
        if name in self.packages:
            module = _Package(name)
            module.__path__ = []
            module.__dict__.update(OVERRIDES.get(name, {}))
            return module
        return _StubModule(name, OVERRIDES.get(name, {}))

    def exec_module(self, module):
        pass


def load(roots: dict[str, Path], modules: tuple[str, ...],
         warm=lambda loaded: None, real_roots: tuple[str, ...] = ()) -> dict[str, types.ModuleType]:
    """Import ``modules`` (real, from the files under ``roots``: top-level package -> the
    folder holding it) and return them by name; ``warm(loaded)`` runs while the stubs are in
    place (for the code's own lazy imports). A third-party package already imported for real
    (torch, numpy: the course's own modules import them) is set aside while loading, so that
    the loaded modules get the stub all the same, unless ``real_roots`` names it (imported
    first, it is the real one they get)."""
    for top, root in roots.items():
        if not (root / top).is_dir():
            raise FileNotFoundError(f"{root / top} is missing: run tests/fidelity/fetch.py")
    set_aside = {n: sys.modules.pop(n) for n in list(sys.modules)
                 if n.split(".")[0] in STUBBED_ROOTS and n.split(".")[0] not in real_roots}
    before = set(sys.modules)
    finder = _Finder(roots, set(modules), real_roots)
    sys.meta_path.insert(0, finder)
    try:
        loaded = {name: importlib.import_module(name) for name in modules}
        warm(loaded)
    finally:
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - before:
            if name.split(".")[0] in STUBBED_ROOTS and name.split(".")[0] not in real_roots:
                del sys.modules[name]
        sys.modules.update(set_aside)
    for name, module in loaded.items():
        where = Path(module.__file__).resolve()
        assert where.is_relative_to(roots[name.split(".")[0]].resolve()), (name, where)
    return loaded


def load_vllm(root: Path) -> types.SimpleNamespace:
    """vLLM 0.33.0's modules, by their last name (``ns.block_pool``, ``ns.kv_cache_utils``)."""
    def warm(loaded):          # the spec -> manager registry fills itself on first use
        loaded["vllm.v1.kv_cache_spec_registry"].KVCacheSpecRegistry._ensure_registered()

    mods = load({"vllm": root}, REAL_VLLM, warm)
    return types.SimpleNamespace(**{n.rsplit(".", 1)[-1]: m for n, m in mods.items()})


def load_sglang(root: Path) -> types.SimpleNamespace:
    mods = load({"sglang": root}, REAL_SGLANG)
    return types.SimpleNamespace(**{n.rsplit(".", 1)[-1]: m for n, m in mods.items()})


def load_sglang_allocators(root: Path) -> types.SimpleNamespace:
    """SGLang 0.5.23's KV-slot allocators (``ns.token``, ``ns.paged``, ``ns.base``)."""
    mods = load({"sglang": root}, REAL_SGLANG_ALLOCATORS)
    return types.SimpleNamespace(**{n.rsplit(".", 1)[-1]: m for n, m in mods.items()})


def load_vllm_scheduler(root: Path) -> types.SimpleNamespace:
    """vLLM 0.33.0's V1 scheduler and the modules under it (``ns.scheduler``, ``ns.request``,
    ``ns.outputs``, ``ns.base`` (the connector's), ``ns.kv_cache_manager``, ...). Loaded afresh:
    :func:`load_vllm` leaves ``vllm.v1.request`` a stub in ``sys.modules``, which the scheduler
    needs real; the modules :func:`load_vllm` returned keep working (each holds its own)."""
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]

    def warm(loaded):
        loaded["vllm.v1.kv_cache_spec_registry"].KVCacheSpecRegistry._ensure_registered()

    mods = load({"vllm": root}, REAL_VLLM_SCHEDULER, warm)
    return types.SimpleNamespace(**{n.rsplit(".", 1)[-1]: m for n, m in mods.items()})


def load_vllm_offloading(root: Path) -> types.SimpleNamespace:
    """vLLM 0.33.0's V1 scheduler (as :func:`load_vllm_scheduler`) and its offloading connector's
    scheduler side with the CPU manager (``ns.scheduler`` is the V1 scheduler's module, the
    offloading one is ``ns.offloading_scheduler``; ``ns.manager``, ``ns.lru``, ``ns.base``
    (the connector's), ``ns.kv_offload_base``, ``ns.common``, ...). numpy is the real one
    (``vllm/v1/kv_offload/base.py`` builds the transfer specs' block-id arrays with it)."""
    import numpy  # noqa: F401  (imported first: the loaded modules get the real one)

    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]

    def warm(loaded):
        loaded["vllm.v1.kv_cache_spec_registry"].KVCacheSpecRegistry._ensure_registered()

    mods = load({"vllm": root}, REAL_VLLM_OFFLOADING, warm, real_roots=("numpy",))
    renamed = {"vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler":
               "offloading_scheduler",
               "vllm.v1.kv_offload.base": "kv_offload_base",
               "vllm.v1.kv_offload.cpu.common": "cpu_common",
               "vllm.v1.kv_offload.cpu.policies.base": "policies_base",
               "vllm.distributed.kv_transfer.kv_connector.v1.metrics": "connector_metrics",
               "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics":
               "offloading_metrics",
               "vllm.v1.kv_offload.config": "offloading_config",
               "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config":
               "connector_offloading_config",
               "vllm.distributed.kv_transfer.kv_connector.utils": "connector_utils"}
    return types.SimpleNamespace(**{renamed.get(n, n.rsplit(".", 1)[-1]): m
                                    for n, m in mods.items()})
