"""The attention backend is resolved once, in course_lib.kernels.backends: every name gives
kernels that agree, the model and the runner only call the backend they were given, and a
backend that cannot run here is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from course_lib.device import BACKEND
from course_lib.kernels.backends import AttentionBackend, get_attn_backend
from course_lib.model.attention import make_attention_metadata
from course_lib.model.loader import load_tiny_model

pytestmark = pytest.mark.ch10
torch.set_num_threads(1)


def test_names_resolve_to_backends_and_bad_names_are_refused() -> None:
    assert get_attn_backend("reference").name == "reference"
    assert get_attn_backend("torch").name == "torch"
    # on a CPU, "auto" is the batched torch path: the interpreter is far too slow to serve
    assert get_attn_backend("auto", "cpu").name == "torch"
    backend = get_attn_backend("torch")
    assert get_attn_backend(backend) is backend          # a resolved backend passes through
    with pytest.raises(ValueError, match="attn_impl must be one of"):
        get_attn_backend("cuda")


@pytest.mark.skipif(not BACKEND.uses_triton, reason="needs Triton")
def test_triton_is_refused_where_it_cannot_run() -> None:
    other = "cuda" if BACKEND.device == "cpu" else "cpu"
    assert BACKEND.triton_runs_on(torch.empty(0)) == (BACKEND.device == "cpu")
    assert not BACKEND.triton_runs_on(other)
    if other == "cpu":
        with pytest.raises(ValueError, match="needs Triton to run on cpu"):
            get_attn_backend("triton", "cpu")
    else:
        assert get_attn_backend("triton", "cpu").name == "triton"   # interpreted


def test_the_model_runs_exactly_the_backend_it_is_given() -> None:
    """A spy backend sees every layer's cache write and attention: no branch on names
    bypasses it, and its output is the model's (the spy wraps the reference)."""
    model = load_tiny_model()
    ref = get_attn_backend("reference")
    calls = []

    keywords = []

    def write(*a, **kw):
        calls.append("write")
        keywords.append(kw)
        ref.reshape_and_cache(*a, **kw)

    def attend(*a, **kw):
        calls.append("attend")
        keywords.append(kw)
        return ref.paged_attention(*a, **kw)

    spy = AttentionBackend("spy", write, attend, ref.copy_blocks)
    cfg = model.config
    caches = [(torch.zeros(4, 4, cfg.num_kv_heads, cfg.head_dim),
               torch.zeros(4, 4, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    meta = make_attention_metadata([[2, 0]], [0], [6], 4)
    ids, pos = torch.tensor([1, 65, 110, 100, 32, 71]), torch.arange(6)
    with torch.no_grad():
        got = model(ids, pos, caches, meta, impl=spy)
        fresh = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
        want = model(ids, pos, fresh, meta, impl="reference")
    assert calls == ["write", "attend"] * cfg.num_layers
    torch.testing.assert_close(got, want)
    # the batch was checked once, on the host: the layers validate nothing and read no
    # maximum back from the device (a GPU would sync on each)
    assert keywords == [dict(validate=False),
                        dict(max_query_len=6, max_seq_len=6, validate=False)] * cfg.num_layers
