"""Chapter 04's exercises: the cases they promise and what each checker says to a wrong
kernel, beyond tests/test_exercises.py."""

from __future__ import annotations

import pytest
import torch
from interpreter_only import INTERPRETER_ONLY

from course_lib.device import BACKEND
from course_lib.exercises import ch04, ch04_wrong
from course_lib.kernels import reference
from course_lib.sizing.units import cdiv

pytestmark = pytest.mark.ch04
needs_triton = pytest.mark.skipif(not BACKEND.uses_triton, reason="the kernels need Triton")


def test_every_case_has_nan_in_the_free_slots_and_minus_one_past_the_table():
    for c in ch04.gather_cases() + ch04.decode_cases():
        if c["key_cache"].shape[0] > ch04.HUGE_PAGE:
            continue                      # the 64-bit case: test_the_64_bit_case_is_virtual
        bs, n = c["block_size"], c["seq_len"]
        table = c["table"].tolist()
        assert table[-2:] == [-1, -1] and len(table) == cdiv(n, bs) + 2
        owned = torch.zeros(c["key_cache"].shape[:2], dtype=torch.bool)
        for p in range(n):
            owned[table[p // bs], p % bs] = True
        cache = c["key_cache"].cpu()
        assert cache[~owned].isnan().all() and not cache[owned].isnan().any()
        # the guard block before the cache: a -1 entry reads NaN, not another allocation
        base = c["key_cache"].untyped_storage()
        assert c["key_cache"].storage_offset() == bs * c["heads"] * c["head_dim"]
        assert base.nbytes() == (c["key_cache"].shape[0] + 2) * bs * c["heads"] * \
            c["head_dim"] * 4


@INTERPRETER_ONLY
def test_the_64_bit_case_passes_2_31_and_stays_virtual():
    """4.1's last case: a slot whose element offset passes 2**31 (an int32 page index
    overflows), in a cache of which only the sequence's slots were written."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    c = ch04.huge_case()
    row = c["heads"] * c["head_dim"]
    first = int(c["table"][0]) * c["block_size"] * row
    assert first >= 2**31 and c["key_cache"].numel() >= 2**31
    assert c["value_cache"].data_ptr() - c["key_cache"].data_ptr() == 8 * c["block_size"] * row * 4
    assert torch.equal(c["key_cache"][int(c["table"][0]), 0], c["k"][0])
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 2**10  # KiB


def test_the_decode_cases_include_the_edges():
    cases = ch04.decode_cases()
    assert any(c["seq_len"] == 1 for c in cases)
    assert any(c["block_size"] == 1 for c in cases)
    assert any(c["seq_len"] % c["block_size"] == 0 and c["seq_len"] > c["block_size"]
               for c in cases)
    big = [c for c in cases if c["q_scale"] > 10]
    assert big and max((c["k"][:, 0] @ c["q"].cpu()).abs().max().item() for c in big) > 89


@needs_triton
def test_wrong_kernels_are_told_the_idea_they_missed():
    forgets_rescale = ch04.EXERCISES["4.2"].rule("rescaled").wrong
    unmasked_v = ch04.EXERCISES["4.2"].rule("mask the K and V").wrong
    assert "exp(m - m_new)" in ch04.check_decode_one_head(forgets_rescale).first_problem
    assert "mask the K and V" in ch04.check_decode_one_head(unmasked_v).first_problem
    logical = ch04.EXERCISES["4.1"].rule("read through block_table").wrong
    table_as_slot = ch04.EXERCISES["4.1"].rule("the table holds blocks").wrong
    for wrong in (logical, table_as_slot):
        assert "a slot the sequence does not own" in ch04.check_gather_kv(wrong).first_problem


@needs_triton
def test_decode_names_a_missing_scale():
    def unscaled(q, key_cache, value_cache, block_table, seq_len):
        k, v = reference.gather_kv(key_cache, value_cache, block_table, seq_len)
        return torch.softmax(k[:, 0].float() @ q.float(), 0) @ v[:, 0].float()

    problem = ch04.check_decode_one_head(unscaled).first_problem
    assert "launched no Triton kernel" in problem and "1/sqrt(head_dim)" in problem


@needs_triton
def test_torch_or_the_course_kernel_is_not_an_answer():
    in_torch = ch04_wrong._gather_in_torch
    verdict = ch04.check_gather_kv(in_torch)
    assert verdict.passed == 0 and "launched no Triton kernel" in verdict.first_problem
    course = ch04_wrong._decode_with_course_kernel
    verdict = ch04.check_decode_one_head(course)
    assert verdict.passed == 0 and "only the course's kernels" in verdict.first_problem
    assert "course_lib.kernels.paged_decode" in verdict.first_problem


def test_without_triton_a_stub_is_unattempted(monkeypatch):
    class NoTriton:
        name, uses_triton, device = "torch-reference", False, "cpu"

    from course_lib.exercises import launches

    monkeypatch.setattr(launches, "BACKEND", NoTriton())

    def stub(*args):
        raise NotImplementedError

    assert not ch04.check_decode_one_head(stub).attempted
    def answer(*args):
        raise NameError("name 'gather_kernel' is not defined")   # as under torch-reference

    verdict = ch04.check_gather_kv(answer)
    assert "runs no Triton" in verdict.first_problem
