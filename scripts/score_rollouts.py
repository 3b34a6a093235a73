"""Score rollouts produced elsewhere: rewards and group advantages exactly as training computes them.

    python scripts/mock_rollouts.py --write-prompts 4 --prompts runs/mock/prompts.jsonl \\
        --output runs/mock/rollouts.jsonl
    python scripts/score_rollouts.py --rollouts runs/mock/rollouts.jsonl \\
        --prompts runs/mock/prompts.jsonl
    python scripts/score_rollouts.py --rollouts r.jsonl --prompts p.jsonl \\
        --reward label format my_rm.py:score --gate format --group-size 8 --output scored.jsonl

Input: one candidate per line, `{"step", "prompt_id", "group_id", "text", "meta"}` (only `prompt_id` and
`text` are required), with G lines sharing a prompt_id; and a prompts JSONL holding each prompt's ground
truth (`label`, `answer`, `bbox`, ...) under its `prompt_id`. The prompt record is the `sample` the reward
functions see.

Output (`--output`, default `<rollouts stem>.scored.jsonl`): every scored line as it came in, plus `reward`
(`total`, `components`: every reward unweighted, `gate_failed`: gate name -> failed) and `advantage`.
Lines that cannot be scored are left out of it and listed in the report. Report (`<output stem>.report.json`):
counts, mean reward, per-component means, gate failure counts, fraction of zero-std groups, groups whose
size is not G, and the bad lines with their line numbers and reasons. Both files are written atomically.

Choices:
- Groups are keyed by (step, prompt_id) when a line has `step`, else by prompt_id. Advantages are
  `grpo.group_advantages` (scale "group", as trainer.py's default) called once per group with
  group_size = len(group), so groups of unequal size are still normalised within themselves.
- NOTE: a group of one (no baseline to compare with) gets advantage 0.0; it is counted in
  `singleton_groups`, listed among the wrong-size groups, and counts as zero-std (it carries no signal).
- G is --group-size, else the most common group size (ties: the larger).
- Bad lines (blank lines are skipped, not bad): not UTF-8, invalid JSON (nested too deeply, an integer of
  more than 4,300 digits: the file is read line by line), not an object, missing prompt_id, unknown
  prompt_id, `text` not a string, a `step` that is neither an integer nor a string (it keys the group), and
  a reward raising ValueError/KeyError on the line (e.g. ground truth missing from its prompt). They never
  stop the other lines from being scored. NaN or Infinity in a line (another tool wrote them) is read; the
  output is strict JSON (logs.json_line: such a value as null, named in the line's `non_finite`).
- A malformed prompts file (invalid JSON, missing or repeated prompt_id) is an error: it is the ground truth.
- Cache: every reward value is stored in an sqlite file (`--cache`, default `reward_cache.sqlite` next to
  the output) under a hash of (reward name, prompt_id, text, the prompt record), so a rerun calls no reward
  function, and a changed ground truth is not served stale values. A changed plug-in is not detected:
  delete the cache file. Rewards that need token counts (`completion_length`) are not supported here.
- Cache errors are the cache's: an sqlite error (not a database, locked by another program) or a stored
  value that is not a number names --cache, never the reward being computed when it happens.
- Errors: a missing file, a malformed prompts line, a reward that cannot be loaded, an unreadable cache or a
  bad flag print one line `error: ...` naming the flag or file:line and exit with status 2 (cli.py). So does
  a run that scores no line, or finds more than half of its lines bad: it writes nothing (a previous output
  is kept) and prints every bad line, then the count and the first reasons.
- Outputs (scripts/outputs.py): --output, --report or --cache over an input (or over each other) is refused;
  one process at a time per output (`.<name>.lock` beside each); an output location that cannot be written
  is found before any reward is computed: one line `error: cannot write ...`, status 74.
- Only its own output is replaced: the report names the script and records the SHA-256 of the output it goes
  with; an existing --output that no report of this script records (a file of yours, another script's, one
  you edited), or an existing --report it did not write, is refused before any reward is computed, left as
  it is, unless --overwrite. A symbolic link is never written through (--overwrite replaces the link of
  --output or --report itself; --cache may not be one), and a FIFO is never opened.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import math
import numbers
import os
import signal
import sqlite3
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # NOTE: a Ctrl-C while torch imports (~2 s) exits 130, with no traceback
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo
import rewards
from grpo_vlm import cli, logs, scoring
from scripts import outputs

PRODUCER = (
    "score_rollouts.py"  # named in the report, with the SHA-256 of the output: it replaces only its own
)


@dataclass
class Args:
    rollouts: str
    """Rollouts JSONL: one candidate per line with prompt_id and text (step, group_id, meta optional)."""
    prompts: str
    """Prompts JSONL: one prompt per line with prompt_id and its ground truth (label / answer / bbox)."""
    output: str | None = None
    """Scored rollouts JSONL. Default: <rollouts stem>.scored.jsonl next to the rollouts."""
    report: str | None = None
    """Report JSON. Default: <output stem>.report.json."""
    cache: str | None = None
    """Reward cache (sqlite). Default: reward_cache.sqlite next to the output."""
    group_size: int | None = None
    """G, the expected group size. Default: the most common group size."""
    reward: tuple[str, ...] = ()
    """Reward names or plug-ins 'module:function'. Default: label format if every prompt has a label,
    else answer_match if every prompt has an answer."""
    reward_weight: tuple[float, ...] = ()
    """One weight per --reward (default 1.0 each)."""
    gate: tuple[str, ...] = ()
    """Rewards (from --reward) that zero the total when they fail, e.g. format."""
    overwrite: bool = False
    """Replace an existing --output and --report this script did not write (a link: the link itself)."""


# --------------------------------------------------------------------------------------------------
# Reading


class Unreadable(str):
    """Why a line holds no JSON."""


def json_lines(path: str) -> Iterator[tuple[int, object]]:
    """(line number, the line's JSON or why it has none: `Unreadable`) of each non-blank line, read one line
    at a time: a byte that is not UTF-8, JSON nested too deeply or an integer of more than 4,300 digits
    spoils its own line only."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield lineno, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield lineno, Unreadable(f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
            except json.JSONDecodeError as e:
                yield lineno, Unreadable(f"invalid JSON ({e.msg} at column {e.colno})")
            except RecursionError:  # json's parser recurses once per '[' or '{'
                yield lineno, Unreadable("JSON nested too deeply")
            except ValueError as e:  # an integer of more than 4,300 digits
                yield lineno, Unreadable(str(e))


def read_prompts(path: str) -> dict[str, dict]:
    """prompt_id -> prompt record; any problem is an error naming file:line."""
    prompts = {}
    for lineno, record in json_lines(path):
        where = f"{path}:{lineno}"
        if isinstance(record, Unreadable):
            raise cli.UsageError(f"{where}: {record}")
        if not isinstance(record, dict) or "prompt_id" not in record:
            raise cli.UsageError(f"{where}: a prompt must be an object with a prompt_id")
        pid = str(record["prompt_id"])
        if pid in prompts:
            raise cli.UsageError(f"{where}: prompt_id {pid!r} appears twice")
        prompts[pid] = record
    return prompts


def parse_rollouts(path: str, prompts: dict[str, dict]) -> tuple[list[tuple[int, dict]], list[dict], int]:
    """(line number, record) of the usable lines, the bad lines {line, reason}, the non-blank line count."""
    good, bad, n_lines = [], [], 0
    for lineno, record in json_lines(path):
        n_lines += 1
        if isinstance(record, Unreadable):
            bad.append({"line": lineno, "reason": str(record)})
            continue
        reason = _problem(record, prompts)
        if reason:
            bad.append({"line": lineno, "reason": reason})
        else:
            good.append((lineno, record))
    return good, bad, n_lines


def _problem(record, prompts: dict[str, dict]) -> str | None:
    if not isinstance(record, dict):
        return f"not a JSON object ({type(record).__name__})"
    if "prompt_id" not in record:
        return "missing prompt_id"
    if str(record["prompt_id"]) not in prompts:
        return f"unknown prompt_id {record['prompt_id']!r}"
    if not isinstance(record.get("text"), str):
        return "text missing or not a string"
    step = record.get("step")  # NOTE: part of the group's key: a list or NaN would group nothing
    if step is not None and type(step) is not int and not isinstance(step, str):
        return f"step must be an integer or a string, got {type(step).__name__} {str(step)[:40]}"
    return None


def default_rewards(prompts: dict[str, dict]) -> tuple[str, ...]:
    if prompts and all("label" in p for p in prompts.values()):
        return ("label", "format")
    if prompts and all("answer" in p for p in prompts.values()):
        return ("answer_match",)
    raise cli.UsageError(
        "--reward: no default fits these prompts (not all have a label, nor all an answer); pass --reward"
    )


# --------------------------------------------------------------------------------------------------
# Reward cache


@contextlib.contextmanager
def cache_errors(path: Path):
    """An sqlite error (another file at that path, "database is locked" by another program, a full disk) is
    the cache's, named as such: never blamed on the reward being computed when it happens."""
    try:
        yield
    except sqlite3.Error as e:
        if getattr(e, "sqlite_errorname", "").startswith(("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_READONLY")):
            raise cli.WriteFailed(f"cannot write {path}: {e}") from e  # a full disk: status 74, as any output
        fix = "wait for the program that holds it" if "locked" in str(e) else "delete it to start afresh"
        raise cli.UsageError(f"--cache {path}: {e} (the reward cache); {fix}, or pass another --cache") from e


def open_cache(path: Path) -> sqlite3.Connection:
    with cache_errors(path):
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE IF NOT EXISTS reward (key TEXT PRIMARY KEY, value REAL NOT NULL)")
    return conn


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def cached(reward: rewards.Reward, conn: sqlite3.Connection, stats: collections.Counter, path: Path):
    """The same reward, its function answered from the cache when (name, prompt, text) was seen before."""

    def fn(completion: str, sample: dict) -> float:
        prompt = json.dumps(sample, sort_keys=True, ensure_ascii=False)
        key = hashlib.sha256(json.dumps([reward.name, prompt, completion]).encode()).hexdigest()
        with cache_errors(path):
            row = conn.execute("SELECT value FROM reward WHERE key = ?", (key,)).fetchone()
        if row is not None:
            # NOTE: sqlite keeps whatever was put in a REAL column; a poisoned row is the cache's fault.
            cli.check(
                is_number(row[0]),
                f"--cache {path}",
                f"holds {row[0]!r} for reward {reward.name!r}, not a "
                "number; delete the file (it is rebuilt) or pass another --cache",
            )
            stats["hits"] += 1
            return row[0]
        stats["misses"] += 1
        value = reward.fn(completion, sample)
        if is_number(value):  # anything else is passed on for scoring.score to reject
            with cache_errors(path):
                conn.execute("INSERT OR REPLACE INTO reward VALUES (?, ?)", (key, float(value)))
        return value

    return dataclasses.replace(reward, fn=fn)


# --------------------------------------------------------------------------------------------------
# Scoring, advantages, report


def score_lines(good, prompts, reward_fns) -> tuple[list[tuple[int, dict]], list[dict]]:
    """Each usable line with its `reward` added, and the lines on which a reward raised (as bad lines)."""
    scored, bad = [], []
    for lineno, record in good:
        sample = prompts[str(record["prompt_id"])]
        try:
            s = scoring.score([record["text"]], [sample], reward_fns)
        except cli.UsageError:  # the cache's, not the line's
            raise
        except (ValueError, KeyError) as e:
            bad.append({"line": lineno, "reason": f"reward failed: {type(e).__name__}: {e}"})
            continue
        reward = {
            "total": s.total[0],
            "components": {name: values[0] for name, values in s.components.items()},
            "gate_failed": {name: failed[0] for name, failed in s.gate_failed.items()},
        }
        scored.append((lineno, {**record, "reward": reward}))
    return scored, bad


def group_key(record: dict) -> tuple:
    return (record.get("step"), str(record["prompt_id"]))


def add_advantages(records: list[dict]) -> dict[tuple, list[int]]:
    """Set each record's `advantage` within its group; return group key -> row indices."""
    groups = collections.defaultdict(list)
    for i, record in enumerate(records):
        groups[group_key(record)].append(i)
    for rows in groups.values():
        if len(rows) == 1:  # NOTE: no baseline for a lone candidate; group_advantages rejects G = 1
            records[rows[0]]["advantage"] = 0.0
            continue
        totals = torch.tensor([records[i]["reward"]["total"] for i in rows])  # float32, as trainer.py
        for i, adv in zip(rows, grpo.group_advantages(totals, len(rows)).tolist()):
            records[i]["advantage"] = adv
    return dict(groups)


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def build_report(records, groups, bad, n_lines, group_size: int | None, cache_stats) -> dict:
    sizes = collections.Counter(len(rows) for rows in groups.values())
    # Most common size; ties go to the larger size.
    G = group_size or (max(sizes, key=lambda n: (sizes[n], n)) if sizes else None)
    totals = [r["reward"]["total"] for r in records]
    names = list(records[0]["reward"]["components"]) if records else []
    gates = list(records[0]["reward"]["gate_failed"]) if records else []
    zero_std = [len({totals[i] for i in rows}) == 1 for rows in groups.values()]
    return {
        "counts": {"lines": n_lines, "scored": len(records), "bad": len(bad), "groups": len(groups)},
        "group_size": G,
        "reward_mean": _mean(totals),
        "component_means": {n: _mean([r["reward"]["components"][n] for r in records]) for n in names},
        "gate_failures": {g: sum(r["reward"]["gate_failed"][g] for r in records) for g in gates},
        "frac_zero_std_groups": _mean(zero_std),
        "singleton_groups": sizes.get(1, 0),
        "wrong_size_groups": [
            {"step": key[0], "prompt_id": key[1], "size": len(rows)}
            for key, rows in groups.items()
            if len(rows) != G
        ],
        "bad_lines": sorted(bad, key=lambda b: b["line"]),
        "cache": dict(cache_stats),
    }


def output_paths(args: Args) -> tuple[Path, Path, Path]:
    rollouts = Path(args.rollouts)
    output = Path(args.output) if args.output else rollouts.with_suffix(".scored.jsonl")
    report = Path(args.report) if args.report else output.with_suffix(".report.json")
    cache = Path(args.cache) if args.cache else output.parent / "reward_cache.sqlite"
    return output, report, cache


def check_args(args: Args) -> tuple[Path, Path, Path]:
    """Input files exist, outputs are not folders, --group-size is a group; return (output, report, cache)."""
    for flag, path in (("--rollouts", args.rollouts), ("--prompts", args.prompts)):
        cli.check(Path(path).is_file(), flag, f"{path} does not exist (or is not a file)")
    G = args.group_size
    cli.check(G is None or G >= 2, "--group-size", f"must be >= 2 (a group needs a baseline), got {G}")
    paths = output_paths(args)
    for flag, path in zip(("--output", "--report", "--cache"), paths):
        cli.check(not path.is_dir(), flag, f"{path} is a folder; give a file")
    outputs.refuse_overwriting_inputs(
        dict(zip(("--output", "--report", "--cache"), ([p] for p in paths))),
        {
            "--rollouts": [args.rollouts],
            "--prompts": [args.prompts],
            "--reward": outputs.plugin_files(args.reward),
        },
    )
    check_own_outputs(*paths, args.overwrite)
    return paths


def check_own_outputs(output: Path, report: Path, cache: Path, overwrite: bool) -> None:
    """Unless --overwrite: an existing --report must be one this script wrote, and an existing --output the
    file that report records (its SHA-256): anything else, a user's file or another script's, is left as it is
    and refused (cli.UsageError). No symbolic link is followed, the cache's never (sqlite would write through
    it), and no FIFO opened."""
    outputs.check_output_file(output, "--output", overwrite)
    outputs.check_output_file(report, "--report", overwrite)
    outputs.check_output_file(cache, "--cache", None)
    if overwrite:
        return
    record = None
    if report.exists():
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(report.read_text(encoding="utf-8"))
        if not (isinstance(record, dict) and record.get("script") == PRODUCER):
            raise cli.UsageError(
                f"--report {report} exists and was not written by {PRODUCER}; it is left as it is: pass "
                "--overwrite to replace it, or choose another --report"
            )
    if output.exists() and (record is None or record.get("output_sha256") != sha256_of(output)):
        raise cli.UsageError(
            f"--output {output} exists and was not written by {PRODUCER} (its report {report} does not "
            "record it); it is left as it is: pass --overwrite to replace it, or choose another --output"
        )


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def reward_functions(args: Args, prompts: dict[str, dict]) -> list[rewards.Reward]:
    """--reward (or the prompts' default), --reward-weight and --gate; a mistake in them is a UsageError."""
    with cli.user_errors():
        return scoring.rewards_from_flags(
            args.reward or default_rewards(prompts), args.reward_weight, args.gate
        )


def score(args: Args, output: Path, report_path: Path, cache_path: Path) -> dict:
    with cli.user_errors("--prompts: "):  # unreadable or not UTF-8
        prompts = read_prompts(args.prompts)
    reward_fns = reward_functions(args, prompts)
    with cli.user_errors("--rollouts: "):
        good, bad, n_lines = parse_rollouts(args.rollouts, prompts)
    conn, cache_stats = open_cache(cache_path), collections.Counter(hits=0, misses=0)
    fns = [cached(r, conn, cache_stats, cache_path) for r in reward_fns]
    try:
        scored, reward_bad = score_lines(good, prompts, fns)
    finally:  # the values computed so far are kept, after a stop too: a rerun does not compute them again
        with cache_errors(cache_path):
            conn.commit()
        conn.close()
    records = [record for _, record in scored]
    groups = add_advantages(records)
    report = build_report(records, groups, bad + reward_bad, n_lines, args.group_size, cache_stats)
    for b in report["bad_lines"]:
        print(f"{args.rollouts}:{b['line']}: {b['reason']}", file=sys.stderr)
    check_mostly_scored(report, args.rollouts)
    text = "".join(logs.json_line(r) + "\n" for r in records)  # strict JSON: a NaN in "meta" as null
    # The report records the output it goes with: a rerun replaces only that file (check_own_outputs).
    report.update(script=PRODUCER, output_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())
    with cli.writing(output):
        outputs.write_text_atomic(output, text)
    with cli.writing(report_path):
        outputs.write_json_atomic(report_path, report)
    brief = {k: report[k] for k in ("counts", "reward_mean", "component_means", "frac_zero_std_groups")}
    print(json.dumps({**brief, "cache": report["cache"]}, ensure_ascii=False))
    print(f"wrote {output} and {report_path}")
    return report


def check_mostly_scored(report: dict, rollouts: str) -> None:
    """Scoring nothing, or more than half of the lines bad, is a failure, not a success: cli.UsageError
    (status 2) with the count and the first reasons, and no output is written (a previous one is kept)."""
    counts, bad = report["counts"], report["bad_lines"]
    if counts["scored"] and counts["bad"] <= counts["lines"] / 2:
        return
    reasons = list(dict.fromkeys(b["reason"] for b in bad))[:2]  # the first two different ones
    first = f"first: {'; '.join(reasons)}" if reasons else "the file holds no lines"
    raise cli.UsageError(
        f"--rollouts {rollouts}: {counts['scored']} of {counts['lines']} lines scored, {counts['bad']} bad "
        f"({first}); nothing written" + (" (every bad line is printed above)" if bad else "")
    )


def main(args: Args) -> dict:
    """Score --rollouts into --output and --report. A bad flag, an output that is an input, an output
    another process writes or that cannot be written is refused before any reward is computed."""
    paths = check_args(args)
    claims = dict(zip(("--output", "--report", "--cache"), ([p] for p in paths)))
    with cli.signals(), outputs.claimed(claims):
        try:
            return score(args, *paths)
        except cli.Stopped:
            raise cli.Stopped(
                f"stopped; no output was written (the rewards computed so far are kept in {paths[2]}, so the "
                "same command does not compute them again)"
            ) from None


if __name__ == "__main__":
    cli.run(main, tyro.cli(Args))
