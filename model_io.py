"""Loading models and LoRA adapters in PEFT's format; the learning-rate schedule a run steps.

`load_model` makes exactly the `from_pretrained` calls that a Qwen-VL (`AutoModelForImageTextToText`:
Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or text-only (`AutoModelForCausalLM`) checkpoint needs, so the tiny model
in `assets/` tests the real loading path offline. Adapters are in PEFT's on-disk format (PEFT reads ours, we
read its plain LoRA), refused before the model changes when they use a PEFT option lora.py lacks, when their
keys or shapes do not match the model's layers, or when they hold NaN or inf values.
"""

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch.optim.lr_scheduler import LambdaLR

import lora

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "assets" / "tiny-qwen2.5-vl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """'auto' is bf16 on CUDA and fp32 elsewhere (CPU bf16 matmuls are slow and imprecise)."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(
    name_or_path: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    attn_implementation: str | None = None,
):
    """Return (model, tokenizer, image_processor or None), the model frozen and in eval mode.
    `attn_implementation`: transformers' (sdpa, flash_attention_2, eager); None: its default (sdpa)."""
    # A hub id is 'org/name'; anything else that does not exist is a mistyped local path.
    is_hub_id = name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~"))
    local = Path(name_or_path).expanduser()
    if not local.exists() and not is_hub_id:
        raise FileNotFoundError(f"model path {name_or_path} does not exist")
    # NOTE: transformers would ask for a `model_type` key in its config.json, as if one existed.
    if local.is_dir() and not (local / "config.json").is_file():
        raise ValueError(f"cannot load a model config from {name_or_path!r}: the folder has no config.json")
    try:
        config = transformers.AutoConfig.from_pretrained(name_or_path)
    except OSError as e:  # not a folder with config.json, and not reachable on the hub
        raise ValueError(f"cannot load a model config from {name_or_path!r}: {e}") from e
    is_vlm = getattr(config, "vision_config", None) is not None
    model_class = transformers.AutoModelForImageTextToText if is_vlm else transformers.AutoModelForCausalLM
    model = model_class.from_pretrained(name_or_path, dtype=dtype, attn_implementation=attn_implementation)
    model.to(device).requires_grad_(False)  # the base is frozen; LoRA parameters are added (trainable) later
    model.eval()  # NOTE: no dropout in the base; LoRA dropout is switched by the trainer explicitly
    tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe: completion masks are built from lengths
    image_processor = transformers.AutoImageProcessor.from_pretrained(name_or_path) if is_vlm else None
    return model, tokenizer, image_processor


def cosine_with_warmup(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int) -> LambdaLR:
    """Linear warm-up to the peak learning rate over warmup_steps, then a cosine decay to 0 at total_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return LambdaLR(optimizer, factor)


# --- LoRA adapters in PEFT's format -------------------------------------------------------------------------
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."  # PEFT's PeftModel -> LoraModel -> original model


def _hyperparameters(model: torch.nn.Module) -> dict:
    """The injected adapters' settings under PEFT's LoraConfig field names."""
    modules = lora.lora_modules(model, required=True)
    path, _ = lora.find_decoder_blocks(model)
    if outside := [name for name in modules if not name.startswith(f"{path}.")]:
        raise ValueError(f"PEFT's layers_to_transform counts blocks of {path}; {outside[0]} is not in one")
    hyper = {(m.r, m.alpha, getattr(m.dropout, "p", 0.0)) for m in modules.values()}
    if len(hyper) != 1:
        raise ValueError(f"adapters have different (r, alpha, dropout): {sorted(hyper)}")
    ((r, alpha, dropout),) = hyper
    rest = [name[len(path) + 1 :].split(".") for name in modules]  # [layer, ..., leaf]
    layers = sorted({int(parts[0]) for parts in rest})
    peft = dict(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=sorted({p[-1] for p in rest}))
    # layers_pattern keeps PEFT from matching same-named linears in the vision tower (`visual.blocks`).
    return peft | dict(layers_to_transform=layers, layers_pattern=path.rpartition(".")[2])


def save_adapter(
    model: torch.nn.Module,
    directory: str | Path,
    *,
    base_model_name_or_path: str,
    write: Callable[[Path, bytes], object] = Path.write_bytes,
) -> None:
    """Write adapter_model.safetensors and adapter_config.json in PEFT's format, each by `write(path, bytes)`:
    a plain write by default (the package passes its whole-file `atomic_write`)."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", **_hyperparameters(model)}
    config |= {"bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False}
    config |= {"inference_mode": True, "base_model_name_or_path": base_model_name_or_path}
    tensors = {_PEFT_PREFIX + k: v.contiguous() for k, v in lora.lora_state_dict(model).items()}
    Path(directory).mkdir(parents=True, exist_ok=True)
    write(Path(directory, ADAPTER_WEIGHTS), save(tensors, {"format": "pt"}))
    write(Path(directory, ADAPTER_CONFIG), json.dumps(config, indent=2).encode())


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


def load_adapter(
    model: torch.nn.Module, directory: str | Path, *, config: dict | None = None, lora_fp32: bool = True
) -> list[str]:
    """Load a PEFT LoRA adapter (`config`: its adapter_config.json, if already read), injecting LoRA if the
    model has none; return the wrapped names. A failed load leaves the model intact. The tensors take the LoRA
    weights' dtype: the existing adapters', or if this call injects, fp32 (`lora_fp32`) or the base dtype."""
    file = Path(directory, ADAPTER_CONFIG)
    check_loadable(file, config := json.loads(file.read_text(encoding="utf-8")) if config is None else config)
    r, alpha, targets = config["r"], float(config["lora_alpha"]), tuple(config["target_modules"])
    path, blocks = lora.find_decoder_blocks(model)
    layers = config.get("layers_to_transform")  # PEFT's None: every layer
    layers = sorted(range(len(blocks)) if layers is None else [layers] if isinstance(layers, int) else layers)
    try:
        tensors = load_file(weights := Path(directory, ADAPTER_WEIGHTS))
    except SafetensorError as e:  # NOTE: torn, emptied or not safetensors at all
        raise ValueError(f"{weights}: unreadable ({e}); is it damaged or cut short?") from None
    if modules := lora.lora_modules(model):
        want = {"r": r, "lora_alpha": alpha, "target_modules": sorted(targets), "layers_to_transform": layers}
        have = {k: v for k, v in _hyperparameters(model).items() if k in want}
        if have != want:
            raise ValueError(f"model already has LoRA with a different config: model {have}, adapter {want}")
        if any(m.merged for m in modules.values()):
            raise RuntimeError("cannot load an adapter into merged weights; call unmerge_lora first")
        linears = {name: m.base_layer for name, m in modules.items()}
    else:
        if any(i < 0 or i >= len(blocks) for i in layers):
            raise ValueError(f"LoRA layers {layers} out of range: {path} has {len(blocks)} blocks")
        adapted = [blocks[i] for i in layers]
        linears = lora.target_linears(model, adapted, targets)
    shapes = {f"{_PEFT_PREFIX}{name}.lora_A.weight": (r, lin.in_features) for name, lin in linears.items()}
    shapes |= {f"{_PEFT_PREFIX}{name}.lora_B.weight": (lin.out_features, r) for name, lin in linears.items()}
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
        dropout, fp32 = float(config.get("lora_dropout", 0.0)), lora_fp32
        lora.inject_lora(model, r=r, alpha=alpha, dropout=dropout, blocks=adapted, targets=targets, fp32=fp32)
    # Keys and shapes checked above; load_state_dict copies each tensor into its weight's dtype and device.
    model.load_state_dict({k.removeprefix(_PEFT_PREFIX): v for k, v in tensors.items()}, strict=False)
    return list(lora.lora_modules(model))
