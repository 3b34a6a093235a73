"""A run folder and its checkpoints: one writer per folder, the run.json marker, checkpoints that prove they
are whole, and what a resume loads.

A run folder holds run.json (the run's id and settings, and whether it finished), metrics.jsonl,
timings.jsonl, rollouts.jsonl and eval_samples.jsonl (appended step by step), thumbs/ (the logged samples'
images, thumbnails.py), checkpoint-NNNNNN/ folders (the adapter, written by the caller's function, e.g.
model_io.save_adapter, and the trainer state), report.html (rewritten at each checkpoint), and at the end
adapter/ and curves.png.

Choices:
- One writer per folder: the process that trains holds the folder's lock (cli.hold_lock) from before it looks
  into the folder until it ends; the kernel releases it however the process dies.
- A checkpoint folder is built under a temporary name and renamed into place only when complete, so a
  crash during a save leaves the previous checkpoint intact. Its `checkpoint.json` lists the size and
  SHA-256 of every other file: a resume verifies them first, and a damaged checkpoint (a disk that lost
  blocks, a file cut short or replaced) is reported and passed over for the newest intact one.
- The trainer state is plain data (tensors, numbers, strings, lists, tuples, dicts; the RNG states taken
  apart into those) and is read with `torch.load(weights_only=True)`. A pickle can run any code while it
  loads, so a checkpoint that needs more than plain data is refused, never loaded "just this once".
- A checkpoint may come from someone else: a manifest names only files inside its folder; a state whose zip
  entries declare more bytes than the file holds, or than the checkpoint's adapter can need, is refused
  before it loads; every field a resume reads is checked for its type first (`trainer_state_problem`, and
  against the run's own optimizer and scheduler: `optimizer_state_problem`, `scheduler_state_problem`), so
  a state of the wrong shape is named by file and field like a torn one. run.json's settings are checked
  against their fields' types when they are read back (`settings_from_record`).
- A checkpoint may name the run that wrote it (`checkpoint.json`); pruning with a run id deletes only
  that run's older checkpoints, so two runs sharing an output folder never delete each other's.
- One run per folder: `run.json` (with a run id) is what makes a folder a run folder and names the run that
  owns it; a folder without it is never written into, and replacing a run removes only that run's own
  files: every removal checked before the first (all or nothing), a symbolic link removed as the link,
  never followed into what it points to. A resumed run trims its logs to the step of its checkpoint (the
  later steps are redone).
- A resumed run continues the recorded one: its settings are run.json's, and only those the caller names
  (how long it trains, what it logs and saves, where and how fast it runs) may be given differently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
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
import stat
import types
import typing
import uuid
import zipfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_vlm import cli, files, plugins

# --- Checkpoints --------------------------------------------------------------------------------------------
STATE_FILE = "trainer_state.pt"
OWNER_FILE = "checkpoint.json"


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
        buffer = io.BytesIO()  # written by write_file, whose error names the file (torch.save's would not)
        torch.save({**state, "rng": rng_state()}, buffer)
        files.write_file(tmp / STATE_FILE, buffer.getvalue())
        # NOTE: fail now, not at a resume hours later, when the state is not plain data. The scan (torch >=
        # 2.5) reads only the pickle, not the tensors; older torch skips the check.
        scan = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
        if unsafe := scan(tmp / STATE_FILE) if scan is not None else []:
            raise TypeError(
                f"the trainer state holds objects that are not plain data ({', '.join(unsafe)}); store "
                f"tensors, numbers, strings, lists and dicts only, or it could not be loaded safely"
            )
        listed = {}
        for f in sorted(filter(Path.is_file, tmp.rglob("*"))):  # on disk before the rename shows the folder
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
                digest = hashlib.file_digest(fh, "sha256").hexdigest()
            listed[f.relative_to(tmp).as_posix()] = {"bytes": f.stat().st_size, "sha256": digest}
        manifest = {"run_id": run_id, "step": state.get("step"), "files": listed}
        files.write_file(tmp / OWNER_FILE, (json.dumps(manifest, indent=2) + "\n").encode())  # ASCII
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
        listed = json.loads(files.regular_file(path).read_text(encoding="utf-8")).get("files")
        for name, record in (listed or {}).items():
            want = int(record["bytes"]), str(record["sha256"])
            if (outside := outside_folder(directory, name)) is not None:
                return f"{OWNER_FILE} lists {name!r}, {outside}"
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


def outside_folder(directory: Path, name: str) -> str | None:
    """Why the manifest entry `name` is not a file of the checkpoint `directory` (None: it is one). NOTE: a
    forged manifest must not make a resume read (hash) a file elsewhere, e.g. ../../../etc/shadow."""
    entry = Path(name)
    if not name or entry.is_absolute() or ".." in entry.parts:
        return "which is not a path inside the checkpoint folder"
    inside, target = directory.resolve(), (directory / entry).resolve()  # every symlink on the way followed
    if target != inside and inside not in target.parents:
        return f"which leads outside the checkpoint folder (to {target})"
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


# What a trainer state may hold besides its optimizer's moments: scheduler, RNG states (~10 KB), settings.
STATE_OVERHEAD_BYTES = 16 * 2**20
# Bytes of state per byte of the checkpoint's adapter: AdamW keeps two fp32 moments per LoRA parameter, 8
# bytes for an adapter stored in bf16 at 2 bytes a parameter (4x), twice that for room (a third moment).
STATE_BYTES_PER_ADAPTER_BYTE = 8


def check_expansion(path: Path) -> None:
    """A ValueError naming `path` when the entries of the zip file `path` (torch.save's format) declare more
    bytes than it can hold: more than its own size (torch stores entries uncompressed: a state that expands
    is not torch's), or than what a state of this checkpoint can need, from the size of its adapter. NOTE:
    torch.load allocates each entry's declared size, so a forged 2 MB file could ask for gigabytes."""
    try:
        with zipfile.ZipFile(path) as archive:
            declared = sum(entry.file_size for entry in archive.infolist())
    except (zipfile.BadZipFile, ValueError, EOFError):  # not a zip (torch.load says what it is), or torn
        return
    size = path.stat().st_size
    others = sum(f.stat().st_size for f in path.parent.iterdir() if f.is_file() and f.name != STATE_FILE)
    need = STATE_OVERHEAD_BYTES + STATE_BYTES_PER_ADAPTER_BYTE * others
    if declared > size or declared > need:
        than = (
            f"its own {size:,} bytes" if declared > size else f"the {need:,} a state of this checkpoint needs"
        )
        raise ValueError(
            f"{path}: its entries would expand to {declared:,} bytes, more than {than}; refusing it"
        )


def load_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Read `trainer_state.pt` of a checkpoint folder, plain data only (the caller loads the adapter), once
    `check_expansion` found its size bounded."""
    path = files.regular_file(Path(directory) / STATE_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint folder (no {STATE_FILE})")
    check_expansion(path)
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


def _is_int(value: Any) -> bool:
    return type(value) is int  # NOTE: a bool is an int to isinstance


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _uint8_vector(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


# The trainer state's fields `set_rng_state` and the resume read: (dotted field, test, what it must be).
TRAINER_STATE_FIELDS = (
    ("step", lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    ("beta", _is_number, "a finite number"),
    ("run_id", lambda v: v is None or isinstance(v, str), "a string or null"),
    ("optimizer.state", lambda v: isinstance(v, dict), "a dict"),
    ("optimizer.param_groups", lambda v: isinstance(v, list), "a list"),
    ("scheduler", lambda v: isinstance(v, dict), "a dict"),
    ("rng.python.version", _is_int, "an int"),
    (
        "rng.python.state",
        lambda v: (
            isinstance(v, list | tuple) and len(v) == 625 and all(_is_int(x) and 0 <= x < 2**32 for x in v)
        ),
        "625 ints in [0, 2**32) (the Mersenne Twister's 624 words and its position)",
    ),
    ("rng.python.gauss_next", lambda v: v is None or _is_number(v), "a number or null"),
    ("rng.numpy.algorithm", lambda v: v == "MT19937", "'MT19937'"),
    (
        "rng.numpy.key",
        lambda v: isinstance(v, torch.Tensor) and v.dtype == torch.int64 and tuple(v.shape) == (624,),
        "an int64 tensor of 624 words",
    ),
    ("rng.numpy.pos", lambda v: _is_int(v) and 0 <= v <= 624, "an int in [0, 624]"),
    ("rng.numpy.has_gauss", lambda v: v in (0, 1) and _is_int(v), "0 or 1"),
    ("rng.numpy.cached_gaussian", _is_number, "a finite number"),
    (
        "rng.torch",
        lambda v: _uint8_vector(v) and v.numel() == torch.get_rng_state().numel(),
        "torch's RNG state",
    ),
    ("rng.cuda", lambda v: isinstance(v, list) and all(map(_uint8_vector, v)), "a list of CUDA RNG states"),
)


# The fields a resume cannot go without (run_id: an older checkpoint names no run; rng.cuda: a CPU run's).
RESUME_FIELDS = tuple(f for f, _, _ in TRAINER_STATE_FIELDS if f not in ("run_id", "rng.cuda"))


def trainer_state_problem(state: dict[str, Any], required: Collection[str] = ("step",)) -> str | None:
    """What is wrong with the trainer state `state` as data ("field: why"), None when nothing is: each field
    of TRAINER_STATE_FIELDS it holds is of its type, and those `required` are there (RESUME_FIELDS: all a
    resume reads). The optimizer's and scheduler's content is checked against the run's own
    (`optimizer_state_problem`, `scheduler_state_problem`)."""
    for field, test, want in TRAINER_STATE_FIELDS:
        value, *path = state, *field.split(".")
        for depth, key in enumerate(path):
            if not isinstance(value, dict):
                return f"{'.'.join(path[:depth])}: must be a dict, got {_shown(value)}"
            if key not in value:
                value = dataclasses.MISSING
                break
            value = value[key]
        if value is dataclasses.MISSING:
            if field not in required:
                continue
            return f"{field}: missing"
        if not test(value):
            return f"{field}: must be {want}, got {_shown(value)}"
    return None


def _shown(value: Any) -> str:
    """A value in a message: short, its type named."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({type(value).__name__})"


def optimizer_state_problem(loaded: Any, optimizer: torch.optim.Optimizer) -> str | None:
    """What keeps the optimizer state `loaded` from being `optimizer`'s ("field: why"), None when nothing
    does: its groups as many, their settings of the fresh ones' types (`_alike`); every tensor of a
    parameter's state of that parameter's shape (a scalar such as Adam's step aside). NOTE: load_state_dict
    checks only the counts, and a moment of another shape fails at the first step, far from the file."""
    own = optimizer.state_dict()
    groups = loaded.get("param_groups") if isinstance(loaded, dict) else None
    if not isinstance(groups, list) or len(groups) != len(own["param_groups"]):
        return f"optimizer.param_groups: must be {len(own['param_groups'])} groups, got {_shown(groups)}"
    shapes = {}
    for i, (group, mine) in enumerate(zip(groups, own["param_groups"])):
        where = f"optimizer.param_groups[{i}]"
        if not isinstance(group, dict) or "params" not in group:
            return f"{where}: must be a dict with params, got {_shown(group)}"
        for key, value in group.items():
            if key in mine and not _alike(value, mine[key]):
                return f"{where}.{key}: must be like {_shown(mine[key])}, got {_shown(value)}"
        if not all(map(_is_int, group["params"])):
            return f"{where}.params: must be parameter indices, got {_shown(group['params'])}"
        params = optimizer.param_groups[i]["params"]
        shapes.update({index: p.shape for index, p in zip(group["params"], params)})
    for index, values in loaded["state"].items():
        where = f"optimizer.state[{index!r}]"
        if index not in shapes or not isinstance(values, dict):
            return f"{where}: no parameter of the groups has this index, or its state is no dict"
        for key, value in values.items():
            tensor = isinstance(value, torch.Tensor) and value.is_floating_point()
            if not (tensor and (value.dim() == 0 or value.shape == shapes[index])) and not _is_number(value):
                want = f"a number or a tensor of shape {tuple(shapes[index])}"
                return f"{where}.{key}: must be {want}, got {_shown(value)}"
    return None


def scheduler_state_problem(loaded: Any, scheduler: Any) -> str | None:
    """What keeps the LR scheduler state `loaded` from being `scheduler`'s: only its keys, each value like
    its own (`_alike`); None when nothing does. NOTE: load_state_dict sets every key it is given as an
    attribute of the scheduler, so a foreign key could replace one of its members."""
    own = scheduler.state_dict()
    if not isinstance(loaded, dict) or not set(loaded) <= set(own):
        return f"scheduler: must hold only {', '.join(sorted(own))}, got {_shown(loaded)}"
    for key, value in loaded.items():
        if not _alike(value, own[key]):
            return f"scheduler.{key}: must be like {_shown(own[key])}, got {_shown(value)}"
    return None


def _alike(value: Any, own: Any) -> bool:
    """Whether a loaded setting `value` can stand where a fresh optimizer or scheduler has `own`: of its type
    (numbers: any finite one), a list or tuple as long, of numbers or None where `own` holds such; None on
    either side (an option unset: torch's versions differ in those) fits."""
    if value is None or own is None or (_is_number(value) and _is_number(own)):
        return True
    if type(value) is not type(own):
        return False
    if isinstance(value, list | tuple):
        return len(value) == len(own) and all(map(_alike, value, own))
    return True


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
            if problem := trainer_state_problem(state):
                raise ValueError(f"{checkpoint / STATE_FILE}: {problem}")
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
    run_json = files.regular_file(out / "run.json")
    owner = json.loads(run_json.read_text(encoding="utf-8")).get("run_id") if run_json.exists() else None
    run_id = state.get("run_id") or owner or uuid.uuid4().hex  # an older checkpoint may name no run
    if owner not in (None, run_id):
        raise ValueError(f"{checkpoint} belongs to another run than {out}/run.json")
    return checkpoint, state, run_id, report


# --- Run folders: one run per folder ------------------------------------------------------------------------
# What a run writes into its folder, besides checkpoint-*/. `run.json` with a run id is the folder's marker:
# --overwrite removes these and the run's own checkpoints, nothing else.
RUN_LOGS = ("metrics.jsonl", "timings.jsonl", "rollouts.jsonl", "eval_samples.jsonl")  # trimmed on --resume
RUN_FILES = ("run.json", *RUN_LOGS, "curves.png", "report.html")
RUN_FOLDERS = ("adapter", "tensorboard", "thumbs")
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
    """run.json of `out` ({"run_id", "args", "plugins"}), None when there is none; a ValueError naming it and
    the field when it is not this project's record."""
    path = files.regular_file(out / "run.json")
    if not path.exists():
        return None
    record = None
    with contextlib.suppress(ValueError, RecursionError):  # not UTF-8 or JSON, a 5,000-digit int, too deep
        record = json.loads(path.read_text(encoding="utf-8"))
    problem = None
    if not (isinstance(record, dict) and isinstance(record.get("run_id"), str)):
        problem = "not a run record of this project (a JSON object with a run_id)"
    elif not isinstance(record.get("args", {}), dict | None):
        problem = f"args: not an object of settings (a {type(record['args']).__name__})"
    if problem is not None:
        raise ValueError(f"{path}: {problem}; damaged?")
    if "plugins" in record:
        plugins.check_records(record["plugins"], path)
    return record


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
        leftover = re.fullmatch(r"\.(.+)\.[0-9a-f]{32}\.tmp", name)  # atomic_write's temporary file
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
    if not (path := files.regular_file(path)).exists():
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
    files.atomic_write(path, b"".join(line + b"\n" for line in kept))


def removal_plan(out: Path, paths: list[Path]) -> list[tuple[Path, bool]]:
    """(path, whether to remove it as a folder) for each of `paths` in the run folder `out`, all checked
    before the caller removes any: a symbolic link (to a user's folder, say) is removed as the link itself,
    never followed; a real folder with everything under it, each of its folders writable. A ValueError names
    the first path that could not be removed; then nothing has been."""

    def fail(error: OSError) -> None:
        raise error

    plan = []
    try:
        if not os.access(out, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(out))
        for path in paths:
            is_folder = stat.S_ISDIR(os.lstat(path).st_mode)  # lstat: a link to a folder is no folder here
            for folder, _, _ in os.walk(path, onerror=fail) if is_folder else ():  # never into links
                if not os.access(folder, os.W_OK | os.X_OK):
                    raise PermissionError(13, "Permission denied", folder)
            plan.append((path, is_folder))
    except OSError as e:
        where = e.filename if e.filename is not None else out
        raise ValueError(
            f"--overwrite: cannot remove {where}: {e.strerror or e}; nothing was removed from {out}"
        ) from e
    return plan


def open_run_folder(
    out: Path,
    mode: str,
    run_id: str,
    start_step: int,
    config: dict,
    plugin_files: list[dict] | None = None,
    command: str | None = None,
) -> str | None:
    """The first write of a run (`mode` from check_run_folder): remove the replaced run's own files, or trim
    the logs of the resumed run to its checkpoint; then run.json records the run that owns the folder, its
    settings (a resumed run's current ones), given, its plug-ins' files (plugins.plugin_records), and its
    "starts": each start's UTC time, step and `command` (None: not from the command line), a resumed run's
    earlier ones first. Returns a line naming what was removed and what else the folder holds (None:
    nothing removed)."""
    removed, kept, starts = [], [], []
    if mode == "resume" and (record := read_run_record(out)) is not None:
        starts = record.get("starts") if isinstance(record.get("starts"), list) else []
    if mode == "replace" and (record := read_run_record(out)) is not None:
        removed, kept = run_files(out, record["run_id"])
        for path, is_folder in removal_plan(out, removed):
            shutil.rmtree(path) if is_folder else path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    for leftover in out.glob("checkpoint-*.tmp"):  # of a save that was killed: never a checkpoint
        shutil.rmtree(leftover, ignore_errors=True)
    if mode == "resume":
        for name in RUN_LOGS:
            trim_jsonl(out / name, start_step)
    # NOTE: "finished" turns true only at the run's real end (`mark_finished`): a process a plug-in ended
    # with os._exit(0), whose exit status says success, leaves it false.
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    starts = [*starts, {"at": now, "from_step": start_step, "command": command}]
    record = {"run_id": run_id, "args": config, "finished": False, "starts": starts}
    record = json.dumps(
        record | ({} if plugin_files is None else {"plugins": plugin_files}), indent=2, ensure_ascii=False
    )
    files.atomic_write(out / "run.json", record.encode() + b"\n")
    if not removed:
        return None
    left = f"; left in place (not the run's own): {', '.join(p.name for p in kept)}" if kept else ""
    return f"replaced the previous run: removed {', '.join(p.name for p in removed)}{left}"


def mark_finished(out: Path, summary: dict | None = None) -> None:
    """run.json's "finished": true (and the last start's `summary`: steps, wall time, accuracy), the last
    write of a run that trained every step and wrote its adapter."""
    record = read_run_record(out)
    text = json.dumps({**record, "finished": True, "summary": summary}, indent=2, ensure_ascii=False)
    files.atomic_write(out / "run.json", text.encode() + b"\n")


@contextlib.contextmanager
def run_folder_lock(out: Path, hold: bool) -> Iterator[None]:
    """One writer per run folder: its lock (cli.hold_lock), taken before anything looks into the folder and
    held until the run ends; the kernel releases it when the process dies, however it dies. A start that
    fails before its first write (no run record) removes the lock file and the folders it made."""
    if not hold:
        yield
        return
    with cli.user_errors():
        created = make_run_folder(out)
    lock_file, new_lock = out / LOCK_FILE, not (out / LOCK_FILE).exists()
    lock = cli.hold_lock(lock_file, f"run folder {out}")
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # a damaged run.json is no run record either
            new_lock = new_lock and read_run_record(out) is None
        if new_lock:
            lock_file.unlink()
            with contextlib.suppress(OSError):  # only the empty folders this process made
                for folder in (out, *out.parents) if created is not None else ():
                    folder.rmdir()
                    if folder == created:
                        break
        lock.close()


@contextlib.contextmanager
def writing(out: Path, path: Path | None = None) -> Iterator[None]:
    """Inside, an OSError becomes cli.WriteFailed naming the file (`path` if the error names none); the
    message adds which checkpoint of the run folder `out` is intact and how to go on."""
    try:
        with cli.writing(path or out):
            yield
    except cli.WriteFailed as e:
        kept = list_checkpoints(out)
        then = f"the newest checkpoint, {kept[-1].name}, is intact" if kept else "no checkpoint yet"
        then += f"; once the cause is gone: python -m grpo_vlm --resume {out}"
        raise cli.WriteFailed(f"{e}; {then}") from e.__cause__


# --- Resume: the recorded run's settings, and where it stands -----------------------------------------------


def flat_settings(settings: dict) -> dict:
    """Settings as a dict (dataclasses.asdict, run.json's "args") -> {field: value}, groups flattened like the
    flags; values as JSON gives them back (tuples as lists)."""
    flat = {}
    for key, value in settings.items():
        flat.update(flat_settings(value) if isinstance(value, dict) else {key: json.loads(json.dumps(value))})
    return flat


def fits(value: Any, hint: Any) -> bool:
    """Whether the JSON value `value` (None, bool, int, float, str, list) can be a field of type `hint` (the
    types settings use: their unions, Literal, tuple[X, ...]); an int fits a float, a bool fits no number.
    NOTE: JSON knows only these types, so this little covers every value run.json can hold."""
    origin, parts = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, part) for part in parts)
    if origin is typing.Literal:
        return any(value == part and type(value) is type(part) for part in parts)
    if origin is tuple:
        each = parts[0] if len(parts) == 2 and parts[1] is Ellipsis else None
        return isinstance(value, list) and (each is None or all(fits(v, each) for v in value))
    if hint is float:
        return type(value) in (int, float)
    if hint in (type(None), None):
        return value is None
    return type(value) is hint if hint in (bool, int, str) else True


def settings_from_record(settings: dict, cls: type):
    """The dataclass `cls` (nested settings groups included) from run.json's "args": each field by its flag
    name, in whichever group the record holds it (a setting moved to another group reads back); JSON lists
    back to tuples; what it lacks keeps the default. A value not of its field's type is a ValueError naming
    the field ("args: batch_size: ...")."""
    flat = flat_settings(settings)

    def build(group: type):
        values, hints = {}, typing.get_type_hints(group)
        for field in dataclasses.fields(group):
            value = flat.get(field.name, dataclasses.MISSING)
            if dataclasses.is_dataclass(field.default_factory):  # a settings group: its fields are flat too
                values[field.name] = build(field.default_factory)
            elif value is not dataclasses.MISSING:
                if not fits(value, hints[field.name]):
                    shown = json.dumps(value)
                    shown = shown if len(shown) <= 40 else shown[:37] + "..."
                    hint = hints[field.name]
                    kind = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
                    raise ValueError(f"args: {field.name}: {shown} is not of type {kind}")
                values[field.name] = tuple(value) if isinstance(value, list) else value
        return group(**values)

    return build(cls)


def resumed_settings(out: Path, given: dict, may_change: Collection[str]) -> tuple[dict, str | None]:
    """(run.json's new "args", a note or None) for resuming the run in `out` with the settings `given`
    (dataclasses.asdict): a ValueError naming --resume when a setting differs from the record but is not in
    `may_change`. The note names the settings the record lacks (a run.json of an older version)."""
    record = read_run_record(out) or {}
    recorded, flat = flat_settings(record.get("args") or {}), flat_settings(given)
    differ = [
        f"--{k.replace('_', '-')} recorded {json.dumps(recorded[k])}, given {json.dumps(v)}"
        for k, v in flat.items()
        if k in recorded and recorded[k] != v and k not in may_change
    ]
    if differ:
        raise ValueError(f"--resume {out}: these flags differ from the recorded run: {'; '.join(differ)}")
    note = None
    if lacking := [k for k in flat if k not in recorded]:
        named = ", ".join(f"--{k.replace('_', '-')}" for k in lacking) if recorded else "settings"
        note = f"{out}/run.json records no {named}: the flags given (or their defaults) are used"
    first = ("output_dir", "resume", "overwrite")  # run.json keeps where the run was first started
    return {**given, **{k: v for k, v in (record.get("args") or {}).items() if k in first}}, note


def finished_run(resume: str, out: Path, steps: int) -> str | None:
    """None when the checkpoint `resume` continues from (the one named, or the run folder's newest intact
    one) is before step `steps`, or the run has not written its curves (last) yet; when it is at `steps`,
    that the run is finished and how to train further; a ValueError naming --steps when it is past it."""
    try:
        _, state, _, _ = checkpoint_to_resume(resume, out)
    except ValueError as e:  # none intact, or another run's
        raise ValueError(f"--resume: {e}") from e
    done = int(state["step"])
    if done > steps:
        raise ValueError(f"--steps: {steps} is below the checkpoint's step {done}")
    if done < steps or not (out / "curves.png").is_file():  # NOTE: a run that stopped while writing its
        return None  # final adapter or curves resumes to write them
    again = f"python -m grpo_vlm --resume {out} --steps M (M > {done})"
    return f"{out}: the run is finished at step {done}; to train further: {again}"
