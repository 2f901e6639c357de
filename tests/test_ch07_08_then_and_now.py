"""Chapters 07 and 08: vLLM's defaults by release, article metric names, Orca before paging,
the max_model_len check and the H200 figure.

Expected values are read off vLLM's sources (0.6.3 and 0.33.0, cited in course_lib) or
multiplied out here, never taken from the library under test.
"""

import numpy as np
import pytest

from course_lib import capacity as cap
from course_lib.claims import tuning
from course_lib.exercises import ch08
from course_lib.sim.static import MemoryTimeline
from course_lib.sim.traces import sharegpt_like
from course_lib.sizing.models import ModelSpec, get_preset, verify_max_model_len
from course_lib.sizing.units import H200_MEMORY_GIB
from course_lib.viz.capacity_explorer import CapacityExplorer, ExplorerState

pytestmark = [pytest.mark.ch07, pytest.mark.ch08]

H200 = 143_771 / 1024


# ---------------------------------------------------------------- vLLM's scheduler defaults

@pytest.mark.parametrize("gib, name, entry, seqs, tokens", [
    (80.0, "NVIDIA A100-SXM4-80GB", "serve", 256, 2048),     # A100: the small tier by name
    (80.0, "NVIDIA A100-SXM4-80GB", "LLM", 256, 8192),
    (H200, "NVIDIA H200", "serve", 1024, 8192),               # >= 70 GiB, not an A100
    (H200, "NVIDIA H200", "LLM", 1024, 16_384),
    (179.0, "NVIDIA B200", "serve", 1024, 16_384),           # >= 160 GiB: both entry points
    (179.0, "NVIDIA B200", "LLM", 1024, 16_384),
    (45.0, "NVIDIA L40S", "serve", 256, 2048),
    (69.9, "", "LLM", 256, 8192),
])
def test_v1_batch_defaults_follow_get_batch_defaults(gib, name, entry, seqs, tokens):
    d = tuning.vllm_scheduler_defaults("0.33.0", gpu_memory_gib=gib, gpu_name=name,
                                       entry_point=entry)
    assert (d.max_num_seqs, d.max_num_batched_tokens) == (seqs, tokens)
    assert d.enable_chunked_prefill and d.gpu_memory_utilization == 0.92
    assert d.swap_space_gib is None


def test_v1_token_budget_is_capped_by_seqs_times_model_len():
    d = tuning.vllm_scheduler_defaults("0.33.0", gpu_memory_gib=80, gpu_name="A100",
                                       entry_point="serve", max_model_len=4)
    assert d.max_num_batched_tokens == 256 * 4
    d = tuning.vllm_scheduler_defaults("0.33.0", gpu_memory_gib=80, max_model_len=4)
    assert d.max_num_batched_tokens == 1024 * 4                 # H100 tier: 1024 sequences


@pytest.mark.parametrize("max_model_len, chunked, tokens", [
    (2048, False, 2048), (8192, False, 8192), (32_768, False, 32_768), (32_769, True, 512),
    (131_072, True, 512), (1024, False, 2048),
])
def test_v0_defaults_are_fixed_but_for_long_contexts(max_model_len, chunked, tokens):
    for gib, entry in ((24, "serve"), (H200, "LLM")):
        d = tuning.vllm_scheduler_defaults("0.6.3", gpu_memory_gib=gib, entry_point=entry,
                                           max_model_len=max_model_len)
        assert d.max_num_seqs == 256 and d.enable_chunked_prefill is chunked
        assert d.max_num_batched_tokens == tokens
        assert (d.gpu_memory_utilization, d.swap_space_gib) == (0.90, 4.0)


@pytest.mark.parametrize("kwargs", [
    {"version": "0.8.0"}, {"entry_point": "grpc"}, {"gpu_memory_gib": 0},
    {"max_model_len": 0}, {"max_model_len": True},
])
def test_defaults_reject_what_they_do_not_model(kwargs):
    args = {"version": "0.33.0", "gpu_memory_gib": 80.0, "entry_point": "serve",
            "max_model_len": 8192, **kwargs}
    version = args.pop("version")
    with pytest.raises(ValueError):
        tuning.vllm_scheduler_defaults(version, **args)


def test_preemption_mode_v0_recomputes_single_sequences_and_swaps_groups():
    assert tuning.vllm_preemption_mode("0.6.3", 1) == "recompute"
    assert tuning.vllm_preemption_mode("0.6.3", 2) == "swap"
    assert tuning.vllm_preemption_mode("0.6.3", 1, "swap") == "swap"
    assert tuning.vllm_preemption_mode("0.6.3", 4, "recompute") == "recompute"
    with pytest.raises(ValueError):
        tuning.vllm_preemption_mode("0.6.3", 1, "offload")
    with pytest.raises(ValueError):
        tuning.vllm_preemption_mode("0.6.3", 0)


def test_preemption_mode_v1_always_recomputes_and_has_no_option():
    assert [tuning.vllm_preemption_mode("0.33.0", n) for n in (1, 2, 8)] == ["recompute"] * 3
    with pytest.raises(ValueError, match="no preemption_mode"):
        tuning.vllm_preemption_mode("0.33.0", 1, "swap")
    with pytest.raises(ValueError):
        tuning.vllm_preemption_mode("0.7.0", 1)


# ---------------------------------------------------------------- metric names

def test_exported_names_follow_the_design():
    v0, v1 = tuning.exported_names("v0"), tuning.exported_names("v1")
    assert {"vllm:gpu_cache_usage_perc", "vllm:num_requests_swapped",
            "vllm:time_per_output_token_seconds", "vllm:gpu_prefix_cache_hit_rate"} <= v0
    assert {"vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total", "vllm:inter_token_latency_seconds"} <= v1
    assert not {"vllm:gpu_cache_usage_perc", "vllm:num_requests_swapped",
                "vllm:cpu_cache_usage_perc"} & v1
    both = {"vllm:num_requests_running", "vllm:num_preemptions_total", "vllm:cache_config_info"}
    assert both <= v0 & v1


def test_article_metric_names_that_never_existed():
    rows = {(r.name, r.cited): r for r in tuning.audit_metric_names()}
    invented = ["vllm:num_gpu_blocks_total", "vllm:num_gpu_blocks_free", "vllm:num_gpu_blocks",
                "vllm:num_free_blocks", "vllm:num_preemption", "vllm:cache_usage"]
    for name in invented:
        (row,) = [r for (n, _), r in rows.items() if n == name]
        assert not row.in_v0 and not row.in_v1, name
    usage = rows[("vllm:gpu_cache_usage_perc", '"Block Manager tutorial" §10')]
    assert usage.in_v0 and not usage.in_v1 and usage.read_v1 == "vllm:kv_cache_usage_perc"
    running = rows[("vllm:num_requests_running", '"Memory optimization" prefix caching case')]
    assert running.in_v0 and running.in_v1
    preempt = rows[("vllm:num_preemption", '"PagedAttention explained" §7.1')]
    assert preempt.read_v0 == preempt.read_v1 == "vllm:num_preemptions_total"
    text = tuning.format_metric_audit(list(rows.values()))
    assert text.count("\n") == 2 * len(rows) - 1
    assert "vllm:num_free_blocks (\"PagedAttention explained\" §7.1, free blocks): V0 no such " \
           "metric, V1 no such metric" in text


# ---------------------------------------------------------------- continuous batching first

def timeline(waiting, batch, rejected=0):
    zeros = np.zeros(len(waiting), dtype=np.int64)
    return MemoryTimeline("t", 10, zeros, zeros, zeros, zeros, zeros + 10,
                          np.array(batch), np.array(waiting), admitted=[], rejected=rejected)


def test_mid_batch_joins_counts_admissions_beside_running_requests():
    assert tuning.mid_batch_joins(timeline([3, 1, 1, 0], [1, 3, 2, 2])) == 2 + 1
    assert tuning.mid_batch_joins(timeline([2, 2, 0], [0, 0, 2])) == 0   # joined an empty batch
    assert tuning.mid_batch_joins(timeline([0], [4])) == 0
    with pytest.raises(ValueError, match="rejected"):
        tuning.mid_batch_joins(timeline([1, 0], [1, 2], rejected=1))


def test_orca_batches_continuously_and_paging_fits_more():
    trace = sharegpt_like(60, seed=3)
    r = tuning.batching_before_paging(trace, num_blocks=400)
    # 6,400 slots hold three 2,048-slot reservations: the first three start together, and each
    # later request joins the two still running when one leaves
    assert r.num_requests == 60 and r.contiguous_joins == 60 - 3
    assert r.contiguous_mean_batch == 6400 // 2048 < r.paged_mean_batch
    alone = tuning.batching_before_paging(trace, num_blocks=200)   # one reservation at a time
    assert alone.contiguous_joins == 0 and alone.contiguous_mean_batch == 1


# ---------------------------------------------------------------- max_model_len, the H200

@pytest.mark.parametrize("name, length", [
    ("llama-2-7b", 4096), ("llama-2-70b", 4096), ("llama-3-8b", 8192), ("llama-3-70b", 8192),
    ("qwen2.5-7b", 131_072), ("deepseek-v3", 163_840)])
def test_verify_max_model_len_defaults_to_and_caps_at_the_models_length(name, length):
    spec = get_preset(name)
    assert verify_max_model_len(spec) == length
    assert verify_max_model_len(spec, length) == length
    assert verify_max_model_len(spec, 16) == 16
    with pytest.raises(ValueError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        verify_max_model_len(spec, length + 1)
    assert verify_max_model_len(spec, 2 * length, allow_long_max_model_len=True) == 2 * length


def test_verify_max_model_len_unknown_length_and_bad_values():
    spec = ModelSpec("unknown", 2, 4, 4, 64, num_params=1)
    assert verify_max_model_len(spec) == 2048            # vLLM's guess without the key
    assert verify_max_model_len(spec, 1_000_000) == 1_000_000
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            verify_max_model_len(get_preset("llama-2-7b"), bad)


def test_explorer_warns_about_a_max_model_len_the_model_refuses():
    state = ExplorerState(preset="llama-2-7b", max_model_len=131_072)
    lines = state.summary().splitlines()
    assert lines[0].startswith("Llama-2-7B (MHA)")
    assert lines[-1].startswith("warning: max_model_len=131,072") and "4,096" in lines[-1]
    assert "warning" not in ExplorerState(preset="qwen2.5-7b",
                                              max_model_len=131_072).summary()
    explorer = CapacityExplorer()
    assert "warning" not in explorer.summary.value               # Llama-3-8B at 8,192
    explorer.max_model_len.value = 32_768
    assert "max_position_embeddings=8,192" in explorer.summary.value
    explorer.preset.value = "deepseek-v3"
    assert "warning" not in explorer.summary.value


def test_h200_figure_and_the_exercise_case_that_uses_it():
    assert H200_MEMORY_GIB == H200 and round(H200, 1) == 140.4
    case = (H200_MEMORY_GIB, 0.92, 65.71, 2, 2_621_440)
    assert case in ch08.BLOCK_CASES
    usable = round(round(143_771 * 2**20) * 0.92)
    expected = (usable - round(65.71 * 2**30) - 2 * 2**30) // (16 * 80 * 2 * 4 * 128 * 2)
    assert expected == 25_173 == ch08.reference_num_gpu_blocks(*case)
    assert 2_621_440 == cap.block_bytes(get_preset("llama-3-70b"), 16, 2)
