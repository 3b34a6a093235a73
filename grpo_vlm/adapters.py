"""LoRA adapters in PEFT's format (model_io.adapter_files) as the package writes and reads them: written whole
(`save_adapter`), read from files someone else wrote (`--adapter`, `--resume`) with every field checked and
one-line errors (`load_adapter`), and folded into the base weights to export a plain model (`unload_lora`).

`load_adapter` reads adapter_config.json field by field: not JSON, not UTF-8, no JSON object, a PEFT option
lora.py lacks (rslora, DoRA, ...), or a field lora.py loads (r, lora_alpha, target_modules, lora_dropout,
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
from safetensors.torch import load_file

import lora
import model_io
from grpo_vlm import files, lora_config

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
    check_loadable(path, config)  # first: target_modules may be one regex string in PEFT
    config = {"lora_dropout": 0.0, "layers_to_transform": None} | config  # PEFT's defaults
    for field, (ok, expected) in FIELDS.items():
        if field not in config:
            raise ValueError(f"{path}: {field}: missing (expected {expected})")
        if not ok(value := config[field]):
            raise ValueError(f"{path}: {field}: expected {expected}, got {value!r}")
    return config


def check_loadable(path: Path, config: dict) -> None:
    """Refuse PEFT options lora.py lacks (rslora scales by alpha / sqrt(r)) rather than load them wrongly."""
    options = ("use_rslora", "use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern")
    bad = {k: config[k] for k in options if config.get(k)}
    if config.get("peft_type") != "LORA" or config.get("bias", "none") != "none":
        bad |= {"peft_type": config.get("peft_type"), "bias": config.get("bias")}
    if not isinstance(config.get("target_modules"), list):  # PEFT also allows one regex string
        bad["target_modules"] = config.get("target_modules")
    if bad:
        raise ValueError(f"{path}: uses options lora.py does not implement: {bad}")


def load_adapter(model: torch.nn.Module, directory: str | Path, *, lora_fp32: bool = True) -> list[str]:
    """Load a PEFT LoRA adapter, injecting LoRA (lora.inject_lora) if the model has none; the wrapped names.
    Both files must be regular ones, adapter_config.json is read field by field (`read_adapter_config`) and
    the weights probed (`probe_adapter`); a failed load leaves the model intact. The tensors take the LoRA
    weights' dtype: the existing adapters', or if this call injects, fp32 (`lora_fp32`) or the base dtype."""
    config = read_adapter_config(Path(directory, model_io.ADAPTER_CONFIG))
    weights = files.regular_file(Path(directory, model_io.ADAPTER_WEIGHTS))
    probe_adapter(weights, config, next(model.parameters()).dtype)
    r, alpha, targets = config["r"], float(config["lora_alpha"]), tuple(config["target_modules"])
    path, blocks = lora.find_decoder_blocks(model)
    layers = config.get("layers_to_transform")  # PEFT's None: every layer
    layers = sorted(range(len(blocks)) if layers is None else [layers] if isinstance(layers, int) else layers)
    try:
        tensors = load_file(weights)
    except SafetensorError as e:  # NOTE: torn, emptied or not safetensors at all
        raise ValueError(f"{weights}: unreadable ({e}); is it damaged or cut short?") from None
    if modules := lora.lora_modules(model):
        want = {"r": r, "lora_alpha": alpha, "target_modules": sorted(targets), "layers_to_transform": layers}
        have = {k: v for k, v in model_io.peft_hyperparameters(model).items() if k in want}
        if have != want:
            raise ValueError(f"model already has LoRA with a different config: model {have}, adapter {want}")
        linears = {name: m.base_layer for name, m in modules.items()}
    else:
        if any(i < 0 or i >= len(blocks) for i in layers):
            raise ValueError(f"LoRA layers {layers} out of range: {path} has {len(blocks)} blocks")
        adapted = [blocks[i] for i in layers]
        linears = lora.target_linears(model, adapted, targets)
    prefix = model_io.PEFT_PREFIX
    shapes = {f"{prefix}{name}.lora_A.weight": (r, lin.in_features) for name, lin in linears.items()}
    shapes |= {f"{prefix}{name}.lora_B.weight": (lin.out_features, r) for name, lin in linears.items()}
    if missing := sorted(shapes.keys() - tensors.keys()):
        raise ValueError(f"adapter is missing {len(missing)} key(s), e.g. {missing[0]!r}")
    if unexpected := sorted(tensors.keys() - shapes.keys()):
        raise ValueError(f"adapter has {len(unexpected)} unexpected key(s), e.g. {unexpected[0]!r}")
    for key, shape in shapes.items():
        if (found := tuple(tensors[key].shape)) != shape:
            raise ValueError(f"shape mismatch for {key!r}: adapter {found}, model {shape}")
        if not tensors[key].isfinite().all():  # NOTE: a diverged run's weights would train or sample garbage
            raise ValueError(f"{weights}: {key!r} holds NaN or inf values; refusing to load it")
    if not modules:
        dropout = float(config.get("lora_dropout", 0.0))
        lora.inject_lora(model, r=r, alpha=alpha, dropout=dropout, blocks=adapted, targets=targets)
        if not lora_fp32:
            lora_config.lora_in_base_dtype(model)
    # Keys and shapes checked above; load_state_dict copies each tensor into its weight's dtype and device.
    model.load_state_dict({k.removeprefix(prefix): v for k, v in tensors.items()}, strict=False)
    return list(lora.lora_modules(model))


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


def save_adapter(model: torch.nn.Module, directory: str | Path, *, base_model_name_or_path: str) -> None:
    """model_io.save_adapter with each file written whole (files.atomic_write): a crash leaves the old file
    or the new one, never half of one."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    for name, content in model_io.adapter_files(
        model, base_model_name_or_path=base_model_name_or_path
    ).items():
        files.atomic_write(Path(directory, name), content)


@torch.no_grad()
def unload_lora(model: torch.nn.Module) -> torch.nn.Module:
    """Fold every adapter into its base weight (W + B @ A * alpha / r, summed in fp32 and rounded once to W's
    dtype) and put the plain nn.Linear back: a model without LoRA, whose state_dict keys are the base's, for
    save_pretrained. NOTE: in bf16 the fold rounds W (~2**-8 relative): fold once, to export."""
    for name, m in lora.lora_modules(model, required=True).items():
        delta = (m.lora_B.weight.float() @ m.lora_A.weight.float()) * m.scaling  # (d_out, d_in)
        m.base_layer.weight.copy_((m.base_layer.weight.float() + delta).to(m.base_layer.weight.dtype))
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, m.base_layer)
    return model
