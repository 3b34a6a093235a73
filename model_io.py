"""Loading models, saving full models, and atomic training checkpoints.

- `load_model` loads a Qwen-VL checkpoint (`AutoModelForImageTextToText`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL)
  or a text-only causal LM (`AutoModelForCausalLM`) from a local folder or a hub id, with its tokenizer
  and (for VLMs) its image processor, in the dtype and on the device the caller chooses, and freezes
  every base parameter. It goes through exactly the `from_pretrained` calls a real checkpoint uses, so
  the embedded tiny model in `assets/` tests the real loading path offline.
- `save_model` writes a full model with `save_pretrained` (call `lora.unload_lora` first to get a
  LoRA-merged checkpoint that any transformers user can load).
- `save_checkpoint` / `load_checkpoint` write and read a training checkpoint folder atomically: it is
  built under a temporary name and renamed into place only when complete, so a crash during a save
  leaves the previous checkpoint intact. The adapter is written by a callback (this module does not
  import `lora.py`; only `train.py` ties the modules together).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
)

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "assets" / "tiny-qwen2.5-vl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """'auto' is bf16 on CUDA and fp32 elsewhere (CPU bf16 matmuls are slow and imprecise)."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(name_or_path: str, *, device: torch.device | str, dtype: torch.dtype):
    """Return (model, tokenizer, image_processor or None), the model frozen and in eval mode."""
    # A hub id is 'org/name'; anything else that does not exist is a mistyped local path.
    is_hub_id = name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~"))
    local = Path(name_or_path).expanduser()
    if not local.exists() and not is_hub_id:
        raise FileNotFoundError(f"model path {name_or_path} does not exist")
    # NOTE: without this check transformers says "Should have a `model_type` key in its config.json",
    # as if a config.json existed.
    if local.is_dir() and not (local / "config.json").is_file():
        raise ValueError(f"cannot load a model config from {name_or_path!r}: the folder has no config.json")
    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except OSError as e:  # not a folder with config.json, and not reachable on the hub
        raise ValueError(f"cannot load a model config from {name_or_path!r}: {e}") from e
    is_vlm = getattr(config, "vision_config", None) is not None
    model_class = AutoModelForImageTextToText if is_vlm else AutoModelForCausalLM
    model = model_class.from_pretrained(name_or_path, dtype=dtype).to(device)
    model.requires_grad_(False)  # the base is frozen; LoRA parameters are added (trainable) later
    model.eval()  # NOTE: no dropout in the base; LoRA dropout is switched by the trainer explicitly

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe: completion masks are built from lengths
    image_processor = AutoImageProcessor.from_pretrained(name_or_path) if is_vlm else None
    return model, tokenizer, image_processor


def save_model(model, tokenizer, image_processor, directory: str | Path) -> None:
    """`save_pretrained` the model, tokenizer and image processor into one folder (safetensors)."""
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if image_processor is not None:
        image_processor.save_pretrained(directory)


# --------------------------------------------------------------------------------------------------
# Checkpoints

STATE_FILE = "trainer_state.pt"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    directory: str | Path,
    *,
    write_adapter: Callable[[Path], None],
    state: dict[str, Any],
    keep_last: int | None,
) -> Path:
    """Write `directory` (e.g. runs/x/checkpoint-000100) atomically; prune older siblings to `keep_last`.

    `write_adapter(folder)` writes the adapter files; `state` (optimizer, scheduler, step, ...) is saved
    with the RNG states as `trainer_state.pt`. The folder appears under its final name only once complete.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (the checkpoint just written), got {keep_last}")
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
    tmp.mkdir(parents=True)
    write_adapter(tmp)
    torch.save({**state, "rng": rng_state()}, tmp / STATE_FILE)
    _fsync_tree(tmp)
    if directory.exists():  # re-saving the same step (e.g. after a resume): swap, never delete first
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old)
    else:
        os.replace(tmp, directory)
    if keep_last is not None:
        prune_checkpoints(directory.parent, keep_last)
    return directory


def _fsync_tree(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first (temporary folders are ignored)."""
    run_dir = Path(run_dir)
    found = [p for p in run_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old)


def load_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Read `trainer_state.pt` of a checkpoint folder (the caller loads the adapter and restores RNG)."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint folder (no {STATE_FILE})")
    # weights_only=False: the state holds numpy RNG state and python tuples, written by this project.
    return torch.load(path, map_location="cpu", weights_only=False)


def append_jsonl(path: str | Path, record: dict) -> None:
    """One line per record, flushed and fsynced, so `tail -f` works and a crash loses at most one line."""
    with Path(path).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
