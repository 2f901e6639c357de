"""Chapter 13: the connector interface watched call by call, the CPU tier swept over GPU pool
sizes and drawn, and the then-and-now map held to the files it cites.

The map's vLLM and SGLang files are checked where the released sources are extracted
($COURSE_VLLM_SRC, /tmp/src by default, holding vllm/; $COURSE_SGLANG_SRC, /tmp/sglang-src by
default, holding sglang/) and skipped elsewhere; `make test-fidelity` fetches both and sets the
two variables, and where a variable is set the check fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from course_lib.engine.kv_connector_trace import (
    ConnectorCall,
    TracingConnector,
    fold_layers,
    format_calls,
    steps_of,
)
from course_lib.engine.offload_study import (
    CONFIGS,
    OffloadRow,
    OffloadWorkload,
    make_engine,
    run_prompts,
    sweep,
)
from course_lib.model.loader import load_tiny_model
from course_lib.sequence import SamplingParams
from course_lib.viz import kv_transfer_map
from course_lib.viz.offload import OffloadExplorer, draw_offload_sweep, sweep_table

pytestmark = pytest.mark.ch13
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "13_beyond_one_gpu.ipynb"
SOURCES = {"vllm": ("COURSE_VLLM_SRC", "/tmp/src", ""),
           "sglang": ("COURSE_SGLANG_SRC", "/tmp/sglang-src", "sglang")}


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


# ------------------------------------------------------------------ the calls, in order
def returning_prompt(model, **kwargs):
    """A prompt, another that evicts it from 12 GPU blocks, the first again with a word more;
    the tier records every call."""
    conn = TracingConnector(32, **kwargs)
    engine = make_engine(model, 12, tier=conn)
    tok = engine.tokenizer
    verse = tok.encode("In the beginning God created the heaven")
    runs = run_prompts(engine, [verse, tok.encode("Blessed are the meek: for they shall"),
                                verse + tok.encode(" and", add_bos=False)],
                       SamplingParams(max_tokens=2, temperature=0.0))
    return conn, runs


SCHEDULE = ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta"]
FORWARD = ["bind_connector_metadata", "start_load_kv", "wait_for_layer_load",
           "save_kv_layer", "wait_for_save", "clear_connector_metadata"]


def test_one_request_makes_the_calls_in_the_courses_order(model):
    """The scheduler side's calls in vLLM 0.33.0's order; the worker side's in the course's,
    which the chapter declares: ``get_finished`` after ``clear_connector_metadata`` and
    ``start_load_kv`` before the forward (vLLM: ``get_finished`` and
    ``get_block_ids_with_load_errors`` before the clear, ``start_load_kv`` after the forward is
    launched unless the step loads synchronously; ``vllm/v1/worker/gpu/kv_connector.py``)."""
    conn, runs = returning_prompt(model)
    assert runs[2].tier_hit_tokens > 0
    steps = steps_of(conn.calls, 2)
    calls = fold_layers([c for c in conn.calls if c.step in steps])
    first = [c.method for c in calls if c.step == steps[0]]
    assert first == SCHEDULE + FORWARD + ["get_finished"]
    last = [c.method for c in calls if c.step == steps[-1]]
    assert last == ["build_connector_meta", *FORWARD, "request_finished", "get_finished"]
    assert {c.side for c in calls if c.method in SCHEDULE + ["request_finished"]} == \
        {"scheduler"}
    assert {c.side for c in calls if c.method in FORWARD + ["get_finished"]} == {"worker"}
    layers = [c.detail for c in conn.calls if c.step == steps[0] and c.method == "save_kv_layer"]
    assert layers == [f"layer {i}" for i in range(model.config.num_layers)]
    # the tracer changes nothing: the same tokens as the tier without a record
    from course_lib.engine.cpu_offload import CPUOffloadConnector

    engine = make_engine(model, 12, tier=CPUOffloadConnector(32))
    tok = engine.tokenizer
    verse = tok.encode("In the beginning God created the heaven")
    plain = run_prompts(engine, [verse, tok.encode("Blessed are the meek: for they shall"),
                                 verse + tok.encode(" and", add_bos=False)],
                        SamplingParams(max_tokens=2, temperature=0.0))
    assert plain == runs


def test_async_loads_take_a_step_with_no_forward(model):
    conn, runs = returning_prompt(model, load_async=True)
    steps = steps_of(conn.calls, 2)
    first = [c for c in fold_layers(conn.calls) if c.step == steps[0]]
    assert "save_kv_layer" not in [c.method for c in first]          # nothing computed
    assert first[-1].method == "get_finished" and "done loading [2]" in first[-1].detail
    assert len(steps) == 3
    assert [r.tokens for r in runs] == [r.tokens for r in returning_prompt(model)[1]]


def test_the_timeline_puts_each_side_in_its_column():
    calls = [ConnectorCall(0, "scheduler", "build_connector_meta", "x"),
             ConnectorCall(0, "worker", "wait_for_layer_load", "layer 0"),
             ConnectorCall(0, "worker", "wait_for_layer_load", "layer 1"),
             ConnectorCall(1, "worker", "get_finished", "")]
    text = format_calls(calls, width=30).splitlines()
    assert text[1] == "   0  build_connector_meta"
    assert text[3] == " " * 38 + "wait_for_layer_load"
    assert text[4].strip() == "layers 0..1"
    assert text[5] == "   1" + " " * 34 + "get_finished"
    assert format_calls(calls, steps=[1]).count("\n") == 1
    with pytest.raises(ValueError, match="no call names seq 7"):
        steps_of(calls, 7)


# ------------------------------------------------------------------ the sweep and its widget
CHAT = OffloadWorkload("chat", num=4, turns=3)      # the chapter's


@pytest.fixture(scope="module")
def rows(model):
    return sweep(model, CHAT, gpu_blocks=(64, 24), tier_blocks=(24, 96), clock=lambda: 0.0)


def test_a_tier_holding_the_chat_gives_back_what_the_gpu_lost(model, rows):
    """By default (prompt blocks only, vLLM's ``offload_prompt_only``) a tier holding the chat
    gives back its prompts, and the answers the GPU lost are computed again at the next turn;
    storing generated blocks too, it gives back everything the GPU lost."""
    by = {(r.gpu_blocks, r.cpu_blocks): r for r in rows}
    assert all(r.same_tokens for r in rows)
    big, small = by[64, 0], by[24, 0]
    assert small.gpu_hit_rate < big.gpu_hit_rate and small.prefill_tokens > big.prefill_tokens
    tiered = by[24, 96]
    assert small.prefill_tokens > tiered.prefill_tokens > big.prefill_tokens
    (_, everything) = sweep(model, CHAT, gpu_blocks=(24,), tier_blocks=(96,),
                            clock=lambda: 0.0, offload_prompt_only=False)
    assert everything.same_tokens and everything.cpu_stored > tiered.cpu_stored
    # one denominator: what the GPU lost, the tier gave back (a re-admission after a
    # preemption looks its prompt up again, hence the tolerance)
    assert everything.gpu_hit_rate + everything.cpu_hit_rate == pytest.approx(
        big.gpu_hit_rate, abs=0.05)
    assert everything.prefill_tokens == big.prefill_tokens
    assert by[64, 96].cpu_hit_rate == 0                 # nothing was lost to give back
    assert by[24, 24].cpu_hit_rate < tiered.cpu_hit_rate  # an LRU smaller than the cycle
    assert by[24, 24].cpu_evictions > 0 and by[24, 96].cpu_evictions == 0


def test_run_prompts_tells_where_each_prompt_came_from(model):
    """A prompt, the same prompt again with a word more (found on the GPU), then after a
    prompt that evicted it (loaded from the tier): hits + computed = the prompt."""
    engine = make_engine(model, 12, tier=32)
    tok = engine.tokenizer
    verse = tok.encode("In the beginning God created the heaven")
    prompts = [verse, verse + tok.encode(" a", add_bos=False),
               tok.encode("Blessed are the meek: for they shall"),
               verse + tok.encode(" and", add_bos=False)]
    runs = run_prompts(engine, prompts, SamplingParams(max_tokens=2, temperature=0.0))
    assert [len(r.tokens) for r in runs] == [2] * 4
    assert runs[0].gpu_hit_tokens == runs[0].tier_hit_tokens == 0
    assert runs[1].gpu_hit_tokens > 0 and runs[1].tier_hit_tokens == 0
    assert runs[3].tier_hit_tokens > 0
    for p, r in zip(prompts, runs, strict=True):
        assert r.gpu_hit_tokens + r.tier_hit_tokens + r.computed_tokens == len(p)


def test_the_sweep_refuses_what_it_cannot_run(model):
    with pytest.raises(ValueError, match="gpu_blocks"):
        sweep(model, CHAT, gpu_blocks=(), tier_blocks=(8,))
    with pytest.raises(ValueError, match="tier_blocks"):
        sweep(model, CHAT, gpu_blocks=(8,), tier_blocks=(0,))
    with pytest.raises(ValueError, match="offload_prompt_only must be a bool"):
        sweep(model, CHAT, gpu_blocks=(8,), tier_blocks=(8,), offload_prompt_only=None)


def test_the_widget_redraws_for_each_tier(rows):
    from test_viz_readability import NOTEBOOK_PX, png_width

    from course_lib.viz.readable import EXPLORER_DPI, MIN_FONT_PT, shown_font_pt

    e = OffloadExplorer(rows)
    assert e.tier.value == 96 and "96 blocks" in e.text.value
    before = bytes(e.image.value)
    e.tier.value = 24
    assert bytes(e.image.value) != before and "24 blocks" in e.text.value
    assert png_width(bytes(e.image.value)) <= NOTEBOOK_PX
    assert shown_font_pt(draw_offload_sweep(rows, 24), EXPLORER_DPI, NOTEBOOK_PX) >= MIN_FONT_PT
    with pytest.raises(ValueError, match="tiers of \\[24, 96\\]"):
        draw_offload_sweep(rows, 50)
    with pytest.raises(ValueError, match="without a tier"):
        draw_offload_sweep([r for r in rows if r.cpu_blocks], 24)
    assert len(sweep_table(rows).splitlines()) == len(rows) + 1
    plain = rows[0]._replace(gpu_blocks=8, cpu_blocks=0, cpu_hit_rate=None, prefill_tokens=10)
    fake = [plain, plain._replace(config=CONFIGS[1], cpu_blocks=4, cpu_hit_rate=0.25,
                                  prefill_tokens=6)]
    assert "8 blocks: 4" in OffloadExplorer(fake).text.value      # prefill saved
    assert isinstance(fake[1], OffloadRow) and "-" in sweep_table(fake).splitlines()[1]


# ------------------------------------------------------------------ then and now
def notebook_markdown() -> str:
    nb = json.loads(NOTEBOOK.read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


def test_the_chapter_shows_the_map_of_course_lib():
    assert kv_transfer_map.map_markdown() in notebook_markdown()
    paths = kv_transfer_map.cited_paths()
    assert len(paths["course"]) >= 4 and len(paths["vllm"]) >= 10 and len(paths["sglang"]) >= 6
    for path in paths["course"]:
        assert (ROOT / path).is_file(), path


def test_the_path_detector_reads_backquoted_paths_only():
    row = kv_transfer_map.MapRow("`course_lib/x.py`", "course_lib/y.py", "`vllm/a/b.py` (`C`)",
                                 "srt/not_quoted.py, `srt/c/d.py`")
    assert kv_transfer_map.cited_paths([row]) == {
        "course": ["course_lib/x.py"], "vllm": ["vllm/a/b.py"], "sglang": ["srt/c/d.py"]}


@pytest.mark.parametrize("source", ["vllm", "sglang"])
def test_the_map_cites_files_that_exist(source):
    variable, default, sub = SOURCES[source]
    root = Path(os.environ.get(variable, default))
    if not (root / (sub or "vllm")).is_dir():
        if variable in os.environ:
            pytest.fail(f"${variable} is set, but {root} holds no {sub or 'vllm'}/ "
                        "(make test-fidelity)")
        pytest.skip(f"{source} sources not extracted at {root}")
    for path in kv_transfer_map.cited_paths()[source]:
        assert (root / sub / path).is_file(), path
    # every name in parentheses right after a file is in that file
    prefix = "vllm" if source == "vllm" else "srt"
    checked = 0
    for row in kv_transfer_map.KV_TRANSFER_MAP:
        for path, names in re.findall(rf"`({prefix}/[\w/.]+\.py)` \(([^)]*)\)",
                                      getattr(row, source)):
            text = (root / sub / path).read_text()
            for name in re.findall(r"`(\w+)`", names):
                assert re.search(rf"\b{name}\b", text), (name, path)
                checked += 1
    assert checked >= 8
