"""Exercises of chapter 01 (KV-cache cost): a model's bytes per token on one tensor-parallel
rank, read from its ``config.json`` as a server reads it; a decode loop with a KV cache shared
by groups of query heads (GQA); the largest batch one GPU serves, weights counted from the
config (1.3, in ``ch01_batch``).

Each reference_* function is the library's answer, built from course_lib.capacity; each check_*
runs a learner's function and the reference on the same cases (the presets' configs, configs
with keys left out as real ones leave them out, edge cases) and returns a Verdict that names the
first case that differs and, where it can tell, the rule that was missed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from course_lib.exercises import (
    Exercise,
    Exercises,
    Rule,
    Verdict,
    judge_cases,
    returns,
    rule_wrongs,
)
from course_lib.exercises.ch01_batch import (
    WRONG_IDEAS,
    check_max_batch_size,
    reference_kv_bytes_from_config,
)
from course_lib.exercises.solutions import ch01 as solutions
from course_lib.kernels.reference import dense_attention
from course_lib.sizing.models import PRESETS, ModelSpec

_DTYPE_NAMES = {4: "float32", 2: "bfloat16", 1: "float16"}


def config_of(spec: ModelSpec, *, drop: tuple[str, ...] = (), dtype: str = "bfloat16",
              **extra) -> dict:
    """A Hugging Face style config.json (as a dict) for a preset; ``drop`` leaves keys out."""
    config = {"num_hidden_layers": spec.num_layers,
              "num_attention_heads": spec.num_attention_heads,
              "num_key_value_heads": spec.num_kv_heads if not spec.is_mla
              else spec.num_attention_heads,           # DeepSeek's config says 128: not used
              "hidden_size": spec.num_attention_heads * spec.head_dim,
              "head_dim": spec.head_dim, "torch_dtype": dtype}
    if spec.is_mla:
        config.update(kv_lora_rank=spec.kv_lora_rank, qk_rope_head_dim=spec.qk_rope_head_dim)
    config.update(extra)
    return {k: v for k, v in config.items() if k not in drop}


def config_cases() -> list[tuple[dict, int]]:
    p = PRESETS
    gemma_like = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
                  "hidden_size": 3072, "head_dim": 256, "torch_dtype": "bfloat16"}
    cases = [(config_of(s), 1) for s in p.values()]
    cases += [
        (config_of(p["llama-2-7b"], drop=("num_key_value_heads", "head_dim"),
                   dtype="float16"), 1),                       # Llama-2's config: MHA, implied
        (config_of(p["llama-2-7b"], drop=("num_key_value_heads",)), 4),
        (config_of(p["llama-3-70b"]), 2), (config_of(p["llama-3-70b"]), 8),
        (config_of(p["llama-3-70b"], drop=("head_dim",)), 16),  # 16 ranks, 8 KV heads
        (config_of(p["qwen2.5-7b"], dtype="float32"), 4),      # 4 KV heads on 4 ranks
        (config_of(p["qwen2.5-7b"]), 2),
        (config_of(p["deepseek-v3"]), 1), (config_of(p["deepseek-v3"]), 8),
        (config_of(p["deepseek-v3"], head_dim=None), 16),       # MLA: TP does not split it
        (gemma_like, 1), (gemma_like, 2),                       # head_dim != hidden / heads
        ({"num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 3,
          "hidden_size": 42, "torch_dtype": "float16", "head_dim": None}, 3),
    ]
    return cases


def _config_text(config: dict) -> str:
    return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in config.items()) + "}"


def _judge_config(learner: Callable, case: tuple) -> str | None:
    config, tp = case
    want = reference_kv_bytes_from_config(config, tp)
    where = f"config {_config_text(config)}, tensor_parallel_size {tp}"
    try:
        got = learner(dict(config), tp)
    except (KeyError, TypeError) as exc:     # a key read as if every config had it
        return f"{where}: raised {type(exc).__name__}: {exc}" + _config_rule({}, tp, None, want)
    if got == want:
        return None
    return (f"{where}: returned {got!r}, the library returns {want:,}"
            + _config_rule(config, tp, got, want))


def check_kv_bytes_from_config(fn: Callable[[dict, int], int]) -> Verdict:
    """1.1: compare bytes; a difference names the config, the TP size and the likely rule."""
    return judge_cases("1.1 kv_bytes_from_config", fn, config_cases(), _judge_config,
                       lambda case: f"config {_config_text(case[0])}, "
                                    f"tensor_parallel_size {case[1]}")


def _config_rule(config: dict, tp: int, got, want: int) -> str:
    if config.get("kv_lora_rank"):
        if got in (want // tp, want * 2):
            return " (MLA caches one latent per token and layer, the same on every rank)"
        return " (MLA: num_layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes)"
    if got == 0 or (isinstance(got, (int, float)) and got < want and tp > 1):
        return (" (a rank holds num_kv_heads // TP KV heads, and at least one: past that "
                "heads are replicated)")
    if got == want * tp or got == want * min(tp, config.get("num_key_value_heads") or tp):
        return " (each rank caches only its share of the KV heads)"
    if "num_key_value_heads" not in config or "head_dim" not in config or \
            config.get("head_dim") is None:
        return (" (a missing num_key_value_heads means MHA, as many as num_attention_heads; "
                "a missing or null head_dim means hidden_size // num_attention_heads)")
    return ""


# ------------------------------------------------------------------ 1.2 a GQA decode with a cache
def reference_gqa_decode(x, Wq, Wk, Wv, num_heads: int, num_kv_heads: int):
    """Causal attention of every token over the ones before it (the library's dense attention),
    and the K and V a cache holds: ``[n, num_kv_heads, head_dim]``."""
    n, d = len(x), Wq.shape[1] // num_heads
    q = (x @ Wq).view(n, num_heads, d)
    k, v = (x @ Wk).view(n, num_kv_heads, d), (x @ Wv).view(n, num_kv_heads, d)
    return dense_attention(q, k, v, d ** -0.5).reshape(n, num_heads * d), k, v


def gqa_cases() -> list[tuple]:
    gen = torch.Generator().manual_seed(12)
    shapes = [(1, 1, 4, 1), (4, 4, 4, 6), (4, 2, 4, 7), (8, 2, 2, 5), (4, 1, 8, 9), (6, 3, 4, 4),
              (2, 1, 4, 3), (8, 4, 2, 8)]
    cases = []
    for heads, kv, d, n in shapes:
        d_model = heads * d
        w = [torch.randn(d_model, cols, generator=gen) / d_model ** 0.5
             for cols in (heads * d, kv * d, kv * d)]
        cases.append((torch.randn(n, d_model, generator=gen), *w, heads, kv))
    return cases


def _judge_gqa(case: tuple, got) -> str | None:
    x, Wq, Wk, Wv, heads, kv = case
    why = _gqa_problem(got, reference_gqa_decode(*case), heads, kv)
    if why and why.startswith("step"):
        why += _gqa_rule(got, case)
    return why and f"{_gqa_text(case)}: {why}"


def _gqa_text(case: tuple) -> str:
    return f"{len(case[0])} tokens, {case[4]} query heads, {case[5]} KV heads"


def check_gqa_decode(fn: Callable) -> Verdict:
    """1.2: outputs and caches; a difference names the step, the head and the likely rule."""
    return judge_cases("1.2 decode_with_gqa_cache", fn, gqa_cases(), returns(_judge_gqa),
                       _gqa_text)


def _gqa_rule(got, case: tuple) -> str:
    """The idea a wrong output shows, when it is one of the usual mistakes."""
    for wrong, rule in ((_sees_the_future, "every step attended over all the tokens: step t "
                         "must see only the cache as it is at step t"),
                        (_heads_round_robin, "query head h read KV head h % num_kv_heads; the "
                         "heads of one group are neighbours: h // (num_heads // num_kv_heads)")):
        if torch.allclose(got[0], wrong(*case)[0], atol=1e-5):
            return f" (here {rule})"
    return ""


def _gqa_problem(got, want, heads: int, kv: int) -> str | None:
    names = ("outputs", "k_cache", "v_cache")
    if not (isinstance(got, (tuple, list)) and len(got) == 3
            and all(isinstance(g, torch.Tensor) for g in got)):
        return f"expected (outputs, k_cache, v_cache), three tensors, got {got!r:.60}"
    for name, g, w in zip(names[1:], got[1:], want[1:], strict=True):
        if g.shape != w.shape:
            return (f"{name} has shape {tuple(g.shape)}, want {tuple(w.shape)}: one entry per "
                    "token and per KV head (not per query head)")
        if not torch.allclose(g, w, atol=1e-5):
            return f"{name} differs from x @ W{name[0]} viewed as [tokens, KV heads, head_dim]"
    if got[0].shape != want[0].shape:
        return f"outputs have shape {tuple(got[0].shape)}, want {tuple(want[0].shape)}"
    d = want[0].shape[1] // heads
    for t in range(want[0].shape[0]):
        for h in range(heads):
            g, w = got[0][t, h * d:(h + 1) * d], want[0][t, h * d:(h + 1) * d]
            if not torch.allclose(g, w, atol=1e-5):
                return (f"step {t}, query head {h} (it reads KV head {h // (heads // kv)}: "
                        f"query heads {heads // kv} at a time share one): got "
                        f"{[round(v, 4) for v in g.tolist()]}, the library "
                        f"{[round(v, 4) for v in w.tolist()]}; step t attends over tokens "
                        f"0..t only, with scores scaled by 1/sqrt(head_dim)")
    return None


def _ignores_tp(config, tensor_parallel_size):
    return solutions.kv_bytes_from_config(config, 1)


def _no_replication(config, tensor_parallel_size):
    if config.get("kv_lora_rank"):
        return solutions.kv_bytes_from_config(config, tensor_parallel_size)
    per_head = solutions.kv_bytes_from_config(config, 1) // (
        config.get("num_key_value_heads") or config["num_attention_heads"])
    kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    return per_head * (kv // tensor_parallel_size)


def _heads_round_robin(x, Wq, Wk, Wv, num_heads, num_kv_heads):
    """Wrong: query head h reads KV head h % num_kv_heads (repeat, not repeat_interleave)."""
    n, d = len(x), Wq.shape[1] // num_heads
    q = (x @ Wq).view(n, num_heads, d)
    k, v = (x @ Wk).view(n, num_kv_heads, d), (x @ Wv).view(n, num_kv_heads, d)
    order = [h % num_kv_heads for h in range(num_heads)]
    out = torch.stack([torch.softmax(
        (k[:, order[h]] @ q[:, h].T).T / d ** 0.5 + torch.full((n, n), float("-inf")).triu(1),
        dim=-1) @ v[:, order[h]] for h in range(num_heads)], dim=1)
    return out.reshape(n, num_heads * d), k, v


def _sees_the_future(x, Wq, Wk, Wv, num_heads, num_kv_heads):
    """Wrong: fills the cache first, then every step attends over all tokens."""
    n, d = len(x), Wq.shape[1] // num_heads
    q = (x @ Wq).view(n, num_heads, d)
    k, v = (x @ Wk).view(n, num_kv_heads, d), (x @ Wv).view(n, num_kv_heads, d)
    g = num_heads // num_kv_heads
    out = torch.stack([torch.softmax(q[:, h] @ k[:, h // g].T / d ** 0.5, dim=-1) @ v[:, h // g]
                       for h in range(num_heads)], dim=1)
    return out.reshape(n, num_heads * d), k, v


def _mla_split_by_tp(config, tensor_parallel_size):
    got = solutions.kv_bytes_from_config(config, tensor_parallel_size)
    return got // tensor_parallel_size if config.get("kv_lora_rank") else got


EXERCISES = Exercises(
    Exercise("1.1", "bytes per token from a model's config.json", check_kv_bytes_from_config,
             hints=(
        "Start from num_layers x 2 (K and V) x num_kv_heads x head_dim x dtype bytes, with the "
        "config's names: num_hidden_layers, num_key_value_heads, head_dim, torch_dtype.",
        "Real configs leave keys out: no num_key_value_heads means MHA (as many KV heads as "
        "attention heads); no head_dim (or null) means hidden_size // num_attention_heads. "
        "config.get(key) returns None for a missing key.",
        "On one rank: max(1, num_kv_heads // tensor_parallel_size) KV heads. A config with "
        "kv_lora_rank is MLA: num_layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes on "
        "every rank.",
    ), solution=solutions.kv_bytes_from_config,
        rules=(
        Rule("each rank caches only its share of the KV heads, num_kv_heads // TP",
             "config {'num_hidden_layers': 32, 'num_attention_heads': 32, 'hidden_size': 4096, 'he",
             _ignores_tp),
        Rule("past num_kv_heads ranks the heads are replicated: at least one KV head a rank",
             "config {'num_hidden_layers': 80, 'num_attention_heads': 64, 'num_key_value_heads': "
             "8, 'hidden_size': 8192, 'torc",
             _no_replication),
        Rule("MLA caches one latent per token and layer, the same on every rank",
             "config {'num_hidden_layers': 61, 'num_attention_heads': 128, 'num_key_value_heads': "
             "128, 'hidden_size': 16384, 'head_dim': 128, 'torch_dtype': 'bfloat16', "
             "'kv_lora_rank': 512, 'qk_rope_head_dim': 64}, tensor_parallel_size 8",
             _mla_split_by_tp),
        Rule("a missing num_key_value_heads means MHA: as many as num_attention_heads",
             "config {'num_hidden_layers': 32, 'num_attention_heads': 32, 'hidden_size': 4096, 'to",
             rule_wrongs.kv_bytes_missing_kv_is_one),
        Rule("head_dim is hidden_size // num_attention_heads only when missing or None",
             "config {'num_hidden_layers': 28, 'num_attention_heads': 16, 'num_key_value_heads': "
             "16, 'hidden_size': 3072, 'head_dim': 256, 'torch_dtype': 'bfloat16'}, "
             "tensor_parallel_size 1",
             rule_wrongs.kv_bytes_head_dim_from_hidden),
        Rule("torch_dtype's bytes: float32 is 4",
             "config {'num_hidden_layers': 28, 'num_attention_heads': 28, 'num_key_value_heads': "
             "4, 'hidden_size': 3584, 'head_dim': 128, 'torch_dtype': 'floa",
             rule_wrongs.kv_bytes_two_bytes),
    ), compare_with=(
        "kv_heads_per_rank and kv_bytes_per_token_per_layer in course_lib/capacity.py")),
    Exercise("1.2", "a decode loop with a GQA cache", check_gqa_decode, hints=(
        "Start from decode_with_cache above. Each step projects only token t: x[t] @ Wk is "
        "num_kv_heads x head_dim numbers, .view(num_kv_heads, head_dim) makes them the "
        "cache's new row; head_dim = Wq.shape[1] // num_heads.",
        "Query head h reads KV head h // (num_heads // num_kv_heads): the group of "
        "num_heads // num_kv_heads neighbouring query heads shares one KV head.",
        "Per step and query head: softmax(K[:, g] @ q[h] / sqrt(head_dim)) @ V[:, g] over the t +"
        " 1 cached rows; concatenate the heads.",
    ), solution=solutions.decode_with_gqa_cache, rules=(
        Rule("query head h reads KV head h // (num_heads // num_kv_heads)",
             "7 tokens, 4 ",
             _heads_round_robin),
        Rule("step t attends over the cached tokens 0..t only",
             "6 tokens, 4 ",
             _sees_the_future),
        Rule("scores scaled by 1 / sqrt(head_dim)",
             "6 tokens, 4 query heads, 4 KV heads",
             rule_wrongs.gqa_decode_unscaled),
    ),
        compare_with=(
        "dense_attention in course_lib/kernels/reference.py (repeat_interleave does the "
        "grouping)")),
    Exercise("1.3", "the largest batch one GPU serves, from config.json", check_max_batch_size,
             hints=(
        "Two parts: the weights' bytes (parameters x dtype bytes, paid once) and the cache of "
        "one request (1.1's bytes per token at TP 1, x (prompt_len + output_len)). What is "
        "left of the memory after the weights, divided by one request's cache (a floor).",
        "Parameters: embed_tokens vocab_size x hidden_size; per layer q_proj and o_proj "
        "hidden_size x (num_attention_heads x head_dim), k_proj and v_proj hidden_size x "
        "(num_key_value_heads x head_dim), gate_proj, up_proj and down_proj hidden_size x "
        "intermediate_size, two RMSNorm weights of hidden_size; a final norm; lm_head "
        "vocab_size x hidden_size unless tie_word_embeddings.",
        "Memory is round(gpu_memory_gib x 2**30) bytes; if the weights take more, 0.",
    ), solution=solutions.max_batch_size, rules=(
        Rule("the MLP has gate_proj, up_proj and down_proj",
             "config {'vocab_size': 128256, 'hidden_size': 4096, 'intermediate_size': 14336, "
             "'num_hidden_layers': 32, 'num_attention_heads': 32, 'num_key_value_heads': 8, "
             "'head_dim': 128, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16'}, 80 G",
             tuple(w for w, _ in WRONG_IDEAS)[0]),
        Rule("GQA makes k_proj and v_proj smaller than q_proj",
             "config {'vocab_size': 128256, 'hidden_size': 4096, 'intermediate_size': 14336, "
             "'num_hidden_layers': 32, 'num_attention_heads': 32, 'num_key_value_heads': 8, "
             "'head_dim': 128, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16'}, 80 G",
             tuple(w for w, _ in WRONG_IDEAS)[1]),
        Rule("a tied lm_head is the embedding matrix, stored once",
             "config {'vocab_size': 128256, 'hidden_size': 2048, 'intermediate_size': 8192, "
             "'num_hidden_layers': 16, 'num_attention_heads': 32, 'num_key_value_heads': 8, "
             "'head_dim': 64, 'tie_word_embeddings': True, 'torch_dtype': 'bfloat16'}, 24 ",
             tuple(w for w, _ in WRONG_IDEAS)[2]),
        Rule("1 GiB is 2**30 bytes",
             "config {'vocab_size': 128256, 'hidden_size': 4096, 'intermediate_size': 14336, "
             "'num_hidden_layers': 32, 'num_attention_heads': 32, 'num_key_value_heads': 8, "
             "'head_dim': 128, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16'}, 80 G",
             tuple(w for w, _ in WRONG_IDEAS)[3]),
        Rule("0 when the weights alone do not fit",
             "config {'vocab_size': 128256, 'hidden_size': 819",
             rule_wrongs.max_batch_negative),
        Rule("two RMSNorm weights a layer, and a final RMSNorm",
             "config {'vocab_size': 128256, 'hidden_size': 4096, 'intermediate_size': 14336, "
             "'num_hidden_layers': 32, 'num_attention_heads': 32, 'num_key_value_heads': 8, "
             "'head_dim': 128, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16'}, 16 G",
             rule_wrongs.max_batch_no_norms),
    ), compare_with=(
        "the modules of course_lib/model/llama.py (Attention, MLP, DecoderLayer, TinyLlama), the "
        "model these shapes build, and weights_kv_crossing_tokens in course_lib/viz/capacity.py")),
)


hint = EXERCISES.print_hint            # ch01.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch01.solution("N.M"): a solution's code
