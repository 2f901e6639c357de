"""Load the shipped tiny model offline: weights and config live in ``course_lib/model/weights``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from course_lib.model.config import ModelConfig
from course_lib.model.llama import TinyLlama

WEIGHTS_DIR = Path(__file__).parent / "weights"
WEIGHTS_FILE = "tiny_llama.pt"     # state dict, float16
META_FILE = "tiny_llama.json"      # config, seed, losses, data hash (written by the trainer)
HELDOUT_FILE = "heldout_sample.txt"  # a few verses the model never trained on


def load_metadata(weights_dir: Path | str = WEIGHTS_DIR) -> dict:
    """The training record: ``config``, ``seed``, ``final_train_loss``, ``final_val_loss``, ..."""
    return json.loads((Path(weights_dir) / META_FILE).read_text())


def load_tiny_model(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    weights_dir: Path | str = WEIGHTS_DIR, *,
                    layer_types: Sequence[str] | None = None,
                    sliding_window: int | None = None) -> TinyLlama:
    """The trained :class:`TinyLlama` in eval mode, from files in the repo (no network).

    ``layer_types`` and ``sliding_window`` (None: the trained config's, all full attention)
    run the same weights as a hybrid model (chapter 14), e.g. every other layer windowed as
    gpt-oss alternates them: ``layer_types=repeat_layer_pattern((SLIDING_ATTENTION,
    FULL_ATTENTION), 4), sliding_window=16`` (``course_lib.sizing.models``). The weights were
    trained with full attention everywhere, so a window changes what the model predicts once
    a context outgrows it (a different model, with every mask well defined: what paged and
    dense runs must agree on), not the weights. ``ModelConfig`` checks both (``ValueError``)."""
    weights_dir = Path(weights_dir)
    path = weights_dir / WEIGHTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no weights at {path}: run scripts/train_tiny_model.py")
    cfg = ModelConfig.from_dict(load_metadata(weights_dir)["config"])
    if layer_types is not None or sliding_window is not None:
        cfg = replace(cfg, layer_types=cfg.layer_types if layer_types is None else layer_types,
                      sliding_window=cfg.sliding_window if sliding_window is None
                      else sliding_window)
    model = TinyLlama(cfg)
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.to(device=device, dtype=dtype).eval()


def heldout_text(weights_dir: Path | str = WEIGHTS_DIR) -> str:
    """Verses from the held-out books (never trained on), for loss checks offline."""
    return (Path(weights_dir) / HELDOUT_FILE).read_text(encoding="utf-8")
