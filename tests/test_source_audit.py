"""The source articles' audit: the right values are pinned here, each derived by hand in a comment.

A pinned value is compared with the claim's course_value, which `claims.sources` computes live
through capacity.py; so these tests fail if either the library's arithmetic or the audit's
use of it drifts.
"""

import dataclasses
import math
from pathlib import Path

import pytest

from course_lib import capacity as cap
from course_lib.claims import sources as sa
from course_lib.claims.sources_claim import SOURCES, VERDICTS, SourceClaim, cite
from course_lib.sizing.models import PRESETS, get_preset
from course_lib.sizing.units import GiB, KiB, MiB

# The articles' text, where a checkout has it (learners do not need it).
ARTICLES_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "seeds"


@pytest.fixture(scope="module")
def claims():
    return {c.key: c for c in sa.audit()}


# key -> (right value in the claim's unit, derivation)
PINNED = {
    "000-1.2-per-token": (327_680, "80 layers x 2 x 8 heads x 128 x 2 B"),
    "000-1.2-200k": (327_680 * 200_000 / GiB, "65.536e9 B = 61.04 GiB"),
    "000-2.3-k-block": (32, "16 x 8 x 128 x 2 B = 32,768 B = 32 KiB"),
    "000-2.3-layer-block": (65_536 / KiB, "K + V: 2 x 32 KiB"),
    "000-2.3-block": (5, "64 KiB x 80 = 5,242,880 B = 5 MiB"),
    "000-4.3-available": (51, "80 x 0.9 - 17.5 - 2 - 1.5 GiB"),
    "000-4.3-block": (655_360, "16 x 80 x 2 x 1 x 128 x 2 B"),
    "000-4.3-num-blocks": (83_558, "51 x 2**30 / 655,360 = 83,558.4 -> floor"),
    "000-4.3-tokens": (1_336_928, "83,558 x 16"),
    "000-8-query": (144, "128 heads x (512 + 64) x 2 B = 147,456 B = 144 KiB"),
    "000-8-output": (128.5, "128 x (512 x 2 + 4) B = 131,584 B = 128.5 KiB"),
    "000-8-move-kv": (180.154368, "(208,512 - 52,128) tokens x 1,152 B = 180,154,368 B"),
    "000-9-latent": (1152, "(512 + 64) x 2 B"),
    "000-9-block": (1_124_352 / MiB, "16 x 61 x 1152 = 1,124,352 B"),
    "000-9-tokens": (52_128, "3,258 x 16"),
    "000-9-cp": (208_512, "3,258 x 16 x 4"),
    "000-9-num-blocks": (3342, "3.5 x 2**30 / 1,124,352 = 3,342.46 -> floor"),
    "000-9-weights": (80 - 671e9 / 8 / GiB, "80 GiB - 83.875e9 B (FP8 weights / 8)"),
    "000-10-mla-formula": (70_272, "61 x 576 x 2 B"),
    "000-12.4-swap": (6553, "4 x 2**30 / 655,360 = 6,553.6 -> floor"),
    "000-13.1-max-model-len": (52_128 / 32_768, "3,258 x 16 / 32,768"),
    "001-kv-7b": (536.870912, "2 x 32 x 32 x 128 x 1024 x 2 = 536,870,912 B"),
    "001-weights-7b": (13.476831232, "6,738,415,616 x 2 B"),
    "001-ratio": (100 * 536_870_912 / 13_476_831_232, "= 3.98%"),
    "001-static": (100 * 896 / 3072, "(256 + 512 + 128) / (3 x 1024) = 29.2%"),
    "001-paged": (100.0, "16 + 32 + 8 blocks hold exactly 896 tokens"),
    "001-prefix-off": (64 * 63 * 2 * MiB / GiB, "64 x ceil(1000/16) blocks x 2 MiB = 7.875"),
    "001-prefix-on": ((31 + 64 * 32) * 2 * MiB / GiB, "(31 + 64 x 32) x 2 MiB = 4.06 GiB"),
    "003-intro-70b": (1.25, "2 x 80 x 4096 x 8 x 128 x 2 = 1,342,177,280 B"),
    "003-1-70b-printed": (1_342_177_280 / GiB, "same formula: 1.25 GiB"),
    "003-1-8b-printed": (0.5, "2 x 32 x 4096 x 8 x 128 x 2 = 536,870,912 B"),
    "003-1-waste": (56 * 0.6, "60% of 56 GiB of KV"),
    "003-3-blocks": (4, "ceil(50 / 16)"),
    "003-3-reserved": (256, "4096 / 16"),
    "003-3-static-util": (100 * 50 / 4096, "= 1.22%"),
    "003-3-paged-util": (78.125, "50 / (4 x 16)"),
    "003-4.1-waste": (31, "block_size - 1"),
    "003-4.2-usable": (72, "80 x 0.9"),
    "003-4.2-kv": (56, "72 - 16"),
    "003-4.2-block": (2, "16 x 32 x 2 x 8 x 128 x 2 = 2,097,152 B = 2 MiB"),
    "003-4.2-blocks": (28_672, "56 GiB / 2 MiB"),
    "003-4.2-tokens": (458_752, "28,672 x 16"),
    "003-4.2-concurrency": (112, "458,752 / 4096"),
    "003-5-shared": (31, "500 // 16"),
    "003-5-private": (13, "ceil(700 / 16) - 31 = 44 - 31"),
    "003-7.3-available": (148, "320 x 0.9 - 140"),
    "003-7.3-block": (5, "2 x 80 x 16 x 8 x 128 x 2 = 5,242,880 B"),
    "003-7.3-blocks": (30_310, "148 x 1024 / 5 = 30,310.4 -> int"),
    "003-7.3-tokens": (484_960, "30,310 x 16"),
    "003-7.3-seqs": (236, "484,960 // 2048"),
    "003-7.3-per-rank": (30_310, "(80 x 0.9 - 35) GiB / 1.25 MiB = 30,310.4"),
    "003-summary-mla": (61 * 128 * (192 + 128) * 2 / 70_272,
                        "MHA: 61 layers x 128 heads x (K 192 + V 128) x 2 B = 4,997,120 B, "
                        "over the 70,272 B latent = 71.1"),
}


@pytest.mark.parametrize("key", sorted(PINNED))
def test_course_value_is_the_right_one(claims, key):
    right, _derivation = PINNED[key]
    assert claims[key].course_value == pytest.approx(right, rel=1e-9)


def test_every_claim_is_pinned(claims):
    # Weights claims (000-4.3, 003-4.2) are rounded published parameter counts; the rest are
    # pinned above, so a new claim needs a hand-derived value too.
    assert set(claims) - set(PINNED) == {"000-4.3-weights", "003-4.2-weights"}
    assert claims["000-4.3-weights"].course_value == pytest.approx(70_553_706_496 * 2 / 1e9)
    assert claims["003-4.2-weights"].course_value == pytest.approx(8_030_261_248 * 2 / 1e9)


def test_keys_and_claims_unique():
    audit = sa.audit()
    assert len({c.key for c in audit}) == len(audit)
    assert len({(c.source, c.where, c.claim) for c in audit}) == len(audit)
    assert all(c.key.startswith(c.source + "-") for c in audit)


def test_every_source_article_is_audited():
    assert {c.source for c in sa.audit()} == set(SOURCES)


@pytest.mark.skipif(not ARTICLES_DIR.is_dir(), reason="source articles not checked out here")
def test_source_files_exist():
    for number in SOURCES:
        assert len(list(ARTICLES_DIR.glob(f"{number}_*.txt"))) == 1, number


def test_cite_names_the_article_by_title():
    assert cite("003", "§2.1") == '"PagedAttention explained" §2.1'
    assert cite("001") == '"Memory optimization"'
    with pytest.raises(ValueError, match="source must be one of"):
        cite("002")


def test_verdicts_match_the_gap():
    for c in sa.audit():
        assert math.isfinite(c.course_value), c.key
        assert c.explanation and c.unit, c.key
        if math.isnan(c.source_value):
            assert c.verdict == "ok", c.key  # a formula or claim the course quantifies
            continue
        gap = abs(c.source_value - c.course_value) / abs(c.course_value)
        if c.verdict == "ok":
            assert gap <= 0.05, c.key  # the article's own rounding
        elif c.verdict == "approx":
            assert 0 < gap <= 0.30, c.key
        else:  # wrong, unit
            assert not math.isclose(c.source_value, c.course_value, rel_tol=1e-3), c.key


def test_some_of_each_verdict():
    counts = {v: sum(c.verdict == v for c in sa.audit()) for v in VERDICTS}
    assert counts["wrong"] >= 15 and counts["ok"] >= 15
    assert counts["approx"] >= 3 and counts["unit"] >= 1


def test_printed_outputs_match_32_kv_heads(claims):
    # The article (003 §1) printed 5.00 and 2.00 GB: 4x the formula, 32 KV heads, not 8.
    for key, name in [("003-1-70b-printed", "llama-2-70b"), ("003-1-8b-printed", "llama-3-8b")]:
        spec = dataclasses.replace(get_preset(name), num_kv_heads=32)
        assert cap.contiguous_kv_bytes(spec, 4096) / GiB == claims[key].source_value
        assert claims[key].source_value == 4 * claims[key].course_value


def test_article_003_73_printed_lines_forget_block_size(claims):
    # The printed "Block count" is int(148 GiB / 327,680 B per token): tokens, not blocks.
    assert int(148 * GiB / 327_680) == claims["003-7.3-blocks"].source_value
    assert int(148 * GiB / 327_680) * 16 == claims["003-7.3-tokens"].source_value
    assert claims["003-7.3-tokens"].source_value // 2048 == claims["003-7.3-seqs"].source_value


def test_course_values_are_computed_live(monkeypatch):
    # Make Llama-3-8B's cache FP32: every claim about it must double, if computed live.
    before = {c.key: c.course_value for c in sa.audit()}
    fp32 = dataclasses.replace(PRESETS["llama-3-8b"], dtype_bytes=4)
    monkeypatch.setitem(PRESETS, "llama-3-8b", fp32)
    after = {c.key: c.course_value for c in sa.audit()}
    assert after["003-4.2-block"] == 2 * before["003-4.2-block"]
    assert after["003-1-8b-printed"] == 2 * before["003-1-8b-printed"]
    assert after["001-prefix-off"] == 2 * before["001-prefix-off"]
    assert after["003-4.2-blocks"] == before["003-4.2-blocks"] // 2
    assert after["000-9-block"] == before["000-9-block"]  # other models untouched


def test_audit_table_rows(claims):
    rows = sa.audit_table()
    assert len(rows) == len(claims)
    assert set(rows[0]) == {"source", "where", "claim", "source_value", "course_value", "unit",
                            "verdict"}
    by_claim = {r["claim"]: r for r in rows}
    assert by_claim[claims["003-4.2-blocks"].claim]["course_value"] == "28,672"
    assert by_claim[claims["003-7.3-per-rank"].claim]["source_value"] == "-"
    assert all(isinstance(v, str) for r in rows for v in r.values())


def test_source_claim_rejects_unknown_verdict_and_source():
    with pytest.raises(ValueError, match="verdict must be one of"):
        SourceClaim("000", "§1", "x", 1.0, "B", 1.0, "maybe", "")
    with pytest.raises(ValueError, match="source must be one of"):
        SourceClaim("999", "§1", "x", 1.0, "B", 1.0, "ok", "")
