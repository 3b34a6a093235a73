"""The scripts' outputs: never over an input, one writer each, whole lines only, resumable JSONL.

A script names what it reads and what it writes (`refuse_overwriting_inputs`): an output that is an input
(the same path, a link to it, or a file inside an input folder) is refused before anything is written, even
with --overwrite. `claimed` then makes the output's folder, checks that it can be written (a small file
written and removed, so a read-only, full or unwritable location fails before the slow work, not after it)
and takes the output's lock (cli.hold_lock): `.<name>.lock` beside an output file, `.lock` inside an output
folder (as in trainer.py's run folder). A second process on the same output is refused at once, naming the
holder; the lock files stay (hidden, a few bytes): deleting one would let two processes lock two files.

A script writes each item's line whole, flushed and fsynced before the next, so a kill tears at most the
last line, and a failed write (disk full) is cut back off at once; a rerun of the same command cuts a torn
line off, skips the items already written and appends the rest. `<output stem>.settings.json` records what
decides the results, so that a rerun with other settings is refused instead of mixing two runs in one file.
Whole files are written beside their path and renamed over it: the old file or the new one, never half.

A script continues or replaces only an output it wrote itself (`check_own_output`: the settings file beside
it names the script and records the same settings); anything else at that path, a user's file or another
script's, is refused in one line naming it and the flag unless --overwrite is given, before anything is
written. A symbolic link is never written through (with --overwrite the link itself is replaced), and a
FIFO, socket or device is never opened (a FIFO would block the read).

Imports the standard library, cli.py, files.py (its `atomic_write`) and logs.py (its `append_jsonl`) only.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from grpo_vlm import cli, files, logs


def same_or_inside(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether `a` and `b` are one file (through a symbolic or hard link too) or one is inside the other."""
    real_a, real_b = Path(os.path.realpath(a)), Path(os.path.realpath(b))
    if real_a == real_b or real_a in real_b.parents or real_b in real_a.parents:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def refuse_overwriting_inputs(writes: dict[str, list], reads: dict[str, list]) -> None:
    """cli.UsageError naming both flags if an output (flag -> paths) is an input, holds one or is inside
    one, or two outputs are one file. None entries are skipped."""
    named = [(flag, path) for flag, paths in writes.items() for path in paths if path is not None]
    for i, (flag, path) in enumerate(named):
        for other, given in named[:i]:
            if same_or_inside(path, given):
                raise cli.UsageError(f"{flag} {path} is the same file as {other} {given}; give another one")
        for in_flag, in_paths in reads.items():
            for source in (p for p in in_paths if p is not None):
                if same_or_inside(path, source):
                    raise cli.UsageError(
                        f"{flag} {path} would write over or into {in_flag} {source} (an output never "
                        f"replaces an input, even with --overwrite); give another {flag}"
                    )


def plugin_files(specs) -> list[str]:
    """The files of reward plug-ins given as `path/to/file.py:function` (inputs too)."""
    files = [spec.rpartition(":")[0] for spec in specs if ":" in spec]
    return [f for f in files if f.endswith(".py") or os.sep in f]


def check_writable(path: Path, folder: bool = False) -> None:
    """Make the folder of `path` (or `path`, an output folder) and write, then remove, a small file in it (a
    read-only, full or unwritable location fails here); an existing output file must be writable too. Raises
    cli.WriteFailed naming `path` and the cause."""
    where = path if folder else path.parent
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=where, prefix=".probe-")
        try:
            os.write(fd, b"probe\n")
        finally:
            os.close(fd)
            os.unlink(probe)
        if not folder and path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise cli.WriteFailed(f"cannot write {path}: {e.strerror or e}") from e


@contextlib.contextmanager
def claimed(paths: dict[str, list[Path]], folder: bool = False) -> Iterator[None]:
    """Check that each output (flag -> paths; output folders if `folder`) can be written and hold its lock
    for the `with` block. If the block raises, each folder made here is removed again when it holds nothing
    but locks: a failed or stopped start leaves nothing behind."""
    wheres = [path if folder else path.parent for flag_paths in paths.values() for path in flag_paths]
    made = {d: None for where in wheres for d in (where, *where.parents) if not d.exists()}
    locks = []
    try:
        for flag, flag_paths in paths.items():
            for path in flag_paths:
                check_writable(path, folder)
                lock = path / ".lock" if folder else path.with_name(f".{path.name}.lock")
                locks.append(cli.hold_lock(lock, f"{flag} {path}"))
        yield
    except BaseException:
        for handle in locks:
            handle.close()
        for folder_made in sorted(made, key=lambda d: len(d.parts), reverse=True):  # deepest first
            with contextlib.suppress(OSError):
                for lock in folder_made.glob(".*lock"):
                    lock.unlink()
                folder_made.rmdir()  # fails, and keeps the folder, when anything else is in it
        raise
    finally:
        for handle in locks:
            handle.close()


def read_resumable(path: Path, key: str, producer: str) -> list[dict]:
    """The lines of an existing output (each a dict with `key`). A torn last line (killed mid-write) is cut
    off the file itself; damage before the last line is a ValueError naming path:line (not ours to fix)."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    lines.pop()  # after the last newline: b"" or a line whose write never finished
    records, good_bytes = [], 0
    for lineno, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # not JSON or UTF-8, an int of 4,300+ digits, nested too deep
            if lineno < len(lines):
                raise ValueError(
                    f"{path}:{lineno}: invalid JSON before the last line; fix that line, pass --overwrite, "
                    "or choose another --output"
                ) from None
            break
        if not (isinstance(record, dict) and key in record):
            raise ValueError(
                f"{path}:{lineno}: not a line of {producer} (no {key}); pass --overwrite or choose "
                "another --output"
            )
        records.append(record)
        good_bytes += len(line) + 1
    if good_bytes < len(raw):
        print(f"{path}: dropping a torn last line ({len(raw) - good_bytes} bytes)")
        with path.open("r+b") as f:
            f.truncate(good_bytes)
            os.fsync(f.fileno())
    return records


def append_line(f, record: dict) -> None:
    """Append one complete line to the open file `f` (logs.append_jsonl: one write, fsynced, cut back off
    the file if it fails), after what `f` itself holds unwritten."""
    f.flush()
    logs.append_jsonl(f.name, record)


def write_text_atomic(path: Path, text: str) -> None:
    """Write beside `path` (files.atomic_write: a temporary file of a random name), then rename over it: a
    kill leaves the old file or the new one, never half; a failed write (or a signal) removes its temporary
    file; a symbolic link at `path` is replaced by the file, its target never written."""
    files.atomic_write(path, text.encode("utf-8"))


def write_json_atomic(path: Path, obj: dict) -> None:
    write_text_atomic(path, json.dumps(obj, ensure_ascii=False, indent=2) + "\n")


def check_output_file(path: Path, flag: str, overwrite: bool | None) -> None:
    """cli.UsageError naming `flag` unless `path` is missing or a regular file. A symbolic link is never
    followed onto another file: with --overwrite (`overwrite` True) the caller replaces the link itself;
    None: --overwrite does not apply to this path. A FIFO, socket or device is never opened (a FIFO would
    block the read until someone writes into it)."""
    if os.path.islink(path):
        fix = "pass --overwrite to replace the link itself, or" if overwrite is not None else "remove it or"
        if not overwrite:
            raise cli.UsageError(
                f"{flag} {path} is a symbolic link (to {os.readlink(path)}); an output is never written "
                f"through one onto another file: {fix} choose another {flag}"
            )
    elif os.path.lexists(path) and not path.is_file():
        raise cli.UsageError(
            f"{flag} {path} is not a regular file (a FIFO, socket or device); choose another {flag}"
        )


def check_own_output(path: Path, flag: str, overwrite: bool, producer: str) -> dict | None:
    """Before anything is written: the recorded settings of an output that `producer` wrote itself (its
    `<stem>.settings.json` beside it, naming `producer`), None when there is none to continue (no output, or
    --overwrite). Anything else at `path`, a user's file or another script's output, is a cli.UsageError
    naming it and `flag`: a script continues only what it wrote, and never touches the rest."""
    settings_path = path.with_suffix(".settings.json")
    check_output_file(path, flag, overwrite)
    check_output_file(settings_path, flag, overwrite)
    if overwrite or (not settings_path.exists() and not os.path.lexists(path)):
        return None
    if not settings_path.exists():
        raise cli.UsageError(
            f"{flag} {path} exists and was not written by {producer} (no {settings_path.name} beside it); "
            f"it is left as it is: pass --overwrite to replace it, or choose another {flag}"
        )
    try:
        old = json.loads(settings_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise cli.UsageError(
            f"{settings_path}: cannot be read ({e}); pass --overwrite to start {flag} {path} afresh"
        ) from e
    if not isinstance(old, dict):
        raise cli.UsageError(
            f"{settings_path}: not a settings file; pass --overwrite or choose another {flag}"
        )
    if old.get("script", producer) != producer:  # NOTE: files of older versions name no script
        raise cli.UsageError(
            f"{flag} {path} was written by {old['script']}, not {producer}; it is left as it is: pass "
            f"--overwrite to replace it, or choose another {flag}"
        )
    return old if os.path.lexists(path) else None


def check_settings(
    path: Path, settings: dict, overwrite: bool, producer: str, companions: tuple[str, ...] = ()
) -> None:
    """Refuse (cli.UsageError) an output `producer` did not write (check_own_output), or one it wrote with
    other settings: it would mix two runs in one file. --overwrite removes the output (a symbolic link as
    the link), its settings and its companion files (suffixes); then the settings are recorded, with
    `producer`."""
    old = check_own_output(path, "--output", overwrite, producer)
    if overwrite:
        for p in (path, path.with_suffix(".settings.json"), *(path.with_suffix(s) for s in companions)):
            p.unlink(missing_ok=True)
    if old is not None:
        keys = settings.keys() | (old.keys() - {"script"})
        changed = sorted(k for k in keys if settings.get(k) != old.get(k))
        if changed:
            raise cli.UsageError(
                f"{path} was written with other settings ({', '.join(changed)}); "
                "pass --overwrite or choose another --output"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path.with_suffix(".settings.json"), {"script": producer, **settings})
