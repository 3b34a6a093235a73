"""Reading LoRA adapters someone else wrote (`--adapter`, `--resume`): every field checked, one-line errors.

`load_adapter` is model_io.load_adapter after adapter_config.json has been read field by field: not JSON, not
UTF-8, no JSON object, or a field lora.py loads (r, lora_alpha, target_modules, lora_dropout,
layers_to_transform) missing or of the wrong type is a ValueError "PATH: field: expected ..., got ...".
Neither file is read unless it is a regular one (files.regular_file: a FIFO would block the read).
"""

import json
import math
from pathlib import Path

import torch

import model_io
from grpo_vlm import files

# The fields lora.py loads: (is the value right, what is expected). PEFT's defaults fill lora_dropout and
# layers_to_transform, whose None means every layer.
FIELDS = {
    "r": (lambda v: type(v) is int and v > 0, "a positive int"),
    "lora_alpha": (lambda v: type(v) in (int, float) and math.isfinite(v), "a finite number"),
    "target_modules": (lambda v: bool(v) and all(isinstance(m, str) for m in v), "a list of module names"),
    "lora_dropout": (lambda v: type(v) in (int, float) and 0 <= v < 1, "a number in [0, 1)"),
    "layers_to_transform": (
        lambda v: v is None or type(v) is int or isinstance(v, list) and all(type(i) is int for i in v),
        "null, a layer index or a list of them",
    ),
}


def read_adapter_config(path: Path) -> dict:
    """adapter_config.json as a dict whose fields lora.py can load; anything else is a ValueError naming the
    file and the field."""
    try:
        config = json.loads(files.regular_file(path).read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(config).__name__}")  # noqa: TRY004
    model_io.check_loadable(path, config)  # first: target_modules may be one regex string in PEFT
    config = {"lora_dropout": 0.0, "layers_to_transform": None} | config  # PEFT's defaults
    for field, (ok, expected) in FIELDS.items():
        if field not in config:
            raise ValueError(f"{path}: {field}: missing (expected {expected})")
        if not ok(value := config[field]):
            raise ValueError(f"{path}: {field}: expected {expected}, got {value!r}")
    return config


def load_adapter(model: torch.nn.Module, directory: str | Path, *, lora_fp32: bool = True) -> list[str]:
    """model_io.load_adapter, with adapter_config.json checked field by field and both files regular ones."""
    config = read_adapter_config(Path(directory, model_io.ADAPTER_CONFIG))
    files.regular_file(Path(directory, model_io.ADAPTER_WEIGHTS))
    return model_io.load_adapter(model, directory, config=config, lora_fp32=lora_fp32)
