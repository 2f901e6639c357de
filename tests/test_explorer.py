"""The explorers, driven the way a learner drives them: slider values and button clicks."""

from __future__ import annotations

import ipywidgets as widgets
import pytest
from hypothesis import given
from hypothesis import strategies as st

from course_lib.viz.explorer import (
    BlockTableExplorer,
    Op,
    PrefixCacheExplorer,
    PrefixCacheSession,
    Scenario,
    ScenarioRun,
    chat_prompts,
    default_scenario,
)

pytestmark = [pytest.mark.ch03, pytest.mark.ch06]


def tables(explorer: BlockTableExplorer) -> dict[str, list[int]]:
    m = explorer.manager
    return {label: m.get_block_table(sid) for label, sid in explorer.run.seq_ids.items()
            if m.has_seq(sid)}


def test_block_table_explorer_widgets_and_initial_state():
    e = BlockTableExplorer()
    assert isinstance(e.step, widgets.IntSlider) and isinstance(e.image, widgets.Image)
    assert isinstance(e.widget, widgets.VBox)
    assert e.step.value == 0 and e.step.max == len(default_scenario().steps)
    assert tables(e) == {} and e.manager.num_free_gpu_blocks == 10
    assert bytes(e.image.value).startswith(b"\x89PNG")


def test_slider_replays_the_scenario_and_redraws():
    e = BlockTableExplorer()
    images = {0: bytes(e.image.value)}
    e.step.value = 5                                  # what moving the slider does
    assert tables(e) == {"A": [0, 1, 3], "B": [2, 7], "C": [4, 5, 6]}
    images[5] = bytes(e.image.value)
    e.set_step(6)
    assert e.run.waiting == [("D", 10)] and "D waits" in e.caption.value
    e.set_step(7)                                     # B finishes, D takes 2, 7 and 8
    assert tables(e) == {"A": [0, 1, 3], "C": [4, 5, 6], "D": [2, 7, 8]}
    assert e.run.waiting == []
    images[7] = bytes(e.image.value)
    assert len(set(images.values())) == 3
    e.manager.check_invariants()
    e.set_step(len(e.scenario.steps))
    assert tables(e) == {} and e.manager.num_free_gpu_blocks == 10
    e.set_step(5)                                     # going back replays from step 0
    assert bytes(e.image.value) == images[5]


def test_prev_next_buttons_and_bounds():
    e = BlockTableExplorer()
    e.prev_button.click()
    assert e.step.value == 0
    e.next_button.click()
    e.next_button.click()
    assert e.step.value == 2 and tables(e) == {"A": [0, 1], "B": [2]}
    e.prev_button.click()
    assert e.step.value == 1
    with pytest.raises(ValueError, match="step must be in"):
        e.set_step(99)


def test_custom_scenario_and_bad_ops():
    s = Scenario(2, 3, ((Op("arrive", "x", 3),), (Op("grow", "x", 3),), (Op("finish", "x"),)))
    e = BlockTableExplorer(s)
    e.set_step(2)                                      # 6 tokens fill the 3 blocks exactly
    assert tables(e) == {"x": [0, 1, 2]} and "cannot grow" not in e.caption.value
    bad = Scenario(2, 3, ((Op("grow", "y", 1),),))
    with pytest.raises(ValueError, match="not running"):
        ScenarioRun(bad, 1)
    with pytest.raises(ValueError, match="kind must be"):
        Op("jump", "x", 1)
    full = Scenario(2, 2, ((Op("arrive", "x", 4),), (Op("grow", "x", 1),)))
    run = ScenarioRun(full, 2)
    assert "cannot grow" in run.log[0] and run.manager.get_table(0).num_tokens == 4


def test_prefix_session_hits_lru_and_reset():
    s = PrefixCacheSession(block_size=4, num_gpu_blocks=8)
    system = list(range(1, 9))
    first = s.submit("a", system + [10, 11], keep=False)
    assert first.num_cached_tokens == 0 and s.lru_order() == [1, 0]
    second = s.submit("b", system + [20, 21, 22])
    assert second.num_cached_tokens == 8 and second.blocks[:2] == first.blocks[:2]
    assert s.manager.ref_count(0) == 1 and s.lru_order() == []
    assert s.reset_prefix_cache() is False
    s.finish()
    assert s.reset_prefix_cache() is True and s.lru_order() == []
    assert s.submit("c", system + [1]).num_cached_tokens == 0
    with pytest.raises(ValueError, match="not running"):
        s.finish(99)
    s.manager.check_invariants()


def test_prefix_session_generated_reply_is_cached_for_the_next_turn():
    s = PrefixCacheSession(block_size=4, num_gpu_blocks=16)
    turn1 = list(range(1, 12))
    s.submit("turn 1", turn1, keep=False, generate=[21, 22, 23, 24, 25])
    r = s.submit("turn 2", turn1 + [21, 22, 23, 24, 25, 31, 32, 33])
    assert r.num_cached_tokens == 16


def test_prefix_session_finishes_oldest_when_the_pool_is_short():
    s = PrefixCacheSession(block_size=4, num_gpu_blocks=4)
    s.submit("a", list(range(8)))
    s.submit("b", list(range(100, 108)))
    s.submit("c", list(range(200, 208)))                # needs a's blocks
    assert s.running == [1, 2] and s.manager.has_seq(0) is False


def test_prefix_cache_explorer_buttons_drive_the_session():
    e = PrefixCacheExplorer()
    assert isinstance(e.prompt, widgets.Dropdown) and list(e.prompt.options) == list(chat_prompts())
    blank = bytes(e.image.value)
    e.prompt.value = "turn 1"
    e.submit_button.click()
    assert e.session.history[-1].num_cached_tokens == 0
    after_first = bytes(e.image.value)
    assert after_first != blank and len(e.session.lru_order()) == 4
    e.prompt.value = "turn 2 (after reply 1)"
    e.keep.value = True
    e.submit_button.click()
    r = e.session.history[-1]
    assert r.num_cached_tokens == 16 and "16 from the cache" in e.caption.value
    assert e.manager.ref_count(r.blocks[0]) == 1 and e.session.running == [1]
    assert bytes(e.image.value) != after_first
    e.reset_button.click()
    assert "refused" in e.caption.value
    e.finish_button.click()
    assert e.session.running == [] and "finished" in e.caption.value
    e.reset_button.click()
    assert e.session.lru_order() == [] and "reset" in e.caption.value
    e.finish_button.click()
    assert "no running request" in e.caption.value


def test_prefix_cache_explorer_timestamp_and_salt_miss():
    e = PrefixCacheExplorer()
    e.submit()                                          # turn 1
    for name in ("timestamp 10:41 + turn 1", "turn 1, tenant B salt"):
        e.prompt.value = name
        assert e.submit().num_cached_tokens == 0
    e.prompt.value = "another user"
    assert e.submit().num_cached_tokens == 8            # the 8-token system prompt
    with pytest.raises(ValueError, match="at least one prompt"):
        PrefixCacheExplorer({})


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3), st.booleans(),
                          st.sampled_from(["submit", "submit", "finish", "reset"])),
                min_size=1, max_size=25))
def test_prefix_session_random_use_keeps_the_manager_consistent(ops):
    """Random submits (prompts sharing prefixes), finishes and resets: the manager's invariants
    hold, and hits never exceed the cap (at least one prompt token is computed)."""
    s = PrefixCacheSession(block_size=2, num_gpu_blocks=10)
    base = [1, 2, 3, 4, 5, 6, 7, 8]
    for length, branch, keep, kind in ops:
        if kind == "finish" and s.running:
            s.finish()
        elif kind == "reset":
            assert s.reset_prefix_cache() == (not s.running)
        else:
            prompt = base[:length] + [100 + branch]
            r = s.submit("p", prompt, keep=keep)
            assert r.num_cached_tokens <= len(prompt) - 1 and r.num_cached_tokens % 2 == 0
        s.manager.check_invariants()


def test_a_submit_that_can_never_fit_finishes_no_running_request():
    session = PrefixCacheSession(block_size=4, num_gpu_blocks=16)
    session.submit("a", [1, 2, 3, 4, 5])
    session.submit("b", [9, 8, 7, 6, 5])
    held = session.num_held_blocks
    with pytest.raises(ValueError, match="can never fit"):
        session.submit("c", list(range(200)))
    assert session.running == [0, 1] and session.num_held_blocks == held
    session.manager.check_invariants()


@pytest.mark.parametrize("token_ids", [[-1, 2, 3], "abc", [1.5, 2]])
def test_a_submit_of_bad_token_ids_is_refused(token_ids):
    session = PrefixCacheSession()
    with pytest.raises(ValueError, match="token ids must be integers >= 0"):
        session.submit("x", token_ids)
    assert session.history == [] and session.num_held_blocks == 0


def test_prefix_cache_explorer_checks_the_shape_of_its_prompts():
    with pytest.raises(ValueError, match=r"prompt 'a' must be a \(token_ids, extra_key, reply\)"):
        PrefixCacheExplorer(prompts={"a": "hello"})


@pytest.mark.parametrize("kwargs, word", [
    ({"block_size": 3}, "block_size must be a power of two"),
    ({"block_size": 0}, "block_size must be a power of two"),
    ({"num_gpu_blocks": 0}, "num_gpu_blocks must be an integer >= 1"),
    ({"num_gpu_blocks": 2.5}, "num_gpu_blocks must be an integer >= 1"),
    ({"hash_algo": "md5"}, "hash_algo must be one of"),
])
def test_the_prefix_cache_session_checks_its_sizes_at_the_door(kwargs, word):
    """The block manager behind it trusts its caller (memory/ holds no argument checks), so
    the widget's session refuses bad sizes itself, before building anything."""
    with pytest.raises(ValueError, match=word):
        PrefixCacheSession(**kwargs)


@pytest.mark.parametrize("block_size, num_gpu_blocks, word", [
    (6, 10, "block_size must be a power of two"), (4, 0, "num_gpu_blocks must be an integer"),
])
def test_a_scenario_checks_its_sizes_at_the_door(block_size, num_gpu_blocks, word):
    with pytest.raises(ValueError, match=word):
        Scenario(block_size, num_gpu_blocks, ())
