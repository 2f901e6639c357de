"""Chapter 01's exercise 1.3: how many requests one GPU serves at once, from a model's
``config.json``: its weights (parameters counted from the config) are paid once, its KV cache
for every token of every request.

The reference counts the parameters of the course's own Llama (``course_lib.model.llama``)
built from the config on torch's ``meta`` device (shapes only, no memory), and the bytes per
token with 1.1's reference. The checker runs the real models' configs (MHA, GQA, MQA, tied
embeddings, a ``head_dim`` that is not ``hidden_size // num_attention_heads``, keys left out),
exact fits and one byte short, then random small configs from a fixed seed; a difference names
the weights and the cache per request as the library counts them, and the idea missed when the
answer is one of the usual mistakes.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from course_lib import capacity as cap
from course_lib.exercises import Verdict, judge_cases, returns
from course_lib.sizing.models import ModelSpec

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def reference_kv_bytes_from_config(config: dict, tensor_parallel_size: int) -> int:
    """Bytes one token adds to the cache of one rank, through course_lib.capacity."""
    heads, mla = config["num_attention_heads"], bool(config.get("kv_lora_rank"))
    spec = ModelSpec(
        "exercise", config["num_hidden_layers"], heads,
        1 if mla else config.get("num_key_value_heads") or heads,
        config.get("head_dim") or config["hidden_size"] // heads, num_params=1,
        dtype_bytes=DTYPE_BYTES[config["torch_dtype"]],
        kv_lora_rank=config.get("kv_lora_rank") or 0,
        qk_rope_head_dim=config.get("qk_rope_head_dim") or 0)
    return cap.kv_bytes_per_token(spec, tensor_parallel_size)

# Llama-style configs as their config.json files give them (the keys 1.3 reads).
CONFIGS = {
    "Llama-2-7B": dict(vocab_size=32_000, hidden_size=4096, intermediate_size=11_008,
                       num_hidden_layers=32, num_attention_heads=32, torch_dtype="float16"),
    "Llama-3-8B": dict(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "Llama-3-70B": dict(vocab_size=128_256, hidden_size=8192, intermediate_size=28_672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        tie_word_embeddings=False, torch_dtype="bfloat16"),
    "Llama-3.2-1B": dict(vocab_size=128_256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "Mistral-7B": dict(vocab_size=32_000, hidden_size=4096, intermediate_size=14_336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=None, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "Gemma-2B": dict(vocab_size=256_000, hidden_size=2048, intermediate_size=16_384,
                     num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1,
                     head_dim=256, tie_word_embeddings=True, torch_dtype="bfloat16"),
}


def _shape(config: dict) -> tuple[int, int, int, int, int, int]:
    heads = config["num_attention_heads"]
    return (config["vocab_size"], config["hidden_size"], config["intermediate_size"], heads,
            config.get("num_key_value_heads") or heads,
            config.get("head_dim") or config["hidden_size"] // heads)


@functools.lru_cache(maxsize=256)
def _params_of_layers(vocab: int, hidden: int, inter: int, heads: int, kv_heads: int,
                      head_dim: int, num_layers: int) -> int:
    """Parameters of the course's Llama with ``num_layers`` layers, built on the meta device."""
    import torch

    import course_lib.device  # noqa: F401 (picks the backend before torch may import triton)
    from course_lib.model.config import ModelConfig
    from course_lib.model.llama import TinyLlama

    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=num_layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      intermediate_size=inter)
    with torch.device("meta"):
        return sum(p.numel() for p in TinyLlama(cfg).parameters())


def reference_num_params(config: dict) -> int:
    """Parameters of a Llama-style model: the course's model with one and two layers on the
    meta device gives the embeddings, the final norm, the head and one layer; a tied head
    (``tie_word_embeddings``) is the embedding matrix itself, counted once."""
    shape = _shape(config)
    one, two = _params_of_layers(*shape, 1), _params_of_layers(*shape, 2)
    total = one + (config["num_hidden_layers"] - 1) * (two - one)
    return total - (shape[0] * shape[1] if config.get("tie_word_embeddings") else 0)


def reference_max_batch_size(config: dict, gpu_memory_gib: float, prompt_len: int,
                             output_len: int) -> int:
    """Requests of ``prompt_len + output_len`` tokens whose whole cache fits beside the
    weights in ``gpu_memory_gib`` GiB on one GPU; 0 when the weights alone do not fit."""
    weights = reference_num_params(config) * DTYPE_BYTES[config["torch_dtype"]]
    per_request = reference_kv_bytes_from_config(config, 1) * (prompt_len + output_len)
    return max(0, round(gpu_memory_gib * GiB) - weights) // per_request


def _weights_and_request(config: dict, prompt_len: int, output_len: int) -> tuple[int, int]:
    return (reference_num_params(config) * DTYPE_BYTES[config["torch_dtype"]],
            reference_kv_bytes_from_config(config, 1) * (prompt_len + output_len))


def batch_cases(seed: int = 14, count: int = 20) -> list[tuple[dict, float, int, int]]:
    """(config, gpu_memory_gib, prompt_len, output_len)."""
    c = CONFIGS
    cases = [(c["Llama-3-8B"], 80, 1000, 1000), (c["Llama-2-7B"], 24, 512, 512),
             (c["Llama-3-70B"], 80, 100, 100),               # 131 GiB of weights: none
             (c["Llama-3.2-1B"], 24, 4000, 96), (c["Gemma-2B"], 16, 2048, 2048),
             (c["Mistral-7B"], 40, 3000, 1000), (c["Llama-3-8B"], 16, 1, 1),
             ({**c["Llama-3-8B"], "torch_dtype": "float32"}, 141, 8000, 192)]
    for name, k in (("Llama-3.2-1B", 7), ("Gemma-2B", 3), ("Llama-3-8B", 0)):
        weights, request = _weights_and_request(c[name], 700, 300)
        cases += [(c[name], (weights + k * request) / GiB, 700, 300),        # exactly k fit
                  (c[name], (weights + k * request + request - 1) / GiB, 700, 300)]
    weights, _ = _weights_and_request(c["Mistral-7B"], 1, 1)
    cases.append((c["Mistral-7B"], (weights - 1) / GiB, 1, 1))  # one byte short of the weights
    rng = random.Random(seed)
    for _ in range(count):
        heads = rng.choice([2, 4, 6, 8])
        head_dim = rng.choice([8, 16, 32])
        config = dict(vocab_size=rng.randrange(100, 5000), num_hidden_layers=rng.randrange(1, 9),
                      hidden_size=heads * head_dim * rng.choice([1, 1, 2]),
                      intermediate_size=rng.randrange(16, 1000), num_attention_heads=heads,
                      num_key_value_heads=rng.choice([k for k in (1, 2, heads) if heads % k == 0]),
                      head_dim=head_dim, tie_word_embeddings=rng.random() < 0.5,
                      torch_dtype=rng.choice(list(DTYPE_BYTES)))
        weights, request = _weights_and_request(config, 1, 0)
        tokens = rng.randrange(2, 3000)
        memory = (weights + rng.randrange(0, 50) * request * tokens + rng.randrange(request)) / GiB
        cases.append((config, memory, tokens - (out := rng.randrange(1, tokens)), out))
    return cases


def _case_text(case: tuple) -> str:
    config, gib, prompt_len, output_len = case
    keys = ", ".join(f"{k!r}: {v!r}" for k, v in config.items())
    return (f"config {{{keys}}}, {gib:.6g} GiB, prompt_len {prompt_len}, "
            f"output_len {output_len}")


def _judge_batch(case: tuple, got) -> str | None:
    config, gib, prompt_len, output_len = case
    want = reference_max_batch_size(*case)
    if got == want and isinstance(got, int):
        return None
    weights, request = _weights_and_request(config, prompt_len, output_len)
    said = (f"{_case_text(case)}: returned {got!r:.60}, the library returns {want} (it counts "
            f"{reference_num_params(config):,} parameters = {weights:,} B of weights, and "
            f"{request:,} B of cache per request)")
    for wrong, concept in WRONG_IDEAS:
        try:
            if wrong(dict(config), gib, prompt_len, output_len) == got:
                return f"{said}; here {concept}"
        except Exception:   # a wrong idea that cannot even run on this case
            continue
    return said


def check_max_batch_size(fn: Callable[[dict, float, int, int], int]) -> Verdict:
    """1.3: the batch; a difference names the weights and the cache per request the library
    counts, and the idea missed when the answer is one of the usual mistakes."""
    return judge_cases("1.3 max_batch_size", fn, batch_cases(), _judge_or_missing_key,
                       _case_text)


def _judge_or_missing_key(learner: Callable, case: tuple) -> str | None:
    try:
        return returns(_judge_batch)(learner, case)
    except (KeyError, TypeError) as exc:     # a key read as if every config had it
        return (f"{_case_text(case)}: raised {type(exc).__name__}: {exc} (configs leave keys "
                "out: no num_key_value_heads means MHA, no or a null head_dim means "
                "hidden_size // num_attention_heads, no tie_word_embeddings means False)")


# ------------------------------------------------------------------ plausible wrong answers
def _batch(config, gpu_memory_gib, prompt_len, output_len, *, mlp=3, kv_like_q=False,
           tie=True, gib=GiB):
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or config["hidden_size"] // heads
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    attn = hidden * heads * d * 2 + 2 * hidden * (heads if kv_like_q else kv) * d
    layer = attn + mlp * hidden * config["intermediate_size"] + 2 * hidden
    head = 0 if tie and config.get("tie_word_embeddings") else vocab * hidden
    params = vocab * hidden + config["num_hidden_layers"] * layer + hidden + head
    dtype = DTYPE_BYTES[config["torch_dtype"]]
    per_token = config["num_hidden_layers"] * 2 * kv * d * dtype
    free = round(gpu_memory_gib * gib) - params * dtype
    return max(0, free) // (per_token * (prompt_len + output_len))


def _mlp_two_matrices(config, gpu_memory_gib, prompt_len, output_len):
    """Wrong: an MLP of up and down projections only (SwiGLU has a gate_proj too)."""
    return _batch(config, gpu_memory_gib, prompt_len, output_len, mlp=2)


def _kv_projections_like_q(config, gpu_memory_gib, prompt_len, output_len):
    """Wrong: k_proj and v_proj as wide as q_proj (GQA shrinks them too)."""
    return _batch(config, gpu_memory_gib, prompt_len, output_len, kv_like_q=True)


def _head_always_counted(config, gpu_memory_gib, prompt_len, output_len):
    """Wrong: counts lm_head even when it is the embedding matrix (tie_word_embeddings)."""
    return _batch(config, gpu_memory_gib, prompt_len, output_len, tie=False)


def _decimal_gigabytes(config, gpu_memory_gib, prompt_len, output_len):
    """Wrong: 1 GiB read as 10**9 bytes."""
    return _batch(config, gpu_memory_gib, prompt_len, output_len, gib=10**9)


WRONG_IDEAS = (
    (_mlp_two_matrices, "the MLP has three matrices, gate_proj, up_proj and down_proj, "
     "each hidden_size x intermediate_size"),
    (_kv_projections_like_q, "k_proj and v_proj map hidden_size to num_key_value_heads x "
     "head_dim: GQA shrinks the weights as well as the cache"),
    (_head_always_counted, "with tie_word_embeddings the output head is the embedding "
     "matrix: count it once"),
    (_decimal_gigabytes, "1 GiB is 2**30 bytes, not 10**9"),
)
