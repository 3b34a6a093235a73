"""The run report: one self-contained HTML file that shows a run folder, built from the files the run keeps
(the data contract: run.json, metrics.jsonl, timings.jsonl, rollouts.jsonl, eval_samples.jsonl, thumbs/).

    python -m grpo_vlm.report runs/grpo                  # writes ./report-grpo.html and prints its path
    python -m grpo_vlm.report runs/grpo --out runs/grpo/report.html

It shows the run (each start's command line, settings as flags, model, data, time, progress), the curves,
the rollouts of every logged step (each group's images, prompt, target and G completions with reward,
components, advantage, length, truncation; boxes drawn on grounding samples; each tool call's turn) with
filters and a text search, and the held-out samples of the first and the latest evaluation side by side.
The trainer writes RUN_DIR/report.html at each checkpoint and at the end (trainer.py).

Legend: `G` completions per prompt (a group), a row is one completion; a group's reward spread is zero when
its G rewards are equal (every advantage is 0: no learning signal).

Choices:
- Read-only: the report opens the run's files for reading only and never takes the folder's lock, so a live
  run goes on undisturbed and any run folder can be shown (a finished one, one being written, one from an
  earlier version without thumbs/ or eval_samples.jsonl). The command writes only its output file: a file
  it wrote before, or a new one (`check_out`); never a file of the run folder but its report.html.
- A run folder is data from anyone: what cannot be read is said where it would show, never raised. Its
  files are read by run_reader.py (lines of at most 16 MB, nesting, NaN and Infinity as null shown as "–",
  a lone surrogate as U+FFFD, no file through a symbolic link: images only from the run folder's own
  thumbs/ directory); every field the page reads is given its type here (`box`, `size`, `turns_view`, ...):
  a malformed one is left out and listed, the page's script never meets it.
- Self-contained: the data is one JSON blob in a <script type="application/json"> ('<' written as \\u003c,
  so no text can close the element); each image file is embedded once, as a base64 data: URI referenced by
  number, and texts that repeat (prompts, completions) are stored once. The CSS and JS are inline, written
  by hand (report.css, report.js beside this module); the page builds its DOM from the data, text through
  textContent only. The Content-Security-Policy runs only the page's own two scripts and style (by their
  SHA-256), data: images and nothing else: no network, and an injected script would not run even if
  escaping ever failed.
- Charts are matplotlib PNGs: logs.curves_figure (reward, held-out accuracy, KL: the figure of curves.png),
  and small multiples of MAX_PANELS more metrics (the trainer's own first, PANEL_FIRST), shown on demand;
  the other metrics are a table (count, range, last value). PNG rather than SVG: its size does not grow with
  the number of steps. A metric with fewer than MIN_CHART_POINTS values is a table of them instead (and
  costs no drawing: a short run's report is quick to build). Names are drawn as text (no mathtext: `$`).
- Bounded whatever the folder holds (docs/report.md gives the figures and how they were measured): at most
  MAX_CURVE_LINES metrics lines kept for the curves (evenly thinned beyond) and MAX_METRIC_KEYS metric
  names; at most MAX_STEPS logged steps of rollouts and MAX_ROWS rows (MAX_STEP_ROWS of one step), spread
  evenly over the run with the first and last included (the page names the steps left out); texts cut at
  MAX_TEXT characters, MAX_TEXTS_CHARS in all; images at most MAX_IMAGE_BYTES each and MAX_IMAGES_BYTES in
  all (beyond, a placeholder says so); MAX_PAIRS held-out samples; lists and objects of a record at most
  MAX_ITEMS entries (MAX_BOXES boxes). The report of the default 100-step run (B = 16, G = 8, every step
  logged, 860 distinct 56-px pictures) is 5.7 MB.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import io
import json
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from grpo_vlm import cli, files, logs
from grpo_vlm.run_reader import (
    MAX_STEP,
    Problems,
    Thinned,
    count,
    number,
    open_run_file,
    read_jsonl,
    read_run_json,
    step_counts,
)

MAX_STEPS = 200  # logged steps of rollouts in one report
MAX_ROWS = 32_000  # rows (completions) of rollouts in one report: 200 steps of B = 16 x G = 10
MAX_STEP_ROWS = 4_096  # rows of one step (B = 256 x G = 16): the page draws a step's rows at once
MAX_TEXT = 4_000  # characters of one prompt, completion or target field
MAX_TEXTS_CHARS = 16_000_000  # characters of every text together
MAX_IMAGE_BYTES = 4 << 20  # one image file: a -seen image is at most 1536 px, far below
MAX_IMAGES_BYTES = 64 << 20  # every image file together
MAX_ITEMS = 16  # entries kept of a record's lists and objects (images, turns, crops, a target's fields)
MAX_BOXES = 64  # boxes kept of one completion or target
MAX_CURVE_LINES = 10_000  # metrics lines kept for the curves (and as many evaluation lines)
MAX_METRIC_KEYS = 5_000  # distinct metric names
MAX_PANELS = 24  # small multiples besides the main figure
MAX_PAIRS = 2_000  # held-out samples shown before / after
MIN_CHART_POINTS = 10  # fewer values: a table says more than a chart
THUMB_NAME = re.compile(r"thumbs/([A-Za-z0-9_.-]+\.jpe?g)")  # the contract's names; nothing outside thumbs/
CHART_KEYS = ("reward/mean", "eval/accuracy", "kl")  # the panels of logs.curves_figure
PASS_AT_K = re.compile(r"eval/pass@([1-9][0-9]{0,3})")  # --eval-num-samples n: eval/pass@1 .. eval/pass@n
MAX_PASS_CURVES = 8  # evaluations drawn on the pass@k chart: the first, the last and evenly between
# The trainer's metrics a person asks for first (metrics.jsonl's order of importance); then the others in
# the order they first appear.
PANEL_FIRST = (
    "loss",
    "grad_norm",
    "entropy",
    "reward/std",
    "frac_correct",
    "frac_zero_std_groups",
    "completion_length/mean",
    "frac_truncated",
    "clip_frac_low",
    "clip_frac_high",
    "ratio_mean",
    "eval/reward",
    "beta",
    "lr",
    "completion_length/max",
    "frac_empty",
    "completion_length/correct",
    "completion_length/incorrect",
    "tools/calls",
    "tools/errors",
)
# the settings that say which data the run trained on, shown in the report's header
DATA_FLAGS = ("--task", "--data", "--eval-data", "--train-size", "--eval-size")
GENERATOR = '<meta name=generator content="grpo_vlm.report">'  # how `check_out` knows a report it wrote
ASSETS = Path(__file__).parent
# Every error of the page's scripts: listed in the visible #errors, counted in <body data-errors>.
ERROR_HOOK = """window.reportErrors = [];
function reportError(message) {
  reportErrors.push(message);
  const box = document.getElementById("errors");
  if (box) { box.hidden = false; box.textContent = "Errors on this page: " + reportErrors.join(" | "); }
  if (document.body) document.body.dataset.errors = reportErrors.length;
}
addEventListener("error", e => reportError(`${e.message} (line ${e.lineno})`));
addEventListener("unhandledrejection", e => reportError(String(e.reason)));
addEventListener("securitypolicyviolation", e => reportError(`blocked: ${e.violatedDirective}`));
"""


# --- Values as the page takes them: JSON without NaN, text UTF-8 can hold, each field of its type --------


def shown_path(path: str | os.PathLike) -> str:
    """A file system path as text the page can hold (a byte that is not UTF-8 as U+FFFD)."""
    return os.fsencode(path).decode("utf-8", "replace")


def cut(text: object, limit: int = MAX_TEXT) -> str:
    """A text as the page shows it: at most `limit` characters, the rest counted; a value that is no text
    as its JSON (itself cut: a 1 MB target is never written whole first)."""
    if not isinstance(text, str):
        text = json.dumps(short_value(text), ensure_ascii=False)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit:,} more characters in the run's file]"


def short_value(value: Any, budget: list[int] | None = None) -> Any:
    """`value` with at most MAX_ITEMS entries in each list or object and MAX_TEXT characters of text in all
    (what is left out counted in place), for a JSON text that stays short whatever the value."""
    budget = [MAX_TEXT] if budget is None else budget
    if isinstance(value, str):
        kept = value[: max(budget[0], 0)]
        budget[0] -= len(kept)
        return kept if len(kept) == len(value) else f"{kept}… [{len(value) - len(kept):,} more characters]"
    if isinstance(value, dict):
        items = list(value.items())
        shown = {
            short_value(k, budget): short_value(v, budget) for k, v in items[:MAX_ITEMS] if budget[0] > 0
        }
        return shown | ({"…": f"{len(items) - len(shown)} more"} if len(shown) < len(items) else {})
    if isinstance(value, list):
        shown = [short_value(v, budget) for v in value[:MAX_ITEMS] if budget[0] > 0]
        return shown + ([f"… {len(value) - len(shown)} more"] if len(shown) < len(value) else [])
    return value


def box(value: object) -> list[float] | None:
    """[x1, y1, x2, y2] of finite numbers, or None."""
    if isinstance(value, list) and len(value) == 4 and all(number(v) is not None for v in value):
        return value
    return None


def size(value: object) -> list[int] | None:
    """[width, height] of positive integers (an image's size), or None."""
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(type(v) is int and 0 < v < MAX_STEP for v in value)
    ):
        return value
    return None


def boxes(value: object) -> list[list[float]] | None:
    """A list of boxes (at most MAX_BOXES; those that are no box left out), or None when no list."""
    if not isinstance(value, list):
        return None
    return [b for b in map(box, value[:MAX_BOXES]) if b is not None]


def target_view(target: object, texts: Texts) -> dict | None:
    """A sample's target as the page shows it: at most MAX_ITEMS fields, each a text (`Texts.inline`), a
    number, or the boxes the page draws (`bbox` a box, `boxes` a list of them); anything else as its JSON."""
    if not isinstance(target, dict):
        return None
    shown = {}
    for key, value in list(target.items())[:MAX_ITEMS]:
        drawn = key == "bbox" and box(value) is not None or key == "boxes" and boxes(value) == value
        plain = value is None or isinstance(value, bool) or number(value) is not None
        shown[cut(key, 200)] = value if drawn or plain else texts.inline(value)
    return shown


def reward_values(rewards: object) -> dict[str, float | None]:
    """{component: value} of a record's "rewards" (at most MAX_ITEMS), each a finite number or None."""
    if not isinstance(rewards, dict):
        return {}
    return {cut(k, 200): number(v) for k, v in list(rewards.items())[:MAX_ITEMS]}


def flat_settings(settings: dict, depth: int = 0) -> dict:
    """run.json's nested "args" -> {"--flag-name": value}, groups flattened as the command's flags are."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict) and depth < 4:
            flat.update(flat_settings(value, depth + 1))
        else:
            flat["--" + cut(key, 200).replace("_", "-")] = value
    return flat


def shown_values(values: dict, limit: int = 500) -> dict:
    """{name: value} as the page lists it (settings, a metrics line): at most `limit`, each value's JSON at
    most MAX_TEXT characters (else that JSON, cut)."""
    shown = {}
    for key, value in list(values.items())[:limit]:
        short = json.dumps(value, ensure_ascii=False) if not isinstance(value, str | int | float) else value
        shown[cut(key, 200)] = value if len(str(short)) <= MAX_TEXT else cut(value)
    return shown


# --- Tables the data refers into: each text and each image once ---------------------------------------------


@dataclass
class Texts:
    """Each distinct text once; the rows refer to it by number (completions and prompts repeat). At most
    MAX_TEXTS_CHARS characters in all: past them, a text is a note saying so."""

    items: list[str] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    chars: int = 0

    def add(self, text: object) -> int:
        """The number of `text` (cut) in the table, added once."""
        text = cut(text)
        if text not in self.index:
            text = self.inline(text)
            self.index.setdefault(text, len(self.items))
            if self.index[text] == len(self.items):
                self.items.append(text)
        return self.index[text]

    def inline(self, text: object, limit: int = MAX_TEXT) -> str:
        """`text` cut for a field the page shows where it stands (a target's, a tool call's), counted."""
        text = cut(text, limit)
        if self.chars + len(text) > MAX_TEXTS_CHARS:
            return f"[not in this report: its {MAX_TEXTS_CHARS:,} characters of text are spent]"
        self.chars += len(text)
        return text


@dataclass
class Images:
    """The run's image files, each embedded once as a data: URI; `add` returns its number, or why not. Read
    only from `run_dir`'s own thumbs/ directory, never through a link (thumbs/ itself or a file in it)."""

    run_dir: Path
    uris: list[str] = field(default_factory=list)
    by_path: dict[str, int | str] = field(default_factory=dict)
    total: int = 0
    missing: int = 0
    folder: int | str | None = None  # thumbs/'s descriptor once opened, or why it cannot be

    def add(self, name: object) -> int | str:
        if not isinstance(name, str) or not (m := THUMB_NAME.fullmatch(name)):
            return f"not an image of thumbs/: {cut(name, 80)}"
        if name not in self.by_path:
            self.by_path[name] = self.read(name, m[1])
            self.missing += isinstance(self.by_path[name], str)
        return self.by_path[name]

    def thumbs(self) -> int | str:
        """thumbs/ opened as a directory without following a link, or why not."""
        if self.folder is None:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                self.folder = os.open(self.run_dir / "thumbs", flags)
            except OSError as e:
                link = (self.run_dir / "thumbs").is_symlink()
                self.folder = (
                    "thumbs/ is a symbolic link, not read" if link else f"thumbs/: {e.strerror or e}"
                )
        return self.folder

    def read(self, name: str, file_name: str) -> int | str:
        if isinstance(folder := self.thumbs(), str):
            return f"{name}: not read ({folder})" if "link" in folder else f"{name}: missing"
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(file_name, flags, dir_fd=folder)
        except FileNotFoundError:
            return f"{name}: missing"
        except OSError as e:
            return (
                f"{name}: a symbolic link, not read"
                if e.errno == 40
                else f"{name}: unreadable ({e.strerror})"
            )
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return f"{name}: not a regular file"
            if info.st_size > MAX_IMAGE_BYTES:
                return f"{name}: {info.st_size:,} bytes, more than an image of the report may take"
            if self.total + info.st_size > MAX_IMAGES_BYTES:
                return f"{name}: not embedded (the report's {MAX_IMAGES_BYTES >> 20} MB for images is spent)"
            content = f.read(MAX_IMAGE_BYTES + 1)
        if not content.startswith(b"\xff\xd8\xff") or len(content) > MAX_IMAGE_BYTES:
            return f"{name}: not a JPEG file"
        self.total += len(content)
        self.uris.append("data:image/jpeg;base64," + base64.b64encode(content).decode("ascii"))
        return len(self.uris) - 1

    def close(self) -> None:
        if isinstance(self.folder, int):
            os.close(self.folder)


def image_entries(record: dict, images: Images) -> list[dict]:
    """The page's view of a record's images: {"ref": the name rollouts.jsonl gives, "t": thumbnail, "s": the
    image as the model saw it (each a number into the images, or absent), "size", "seen", "why": what is
    missing}."""
    refs = record.get("images") if isinstance(record.get("images"), list) else []
    thumbs = record.get("thumbs")
    if not isinstance(thumbs, list):
        return [{"ref": cut(ref, 500), "why": "not kept by this run"} for ref in refs[:MAX_ITEMS]]
    entries = []
    for i, thumb in enumerate(thumbs[:MAX_ITEMS]):
        entry = {"ref": cut(refs[i], 500) if i < len(refs) else ""}
        thumb = thumb if isinstance(thumb, dict) else {"error": f"not a thumbnail record: {cut(thumb, 200)}"}
        if "error" in thumb:
            entries.append(entry | {"why": f"not kept: {cut(thumb['error'], 500)}"})
            continue
        for key, name in (("t", "thumb"), ("s", "seen")):
            if name == "seen" and thumb.get("seen", "") is None:  # the run's budget left it out: no problem
                entry[key] = None
                continue
            number_ = images.add(thumb.get(name))
            entry[key] = number_ if isinstance(number_, int) else None
            if isinstance(number_, str):
                entry.setdefault("why", number_)
        entry["size"], entry["seen"] = size(thumb.get("size")), size(thumb.get("seen_size"))
        entries.append(entry)
    return entries


def call_shape(call: object) -> str | None:
    """What is wrong with a tool call record's shape (None: nothing): the page reads an object whose
    "images" is a list of {"crop": [x1, y1, x2, y2] or null, "size", "thumb"}."""
    if not isinstance(call, dict):
        return f"not an object: {cut(call, 80)}"
    returned = call.get("images", [])
    if not isinstance(returned, list):
        return f"images is {cut(returned, 80)}, not a list"
    for i, image in enumerate(returned[:MAX_ITEMS]):
        if not isinstance(image, dict):
            return f"images[{i}] is {cut(image, 80)}, not an object"
        if image.get("crop") is not None and box(image["crop"]) is None:
            return f"images[{i}].crop is {cut(image['crop'], 80)}, not [x1, y1, x2, y2]"
    return None


def crop_view(image: dict, images: Images) -> dict:
    """A crop a tool returned (`call_shape` checked its record) as the page draws it."""
    crop = {"crop": box(image.get("crop")), "size": size(image.get("size"))}
    number_ = images.add(image["thumb"]) if "thumb" in image else image.get("thumb_error")
    if isinstance(number_, int):
        crop["t"] = number_
    else:
        crop["why"] = cut(number_, 500) if number_ is not None else "not kept"
    return crop


def turns_view(turns: object, texts: Texts, images: Images, where: str, problems: Problems) -> list | None:
    """A tool rollout's turns (at most MAX_ITEMS) as the page draws them: texts cut (`Texts.inline`), each
    returned crop's box checked and its thumbnail a number into the images. A call record of another
    shape is left out of its turn and listed (`where`: its file and line)."""
    if not isinstance(turns, list):
        return None
    shown = []
    for turn in turns[:MAX_ITEMS]:
        turn = turn if isinstance(turn, dict) else {"text": turn}
        view = {"text": texts.inline(turn.get("text", ""))}
        if (call := turn.get("call")) is not None and (why := call_shape(call)) is not None:
            problems.add(f"{where}: a tool call record of another shape ({why}), not shown")
        elif call is not None:
            name, error = call.get("name"), call.get("error")
            view["call"] = {
                "name": cut(name, 200) if name is not None else None,
                "arguments": texts.inline(call.get("arguments")),
                "error": cut(error, 500) if error is not None else None,
                "text": texts.inline(call.get("text") or ""),
                "images": [crop_view(image, images) for image in (call.get("images") or [])[:MAX_ITEMS]],
            }
        shown.append(view)
    return shown


# --- Rollouts: the logged steps, group by group -------------------------------------------------------------


def spread_steps(steps: list[int], rows: dict[int, int]) -> list[int]:
    """At most MAX_STEPS of `steps` (sorted) and MAX_ROWS rows, evenly spread, the first and the last kept
    (a step counts at most MAX_STEP_ROWS rows: the report keeps no more of one)."""
    per_step = min(max(rows.values(), default=1), MAX_STEP_ROWS)
    keep = max(2, min(MAX_STEPS, MAX_ROWS // max(per_step, 1)))
    if len(steps) <= keep:
        return steps
    return sorted({steps[round(i * (len(steps) - 1) / (keep - 1))] for i in range(keep)})


def sample_view(record: dict, texts: Texts, images: Images) -> dict:
    """What a record says of its sample (the same for a group's G rows, or each evaluation): its id,
    prompt, target and images."""
    sample_id, prompt = record.get("sample_id"), record.get("prompt")
    return {
        "id": cut(sample_id, 500) if sample_id is not None else None,
        "prompt": texts.add(prompt) if isinstance(prompt, str) else None,
        "target": target_view(record.get("target"), texts),
        "images": image_entries(record, images),
    }


def extras_view(record: dict, texts: Texts, images: Images, where: str, problems: Problems) -> dict:
    """A completion's parsed boxes and tool turns, those it has."""
    extras = {}
    if (parsed := boxes(record.get("boxes_parsed"))) is not None:
        extras["boxes"] = parsed
    if (turns := turns_view(record.get("turns"), texts, images, where, problems)) is not None:
        extras["turns"] = turns
    return extras


def row_view(record: dict, texts: Texts, images: Images, where: str, problems: Problems) -> list:
    """One completion as the page reads it: [text, reward, advantage, length, truncated, {component: value}
    (`rollout_steps` makes it the list of every component's value), extras ({"boxes", "turns"}, or 0)]."""
    return [
        texts.add(record.get("completion", "")),
        number(record.get("reward")),
        number(record.get("advantage")),
        count(record.get("length")),
        record.get("truncated") is True,
        reward_values(record.get("rewards")),
        extras_view(record, texts, images, where, problems) or 0,
    ]


def rollout_steps(run_dir: Path, group_size: int, texts: Texts, images: Images, problems: Problems) -> dict:
    """The logged steps of rollouts.jsonl the report holds, each as its groups (made as each line is read:
    no line is kept); which were left out."""
    path = run_dir / "rollouts.jsonl"
    counts = step_counts(path, problems)
    chosen = spread_steps(sorted(counts), counts)
    by_step: dict[int, dict] = {}
    kept: dict[int, int] = {}
    components: list[str] = []
    for number_, record in read_jsonl(path, problems, set(chosen)):
        step = record["step"]
        if kept.get(step, 0) >= MAX_STEP_ROWS:
            continue
        position = kept[step] = kept.get(step, 0) + 1
        # NOTE: a record without "group" (not written by this project's trainer) is grouped by position
        key = (
            record["group"]
            if count(record.get("group")) is not None
            else (position - 1) // max(group_size, 1)
        )
        groups = by_step.setdefault(step, {})
        if key not in groups:
            groups[key] = {"group": key, **sample_view(record, texts, images), "rows": []}
        row = row_view(record, texts, images, f"rollouts.jsonl:{number_}", problems)
        components += [name for name in row[5] if name not in components][: MAX_ITEMS - len(components)]
        groups[key]["rows"].append(row)
    for step, rows in sorted(kept.items()):
        if rows == MAX_STEP_ROWS and counts.get(step, 0) > rows:
            problems.add(
                f"rollouts.jsonl: step {step} logged {counts[step]:,} rows; the first {rows:,} are shown"
            )
    steps = []
    for step, groups in sorted(by_step.items()):
        for group in groups.values():
            for row in group["rows"]:
                row[5] = [row[5].get(name) for name in components]
            group["zero_spread"] = len({row[1] for row in group["rows"]}) == 1 and len(group["rows"]) > 1
        steps.append({"step": step, "groups": [groups[key] for key in sorted(groups)]})
    left_out = sorted(set(counts) - set(chosen))
    return {"components": components, "steps": steps, "left_out": left_out, "logged": len(counts)}


# --- Held-out samples: the first and the latest evaluation --------------------------------------------------


def eval_view(record: dict, texts: Texts, images: Images, where: str, problems: Problems) -> dict:
    """One held-out sample's greedy answer at one evaluation."""
    view = {
        "completion": texts.add(record.get("completion", "")),
        "correct": record.get("correct") is True,
        "reward": number(record.get("reward")),
        "rewards": reward_values(record.get("rewards")),
        "length": count(record.get("length")),
        "truncated": record.get("truncated") is True,
    }
    return view | extras_view(record, texts, images, where, problems)


def eval_pairs(run_dir: Path, texts: Texts, images: Images, problems: Problems) -> dict | None:
    """The held-out samples (at most MAX_PAIRS) of the first and the latest evaluation, paired by index
    (None: no eval_samples.jsonl). Two passes: which steps, then the lines of those two only."""
    path = run_dir / "eval_samples.jsonl"
    if not path.exists() and not path.is_symlink():
        return None
    evaluated = step_counts(path, problems)
    first, last = (min(evaluated), max(evaluated)) if evaluated else (None, None)
    pairs: dict[int, dict] = {}
    for number_, record in read_jsonl(path, problems, {first, last}):
        where, step, index = f"eval_samples.jsonl:{number_}", record["step"], record.get("index")
        if count(index) is None:
            problems.add(f"{where}: a record without an integer index")
            continue
        if index not in pairs:
            if len(pairs) >= MAX_PAIRS:
                continue
            pairs[index] = {
                "index": index,
                **sample_view(record, texts, images),
                "before": None,
                "after": None,
            }
        for key, at in (("before", first), ("after", last)):
            if step == at and pairs[index][key] is None:
                pairs[index][key] = eval_view(record, texts, images, where, problems)
    if len(pairs) == MAX_PAIRS:
        problems.add(f"eval_samples.jsonl: {MAX_PAIRS:,} held-out samples shown; any after them are left out")
    return {"first": first, "last": last, "pairs": [pairs[index] for index in sorted(pairs)]}


# --- Metrics: bounded whatever metrics.jsonl holds ----------------------------------------------------------


@dataclass
class KeyValues:
    """One metric's values: how many, their range, the last, and the first MIN_CHART_POINTS - 1 of them."""

    count: int = 0
    low: float = math.inf
    high: float = -math.inf
    last: list | None = None  # [step, value]
    first: list = field(default_factory=list)

    def add(self, step: int, value: float) -> None:
        self.count += 1
        self.low, self.high, self.last = min(self.low, value), max(self.high, value), [step, value]
        if len(self.first) < MIN_CHART_POINTS - 1:
            self.first.append([step, value])


@dataclass
class Metrics:
    """metrics.jsonl as the report keeps it: each metric's values (`KeyValues`, MAX_METRIC_KEYS names),
    and for the curves the lines (at most MAX_CURVE_LINES training lines and as many evaluation lines, each
    with the keys a chart may draw: CHART_KEYS, PANEL_FIRST and the first MAX_PANELS other names)."""

    keys: dict[str, KeyValues] = field(default_factory=dict)
    drawn: set[str] = field(default_factory=set)
    train: Thinned = field(default_factory=lambda: Thinned(MAX_CURVE_LINES))
    evals: Thinned = field(default_factory=lambda: Thinned(MAX_CURVE_LINES))
    last_train: dict | None = None
    last_step: int | None = None
    more_keys: bool = False

    def add(self, record: dict) -> None:
        step = record["step"]
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        train, evals = {"step": step}, {"step": step}
        for key, value in record.items():
            if key == "step" or (value := number(value)) is None:
                continue
            if key not in self.keys:
                if len(self.keys) >= MAX_METRIC_KEYS:
                    self.more_keys = True
                    continue
                self.keys[key] = KeyValues()
                if (
                    key in CHART_KEYS
                    or key in PANEL_FIRST
                    or PASS_AT_K.fullmatch(key)
                    or len(self.drawn) < MAX_PANELS + len(CHART_KEYS)
                ):
                    self.drawn.add(key)
            self.keys[key].add(step, value)
            if key in self.drawn:
                (evals if key.startswith("eval/") else train)[key] = value
        if isinstance(skipped := record.get("skipped"), str) and skipped:
            train["skipped"] = cut(skipped, 200)
        if len(train) > 1:
            self.train.add(train)
        if len(evals) > 1:
            self.evals.add(evals)
        if step > 0:
            self.last_train = {k: v for k, v in list(record.items())[:MAX_METRIC_KEYS]}

    def records(self) -> list[dict]:
        """The kept lines for the charts (logs.series reads each key from the lines that hold it)."""
        return self.train.items + self.evals.items


def read_metrics(run_dir: Path, problems: Problems) -> Metrics:
    metrics = Metrics()
    for _, record in read_jsonl(run_dir / "metrics.jsonl", problems):
        metrics.add(record)
    if metrics.more_keys:
        problems.add(
            f"metrics.jsonl: more than {MAX_METRIC_KEYS:,} metric names; the later ones are left out"
        )
    if metrics.train.stride > 1 or metrics.evals.stride > 1:
        problems.add(
            f"metrics.jsonl: {metrics.train.seen:,} lines; the curves draw every {metrics.train.stride}th "
            f"(at most {MAX_CURVE_LINES:,}), the tables count them all"
        )
    return metrics


# --- Charts: matplotlib PNGs --------------------------------------------------------------------------------


def png_uri(figure: Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")  # a Figure with no canvas renders with Agg
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def metrics_grid(panels: dict[str, list[tuple[float, float]]], evals: list[float], skipped: list[int]) -> str:
    """Small multiples, one panel per metric against step: every step thin, its moving average thick
    (logs.draw_noisy), evaluations dotted, skipped steps crossed. One figure with fixed margins: a layout
    engine would measure every panel's labels, several times the drawing's cost."""
    columns, rows = 3, math.ceil(len(panels) / 3)
    figure = Figure(figsize=(13.0, 0.5 + 2.1 * rows), dpi=80)
    figure.subplots_adjust(
        left=0.05, right=0.98, bottom=0.5 / (0.5 + 2.1 * rows), top=1 - 0.35 / (0.5 + 2.1 * rows)
    )
    figure.subplots_adjust(hspace=0.6, wspace=0.2)
    axes = figure.subplots(rows, columns, squeeze=False, sharex=True).flat
    for ax, (key, pts) in zip(axes, panels.items()):
        smoothed = logs.draw_noisy(ax, pts, (logs.RAW, logs.SMOOTH))
        ax.vlines(evals, 0, 1, transform=ax.get_xaxis_transform(), colors=logs.EVAL_MARK, linestyles=":")
        if skipped:  # NOTE: a skipped step has no value (null): a cross at the panel's foot marks it
            ax.plot(
                skipped, [0.05] * len(skipped), "x", color=logs.SKIP_MARK, transform=ax.get_xaxis_transform()
            )
        stats = f"last {logs.short(pts[-1][1])}" + (
            f", EMA {logs.short(smoothed)}" if smoothed is not None else ""
        )
        # the name as it is: a plug-in's reward may be called "$x$", which mathtext would read
        ax.set_title(key, loc="left", fontsize=10, parse_math=False)
        ax.set_title(stats, loc="right", fontsize=8, color=logs.FAINT)
        ax.tick_params(labelsize=8)
        ax.grid(color="0.92")
    for ax in axes:  # the panels left over in the last row
        ax.set_axis_off()
    return png_uri(figure)


def pass_at_k_chart(records: list[dict]) -> str | None:
    """pass@k against k, one curve per evaluation (at most MAX_PASS_CURVES: first, last, evenly between),
    later ones darker: did GRPO sharpen pass@1 (the curve's left end rises) or widen pass@n (its right)?"""
    curves = []
    for record in records:
        pts = sorted((int(m[1]), v) for k, v in record.items() if (m := PASS_AT_K.fullmatch(k)))
        if pts:
            curves.append((record["step"], pts))
    if not curves:
        return None
    if len(curves) > MAX_PASS_CURVES:
        picked = {round(i * (len(curves) - 1) / (MAX_PASS_CURVES - 1)) for i in range(MAX_PASS_CURVES)}
        curves = [curves[i] for i in sorted(picked)]
    figure = Figure(figsize=(6.5, 3.2), dpi=80)
    figure.subplots_adjust(left=0.1, right=0.97, bottom=0.15, top=0.88)
    ax = figure.subplots()
    for i, (step, pts) in enumerate(curves):
        shade = 0.75 - 0.75 * i / max(1, len(curves) - 1)  # the first evaluation light grey, the last black
        ax.plot(*zip(*pts), "o-", markersize=3, color=str(shade), label=f"step {step}")
    ax.set_xlabel("k", fontsize=9)
    ax.set_title("held-out pass@k (unbiased, from n samples a prompt)", loc="left", fontsize=10)
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(color="0.92")
    return png_uri(figure)


def charts(metrics: Metrics) -> dict:
    """The main figure (reward, accuracy, KL), small multiples of at most MAX_PANELS other metrics with at
    least MIN_CHART_POINTS values (PANEL_FIRST first), a table of the values of those with fewer, and the
    rest as one line each: [name, count, lowest, highest, last step, last value]."""
    records = metrics.records()
    order = [k for k in PANEL_FIRST if k in metrics.keys] + [k for k in metrics.keys if k not in PANEL_FIRST]
    evals = [s for s, _ in logs.series(records, "eval/accuracy")]
    skipped = [r["step"] for r in metrics.train.items if "skipped" in r]
    panels, tables, rest = {}, {}, []
    for key in order:
        values = metrics.keys[key]
        if key in CHART_KEYS or PASS_AT_K.fullmatch(key):  # pass@k: its own chart, k on the x axis
            continue
        if values.count < MIN_CHART_POINTS:
            tables[cut(key, 200)] = values.first
            continue
        pts = logs.series(records, key) if key in metrics.drawn and len(panels) < MAX_PANELS else []
        if len(pts) >= MIN_CHART_POINTS:
            panels[key] = pts
        else:
            rest.append([cut(key, 200), values.count, values.low, values.high, *values.last])
    return {
        "main": png_uri(logs.curves_figure(records)) if records else None,
        "grid": metrics_grid(panels, evals, skipped) if panels else None,
        "grid_keys": [cut(key, 200) for key in panels],
        "pass_at_k": pass_at_k_chart(metrics.evals.items),
        "tables": tables,
        "rest": rest,
    }


# --- The page -----------------------------------------------------------------------------------------------


def starts_view(starts: object) -> list[dict]:
    """run.json's "starts" (each start's time, step, command line) as texts, at most MAX_ITEMS."""
    starts = [s for s in starts if isinstance(s, dict)] if isinstance(starts, list) else []
    shown = starts[:1] + starts[1:][-(MAX_ITEMS - 1) :]  # the first and the latest
    return [
        {
            "at": cut(s["at"], 100) if isinstance(s.get("at"), str) else None,
            "from_step": count(s.get("from_step")),
            "command": cut(s["command"]) if isinstance(s.get("command"), str) else None,
        }
        for s in shown
    ]


def run_view(run_dir: Path, run: dict, metrics: Metrics, problems: Problems) -> dict:
    """The run's header: settings, model, data, time, progress, checkpoints."""
    settings = run.get("args") if isinstance(run.get("args"), dict) else {}
    flat = flat_settings(settings)
    step_seconds = 0.0
    for _, record in read_jsonl(run_dir / "timings.jsonl", problems):
        step_seconds += sum(number(v) or 0.0 for k, v in record.items() if k.endswith("_s"))
    last_write = None
    try:
        if (f := open_run_file(run_dir / "metrics.jsonl")) is not None:
            with f:
                last_write = os.fstat(f.fileno()).st_mtime
    except ValueError:
        pass  # read_jsonl says why
    checkpoints = sorted(
        p.name for p in run_dir.glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name)
    )
    summary = run.get("summary") if isinstance(run.get("summary"), dict) else None
    steps = flat.get("--steps")
    model = flat.get("--model")
    evals = logs.series(metrics.evals.items, "eval/accuracy")
    return {
        "folder": shown_path(run_dir.resolve().name),
        "path": shown_path(run_dir.resolve()),
        "run_id": cut(run["run_id"], 200) if isinstance(run.get("run_id"), str) else None,
        "finished": run.get("finished") is True,
        "settings": shown_values(flat),
        "model": cut(model, 500) if isinstance(model, str) else None,
        "data": shown_values({k: flat[k] for k in DATA_FLAGS if flat.get(k) not in (None, [], "")}),
        "starts": starts_view(run.get("starts")),
        "summary": shown_values(summary, MAX_ITEMS) if summary else None,
        "steps": count(steps),
        "last_step": metrics.last_step,
        "step_seconds": step_seconds,
        "last_write": last_write,
        "checkpoints": checkpoints
        if len(checkpoints) <= 20
        else [*checkpoints[:10], "…", *checkpoints[-10:]],
        "last_metrics": shown_values(metrics.last_train, MAX_METRIC_KEYS) if metrics.last_train else None,
        "evals": [[s, a] for s, a in evals],
    }


def report_data(run_dir: Path) -> dict:
    """Everything the page shows, as JSON-ready data (strict JSON: no NaN, text UTF-8 can hold)."""
    problems = Problems()
    run = read_run_json(run_dir, problems)
    metrics = read_metrics(run_dir, problems)
    if not (run_dir / "metrics.jsonl").exists():
        problems.add("metrics.jsonl: absent (no step logged yet)")
    view = run_view(run_dir, run, metrics, problems)
    group_size = view["settings"].get("--group-size")
    group_size = group_size if count(group_size) else 1
    texts, images = Texts(), Images(run_dir)
    try:
        rollouts = rollout_steps(run_dir, group_size, texts, images, problems)
        evals = eval_pairs(run_dir, texts, images, problems)
    finally:
        images.close()
    if images.missing:
        missing = f"{images.missing} image file(s) not in the report"
        problems.add(f"thumbs/: {missing} (each one is named where it would show)")
    accuracy = view["settings"].get("--accuracy-reward") or (rollouts["components"] or [None])[0]
    return {
        "run": view,
        "charts": charts(metrics),
        "rollouts": rollouts,
        "evals": evals,
        "accuracy": accuracy if isinstance(accuracy, str) else None,
        "texts": texts.items,
        "images": images.uris,
        "problems": problems.listed(),
        "built": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def json_for_script(data: dict) -> str:
    """JSON that an HTML <script> element holds as it is: no '<' (so no '</script>' or '<!--' inside)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def sha256_source(text: str) -> str:
    """A Content-Security-Policy source that allows the inline element whose content is `text`."""
    return f"'sha256-{base64.b64encode(hashlib.sha256(text.encode('utf-8')).digest()).decode('ascii')}'"


def page(data: dict) -> str:
    title = html.escape(f"GRPO run report: {data['run']['folder']}")
    style = "\n" + (ASSETS / "report.css").read_text(encoding="utf-8")
    hook = "\n" + ERROR_HOOK
    script = "\n" + (ASSETS / "report.js").read_text(encoding="utf-8")
    policy = (
        f"default-src 'none'; img-src data:; style-src {sha256_source(style)}; "
        f"script-src {sha256_source(hook)} {sha256_source(script)}; base-uri 'none'; form-action 'none'"
    )
    return (
        f"<!doctype html>\n<html lang=en>\n<head>\n<meta charset=utf-8>\n{GENERATOR}\n"
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">\n'
        f'<meta name=viewport content="width=device-width, initial-scale=1">\n<title>{title}</title>\n'
        f"<style>{style}</style>\n"
        # installed before the page's own script, so that its errors (a syntax error included) show
        f"<script>{hook}</script>\n"
        f"</head>\n<body>\n<div id=errors hidden></div>\n<main id=report><p>Loading the report…</p></main>\n"
        f"<script type=application/json id=report-data>{json_for_script(data)}</script>\n"
        f"<script>{script}</script>\n</body>\n</html>\n"
    )


def build_report(run_dir: str | Path) -> str:
    """The report of `run_dir` as one HTML page; reads the folder, writes nothing."""
    return page(report_data(Path(run_dir)))


def write_report(run_dir: str | Path, dest: str | Path) -> Path:
    """The report of `run_dir` written whole to `dest` (files.atomic_write); returns `dest`."""
    files.atomic_write(dest := Path(dest), build_report(run_dir).encode("utf-8"))
    return dest


# --- The command: what it reads, and the one file it writes -------------------------------------------------


def check_run_dir(run_dir: Path) -> None:
    """A UsageError naming `run_dir` unless it is a folder with a run's files in it."""
    if not run_dir.is_dir():
        raise cli.UsageError(f"{run_dir}: no such folder")
    if not any((run_dir / name).is_file() for name in ("run.json", "metrics.jsonl", "rollouts.jsonl")):
        raise cli.UsageError(f"{run_dir}: not a run folder (no run.json, metrics.jsonl or rollouts.jsonl)")


def is_report(path: Path) -> bool:
    """Whether the regular file `path` is a report this module wrote (its head names the generator, or, by an
    earlier version, the report's title and policy)."""
    with path.open("rb") as f:
        head = f.read(4096).decode("utf-8", "replace")
    earlier = head.startswith("<!doctype html>") and "<title>GRPO run report: " in head
    return GENERATOR in head or (earlier and "Content-Security-Policy" in head)


def check_out(dest: Path, run_dir: Path, overwrite: bool) -> None:
    """A UsageError naming `--out` unless writing the report to `dest` replaces nothing but a report: a new
    file, or a report this command (or the trainer) wrote; anything else there (a file of yours, a symbolic
    link: replaced as the link, never followed) only with --overwrite. Never a folder, a FIFO or a device,
    nor a file of the run folder but its report.html, --overwrite or not."""
    if not dest.parent.is_dir():
        raise cli.UsageError(f"--out {dest}: {dest.parent} is not a folder (create it first)")
    folder, run = dest.parent.resolve(), run_dir.resolve()
    if folder.is_relative_to(run) and not (folder == run and dest.name == "report.html"):
        raise cli.UsageError(
            f"--out {dest}: inside the run folder {run_dir}, whose files are the run's; write the report "
            f"elsewhere, or as the run's own {run_dir / 'report.html'}"
        )
    if dest.is_symlink():
        if not overwrite:
            raise cli.UsageError(
                f"--out {dest}: a symbolic link, never written through; --overwrite replaces the link itself"
            )
        return
    if not dest.exists():
        return
    if dest.is_dir():
        raise cli.UsageError(f"--out {dest}: a folder; name the file to write, e.g. {dest / 'report.html'}")
    if not dest.is_file():
        raise cli.UsageError(f"--out {dest}: not a regular file (a FIFO or a device); choose another --out")
    if not overwrite and not is_report(dest):
        raise cli.UsageError(
            f"--out {dest}: exists and is not a report this command wrote; refusing to replace it "
            "(--overwrite replaces it)"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m grpo_vlm.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run folder (read only; its lock is never taken)")
    parser.add_argument(
        "--out",
        type=Path,
        help="the HTML file to write (default: ./report-<folder>.html); it may replace only a report this "
        "command wrote, and never a file of the run folder but its report.html",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace whatever file --out names")
    options = parser.parse_args(argv)

    def build(options: argparse.Namespace) -> None:
        check_run_dir(options.run_dir)
        dest = options.out or Path(f"report-{options.run_dir.resolve().name}.html")
        check_out(dest, options.run_dir, options.overwrite)
        with cli.writing(dest):
            print(write_report(options.run_dir, dest))

    cli.run(build, options)


if __name__ == "__main__":
    main()
