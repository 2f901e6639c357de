"""The CPU offload tier measured (``course_lib/engine/offload_study.py``, ``bench/offload.py``):
on the multi-turn chat and the RAG-like trace, at small sizes, the engine with the tier gives
the tokens of the engine without it (greedy and seeded), its hits are > 0 when the GPU pool
is too small and 0 when it holds everything, and a tier of one or two blocks under a
workload that needs many evicts and never fails a request. Each detector is shown to trip:
wrong loads make the token check fail, a tier that refuses when full makes a request fail.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.engine import cpu_offload
from course_lib.engine.offload_study import (
    CONFIGS,
    OffloadWorkload,
    compare,
    make_engine,
    rag_prompts,
    run_workload,
    sweep,
)
from course_lib.engine.recovery import StepFailed
from course_lib.model.loader import load_tiny_model

torch.set_num_threads(1)

SMALL = {"chat": OffloadWorkload("chat", num=4, turns=3),
         "rag": OffloadWorkload("rag", num=12)}
TIGHT, ROOMY = 24, 256          # GPU blocks: too few for the reuse; enough to hold everything


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["chat", "rag"])
def test_the_tier_gives_the_same_tokens_and_computes_less_prefill(model, kind, sampled):
    plain, tier = compare(model, SMALL[kind], TIGHT, 64, sampled=sampled, check=True,
                          configs=CONFIGS[:2])
    assert plain.same_tokens and tier.same_tokens
    assert tier.cpu_loaded > 0 and tier.cpu_hit_rate > 0
    assert tier.prefill_saved > 0 and tier.prefill_tokens < plain.prefill_tokens
    # the tier sits behind the GPU cache: together they find more than the GPU alone (the GPU's
    # own share moves only with the re-admissions after a preemption, which count too)
    assert tier.gpu_hit_rate + tier.cpu_hit_rate > plain.gpu_hit_rate


@pytest.mark.parametrize("kind", ["chat", "rag"])
def test_the_tier_hits_only_when_the_gpu_pool_is_too_small(model, kind):
    """Tiers that store generated blocks too (``offload_prompt_only=False``): the chat's
    answers come back as well, so a tier that holds everything closes the gap (the default,
    prompt blocks only, is ``test_ch13``'s and chapter 13's)."""
    rows = sweep(model, SMALL[kind], [ROOMY, TIGHT], [2, ROOMY], offload_prompt_only=False)
    assert [(r.gpu_blocks, r.cpu_blocks, r.config) for r in rows] == [
        (n, cpu, CONFIGS[1] if cpu else CONFIGS[0]) for n in (ROOMY, TIGHT)
        for cpu in (0, 2, ROOMY)]
    roomy, _, roomy_tier, tight, tiny_tier, tight_tier = rows
    assert roomy.cpu_hit_rate is None and all(r.same_tokens for r in rows)
    assert tight_tier.cpu_hit_rate > 0 and tight_tier.prefill_saved > 0
    assert roomy_tier.cpu_hit_rate == 0 and roomy_tier.prefill_saved == 0
    assert roomy.gpu_hit_rate > tight.gpu_hit_rate   # the GPU pool kept what the small lost
    # a tier that holds everything (it never evicts) closes the gap to the roomy GPU pool,
    # but for a few tokens recomputed after a preemption; a 2-block one evicts and saves less
    assert tight_tier.cpu_evictions == 0 and tiny_tier.cpu_evictions > 0
    assert tight_tier.prefill_tokens - roomy.prefill_tokens <= \
        (tight.prefill_tokens - roomy.prefill_tokens) / 10
    assert tiny_tier.prefill_saved < tight_tier.prefill_saved


@pytest.mark.parametrize("cpu_blocks", [1, 2])
@pytest.mark.parametrize("kind", ["chat", "rag"])
def test_a_full_tier_evicts_and_never_fails_a_request(model, kind, cpu_blocks):
    """Every request finishes (``run_workload`` raises on any other ending), the tokens are
    the no-offload run's, invariants (the tier's pool included) hold after every step."""
    plain, tier = compare(model, SMALL[kind], TIGHT, cpu_blocks, check=True,
                          configs=CONFIGS[:2])
    assert tier.same_tokens and tier.cpu_evictions > 0
    assert tier.cpu_stored > cpu_blocks                # it needed many more than it has
    engine = make_engine(model, TIGHT, tier=cpu_blocks)
    run = run_workload(engine, SMALL[kind], check=True)
    n = SMALL[kind].num * (SMALL[kind].turns if kind == "chat" else 1)
    assert len(run.answers) == n and all(len(a) == SMALL[kind].max_tokens for a in run.answers)
    assert len(engine.kv_connector.cpu_pool.hash_to_block) <= cpu_blocks


def test_the_detectors_trip(model, monkeypatch):
    """A tier that refuses to store when full fails the run; a tier that loads wrong K/V
    gives other tokens, which the comparison reports."""
    real_allocate = cpu_offload.CPUBlockPool.allocate

    def refuse_when_full(self, block_hash, pinned):
        if self.num_allocated == self.num_blocks:
            raise RuntimeError("the CPU tier is full")
        return real_allocate(self, block_hash, pinned)

    monkeypatch.setattr(cpu_offload.CPUBlockPool, "allocate", refuse_when_full)
    with pytest.raises((RuntimeError, StepFailed), match="full|finished with"):
        run_workload(make_engine(model, TIGHT, tier=2), SMALL["chat"])
    monkeypatch.setattr(cpu_offload.CPUBlockPool, "allocate", real_allocate)

    def load_zeros(self, layer):
        meta = self._get_connector_metadata()
        for cache in self.kv_caches[layer]:
            for _, gpu in meta.loads:
                cache[gpu].zero_()

    monkeypatch.setattr(cpu_offload.CPUOffloadConnector, "wait_for_layer_load", load_zeros)
    _, tier = compare(model, SMALL["chat"], TIGHT, 64, configs=CONFIGS[:2])
    assert tier.cpu_loaded > 0 and not tier.same_tokens


def test_v0_swap_moves_preempted_sequences_not_prefixes(model):
    """V0's swap space of the same CPU bytes is used (sequences preempted mid-decode go
    there and back) but serves no prefix: it computes at least the prefill of no offload."""
    rows = compare(model, SMALL["chat"], 32, 64)
    plain, tier, v0 = rows
    assert v0.config == "V0 + swap" and v0.swapped_blocks > 0 and v0.cpu_hit_rate is None
    assert v0.prefill_tokens > tier.prefill_tokens
    assert tier.same_tokens


def test_bad_settings_are_refused(model):
    with pytest.raises(ValueError, match="kind must be one of"):
        OffloadWorkload("sharegpt")
    with pytest.raises(ValueError, match="num must be an int >= 1"):
        OffloadWorkload("chat", num=0)
    with pytest.raises(ValueError, match="config must be one of"):
        compare(model, SMALL["chat"], 8, 8, configs=(CONFIGS[0], "V1 + disk"))
    with pytest.raises(ValueError, match="tier must be a number of CPU blocks >= 1"):
        make_engine(model, 8, tier=0)
    with pytest.raises(ValueError, match="not both"):
        make_engine(model, 8, tier=4, swap_blocks=4)
    with pytest.raises(ValueError, match="swap_blocks must be an int >= 0"):
        make_engine(model, 8, swap_blocks=-1)
    with pytest.raises(ValueError, match="gpu_blocks"):
        sweep(model, SMALL["chat"], [], [8])
    with pytest.raises(ValueError, match="tier_blocks"):
        sweep(model, SMALL["chat"], [8], [0])
    with pytest.raises(ValueError, match="must start with"):
        compare(model, SMALL["chat"], 8, 8, configs=CONFIGS[1:])
    prompts = rag_prompts(OffloadWorkload("rag", num=20, num_docs=3, doc_len=8))
    assert len(prompts) == 20 and all(9 + 4 <= len(p) <= 1 + 16 + 12 for p in prompts)


@pytest.mark.parametrize("seed", [-1, "a", 1.5, True])
def test_a_bad_workload_seed_is_refused_up_front(seed):
    # accepted, it failed later, in the middle of a run (1000 * seed + key)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        OffloadWorkload("rag", seed=seed)


def test_a_repeated_config_is_refused(model):
    with pytest.raises(ValueError, match="must not repeat a config"):
        compare(model, SMALL["rag"], 8, 8, configs=(CONFIGS[0], CONFIGS[0]))
