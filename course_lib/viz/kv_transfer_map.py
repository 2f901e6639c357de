"""Chapter 13's then-and-now map: the course's KV-transfer modules (the connector interface, the
CPU offload tier, P/D disaggregation) beside vLLM 0.33.0's and SGLang 0.5.23's files.

The rows are data so that the tests can hold them to the sources: every ``course_lib/`` path
must exist here, every ``vllm/`` path in vLLM 0.33.0's source distribution and every ``srt/``
path in SGLang 0.5.23's wheel (under ``sglang/``), and the chapter's table must be
:func:`map_markdown` of them (``tests/test_ch13.py``; ``make test-fidelity`` fetches both
sources). Paths in the SGLang column are relative to ``python/sglang/`` of its repository, as
in chapter 12's map.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple


class MapRow(NamedTuple):
    """One concept: the course's module(s), what they do, vLLM 0.33.0's and SGLang 0.5.23's
    counterparts (files in backquotes, names after them in parentheses)."""
    course: str
    concept: str
    vllm: str
    sglang: str


KV_TRANSFER_MAP: tuple[MapRow, ...] = (
    MapRow("`course_lib/engine/kv_connector.py`, `course_lib/scheduler/kv_connector.py`",
           "the connector interface: a scheduler side and a worker side, one step's metadata "
           "between them",
           "`vllm/distributed/kv_transfer/kv_connector/v1/base.py` (`KVConnectorBase_V1`, "
           "`KVConnectorRole`); the runner calls the worker side in "
           "`vllm/model_executor/layers/attention/kv_transfer_utils.py`",
           "no common interface: the host tier is part of the radix cache, P/D a pair of "
           "scheduler mixins (rows below)"),
    MapRow("`course_lib/scheduler/v1.py` (`waiting_for_remote`, "
           "`update_from_kv_xfer_finished`)",
           "external hits asked after the local prefix cache; a request waiting for its "
           "blocks; blocks kept until a transfer is done",
           "`vllm/v1/core/sched/scheduler.py` (`WAITING_FOR_REMOTE_KVS`, "
           "`_update_waiting_for_remote_kv`, `_update_from_kv_xfer_finished`), the status in "
           "`vllm/v1/request.py`",
           "the decode server's queues in `srt/disaggregation/decode.py` "
           "(`DecodePreallocQueue`, `DecodeTransferQueue`)"),
    MapRow("`course_lib/engine/cpu_offload.py` (`CPUOffloadConnector`)",
           "a CPU tier of prefix blocks: full blocks stored when computed, keyed by block "
           "hash, loaded back on a hit",
           "`vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py` "
           "(`OffloadingConnector`, what the tier's size below builds) over "
           "`vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py`; or "
           "`vllm/distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py` "
           "(`SimpleCPUOffloadConnector`, with `VLLM_USE_SIMPLE_KV_OFFLOAD=1`) over "
           "`vllm/v1/simple_kv_offload/manager.py`",
           "HiCache: `srt/mem_cache/unified_radix_cache.py` (`init_hicache`, `load_back`): a "
           "tree node is backed up to host memory once its hit count reaches "
           "`write_through_threshold` (or when evicted, with `write_back`), its copies run by "
           "`srt/managers/cache_controller.py` (`HiCacheController`)"),
    MapRow("`course_lib/engine/cpu_offload.py` (`CPUBlockPool`)",
           "the tier's own blocks, least recently used evicted first",
           "`vllm/v1/kv_offload/cpu/manager.py` with `vllm/v1/kv_offload/cpu/policies/lru.py` "
           "(`LRUCachePolicy`; `arc.py` is the other policy)",
           "`srt/mem_cache/pool_host/base.py` (`HostKVCache`), "
           "`srt/mem_cache/pool_host/mha.py` (`MHATokenToKVPoolHost`), "
           "`srt/mem_cache/memory_pool_host.py`"),
    MapRow("`course_lib/config.py` (`CacheConfig.kv_offloading_size`)",
           "the tier's size",
           "`vllm/config/cache.py` (`kv_offloading_size` in GiB, `kv_offloading_backend`), "
           "made a connector by `vllm/config/vllm.py` (`_post_init_kv_transfer_config`)",
           "`srt/arg_groups/fields/memory.py` (`enable_hierarchical_cache`, `hicache_ratio` "
           "of the device pool, `hicache_size` in GB, `hicache_write_policy`)"),
    MapRow("`course_lib/engine/p2p_connector.py` (`P2PConnector`, `KVLayout`), "
           "`course_lib/parallel/disagg.py` (`DisaggCluster`)",
           "P/D disaggregation: the prefill side's blocks sent to blocks the decode side "
           "allocated, a proxy routing each request from one to the other; engines whose "
           "caches differ refused when they connect",
           "`vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py` "
           "(`kv_transfer_params`: `do_remote_decode`, `do_remote_prefill`, "
           "`remote_block_ids`; `delay_free_blocks`), "
           "`vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_scheduler.py`",
           "`srt/disaggregation/prefill.py`, `srt/disaggregation/decode.py`, "
           "`srt/disaggregation/base/conn.py` (`BaseKVSender`, `BaseKVReceiver`)"),
    MapRow("`course_lib/sim/disagg_replay.py` (`replay_colocated`, `replay_disaggregated`, "
           "`max_goodput_rate`)",
           "colocated against xPyD on the same GPUs, replayed without a model: requests "
           "routed to the least loaded engine, goodput under an SLO",
           "`vllm/v1/engine/core_client.py` (`DPLBAsyncMPClient`: the data-parallel load "
           "balancer), `vllm/benchmarks/serve.py` (`request_goodput`)",
           "`srt/managers/data_parallel_controller.py` (`DataParallelController`, "
           "`LoadBalanceMethod`); goodput in `benchmark/goodput.py` (`calculate_goodput`)"),
)

HEADER = ("| `course_lib` | what | vLLM 0.33.0 | SGLang 0.5.23 |\n"
          "| --- | --- | --- | --- |")


def map_markdown(rows: Sequence[MapRow] = KV_TRANSFER_MAP) -> str:
    """The rows as a markdown table (the chapter's)."""
    return "\n".join([HEADER, *(f"| {r.course} | {r.concept} | {r.vllm} | {r.sglang} |"
                                for r in rows)])


def cited_paths(rows: Sequence[MapRow] = KV_TRANSFER_MAP) -> dict[str, list[str]]:
    """Every file the rows cite, by source: ``"course"`` (``course_lib/...``), ``"vllm"``
    (``vllm/...``) and ``"sglang"`` (``srt/...``)."""
    def paths(texts: list[str], prefix: str) -> list[str]:
        return sorted({p for t in texts for p in re.findall(rf"`({prefix}/[\w/.]+)`", t)})

    return {"course": paths([r.course for r in rows], "course_lib"),
            "vllm": paths([r.vllm for r in rows], "vllm"),
            "sglang": paths([r.sglang for r in rows], "srt")}
