"""A model folder read as data (`--model`): its JSON files, its weights and transformers' failures on them
named in one line.

model_io.load_model hands the folder to transformers, whose failures on a hostile folder are tracebacks that
name no file: JSON nested 100,000 deep (RecursionError), a weights file cut short (SafetensorError), sizes
in config.json that the weights do not have (a RuntimeError after a table of every mismatched tensor).
`load_model` reads every JSON file of a local folder first, then turns those failures into a ValueError that
names the file (the first weights file whose header safetensors refuses) or the first tensor whose size
differs.
"""

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

import model_io
from grpo_vlm import files


@contextlib.contextmanager
def _size_mismatches() -> Iterator[list[str]]:
    """Inside, transformers' load report is held back when it lists tensors of the wrong size (the load then
    raises); the list gets the first such line, its columns squeezed to single spaces."""
    found: list[str] = []

    def keep(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "LOAD REPORT" not in message or "MISMATCH" not in message:
            return True
        found.append(" ".join(next(line for line in message.splitlines() if "MISMATCH" in line).split()))
        return False

    logger = logging.getLogger("transformers.modeling_utils")  # the logger that writes the report
    logger.addFilter(keep)
    try:
        yield found
    finally:
        logger.removeFilter(keep)


def unreadable_weights(folder: Path) -> tuple[Path, SafetensorError] | None:
    """The first *.safetensors file of `folder` whose header safetensors refuses, and why (None: none is)."""
    for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        try:
            with safe_open(path, "pt"):
                pass
        except SafetensorError as e:
            return path, e
    return None


def resolve_dtype(name: str, device) -> torch.dtype:
    """model_io.resolve_dtype, and 'float16' for inference (evaluation, summaries; training refuses it)."""
    return torch.float16 if name == "float16" else model_io.resolve_dtype(name, device)


def load_model(name_or_path: str, *, device, dtype, attn_implementation: str | None = None):
    """model_io.load_model with the folder's JSON files read first and its weights' failures named
    (ValueError), then `attn_implementation` (sdpa, flash_attention_2, eager; None: transformers' default,
    sdpa): (model, tokenizer, image_processor or None)."""
    folder = Path(name_or_path).expanduser()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        files.read_json(path)
    with _size_mismatches() as mismatches:
        try:
            model, tokenizer, image_processor = model_io.load_model(name_or_path, device=device, dtype=dtype)
        except SafetensorError as e:  # NOTE: a file cut short, emptied or not safetensors at all
            path, why = unreadable_weights(folder) or (None, e)
            named = f": {path}" if path is not None else ""
            raise ValueError(
                f"{name_or_path}: a weights file is unreadable{named} ({why}); damaged or cut short?"
            ) from None
        except RuntimeError:
            if not mismatches:
                raise
            raise ValueError(
                f"{name_or_path}: the weights do not have the sizes config.json gives (hidden sizes or layer "
                f"counts edited?): {mismatches[0]}"
            ) from None
    if attn_implementation is not None:  # transformers' default is sdpa; switched in place, weights as loaded
        model.set_attn_implementation(attn_implementation)
    return model, tokenizer, image_processor
