"""Loading models, LoRA adapters in PEFT's format, training checkpoints and run folders.

`load_model` makes exactly the `from_pretrained` calls that a Qwen-VL (`AutoModelForImageTextToText`:
Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or text-only (`AutoModelForCausalLM`) checkpoint needs, so the tiny model
in `assets/` tests the real loading path offline. lora.py's adapters are written in PEFT's on-disk format,
so `peft.PeftModel.from_pretrained(base, dir)` reads ours, and we read PEFT's (plain LoRA options only).

Choices:
- A checkpoint folder is built under a temporary name and renamed into place only when complete, so a
  crash during a save leaves the previous checkpoint intact. Its `checkpoint.json` lists the size and
  SHA-256 of every other file: a resume verifies them first, and a damaged checkpoint (a disk that lost
  blocks, a file cut short or replaced) is reported and passed over for the newest intact one.
- The trainer state is plain data (tensors, numbers, strings, lists, tuples, dicts; the RNG states taken
  apart into those) and is read with `torch.load(weights_only=True)`. A pickle can run any code while it
  loads, so a checkpoint that needs more than plain data is refused, never loaded "just this once".
- A checkpoint may name the run that wrote it (`checkpoint.json`); pruning with a run id deletes only
  that run's older checkpoints, so two runs sharing an output folder never delete each other's.
- One run per folder: `run.json` (with a run id) is what makes a folder a run folder and names the run that
  owns it; a folder without it is never written into, and replacing a run removes only that run's own
  files. A resumed run trims its logs to the step of its checkpoint (the later steps are redone).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import numbers
import os
import pickle
import random
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
)

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
        config = AutoConfig.from_pretrained(name_or_path)
    except OSError as e:  # not a folder with config.json, and not reachable on the hub
        raise ValueError(f"cannot load a model config from {name_or_path!r}: {e}") from e
    is_vlm = getattr(config, "vision_config", None) is not None
    model_class = AutoModelForImageTextToText if is_vlm else AutoModelForCausalLM
    attention = dict(attn_implementation=attn_implementation)  # None: transformers' choice
    model = model_class.from_pretrained(name_or_path, dtype=dtype, **attention).to(device)
    model.requires_grad_(False)  # the base is frozen; LoRA parameters are added (trainable) later
    model.eval()  # NOTE: no dropout in the base; LoRA dropout is switched by the trainer explicitly
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe: completion masks are built from lengths
    image_processor = AutoImageProcessor.from_pretrained(name_or_path) if is_vlm else None
    return model, tokenizer, image_processor


def save_model(model, tokenizer, image_processor, directory: str | Path) -> None:
    """`save_pretrained` model, tokenizer and image processor into one folder (merge: `lora.unload_lora`)."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if image_processor is not None:
        image_processor.save_pretrained(directory)


# --- LoRA adapters in PEFT's format -------------------------------------------------------------------------
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."  # PEFT's PeftModel -> LoraModel -> original model


def _write(path: Path, content: bytes, *, name: str | Path | None = None) -> None:
    """Write `content` to `path` and fsync it. The OSError of a failed write (no space left, ...) names no
    file; here it names `name` (default `path`), so the one-line error can say which."""
    try:
        with path.open("wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is not None and str(e.filename) != str(path):
            raise
        raise OSError(e.errno, e.strerror, str(name or path)) from e


def _atomic_write(path: str | Path, content: bytes) -> None:
    """Write a temp file beside `path`, fsync it and rename it over `path`: a reader or a crash sees the old
    or the new file, never half of one (the folder is not fsynced: a lost rename brings back the old file)."""
    tmp = Path(path).with_name(f".{Path(path).name}.{uuid.uuid4().hex}.tmp")
    try:
        _write(tmp, content, name=path)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _regular(path: str | Path) -> Path:
    """`path`, refused unless a regular file: opening a FIFO would wait for a writer, deaf to signals."""
    if (path := Path(path)).exists() and not path.is_file():  # is_file: stat.S_ISREG
        raise ValueError(f"{path} is not a regular file; refusing to read it")
    return path


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


def save_adapter(model: torch.nn.Module, directory: str | Path, *, base_model_name_or_path: str) -> None:
    """Write adapter_model.safetensors and adapter_config.json in PEFT's format, each atomically."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", **_hyperparameters(model)}
    config |= {"bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False}
    config |= {"inference_mode": True, "base_model_name_or_path": base_model_name_or_path}
    tensors = {_PEFT_PREFIX + k: v.contiguous() for k, v in lora.lora_state_dict(model).items()}
    os.makedirs(directory, exist_ok=True)
    _atomic_write(os.path.join(directory, ADAPTER_WEIGHTS), save(tensors, {"format": "pt"}))
    _atomic_write(os.path.join(directory, ADAPTER_CONFIG), json.dumps(config, indent=2).encode())


def _read_adapter_config(path: Path) -> dict:
    """adapter_config.json as a dict whose fields lora.py can load; anything else is a ValueError naming the
    file and the field."""
    try:
        config = json.loads(_regular(path).read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(config).__name__}")  # noqa: TRY004
    _check_loadable(path, config)
    fields = {
        "r": (lambda v: type(v) is int and v > 0, "a positive int"),
        "lora_alpha": (lambda v: type(v) in (int, float) and math.isfinite(v), "a finite number"),
        "target_modules": (
            lambda v: bool(v) and all(isinstance(m, str) for m in v),
            "a list of module names",
        ),
        "lora_dropout": (lambda v: type(v) in (int, float) and 0 <= v < 1, "a number in [0, 1)"),
        "layers_to_transform": (
            lambda v: type(v) is int or isinstance(v, list) and all(type(i) is int for i in v),
            "null, a layer index or a list of them",
        ),
    }
    config = {"lora_dropout": 0.0, "layers_to_transform": None} | config  # PEFT's defaults
    for field, (ok, expected) in fields.items():
        if field not in config:
            raise ValueError(f"{path}: {field}: missing (expected {expected})")
        value = config[field]
        if not (ok(value) or value is None and field == "layers_to_transform"):  # None: every layer
            raise ValueError(f"{path}: {field}: expected {expected}, got {value!r}")
    return config


def _check_loadable(path: Path, config: dict) -> None:
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
    """Load a PEFT LoRA adapter strictly, injecting it first if the model has none; return the wrapped names.
    Every check runs before the model changes, so a failed load leaves it intact. The tensors take the LoRA
    weights' dtype: the existing adapters', or if this call injects, fp32 (`lora_fp32`) or the base dtype."""
    config = _read_adapter_config(Path(directory, ADAPTER_CONFIG))
    r, alpha, targets = config["r"], float(config["lora_alpha"]), tuple(config["target_modules"])
    path, blocks = lora.find_decoder_blocks(model)
    layers = config.get("layers_to_transform")  # PEFT's None: every layer
    layers = sorted(range(len(blocks)) if layers is None else [layers] if isinstance(layers, int) else layers)
    try:
        tensors = load_file(weights := _regular(Path(directory, ADAPTER_WEIGHTS)))
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
        dropout = float(config.get("lora_dropout", 0.0))
        settings = lora.LoRAConfig(
            lora_last_k=len(layers), lora_r=r, lora_alpha=alpha, lora_fp32=lora_fp32, lora_dropout=dropout
        )
        lora.inject_lora(model, settings, blocks=adapted, targets=targets)
        modules = lora.lora_modules(model)
    with torch.no_grad():
        for name, m in modules.items():
            for part in ("lora_A", "lora_B"):
                w = getattr(m, part).weight
                w.copy_(tensors[f"{_PEFT_PREFIX}{name}.{part}.weight"].to(device=w.device, dtype=w.dtype))
    return list(modules)


# --- Checkpoints --------------------------------------------------------------------------------------------
STATE_FILE = "trainer_state.pt"
OWNER_FILE = "checkpoint.json"


def cosine_with_warmup(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the peak learning rate over warmup_steps, then a cosine decay to 0 at total_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch (and CUDA) RNG states as plain data, so that `weights_only=True` loads them."""
    version, internal, gauss_next = random.getstate()
    algorithm, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    # The uint32 Mersenne-Twister key travels as int64: every uint32 fits, and torch serialises it.
    numpy = dict(algorithm=algorithm, key=torch.from_numpy(key.astype(np.int64)), pos=int(pos))
    numpy |= dict(has_gauss=int(has_gauss), cached_gaussian=float(cached_gaussian))
    python = {"version": version, "state": list(internal), "gauss_next": gauss_next}
    state = {"python": python, "numpy": numpy, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    python, numpy = state["python"], state["numpy"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss_next"]))
    key = numpy["key"].numpy().astype(np.uint32)
    np.random.set_state((numpy["algorithm"], key, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    directory: str | Path,
    *,
    write_adapter: Callable[[Path], None],
    state: dict[str, Any],
    keep_last: int | None,
    run_id: str | None = None,
) -> Path:
    """Write `directory` (e.g. runs/x/checkpoint-000100) atomically: the adapter by `write_adapter(folder)`,
    `state` (plain data: optimizer, scheduler, step, ...) with the RNG states as trainer_state.pt, and
    checkpoint.json: `run_id` (pruning to `keep_last` counts only this run's checkpoints) and the manifest.
    A save that fails (no space left, ...) removes its temporary folder and raises."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (the checkpoint just written), got {keep_last}")
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
    try:
        tmp.mkdir(parents=True)
        write_adapter(tmp)
        buffer = io.BytesIO()  # written by _write, whose error names the file (torch.save's would not)
        torch.save({**state, "rng": rng_state()}, buffer)
        _write(tmp / STATE_FILE, buffer.getvalue())
        # NOTE: fail now, not at a resume hours later, when the state is not plain data. The scan (torch >=
        # 2.5) reads only the pickle, not the tensors; older torch skips the check.
        scan = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
        if unsafe := scan(tmp / STATE_FILE) if scan is not None else []:
            raise TypeError(
                f"the trainer state holds objects that are not plain data ({', '.join(unsafe)}); store "
                f"tensors, numbers, strings, lists and dicts only, or it could not be loaded safely"
            )
        files = {}
        for f in sorted(filter(Path.is_file, tmp.rglob("*"))):  # on disk before the rename shows the folder
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
                digest = hashlib.file_digest(fh, "sha256").hexdigest()
            files[f.relative_to(tmp).as_posix()] = {"bytes": f.stat().st_size, "sha256": digest}
        manifest = {"run_id": run_id, "step": state.get("step"), "files": files}
        _write(tmp / OWNER_FILE, (json.dumps(manifest, indent=2) + "\n").encode())  # json.dumps: ASCII
        old = directory.with_name(directory.name + ".old")
        if directory.exists():  # re-saving the same step (e.g. after a resume): swap, never delete first
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old.exists():
        shutil.rmtree(old)
    if keep_last is not None:
        prune_checkpoints(directory.parent, keep_last, run_id=run_id)
    return directory


def verify_checkpoint(directory: str | Path) -> str | None:
    """None when every file of the manifest in checkpoint.json has its recorded size and SHA-256, else what
    is wrong, naming the file. A checkpoint without a manifest (written by an older version) has nothing to
    verify: None."""
    directory = Path(directory)
    if not (path := directory / OWNER_FILE).exists():
        return None
    try:
        files = json.loads(_regular(path).read_text(encoding="utf-8")).get("files")
        for name, record in (files or {}).items():
            want = int(record["bytes"]), str(record["sha256"])
            if not (f := directory / name).exists():
                return f"{name} is missing"
            if not f.is_file():  # NOTE: a FIFO would block the read below
                return f"{name} is not a regular file"
            if (size := f.stat().st_size) != want[0]:
                return f"{name} is {size:,} bytes, the manifest says {want[0]:,}"
            with f.open("rb") as fh:
                if hashlib.file_digest(fh, "sha256").hexdigest() != want[1]:
                    return f"{name}: its SHA-256 differs from the manifest's"
    except OSError as e:
        return f"{Path(e.filename or path).name} is unreadable ({e.strerror or e})"
    except (ValueError, AttributeError, KeyError, TypeError):  # torn, emptied or foreign: no manifest left
        return f"{OWNER_FILE} is unreadable"
    return None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first (temporary folders are ignored)."""
    found = [p for p in Path(run_dir).glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def checkpoint_run_id(directory: str | Path) -> str | None:
    """The run id recorded in a checkpoint's `checkpoint.json`; None when it has none or it is unreadable."""
    path = Path(directory) / OWNER_FILE
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return json.loads(path.read_text(encoding="utf-8")).get("run_id") if path.is_file() else None


def prune_checkpoints(run_dir: str | Path, keep_last: int, run_id: str | None = None) -> None:
    """Delete all but the newest `keep_last` checkpoints; with a `run_id`, only among that run's own."""
    found = list_checkpoints(run_dir)
    if run_id is not None:  # NOTE: another run's checkpoint, or one without a readable owner, is not ours
        found = [p for p in found if checkpoint_run_id(p) == run_id]
    for old in found[:-keep_last]:
        shutil.rmtree(old)


def load_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Read `trainer_state.pt` of a checkpoint folder, plain data only (the caller loads the adapter)."""
    path = _regular(Path(directory) / STATE_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint folder (no {STATE_FILE})")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError) as e:  # refused global; torn; not a zip
        if found := re.search(r"GLOBAL (\S+)", message := str(e)):
            raise ValueError(
                f"{path}: not a plain-data trainer state (it would need to run code to load: {found[1]}); "
                f"refusing to load it. Was it written by another program or an older version?"
            ) from None  # torch's message advises weights_only=False, the very thing refused here
        found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", message)
        reason = found.group(1) if found else message.split(". ")[0] or type(e).__name__
        raise ValueError(f"{path}: unreadable ({reason}); is it damaged or cut short?") from None
    if isinstance(state, dict):
        return state
    raise ValueError(f"{path}: not a trainer state (a {type(state).__name__}, not a dict)")


def checkpoint_to_resume(path: str | Path, out: Path) -> tuple[Path, dict[str, Any], str, str | None]:
    """(checkpoint folder, trainer state, run id, report) for resuming the run in `out` from `path`: a
    checkpoint folder, or a run folder, whose newest intact checkpoint is taken; `report` (None: nothing to
    say) names the damaged ones passed over and the steps that will be redone. A ValueError when the
    checkpoint named, or every one, is damaged, or it belongs to another run than out/run.json."""
    named = (Path(path) / STATE_FILE).exists()
    damaged = []  # (folder, what is wrong), newest first
    for checkpoint in [Path(path)] if named else reversed(list_checkpoints(path)):
        try:
            if reason := verify_checkpoint(checkpoint):
                raise ValueError(reason)
            state = load_checkpoint(checkpoint)
            break
        except (ValueError, OSError) as e:  # OSError: a state file that vanished or cannot be read
            if named:
                again = f"give the run folder (--resume {checkpoint.parent}) to take its newest intact one"
                raise ValueError(f"{checkpoint} is damaged ({e}); {again}") from None
            damaged.append((checkpoint, str(e)))
    else:
        found = "; ".join(f"{c.name} ({reason})" for c, reason in damaged) or "none found"
        raise ValueError(f"no intact checkpoint in {path}: {found}")
    report = "; ".join(f"{c.name} is damaged ({reason})" for c, reason in damaged) or None
    if report:  # the steps after this checkpoint, up to the newest one passed over, are trained again
        last = max(int(damaged[0][0].name.split("-")[-1]), state["step"] + 1)
        redo = f"step {last}" if last == state["step"] + 1 else f"steps {state['step'] + 1}-{last}"
        report += f"; resuming from {checkpoint.name}: {redo} will be redone"
    run_json = _regular(out / "run.json")
    owner = json.loads(run_json.read_text(encoding="utf-8")).get("run_id") if run_json.exists() else None
    run_id = state.get("run_id") or owner or uuid.uuid4().hex  # an older checkpoint may name no run
    if owner not in (None, run_id):
        raise ValueError(f"{checkpoint} belongs to another run than {out}/run.json")
    return checkpoint, state, run_id, report


# --- Run folders: one run per folder ------------------------------------------------------------------------
# What a run writes into its folder, besides checkpoint-*/. `run.json` with a run id is the folder's marker:
# --overwrite removes these and the run's own checkpoints, nothing else.
RUN_FILES = ("run.json", "metrics.jsonl", "timings.jsonl", "rollouts.jsonl", "curves.png")
RUN_FOLDERS = ("adapter", "tensorboard")
LOCK_FILE = ".lock"  # cli.hold_lock's: never removed while the folder holds anything else


def run_folder(output_dir: str | None, resume: str | None) -> Path:
    """The run's folder: `output_dir` (default runs/grpo), or with `resume` the resumed run's own folder."""
    if not resume:
        return Path(output_dir or "runs/grpo")
    given = Path(resume)
    if not given.is_dir():
        raise ValueError(f"--resume: {given} is not a folder: give a run folder or one of its checkpoints")
    folder = given.parent if (given / STATE_FILE).is_file() else given
    if output_dir is not None and Path(output_dir).resolve() != folder.resolve():
        raise ValueError(f"--output-dir: --resume continues {folder} in that folder; leave --output-dir out")
    return folder


def make_run_folder(out: Path) -> Path | None:
    """Create `out` (and its missing parents), or a ValueError naming --output-dir; returns the topmost
    folder created (None: it existed), so that a start that fails can remove what it made."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--output-dir: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK):
        raise ValueError(f"--output-dir: {existing} is not writable")
    missing = [p for p in (out, *out.parents) if not p.exists()]  # out first, the topmost last
    out.mkdir(parents=True, exist_ok=True)
    return missing[-1] if missing else None


def read_run_record(out: Path) -> dict | None:
    """run.json of `out` ({"run_id", "args"}), None when there is none; a ValueError naming it when it is not
    this project's record."""
    path = _regular(out / "run.json")
    if not path.exists():
        return None
    record = None
    with contextlib.suppress(UnicodeDecodeError, json.JSONDecodeError):
        record = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(record, dict) and isinstance(record.get("run_id"), str):
        return record
    raise ValueError(f"{path}: not a run record of this project (a JSON object with a run_id); damaged?")


def logged_steps(metrics_path: Path) -> int:
    """The last step a metrics.jsonl records (0: only the step-0 evaluation; -1: none)."""
    steps = [-1]
    for line in metrics_path.read_text(encoding="utf-8").splitlines() if metrics_path.is_file() else []:
        with contextlib.suppress(ValueError, KeyError, TypeError):  # a torn last line is no step
            steps.append(int(json.loads(line)["step"]))
    return max(steps)


def run_files(out: Path, run_id: str) -> tuple[list[Path], list[Path]]:
    """(the run's own files and folders in `out`, everything else but the lock file). Its own: RUN_FILES,
    RUN_FOLDERS, the checkpoints naming `run_id`, and leftovers of interrupted writes."""
    own, others = [], []
    for path in sorted(out.iterdir()):
        name = path.name
        leftover = re.fullmatch(r"\.(.+)\.[0-9a-f]{32}\.tmp", name)  # _atomic_write's temporary file
        if name == LOCK_FILE:
            continue
        if (
            name in RUN_FILES + RUN_FOLDERS
            or re.fullmatch(r"checkpoint-\d+\.(tmp|old)", name)
            or (leftover and leftover[1] in RUN_FILES)
            or (name.startswith("checkpoint-") and checkpoint_run_id(path) == run_id)
        ):
            own.append(path)
        else:
            others.append(path)
    return own, others


def check_run_folder(out: Path, *, resume: str | None, overwrite: bool) -> str:
    """What starting a run in `out` means, or a ValueError naming the flag, before anything is written:
    'new', 'resume', or 'replace' (--overwrite; or a run without a checkpoint yet, which nothing can resume:
    the same command starts it again). A folder without this project's run.json is never written into."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir: {out} is a file, not a folder")
    record = read_run_record(out) if out.is_dir() else None
    if record is None:
        if resume:
            raise ValueError(f"--resume: {out} is not a run folder (no run.json)")
        content = [p.name for p in sorted(out.iterdir()) if p.name != LOCK_FILE] if out.is_dir() else []
        if content:
            shown = ", ".join(content[:3]) + (f" and {len(content) - 3} more" if len(content) > 3 else "")
            raise ValueError(
                f"--output-dir: {out} is not a run folder of this project (no run.json) and holds {shown}; "
                f"choose an empty or new folder"
            )
        return "new"
    # NOTE: a checkpoint naming no run (an older version's, or a damaged checkpoint.json) may be this run's:
    # resume verifies it; --overwrite leaves it in place
    own = [p for p in list_checkpoints(out) if checkpoint_run_id(p) in (record["run_id"], None)]
    if resume:
        return "resume" if own or (Path(resume) / STATE_FILE).is_file() else "replace"
    if not own or overwrite:
        return "replace"
    raise ValueError(
        f"{out} already holds a run ({logged_steps(out / 'metrics.jsonl')} steps logged, {len(own)} "
        f"checkpoints): continue it with --resume {out}, choose another --output-dir, or delete it with "
        f"--overwrite"
    )


def trim_jsonl(path: Path, last_step: int) -> None:
    """Keep only the lines whose "step" is <= last_step (absent file: no-op). Lines that are not a JSON object
    with a numeric "step" go too: in an append-only file that is a torn last line, cut by a crash."""
    if not (path := _regular(path)).exists():
        return
    kept = []
    for raw in path.read_bytes().split(b"\n"):
        try:
            # NOTE: decoded line by line: a torn line may end inside a multi-byte UTF-8 character (labels
            # and completions are written with ensure_ascii=False), which would fail a whole-file read.
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, numbers.Real) and step <= last_step:
            kept.append(raw.rstrip(b"\r"))
    _atomic_write(path, b"".join(line + b"\n" for line in kept))


def open_run_folder(
    out: Path, mode: str, run_id: str, start_step: int, config: dict
) -> tuple[list[Path], list[Path]]:
    """The first write of a run (`mode` from check_run_folder): remove the replaced run's own files, or trim
    the logs of the resumed run to its checkpoint; then run.json records the run that owns the folder and its
    settings (a resumed run's current ones). Returns (what was removed, what else the folder holds)."""
    removed, kept = [], []
    if mode == "replace" and (record := read_run_record(out)) is not None:
        removed, kept = run_files(out, record["run_id"])
        for path in removed:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    for leftover in out.glob("checkpoint-*.tmp"):  # of a save that was killed: never a checkpoint
        shutil.rmtree(leftover, ignore_errors=True)
    if mode == "resume":
        for name in ("metrics.jsonl", "timings.jsonl", "rollouts.jsonl"):
            trim_jsonl(out / name, start_step)
    record = json.dumps({"run_id": run_id, "args": config}, indent=2, ensure_ascii=False)
    _atomic_write(out / "run.json", record.encode() + b"\n")
    return removed, kept
