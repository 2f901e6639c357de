"""The tiny model: tokenizer, shipped weights, and paged forward == contiguous forward."""

from __future__ import annotations

import math
import re
import socket

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from property_budget import examples

from course_lib.model.attention import AttentionMetadata, make_attention_metadata
from course_lib.model.config import ModelConfig
from course_lib.model.generate import generate_contiguous
from course_lib.model.llama import TinyLlama, allocate_kv_caches
from course_lib.model.loader import heldout_text, load_metadata, load_tiny_model
from course_lib.model.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from course_lib.sizing.units import cdiv

pytestmark = pytest.mark.ch10
torch.set_num_threads(1)

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return load_tiny_model()


# ---------------------------------------------------------------- tokenizer


@settings(max_examples=examples(200), deadline=None)
@given(st.text())
def test_tokenizer_round_trips_any_text(text: str) -> None:
    ids = TOK.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    assert all(0 <= i < 256 for i in ids[1:-1])
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert TOK.decode(ids) == text


def test_tokenizer_rejects_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="0..258"):
        TOK.decode([65, 259])
    assert TOK.token_str(BOS_ID) == "<bos>" and TOK.token_str(ord("a")) == "a"


# ---------------------------------------------------------------- weights


def test_weights_load_offline_and_match_the_recorded_config(monkeypatch) -> None:
    def no_network(*args, **kwargs):
        raise AssertionError("loading the model touched the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    m = load_tiny_model()
    meta = load_metadata()
    assert m.config == ModelConfig.from_dict(meta["config"])
    assert m.config.vocab_size == TOK.vocab_size
    assert m.config.num_heads // m.config.num_kv_heads == 4  # GQA
    assert sum(p.numel() for p in m.parameters()) == meta["parameters"]
    assert meta["data_sha256"] and isinstance(meta["seed"], int)
    assert all(p.dtype == torch.float32 for p in m.parameters())


def test_config_rejects_inconsistent_heads() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(num_heads=8, num_kv_heads=3)
    with pytest.raises(ValueError, match="even"):
        ModelConfig(head_dim=31)


def test_trained_model_beats_a_uniform_model_on_heldout_text(model) -> None:
    # The training format: <bos> verse <eos> <bos> verse <eos> ...; one full context window.
    ids = [t for v in heldout_text().splitlines() for t in TOK.encode(v, add_eos=True)]
    x = torch.tensor([ids[:model.config.max_position + 1]])
    with torch.no_grad():
        logits, _ = model.forward_contiguous(x[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits[0], x[0, 1:]).item()
    uniform = math.log(256)
    assert loss < 0.6 * uniform, f"held-out loss {loss:.3f} nats/byte vs uniform {uniform:.3f}"
    assert load_metadata()["final_val_loss"] < 0.6 * uniform


def test_greedy_generation_is_made_of_english_words(model) -> None:
    known = set(re.findall(r"[a-z]+", heldout_text().lower()))
    for prompt in ("And God said", "In the beginning"):
        text = TOK.decode(generate_contiguous(model, TOK.encode(prompt), 80))
        words = re.findall(r"[a-z]+", text.lower())
        assert len(words) >= 8, text
        hits = sum(w in known for w in words)
        assert hits >= 0.6 * len(words), f"{prompt!r} -> {text!r}"


# ---------------------------------------------------------------- contiguous path


def test_contiguous_forward_is_deterministic_and_batch_independent(model) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (3, 40), generator=gen)
    with torch.no_grad():
        a, _ = model.forward_contiguous(x)
        b, _ = model.forward_contiguous(x)
        one, _ = model.forward_contiguous(x[1:2])
    assert torch.equal(a, b)
    torch.testing.assert_close(one[0], a[1], atol=1e-5, rtol=1e-5)


def test_contiguous_cache_continues_like_a_full_forward(model) -> None:
    x = torch.tensor([TOK.encode("And the LORD spake unto Moses, saying")])
    with torch.no_grad():
        full, _ = model.forward_contiguous(x)
        head, past = model.forward_contiguous(x[:, :20])
        tail, past = model.forward_contiguous(x[:, 20:], past)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), full, atol=1e-4, rtol=1e-4)
    assert past[0][0].shape == (1, x.shape[1], model.config.num_kv_heads, model.config.head_dim)


def test_forward_rejects_positions_past_the_context(model) -> None:
    with pytest.raises(ValueError, match="past the model's context"):
        model.forward_contiguous(torch.zeros(1, model.config.max_position + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="0..258"):
        model.forward_contiguous(torch.tensor([[300]]))


# ---------------------------------------------------------------- paged path


class PagedBatch:
    """Several sequences on one paged cache, with random permuted block tables (the test's
    stand-in for the block manager): each step runs a chunk of new tokens per sequence."""

    def __init__(self, model: TinyLlama, max_len: int, num_seqs: int, block_size: int,
                 seed: int, impl: str) -> None:
        self.model, self.block_size, self.impl = model, block_size, impl
        self.device = next(model.parameters()).device
        per_seq = cdiv(max_len, block_size)
        num_blocks = per_seq * num_seqs + 3  # a few blocks never used
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables = [perm[s * per_seq:(s + 1) * per_seq] for s in range(num_seqs)]
        self.caches = allocate_kv_caches(model.config, num_blocks, block_size,
                                         device=self.device)
        self.cached = [0] * num_seqs

    def step(self, chunks: list[list[int]]) -> torch.Tensor:
        """``chunks[s]``: new tokens of sequence ``s``. Returns logits ``[num_tokens, vocab]``."""
        q_lens = [len(c) for c in chunks]
        meta = make_attention_metadata(self.tables, self.cached, q_lens, self.block_size,
                                       self.device)
        positions = torch.cat([torch.arange(c, c + q) for c, q in zip(self.cached, q_lens,
                                                                       strict=True)])
        ids = torch.tensor([t for c in chunks for t in c])
        with torch.no_grad():
            logits = self.model(ids.to(self.device), positions.to(self.device), self.caches,
                                meta, impl=self.impl)
        self.cached = [c + q for c, q in zip(self.cached, q_lens, strict=True)]
        return logits


def contiguous_logits(model: TinyLlama, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        x = torch.tensor([ids], device=next(model.parameters()).device)
        return model.forward_contiguous(x)[0][0]


# "reference": the torch spec of paged attention; "auto": what the engine uses (on CPU, the
# Triton kernels in the interpreter: slow, so fewer decode steps).
@pytest.mark.parametrize(("block_size", "impl", "steps"), [
    (4, "reference", 20), (16, "reference", 20), (4, "auto", 3), (16, "auto", 3)])
def test_paged_forward_equals_contiguous_forward(model, block_size: int, impl: str,
                                                 steps: int) -> None:
    check_paged_against_contiguous(model, block_size, impl, steps)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_forward_equals_contiguous_forward_on_cuda(block_size: int) -> None:
    """Compiled Triton kernels (reshape_and_cache, prefill, split-K decode) on the GPU."""
    check_paged_against_contiguous(load_tiny_model(device="cuda"), block_size, "auto", 20)


def check_paged_against_contiguous(model: TinyLlama, block_size: int, impl: str,
                                   steps: int) -> None:
    """Three prompts packed together, chunked prefill in two chunks, then ``steps`` greedy
    decode steps: every logit row equals the contiguous forward's, every token is the same."""
    prompts = [TOK.encode(p) for p in ("And God said", "In the beginning God created the "
                                       "heaven and the earth.", "Jesus wept.")]
    batch = PagedBatch(model, max(map(len, prompts)) + steps, len(prompts), block_size,
                       seed=block_size, impl=impl)
    # Chunked prefill in two chunks: the first few tokens, then the rest of each prompt.
    cut = [max(1, len(p) // 3) for p in prompts]
    first = batch.step([p[:c] for p, c in zip(prompts, cut, strict=True)])
    second = batch.step([p[c:] for p, c in zip(prompts, cut, strict=True)])
    rows = iter(torch.cat([first[:sum(cut)], second]).split(
        [*cut, *[len(p) - c for p, c in zip(prompts, cut, strict=True)]]))
    firsts, rests = [next(rows) for _ in prompts], [next(rows) for _ in prompts]
    for p, a, b in zip(prompts, firsts, rests, strict=True):
        torch.testing.assert_close(torch.cat([a, b]), contiguous_logits(model, p),
                                   atol=1e-4, rtol=1e-4)
    # Decode: one new token per sequence per step, greedy, against a full contiguous forward.
    seqs = [list(p) for p in prompts]
    last = [b[-1] for b in rests]
    for _ in range(steps):
        nxt = [int(torch.argmax(v)) for v in last]
        for s, t in zip(seqs, nxt, strict=True):
            s.append(t)
        logits = batch.step([[t] for t in nxt])
        last = list(logits)
        for s, v in zip(seqs, last, strict=True):
            ref = contiguous_logits(model, s)[-1]
            torch.testing.assert_close(v, ref, atol=1e-4, rtol=1e-4)
    # Token for token the same text as the contiguous-cache generator.
    for p, s in zip(prompts, seqs, strict=True):
        ref = generate_contiguous(model, p, steps, stop_at_eos=False)
        assert s[len(p):] == ref and len(ref) == steps


def test_paged_cache_holds_exactly_the_contiguous_keys(model) -> None:
    ids = TOK.encode("The LORD is my shepherd; I shall not want.")
    batch = PagedBatch(model, len(ids), 1, 4, seed=7, impl="reference")
    batch.step([ids])
    with torch.no_grad():
        _, past = model.forward_contiguous(torch.tensor([ids]))
    from course_lib.kernels.reference import gather_kv

    for (kc, vc), (k, v) in zip(batch.caches, past, strict=True):
        pk, pv = gather_kv(kc, vc, torch.tensor(batch.tables[0]), len(ids))
        torch.testing.assert_close(pk, k[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pv, v[0], atol=1e-5, rtol=1e-5)


def test_paged_forward_rejects_bad_input(model) -> None:
    caches = allocate_kv_caches(model.config, 4, 4)
    meta = make_attention_metadata([[0, 1]], [0], [3], 4)
    ids, pos = torch.tensor([1, 2, 3]), torch.arange(3)
    with pytest.raises(ValueError, match="one \\(key_cache, value_cache\\) per layer"):
        model(ids, pos, caches[:1], meta)
    with pytest.raises(ValueError, match="input_ids and positions"):
        model(ids, pos[:2], caches, meta)
    with pytest.raises(ValueError, match="context_len >= 0 and query_len >= 1"):
        make_attention_metadata([[0]], [0], [0], 4)
    with pytest.raises(ValueError, match="outside the 1 blocks"):
        make_attention_metadata([[0]], [3], [2], 4)
    with pytest.raises(ValueError, match="empty batch"):
        make_attention_metadata([], [], [], 4)
    with pytest.raises(ValueError, match=r"must be in 0\.\.3, got \[0, 4\]"):
        make_attention_metadata([[0, 4]], [0], [6], 4, num_blocks=4)
    with pytest.raises(ValueError, match=r"must be in 0\.\., got \[-1\]"):
        make_attention_metadata([[-1, 2]], [0], [3], 4)
    # a block past the tokens may hold anything (the padding of a table)
    assert make_attention_metadata([[1, -1]], [0], [3], 4, num_blocks=4).max_seq_len == 3
    assert isinstance(meta, AttentionMetadata) and meta.num_seqs == 1 and meta.num_tokens == 3
    assert meta.last_token_indices().tolist() == [2]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 3)


# ---------------------------------------------------------------- independent implementation


def test_same_logits_as_hugging_face_llama_with_these_weights(model) -> None:
    """Hugging Face's ``LlamaForCausalLM`` (eager attention), given our config and state dict,
    computes the same logits: RoPE layout, GQA grouping, norms and MLP agree."""
    transformers = pytest.importorskip("transformers")
    c = model.config
    hf_cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position, rms_norm_eps=c.rms_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, hidden_act="silu")
    hf_cfg._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    x = torch.tensor([TOK.encode("And God said, Let there be light: and there was light.")])
    with torch.no_grad():
        ours, _ = model.forward_contiguous(x)
        theirs = hf(input_ids=x).logits
    torch.testing.assert_close(ours, theirs.float(), atol=1e-4, rtol=1e-4)


def test_paged_forward_rejects_negative_positions_float_ids_and_a_foreign_batch(model) -> None:
    caches = allocate_kv_caches(model.config, 4, 4)
    meta = make_attention_metadata([[0, 1]], [0], [3], 4)
    ids, pos = torch.tensor([1, 2, 3]), torch.arange(3)
    before = [k.clone() for k, _ in caches]
    with pytest.raises(ValueError, match=r"positions must be in 0\.\.255, got -3"):
        model(ids, pos - 3, caches, meta)           # RoPE would rotate by a negative angle
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        model(ids.float(), pos, caches, meta)
    with pytest.raises(ValueError, match="attn_metadata describes 3 new tokens, input_ids "
                                         "holds 2"):
        model(ids[:2], pos[:2], caches, meta)
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        model.forward_contiguous(ids[None].float())
    assert all(torch.equal(k, b) for (k, _), b in zip(caches, before, strict=True))


def test_generation_helpers_reject_bad_arguments(model) -> None:
    from course_lib.model.generate import sample_next

    logits = torch.randn(10)
    for temperature in (math.nan, math.inf, -1.0, "0.5"):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            sample_next(logits, temperature)
    with pytest.raises(ValueError, match="top_k must be None or an integer >= 1, got 0"):
        sample_next(logits, 1.0, top_k=0)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0, got -1"):
        generate_contiguous(model, [BOS_ID], -1)
    for bad in (259, -1, 2.0):
        with pytest.raises(ValueError, match=r"token id must be an integer in 0\.\.258"):
            ByteTokenizer().token_str(bad)
    assert ByteTokenizer().token_str(torch.tensor(BOS_ID)) == "<bos>"
