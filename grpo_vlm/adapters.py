"""Reading LoRA adapters someone else wrote (`--adapter`, `--resume`): every field checked, one-line errors.

`load_adapter` is model_io.load_adapter after adapter_config.json has been read field by field: not JSON, not
UTF-8, no JSON object, or a field lora.py loads (r, lora_alpha, target_modules, lora_dropout,
layers_to_transform) missing or of the wrong type is a ValueError "PATH: field: expected ..., got ...".
Neither file is read unless it is a regular one (files.regular_file: a FIFO would block the read). Weights of
a type other than float32, bfloat16, float16 or float64 are refused (load_state_dict would cast ints and
bools silently, and float8 fails deep inside torch), and so is an adapter whose branch `B A x * alpha / r`
is not finite, in the model's dtype, on a probe input `x` of ones (`lora_alpha` 1e308, weights 1e38: the
sampler would draw from NaN); the model is unchanged when an adapter is refused.
"""

import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

import model_io
from grpo_vlm import files

FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors' names of the dtypes an adapter may hold

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
    config = files.read_json(path)
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
    weights = files.regular_file(Path(directory, model_io.ADAPTER_WEIGHTS))
    probe_adapter(weights, config, next(model.parameters()).dtype)
    return model_io.load_adapter(model, directory, config=config, lora_fp32=lora_fp32)


def probe_adapter(weights: Path, config: dict, dtype: torch.dtype) -> None:
    """Refuse (ValueError naming `weights` and the tensor) weights that are not floats, and a LoRA pair whose
    output `B @ A @ ones * alpha / r` in `dtype` (the activations') is not finite. Pairs whose shapes do not
    chain are left to model_io.load_adapter, which names them."""
    try:
        with safe_open(weights, framework="pt") as f:
            keys = set(f.keys())
            for key in sorted(keys):
                if (kind := f.get_slice(key).get_dtype()) not in FLOAT_DTYPES:
                    raise ValueError(
                        f"{weights}: {key}: dtype {kind}; an adapter holds float32, bf16 or fp16"
                    )
            for a_key in sorted(k for k in keys if ".lora_A." in k):
                if (b_key := a_key.replace(".lora_A.", ".lora_B.")) not in keys:
                    continue
                a, b = f.get_tensor(a_key).to(dtype), f.get_tensor(b_key).to(dtype)
                if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
                    continue
                out = (
                    b
                    @ (a @ torch.ones(a.shape[1], dtype=dtype))
                    * (float(config["lora_alpha"]) / config["r"])
                )
                if not out.isfinite().all():
                    largest = max(a.abs().max(), b.abs().max())
                    raise ValueError(
                        f"{weights}: {b_key}: the adapter's output on a probe input is not finite in {dtype} "
                        f"(lora_alpha {config['lora_alpha']}, largest weight {largest:.3g}); refusing it"
                    )
    except SafetensorError as e:  # torn, emptied or not safetensors at all
        raise ValueError(f"{weights}: unreadable ({e}); is it damaged or cut short?") from None
