"""The plug-ins a run imports (`--reward` and `--tools` given as `file.py:function` or `module:function`):
which file each one is, its SHA-256 as run.json records it, and what `--resume` checks before importing.

A run folder may come from someone else, and its run.json names code that `--resume` would import and run.
Choices:
- At the run's start, run.json records each plug-in's file and SHA-256 (a module plug-in: the file of the
  module as the import would find it, found without running any code; a module without one, e.g. built into
  Python: no hash, nothing to compare).
- `--resume` prints each plug-in it imports (flag, file, hash prefix) before importing it, and refuses a
  plug-in whose file differs from the recorded hash, or whose hash run.json does not record (a run.json of
  an older version, or one edited: a missing hash would otherwise be a way around the check). Giving the
  flag again on the resume command line accepts its plug-ins as their files are now; run.json then records
  the new hashes.
Stdlib only.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from grpo_vlm import files

HASH_SHOWN = 12  # hex digits of a SHA-256 printed in a line: enough to tell two files apart by eye


def is_file_spec(module_spec: str) -> bool:
    """Whether rewards.import_plugin reads `module_spec` as a file path (else as a module on sys.path)."""
    return module_spec.endswith(".py") or "/" in module_spec or os.sep in module_spec


def module_file(name: str) -> Path | None:
    """The file that `import name` would run, found without running any code (importlib.util.find_spec
    imports the parent packages); None when there is none (not found, built in, a namespace package)."""
    if (module := sys.modules.get(name)) is not None:
        found = getattr(module, "__file__", None)
        return Path(found) if found else None
    parent, _, _ = name.rpartition(".")
    search = None
    if parent:
        if (package := sys.modules.get(parent)) is not None:
            search = getattr(package, "__path__", None)
        elif (package_file := module_file(parent)) is not None and package_file.name == "__init__.py":
            search = [str(package_file.parent)]
        if search is None:
            return None
    spec = importlib.machinery.PathFinder.find_spec(name, search)
    return Path(spec.origin) if spec is not None and spec.has_location and spec.origin else None


def plugin_file(module_spec: str) -> Path | None:
    """The file (absolute) a plug-in's `module_spec` imports; None: no such file, or a module without one."""
    if is_file_spec(module_spec):
        return Path(module_spec).resolve() if os.path.isfile(module_spec) else None
    found = module_file(module_spec)
    return found.resolve() if found is not None else None


def sha256_of(path: Path) -> str:
    with files.regular_file(path).open("rb") as f:  # NOTE: a FIFO named like a plug-in would block the read
        return hashlib.file_digest(f, "sha256").hexdigest()


def plugin_records(flags: Mapping[str, Sequence[str]]) -> list[dict]:
    """run.json's "plugins": {"flag", "spec", "file", "sha256"} of each plug-in among the values of `flags`
    ({"--reward": ("label", "judge.py:judge")}); a built-in (no ':') is no plug-in."""
    records = []
    for flag, values in flags.items():
        for spec in values:
            if ":" not in spec:
                continue
            path = plugin_file(spec.rpartition(":")[0])
            digest = sha256_of(path) if path is not None else None
            records.append(dict(flag=flag, spec=spec, file=str(path) if path else None, sha256=digest))
    return records


def check_records(records: object, where: Path) -> list[dict]:
    """run.json's "plugins" (`where`: the file), or a ValueError naming the file and the field."""
    keys = {"flag": str, "spec": str, "file": str | None, "sha256": str | None}
    fine = isinstance(records, list) and all(
        isinstance(r, dict) and all(isinstance(r.get(k), kind) for k, kind in keys.items()) for r in records
    )
    if not fine:
        raise ValueError(f"{where}: plugins: not a list of {{flag, spec, file, sha256}} records; damaged?")
    return records


def describe(record: dict) -> str:
    digest = f"sha256 {record['sha256'][:HASH_SHOWN]}" if record["sha256"] else "no file to hash"
    return f"{record['file'] or record['spec']} ({digest})"


def check_resumed(
    recorded: list[dict] | None,
    current: list[dict],
    flags: Mapping[str, Sequence[str]],
    given_again: Collection[str],
    where: Path,
) -> list[str]:
    """The lines that say which plug-ins a resumed run imports; a ValueError naming the flag and the plug-in
    when its file differs from the hash run.json (`where`) records, or no hash is recorded (`recorded` None:
    run.json has no "plugins"), unless its flag is among `given_again` (typed on the resume command line)."""
    known = {(r["flag"], r["spec"]): r for r in recorded or []}
    lines = []
    for now in current:
        flag, spec = now["flag"], now["spec"]
        if now["file"] is None and is_file_spec(spec.rpartition(":")[0]):
            continue  # no such file: the import says so
        then = known.get((flag, spec))
        again = f"give {flag} {' '.join(flags[flag])} again on the command line to accept it as it is now"
        if flag in given_again:
            lines.append(
                f"imports {flag} plug-in {spec}: {describe(now)}, given again: accepted as it is now"
            )
        elif then is None or (then["sha256"] is None and now["sha256"] is not None):
            raise ValueError(
                f"{flag}: {where} records no SHA-256 of the plug-in {spec} (written by an older version, or "
                f"edited), so whether {describe(now)} is the file the run started with is unknown; {again}"
            )
        elif then["sha256"] != now["sha256"]:
            changed = f"{then['sha256'][:HASH_SHOWN] if then['sha256'] else 'no file'} when the run started"
            raise ValueError(
                f"{flag}: the plug-in {spec} changed since the run started ({describe(now)}, {changed}, as "
                f"{where} records); {again}"
            )
        else:
            lines.append(f"imports {flag} plug-in {spec}: {describe(now)}, as when the run started")
    return lines
