"""Resumable JSONL outputs of the scripts (evaluate.py, summarize_photos.py): one line per finished item.

A script writes each item's line whole, flushed and fsynced before the next, so a kill tears at most the
last line; a rerun of the same command cuts that line off, skips the items already written and appends the
rest. `<output stem>.settings.json` records what decides the results, so that a rerun with other settings
is refused instead of mixing two runs in one file.

Imports the standard library only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


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
        except (json.JSONDecodeError, UnicodeDecodeError):
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
    """Write one complete line to an open file, then flush and fsync: a crash tears at most this line."""
    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write beside `path`, then rename over it: a kill leaves the old file or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def check_settings(path: Path, settings: dict, overwrite: bool, companions: tuple[str, ...] = ()) -> None:
    """Refuse (ValueError) to resume an output written with other settings: it would mix two runs in one
    file. --overwrite removes the output, its settings and its companion files (suffixes), then records."""
    settings_path = path.with_suffix(".settings.json")
    if overwrite:
        for p in (path, settings_path, *(path.with_suffix(s) for s in companions)):
            p.unlink(missing_ok=True)
    if path.exists() and settings_path.exists():
        try:
            old = json.loads(settings_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{settings_path}: cannot be read (pass --overwrite to start afresh): {e}"
            ) from e
        if not isinstance(old, dict):
            raise ValueError(f"{settings_path}: not a settings file; pass --overwrite")
        changed = sorted(k for k in settings.keys() | old.keys() if settings.get(k) != old.get(k))
        if changed:
            raise ValueError(
                f"{path} was written with other settings ({', '.join(changed)}); "
                "pass --overwrite or choose another --output"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(settings_path, settings)
