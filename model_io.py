"""Loading models; LoRA adapters in PEFT's format; a run's folder, log and checkpoint; the LR schedule.

`load_model` makes exactly the `from_pretrained` calls a Qwen-VL (`AutoModelForImageTextToText`: Qwen2-VL,
Qwen2.5-VL, Qwen3-VL) or text-only (`AutoModelForCausalLM`) checkpoint needs: the tiny model in `assets/`
tests the real path offline. `save_adapter` writes what PEFT writes, so PEFT, vLLM and transformers load it.
A checkpoint holds tensors, numbers and strings (`torch.load(weights_only=True)` runs no pickled code) and
is written whole: a temporary file renamed over the previous one.
"""

import json
import math
import os
from pathlib import Path

import torch
import transformers
from safetensors.torch import save
from torch.optim.lr_scheduler import LambdaLR

import lora

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "assets" / "tiny-qwen2.5-vl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """'auto' is bf16 on CUDA and fp32 elsewhere (CPU bf16 matmuls are slow and imprecise)."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[name]  # float32 or bfloat16


def load_model(name_or_path: str, *, device: torch.device | str, dtype: torch.dtype):
    """Return (model, tokenizer, image_processor or None), the model frozen and in eval mode."""
    # A hub id is 'org/name'; anything else that does not exist is a mistyped local path.
    is_hub_id = name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~"))
    local = Path(name_or_path).expanduser()
    if not local.exists() and not is_hub_id:
        raise FileNotFoundError(f"model path {name_or_path} does not exist")
    if local.is_dir() and not (local / "config.json").is_file():  # transformers would ask for a `model_type`
        raise ValueError(f"cannot load a model config from {name_or_path!r}: the folder has no config.json")
    try:
        config = transformers.AutoConfig.from_pretrained(name_or_path)
    except OSError as e:  # not a folder with config.json, and not reachable on the hub
        raise ValueError(f"cannot load a model config from {name_or_path!r}: {e}") from e
    is_vlm = getattr(config, "vision_config", None) is not None
    model_class = transformers.AutoModelForImageTextToText if is_vlm else transformers.AutoModelForCausalLM
    model = model_class.from_pretrained(name_or_path, dtype=dtype, use_kernels=False)  # sdpa, no hub kernel
    model.to(device).requires_grad_(False).eval()  # frozen, no dropout: the trainer adds LoRA and switches
    tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe: the mask ends at the FIRST end of turn
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
PEFT_PREFIX = "base_model.model."  # PEFT's PeftModel -> LoraModel -> original model


def peft_hyperparameters(model: torch.nn.Module) -> dict:
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


def adapter_files(model: torch.nn.Module, *, base_model_name_or_path: str) -> dict[str, bytes]:
    """The adapter's two files in PEFT's format, by name: the LoRA weights and their LoraConfig."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", **peft_hyperparameters(model)}
    config |= {"bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False}
    config |= {"inference_mode": True, "base_model_name_or_path": base_model_name_or_path}
    tensors = {PEFT_PREFIX + k: v.contiguous() for k, v in lora.lora_state_dict(model).items()}
    weights = save(tensors, metadata={"format": "pt"})  # what transformers' and PEFT's loaders expect
    return {ADAPTER_WEIGHTS: weights, ADAPTER_CONFIG: json.dumps(config, indent=2).encode()}


def save_adapter(model: torch.nn.Module, directory: str | Path, *, base_model_name_or_path: str) -> None:
    """Write the adapter (`adapter_files`) into `directory`, created if missing."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    for name, content in adapter_files(model, base_model_name_or_path=base_model_name_or_path).items():
        Path(directory, name).write_bytes(content)


# --- A run's folder and checkpoint -----------------------------------------------------------------------
RUN_FILES = ("metrics.jsonl", "metrics.tmp", "checkpoint.pt", "checkpoint.tmp", "adapter")  # all a run writes


def check_run_folder(out: Path, *, resume: bool) -> None:
    """A new or empty folder, or (`resume`) one that holds a run's checkpoint.pt and nothing but a run's
    files, none of them a link (nothing is written through one): ValueError saying what to do otherwise."""
    found = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    foreign = [out / name for name in found if name not in RUN_FILES or (out / name).is_symlink()]
    if out.is_symlink() or out.exists() and not out.is_dir() or foreign:
        raise ValueError(f"{([*foreign, out])[0]} is no file of a run; choose a new or empty --output-dir")
    if found and not resume:
        raise ValueError(f"{out} holds a run: continue it with --resume, or choose a new --output-dir")
    if resume and "checkpoint.pt" not in found:
        raise ValueError(f"{out} holds no checkpoint.pt to resume; start anew in an empty --output-dir")


def append_line(path: Path, record: dict) -> None:
    """`record` as one line of strict JSON (a NaN or inf value, e.g. a skipped update's loss, as null)."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    try:
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps(finite, allow_nan=False) + "\n")
    except OSError as e:
        raise OSError(f"cannot write {path}: {e.strerror or e}") from e


def keep_lines_up_to(path: Path, step: int) -> None:
    """Cut a JSONL log back to its lines of steps <= `step`; a line a crash tore (no newline) goes too."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []
    kept = [line for line in lines if line.endswith("\n") and json.loads(line)["step"] <= step]
    path.with_suffix(".tmp").write_text("".join(kept), encoding="utf-8")
    os.replace(path.with_suffix(".tmp"), path)


def save_checkpoint(path: Path, model, optimizer, scheduler, *, step: int, settings: dict) -> None:
    """LoRA, AdamW, the schedule, the generators (CUDA's too), the step and the settings, written whole."""
    state = {"step": step, "settings": settings, "lora": lora.lora_state_dict(model)}
    state |= {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    state["rng"] = torch.get_rng_state()
    if model.device.type == "cuda":  # sampling on CUDA draws from the device's own generator
        state["cuda_rng"] = torch.cuda.get_rng_state(model.device)
    tmp = path.with_suffix(".tmp")
    try:  # a temporary file renamed over `path`: a crash leaves the last checkpoint whole
        torch.save(state, tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(f"cannot write {path}: {e.strerror or e}") from e
    finally:  # a full disk or a Ctrl-C mid-write leaves no tmp (after the rename there is none)
        tmp.unlink(missing_ok=True)


def restore_checkpoint(state: dict, model: torch.nn.Module, optimizer, scheduler) -> int:
    """Put `load_checkpoint`'s state back, so the run goes on as if it had never stopped; its step."""
    model.load_state_dict(state["lora"], strict=False)  # strict=False: the frozen base is not in it
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    if "cuda_rng" in state and model.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], model.device)
    return state["step"]


def load_checkpoint(path: Path) -> dict:
    """`save_checkpoint`'s state; a missing, cut or foreign file is a ValueError naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (torch raises many kinds for a cut or foreign file)
        raise ValueError(f"{path} cannot be read as a checkpoint ({type(e).__name__}: {e})") from None
