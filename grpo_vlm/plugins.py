"""The plug-ins a run imports (`--reward` and `--tools` given as `file.py:function` or `module:function`):
which file each one is, its SHA-256 as run.json records it, and what `--resume` checks before importing.

`import_plugin` imports one (a file as a fresh module under a private name, nothing half-imported left in
sys.modules) and `reward_function` loads a reward by name or plug-in, its signature checked. A run folder may
come from someone else, and its run.json names code that `--resume` would import and run.
Choices:
- At the run's start, run.json records each plug-in's file and SHA-256 (a module plug-in: the file of the
  module as the import would find it, found without running any code; a module without one, e.g. built into
  Python: no hash, nothing to compare).
- `--resume` prints each plug-in it imports (flag, file, hash prefix) before importing it, and refuses a
  plug-in whose file differs from the recorded hash, or whose hash run.json does not record (a run.json of
  an older version, or one edited: a missing hash would otherwise be a way around the check). Giving the
  flag again on the resume command line accepts its plug-ins as their files are now; run.json then records
  the new hashes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import rewards
from grpo_vlm import files

HASH_SHOWN = 12  # hex digits of a SHA-256 printed in a line: enough to tell two files apart by eye


def is_file_spec(module_spec: str) -> bool:
    """Whether `import_plugin` reads `module_spec` as a file path (else as a module on sys.path)."""
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


def import_plugin(module_spec: str, *, kind: str = "reward") -> Any:
    """Import `pkg.mod` from sys.path, or run `path/to/file.py` as a fresh module (`kind`: what it holds)."""
    if is_file_spec(module_spec):
        if not os.path.isfile(module_spec):
            raise ValueError(f"{kind} file {module_spec!r} does not exist")
        # NOTE: in sys.modules (dataclasses, pickle look it up) under a private name: no user file clashes.
        name = f"_{kind}_plugin_{os.path.splitext(os.path.basename(module_spec))[0]}"
        spec = importlib.util.spec_from_file_location(name, module_spec)
        assert spec is not None and spec.loader is not None  # None for a suffix Python cannot import
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException as e:  # leave no half-initialised module behind, whatever the module raised
            del sys.modules[name]
            if not isinstance(e, ImportError | SyntaxError):
                raise
            raise ValueError(f"could not import {kind} file {module_spec!r}: {e}") from e
        return module
    try:
        return importlib.import_module(module_spec)
    except (ImportError, SyntaxError) as e:
        missing = isinstance(e, ModuleNotFoundError) and e.name == module_spec.split(".")[0]
        hint = " (is its directory on sys.path? or pass a file: path/to/file.py:function)" if missing else ""
        raise ValueError(f"could not import {kind} module {module_spec!r}: {e}{hint}") from e


def reward_function(spec: str, builtins: Mapping[str, rewards.RewardFn], **bind: Any) -> rewards.RewardFn:
    """rewards.load_reward for a command line that names a file or module someone else wrote: a built-in by
    name (from `builtins`) or a plug-in (`import_plugin`), keyword arguments bound
    (`reward_function("numeric_match", builtins, rel_tol=0.01)`), its signature checked against how
    rewards.score calls it. Every problem is a ValueError fit for a command line."""
    if ":" not in spec:
        if spec not in builtins:
            plugin = "or give a plug-in as module:function or path/to/file.py:function"
            raise ValueError(f"unknown reward {spec!r}; built-ins are {', '.join(builtins)}, {plugin}")
        fn = builtins[spec]
    else:
        module_spec, _, attr = spec.rpartition(":")
        if not module_spec or not attr:
            raise ValueError(f"reward {spec!r} must look like module:function or path/to/file.py:function")
        module = import_plugin(module_spec)
        if not hasattr(module, attr):
            raise ValueError(f"reward module {module_spec!r} has no attribute {attr!r}")
        fn = getattr(module, attr)
    if not callable(fn):  # ValueError, not TypeError: a command-line mistake like all the others
        raise ValueError(f"reward {spec!r} is not callable (got {type(fn).__name__})")  # noqa: TRY004
    fn = functools.partial(fn, **bind) if bind else fn
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward {spec!r}: cannot read its signature: {e}") from e
    try:  # exactly how score() will call it
        sig.bind(
            "completion", {}, **({"completion_length": 0} if rewards.wants_completion_length(fn) else {})
        )
    except TypeError as e:
        how = f"reward {spec!r} has signature {sig}, but must accept (completion, sample) positionally"
        raise ValueError(f"{how}; other parameters need defaults or must be bound when loading ({e})") from e
    return fn
