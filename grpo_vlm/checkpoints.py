"""A run folder and its checkpoints: one writer per folder, the run.json marker, checkpoints that prove they
are whole, and what a resume loads.

A run folder holds run.json (the run's id and settings), metrics.jsonl, timings.jsonl and rollouts.jsonl
(appended step by step), checkpoint-NNNNNN/ folders (the adapter, written by the caller's function, e.g.
model_io.save_adapter, and the trainer state), and at the end adapter/ and curves.png.

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
import hashlib
import io
import json
import numbers
import os
import pickle
import random
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_vlm import cli, files

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
    path = files.regular_file(Path(directory) / STATE_FILE)
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
    run_json = files.regular_file(out / "run.json")
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
    path = files.regular_file(out / "run.json")
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


def open_run_folder(out: Path, mode: str, run_id: str, start_step: int, config: dict) -> str | None:
    """The first write of a run (`mode` from check_run_folder): remove the replaced run's own files, or trim
    the logs of the resumed run to its checkpoint; then run.json records the run that owns the folder and its
    settings (a resumed run's current ones). Returns a line naming what was removed and what else the folder
    holds (None: nothing removed)."""
    removed, kept = [], []
    if mode == "replace" and (record := read_run_record(out)) is not None:
        removed, kept = run_files(out, record["run_id"])
        for path, is_folder in removal_plan(out, removed):
            shutil.rmtree(path) if is_folder else path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    for leftover in out.glob("checkpoint-*.tmp"):  # of a save that was killed: never a checkpoint
        shutil.rmtree(leftover, ignore_errors=True)
    if mode == "resume":
        for name in ("metrics.jsonl", "timings.jsonl", "rollouts.jsonl"):
            trim_jsonl(out / name, start_step)
    record = json.dumps({"run_id": run_id, "args": config}, indent=2, ensure_ascii=False)
    files.atomic_write(out / "run.json", record.encode() + b"\n")
    if not removed:
        return None
    left = f"; left in place (not the run's own): {', '.join(p.name for p in kept)}" if kept else ""
    return f"replaced the previous run: removed {', '.join(p.name for p in removed)}{left}"


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


def settings_from_record(settings: dict, cls: type):
    """The dataclass `cls` (nested settings groups included) from run.json's "args": each field by its flag
    name, in whichever group the record holds it (a setting moved to another group reads back); JSON lists
    back to tuples; what it lacks keeps the default."""
    flat = flat_settings(settings)

    def build(group: type):
        values = {}
        for field in dataclasses.fields(group):
            value = flat.get(field.name, dataclasses.MISSING)
            if dataclasses.is_dataclass(field.default_factory):  # a settings group: its fields are flat too
                values[field.name] = build(field.default_factory)
            elif value is not dataclasses.MISSING:
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
