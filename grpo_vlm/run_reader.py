"""Reading a run folder that anyone may have written (the run report's input): bounded, lenient, never
through a symbolic link. What cannot be read is listed (`Problems`), never raised.

- A JSONL file is read a line at a time (`lines`): a line longer than MAX_LINE_BYTES is skipped a chunk at a
  time, never held, so a 2 GB line costs no more memory than a 16 MB one. A line that is not UTF-8, not JSON
  (a live run's torn last line), nested deeper than MAX_DEPTH, or without an integer step in [0, 2**53) is
  listed as `name:line: why` and skipped (`read_jsonl`).
- JSON as JSON is (RFC 8259): NaN, Infinity and a float beyond the float range, which an earlier version
  wrote (json.dumps' default), read as None and are counted per file; a lone surrogate (text that JS or Java
  cut inside an emoji) reads as U+FFFD and is listed with its field (`clean`).
- A file is opened with O_NOFOLLOW and O_NONBLOCK (`open_run_file`): a symbolic link is not followed onto a
  file outside the folder, a FIFO does not block the read.
- `Thinned` keeps at most N of a stream of items, evenly spread, whatever its length.
Imports the standard library and logs.py only.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from grpo_vlm import logs

MAX_LINE_BYTES = 16 << 20  # one line of a JSONL file (or run.json): a longer one is not read
MAX_DEPTH = 32  # nesting of one line's JSON: the trainer's deepest (a tool call's crop) is 7
MAX_LOGGED_STEPS = 1_000_000  # distinct steps of a file counted by `step_counts` (about 100 bytes each)
MAX_PROBLEMS = 200  # problem notes listed; the rest counted
MAX_STEP = 2**53  # a step JSON and JS both hold exactly
STEP_PREFIX = re.compile(rb'\{"step": (\d{1,15})[,}]')  # how logs.py starts every line it writes


class _NonFinite:
    """What json.loads reads for NaN, Infinity, -Infinity or 1e400: turned into None by `clean`."""


NON_FINITE = _NonFinite()


class TooDeep(ValueError):
    pass


def parse_json(text: str) -> tuple[Any, int]:
    """(json.loads of `text`, how many values it read as NON_FINITE: NaN, Infinity, a float beyond the float
    range, an integer of more than 308 digits)."""
    seen = [0]

    def non_finite(_: str) -> _NonFinite:
        seen[0] += 1
        return NON_FINITE

    def floats(text: str) -> float | _NonFinite:
        value = float(text)
        return value if math.isfinite(value) else non_finite(text)

    def ints(text: str) -> int | _NonFinite:
        return int(text) if len(text.lstrip("-")) <= 308 else non_finite(text)

    return json.loads(text, parse_constant=non_finite, parse_float=floats, parse_int=ints), seen[0]


@dataclass
class Found:
    """What `clean` replaced in one record: non-finite numbers, and the first text that is not valid."""

    non_finite: int = 0
    not_text: str | None = None  # "field: not valid text (a lone surrogate at character N)"


def clean(value: Any, found: Found, path: str = "", depth: int = 0) -> Any:
    """`value` (parsed JSON) as the page may carry it: NON_FINITE and an int beyond the float range as None,
    a lone surrogate as U+FFFD (`found` counts both); TooDeep beyond MAX_DEPTH levels of nesting."""
    if depth > MAX_DEPTH:
        raise TooDeep(f"JSON nested deeper than {MAX_DEPTH} levels")
    if value is NON_FINITE:
        found.non_finite += 1
        return None
    if isinstance(value, str):
        if bad := logs.LONE_SURROGATE.search(value):
            at = f"{path}: " if path else ""
            found.not_text = (
                found.not_text or f"{at}not valid text (a lone surrogate at character {bad.start() + 1})"
            )
            return logs.LONE_SURROGATE.sub("\ufffd", value)
        return value
    inner = f"{path}." if path else ""
    if isinstance(value, dict):
        return {
            clean(k, found, path, depth): clean(v, found, f"{inner}{k}", depth + 1) for k, v in value.items()
        }
    if isinstance(value, list):
        return [clean(v, found, f"{inner}{i}", depth + 1) for i, v in enumerate(value)]
    return value


def number(value: object) -> float | None:
    """A finite number as JSON can carry it; anything else None (JSON has no NaN)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


def count(value: object) -> int | None:
    """A non-negative integer (a length, an index), or None."""
    return value if type(value) is int and 0 <= value < MAX_STEP else None


@dataclass
class Problems:
    """The notes the page lists at its top: at most MAX_PROBLEMS, the others counted."""

    notes: list[str] = field(default_factory=list)
    more: int = 0
    non_finite: dict[str, list[int]] = field(default_factory=dict)  # {file: [values, lines, first line]}

    def add(self, note: str) -> None:
        if len(self.notes) < MAX_PROBLEMS:
            self.notes.append(note)
        else:
            self.more += 1

    def listed(self) -> list[str]:
        notes = list(self.notes)
        for name, (values, lines, first) in self.non_finite.items():
            notes.append(
                f"{name}: {values:,} values on {lines:,} lines are NaN, Infinity or beyond the float range, "
                f"which JSON has not (written by an earlier version?), first at line {first}; shown as –"
            )
        return notes + ([f"and {self.more:,} more problems"] if self.more else [])


def open_run_file(path: Path) -> IO[bytes] | None:
    """`path` open for reading (None: absent); a ValueError saying why when it is a symbolic link (never
    followed: the report reads the run folder's own files) or no regular file (a FIFO would block)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if path.is_symlink():
            raise ValueError(
                "a symbolic link, not read (the report reads only the run folder's own files)"
            ) from e
        raise ValueError(f"unreadable ({e.strerror or e})") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError("not a regular file, not read")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def lines(f: IO[bytes]) -> Iterator[tuple[int, bytes | None]]:
    """(line number, the line's bytes) of `f`, None for a line longer than MAX_LINE_BYTES, which is skipped
    a chunk at a time, never held."""
    for number_ in range(1, 1 << 62):
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (chunk := f.readline(1 << 20)) and not chunk.endswith(b"\n"):
                pass
            raw = None
        yield number_, raw


def load_line(raw: bytes, name: str, number_: int, problems: Problems) -> Any:
    """A line's JSON, cleaned (`clean`), or None with its problem listed ('name:line: why')."""
    where = f"{name}:{number_}"
    try:
        found = Found()
        value, non_finite = parse_json(raw.decode("utf-8"))
        # NOTE: `clean` walks the whole value; a line that can hold nothing it replaces is taken as it is:
        # no NaN read, no surrogate escape (UTF-8 itself cannot hold one), fewer brackets than MAX_DEPTH
        escaped = b"\\ud" in raw or b"\\uD" in raw
        if non_finite or escaped or raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:
            value = clean(value, found)
    except UnicodeDecodeError:
        problems.add(f"{where}: not UTF-8")
        return None
    except (TooDeep, RecursionError):  # json's parser recurses once per '[' or '{'
        problems.add(f"{where}: JSON nested too deeply (more than {MAX_DEPTH} levels)")
        return None
    except ValueError:  # not JSON; an int of more than 4,300 digits
        if raw.strip():
            # NOTE: a live run's last line may be read while it is written: torn, no newline yet
            torn = " (a torn last line: a live run writing it?)" if not raw.endswith(b"\n") else ""
            problems.add(f"{where}: not JSON{torn}")
        return None
    if found.non_finite:
        values, lines_, first = problems.non_finite.get(name, [0, 0, number_])
        problems.non_finite[name] = [values + found.non_finite, lines_ + 1, first]
    if found.not_text:
        problems.add(f"{where}: {found.not_text}; shown with U+FFFD")
    return value


def read_jsonl(path: Path, problems: Problems, steps: set[int] | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, record) of each line of `path` that is a JSON object with an integer step in [0, 2**53)
    (absent file: nothing); with `steps`, only the lines of those steps (the others not parsed). Each damaged
    line adds 'name:line: why' to `problems`."""
    try:
        f = open_run_file(path)
    except ValueError as e:
        problems.add(f"{path.name}: {e}")
        return
    if f is None:
        return
    with f:
        for number_, raw in lines(f):
            if raw is None:
                problems.add(f"{path.name}:{number_}: longer than {MAX_LINE_BYTES >> 20} MB, not read")
                continue
            if steps is not None and (m := STEP_PREFIX.match(raw)) and int(m[1]) not in steps:
                continue
            if not raw.strip():
                continue
            record = load_line(raw, path.name, number_, problems)
            if record is None:
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if type(step) is not int or count(step) is None:
                why = "not a record with an integer step" if type(step) is not int else "a step out of range"
                problems.add(
                    f"{path.name}:{number_}: {why} (0 to 2**53)"
                    if type(step) is int
                    else f"{path.name}:{number_}: {why}"
                )
                continue
            if steps is None or record["step"] in steps:
                yield number_, record


def step_counts(path: Path, problems: Problems) -> dict[int, int]:
    """{step: rows} of rollouts.jsonl, read cheaply: the step from the line's start, a full parse only for a
    line that does not start as the trainer writes it (a damaged line counts nowhere: read_jsonl lists it).
    At most MAX_LOGGED_STEPS steps are counted."""
    counts: dict[int, int] = {}
    try:
        f = open_run_file(path)
    except ValueError:
        return counts  # read_jsonl says why
    if f is None:
        return counts
    with f:
        for _, raw in lines(f):
            if raw is None:
                continue
            if m := STEP_PREFIX.match(raw):
                step = int(m[1])
            else:
                record = load_line(raw, path.name, 0, Problems())  # read_jsonl lists its problems
                step = count(record.get("step")) if isinstance(record, dict) else None
                if step is None:
                    continue
            if step in counts or len(counts) < MAX_LOGGED_STEPS:
                counts[step] = counts.get(step, 0) + 1
    if len(counts) == MAX_LOGGED_STEPS:
        problems.add(f"{path.name}: more than {MAX_LOGGED_STEPS:,} logged steps; the later ones are left out")
    return counts


def read_run_json(run_dir: Path, problems: Problems) -> dict:
    """run.json as a dict ({} when absent or damaged, which `problems` then says)."""
    try:
        f = open_run_file(run_dir / "run.json")
    except ValueError as e:
        problems.add(f"run.json: {e}")
        return {}
    if f is None:
        problems.add("run.json: absent (a run folder from an earlier version?): settings unknown")
        return {}
    with f:
        raw = f.read(MAX_LINE_BYTES + 1)
    if len(raw) > MAX_LINE_BYTES:
        problems.add(f"run.json: longer than {MAX_LINE_BYTES >> 20} MB, not read")
        return {}
    record = load_line(raw + b"\n", "run.json", 1, problems)
    if record is not None and not isinstance(record, dict):
        problems.add("run.json: not a JSON object")
    return record if isinstance(record, dict) else {}


@dataclass
class Thinned:
    """At most `cap` of the items added, evenly spread: every `stride`-th, the stride doubled when full."""

    cap: int
    items: list = field(default_factory=list)
    stride: int = 1
    seen: int = 0

    def add(self, item: Any) -> None:
        if self.seen % self.stride == 0:
            self.items.append(item)
            if len(self.items) > self.cap:
                self.items, self.stride = self.items[::2], self.stride * 2
        self.seen += 1
