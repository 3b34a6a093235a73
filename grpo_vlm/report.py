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
  earlier version without thumbs/ or eval_samples.jsonl). The command writes only its output file.
- What cannot be read is said where it would show, never raised: a JSONL line that is not JSON (a live
  run's torn last line, a damaged line) is skipped and listed ("metrics.jsonl:17: not JSON"), an image that
  is not in the report is a placeholder saying why.
- Self-contained: the data is one JSON blob in a <script type="application/json"> ('<' written as \\u003c,
  so no text can close the element); each image file is embedded once, as a base64 data: URI referenced by
  number, and texts that repeat (prompts, completions) are stored once. The CSS and JS are inline, written
  by hand (report.css, report.js beside this module); the page builds its DOM from the data, text through
  textContent only. A Content-Security-Policy allows inline code and data: images and nothing else, so the
  page loads nothing from the network.
- Charts are matplotlib PNGs: logs.curves_figure (reward, held-out accuracy, KL: the figure of curves.png),
  and small multiples of every other numeric metric, shown on demand. PNG rather than SVG: its size does not
  grow with the number of steps. A metric with fewer than MIN_CHART_POINTS values is a table of them instead
  (and costs no drawing: a short run's report is quick to build).
- Bounded: at most MAX_STEPS logged steps of rollouts and MAX_ROWS rows, spread evenly over the run with the
  first and last included (the page names the steps left out); texts cut at MAX_TEXT characters; images read
  only from the run's thumbs/ folder, at most MAX_IMAGE_BYTES each and MAX_IMAGES_BYTES in all (beyond, a
  placeholder says so). The report of the default 100-step run (B = 16, G = 8, every step logged, 860
  distinct 56-px pictures) is 5.7 MB; a run with photos embeds 256-px thumbnails and larger -seen images,
  and its report grows with them, up to the MAX_IMAGES_BYTES bound.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import numbers
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from grpo_vlm import cli, files, logs

MAX_STEPS = 200  # logged steps of rollouts in one report
MAX_ROWS = 32_000  # rows (completions) of rollouts in one report: 200 steps of B = 16 x G = 10
MAX_TEXT = 4_000  # characters of one prompt or completion
MAX_IMAGE_BYTES = 4 << 20  # one image file: a -seen image is at most 1536 px, far below
MAX_IMAGES_BYTES = 64 << 20  # every image file together
MIN_CHART_POINTS = 10  # fewer values: a table says more than a chart
THUMB_PATH = re.compile(r"thumbs/[A-Za-z0-9_.-]+\.jpe?g")  # the contract's names; nothing outside thumbs/
STEP_PREFIX = re.compile(rb'\{"step": (-?\d+)[,}]')  # how logs.rollout_records starts every line
CHART_KEYS = ("reward/mean", "eval/accuracy", "kl")  # the panels of logs.curves_figure
# the settings that say which data the run trained on, shown in the report's header
DATA_FLAGS = ("--task", "--data", "--eval-data", "--train-size", "--eval-size")
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
"""


# --- Reading the run folder: read-only, problems listed, never raised ---------------------------------------


def read_jsonl(path: Path, problems: list[str], steps: set[int] | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, record) of each JSON-object line of `path` (absent: nothing); with `steps`, only the
    lines of those steps (the others not parsed). Each damaged line adds 'name:line: why' to `problems`."""
    try:
        f = files.regular_file(path).open("rb") if path.exists() else None
    except (OSError, ValueError) as e:
        problems.append(f"{path.name}: unreadable ({e})")
        return
    if f is None:
        return
    with f:
        for number, raw in enumerate(f, start=1):
            if steps is not None and (m := STEP_PREFIX.match(raw)) and int(m[1]) not in steps:
                continue
            why = None
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                why = "not UTF-8"
            except (ValueError, RecursionError):
                # NOTE: a live run's last line may be read while it is written: torn, no newline yet
                torn = not raw.endswith(b"\n")
                why = "not JSON" + (" (a torn last line: a live run writing it?)" if torn else "")
            else:
                if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                    why = "not a record with an integer step"
            if why is not None:
                if raw.strip():
                    problems.append(f"{path.name}:{number}: {why}")
                continue
            if steps is None or record["step"] in steps:
                yield number, record


def step_counts(path: Path, problems: list[str]) -> dict[int, int]:
    """{step: rows} of rollouts.jsonl, read cheaply: the step from the line's start, a full parse only for a
    line that does not start as the trainer writes it (a damaged line counts nowhere: read_jsonl lists it)."""
    counts: dict[int, int] = {}
    try:
        f = files.regular_file(path).open("rb") if path.exists() else None
    except (OSError, ValueError):
        return counts  # read_jsonl says why
    if f is None:
        return counts
    with f:
        for raw in f:
            if m := STEP_PREFIX.match(raw):
                step = int(m[1])
            else:
                try:
                    step = json.loads(raw.decode("utf-8"))["step"]
                except (ValueError, RecursionError, TypeError, KeyError):
                    continue
                if not isinstance(step, int):
                    continue
            counts[step] = counts.get(step, 0) + 1
    return counts


def read_run_json(run_dir: Path, problems: list[str]) -> dict:
    """run.json as a dict ({} when absent or damaged, which `problems` then says)."""
    path = run_dir / "run.json"
    if not path.exists():
        problems.append("run.json: absent (a run folder from an earlier version?): settings unknown")
        return {}
    try:
        record = files.read_json(path)
    except (OSError, ValueError) as e:
        problems.append(f"run.json: {e}")
        return {}
    if not isinstance(record, dict):
        problems.append("run.json: not a JSON object")
        return {}
    return record


def flat_settings(settings: dict) -> dict:
    """run.json's nested "args" -> {"--flag-name": value}, groups flattened as the command's flags are."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(flat_settings(value))
        else:
            flat["--" + str(key).replace("_", "-")] = value
    return flat


def cut(text: object) -> str:
    """A text as the page shows it: at most MAX_TEXT characters, the rest counted."""
    text = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
    if len(text) <= MAX_TEXT:
        return text
    return f"{text[:MAX_TEXT]}… [{len(text) - MAX_TEXT:,} more characters in the run's file]"


# --- Tables the data refers into: each text and each image once ---------------------------------------------


@dataclass
class Texts:
    """Each distinct text once; the rows refer to it by number (completions and prompts repeat)."""

    items: list[str] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)

    def add(self, text: object) -> int:
        text = cut(text)
        if text not in self.index:
            self.index[text] = len(self.items)
            self.items.append(text)
        return self.index[text]


@dataclass
class Images:
    """The run's image files, each embedded once as a data: URI; `add` returns its number, or why not."""

    run_dir: Path
    uris: list[str] = field(default_factory=list)
    by_path: dict[str, int | str] = field(default_factory=dict)
    total: int = 0
    missing: int = 0

    def add(self, name: object) -> int | str:
        if not isinstance(name, str) or not THUMB_PATH.fullmatch(name):
            return f"not an image of thumbs/: {str(name)[:80]!r}"
        if name not in self.by_path:
            self.by_path[name] = self.read(name)
            self.missing += isinstance(self.by_path[name], str)
        return self.by_path[name]

    def read(self, name: str) -> int | str:
        path = self.run_dir / name
        try:
            if path.is_symlink() or not path.is_file():
                return f"{name}: missing" if not path.exists() else f"{name}: not a regular file"
            if (size := path.stat().st_size) > MAX_IMAGE_BYTES:
                return f"{name}: {size:,} bytes, more than an image of the report may take"
            if self.total + size > MAX_IMAGES_BYTES:
                return f"{name}: not embedded (the report's {MAX_IMAGES_BYTES >> 20} MB for images is spent)"
            content = path.read_bytes()
        except OSError as e:
            return f"{name}: unreadable ({e.strerror or e})"
        if not content.startswith(b"\xff\xd8\xff"):
            return f"{name}: not a JPEG file"
        self.total += len(content)
        self.uris.append("data:image/jpeg;base64," + base64.b64encode(content).decode("ascii"))
        return len(self.uris) - 1


def image_entries(record: dict, images: Images) -> list[dict]:
    """The page's view of a record's images: {"ref": the name rollouts.jsonl gives, "t": thumbnail, "s": the
    image as the model saw it (each a number into the images, or absent), "size", "seen", "why": what is
    missing}."""
    refs = record.get("images") if isinstance(record.get("images"), list) else []
    thumbs = record.get("thumbs")
    if not isinstance(thumbs, list):
        return [{"ref": cut(ref), "why": "not kept by this run"} for ref in refs]
    entries = []
    for i, thumb in enumerate(thumbs):
        entry = {"ref": cut(refs[i]) if i < len(refs) else ""}
        thumb = thumb if isinstance(thumb, dict) else {"error": f"not a thumbnail record: {cut(thumb)}"}
        if "error" in thumb:
            entries.append(entry | {"why": f"not kept: {cut(thumb['error'])}"})
            continue
        for key, name in (("t", "thumb"), ("s", "seen")):
            if name == "seen" and thumb.get("seen", "") is None:  # the run's budget left it out: no problem
                entry[key] = None
                continue
            number = images.add(thumb.get(name))
            entry[key] = number if isinstance(number, int) else None
            if isinstance(number, str):
                entry.setdefault("why", number)
        entry["size"], entry["seen"] = thumb.get("size"), thumb.get("seen_size")
        entries.append(entry)
    return entries


def turns_view(turns: object, images: Images) -> list[dict] | None:
    """A tool rollout's turns with each returned crop's thumbnail as a number into the images."""
    if not isinstance(turns, list):
        return None
    shown = []
    for turn in turns:
        turn = turn if isinstance(turn, dict) else {"text": turn}
        view = {"text": cut(turn.get("text", ""))}
        if isinstance(call := turn.get("call"), dict):
            crops = []
            for image in call.get("images") or []:
                image = image if isinstance(image, dict) else {}
                crop = {"crop": image.get("crop"), "size": image.get("size")}
                number = images.add(image["thumb"]) if "thumb" in image else image.get("thumb_error")
                crop["t" if isinstance(number, int) else "why"] = number if number is not None else "not kept"
                crops.append(crop)
            view["call"] = {
                "name": call.get("name"),
                "arguments": cut(call.get("arguments")),
                "error": call.get("error"),
                "text": cut(call.get("text") or ""),
                "images": crops,
            }
        shown.append(view)
    return shown


# --- Rollouts: the logged steps, group by group -------------------------------------------------------------


def spread_steps(steps: list[int], rows: dict[int, int]) -> list[int]:
    """At most MAX_STEPS of `steps` (sorted) and MAX_ROWS rows, evenly spread, the first and the last kept."""
    per_step = max(rows.values(), default=1)
    keep = max(2, min(MAX_STEPS, MAX_ROWS // max(per_step, 1)))
    if len(steps) <= keep:
        return steps
    return sorted({steps[round(i * (len(steps) - 1) / (keep - 1))] for i in range(keep)})


def number(value: object) -> float | None:
    """A finite number as JSON can carry it; anything else None (JSON has no NaN)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


def row_view(record: dict, components: list[str], texts: Texts, images: Images) -> list:
    """One completion as the page reads it: [text, reward, advantage, length, truncated, [each component],
    extras ({"boxes": parsed boxes, "turns": tool turns}, or 0)]."""
    rewards = record.get("rewards") if isinstance(record.get("rewards"), dict) else {}
    extras = {}
    if isinstance(record.get("boxes_parsed"), list):
        extras["boxes"] = record["boxes_parsed"]
    if (turns := turns_view(record.get("turns"), images)) is not None:
        extras["turns"] = turns
    return [
        texts.add(record.get("completion", "")),
        number(record.get("reward")),
        number(record.get("advantage")),
        record.get("length"),
        bool(record.get("truncated")),
        [number(rewards.get(name)) for name in components],
        extras or 0,
    ]


def group_view(records: list[dict], components: list[str], texts: Texts, images: Images) -> dict:
    """A group's card: its sample once (images, prompt, target) and its rows."""
    first = records[0]
    rewards = [r.get("reward") for r in records]
    return {
        "group": first.get("group"),
        "id": cut(first.get("sample_id")) if first.get("sample_id") is not None else None,
        "prompt": texts.add(first["prompt"]) if isinstance(first.get("prompt"), str) else None,
        "target": first.get("target") if isinstance(first.get("target"), dict) else None,
        "images": image_entries(first, images),
        "zero_spread": len(set(map(str, rewards))) == 1 and len(records) > 1,
        "rows": [row_view(r, components, texts, images) for r in records],
    }


def rollout_steps(run_dir: Path, group_size: int, texts: Texts, images: Images, problems: list[str]) -> dict:
    """The logged steps of rollouts.jsonl the report holds, each as its groups; which were left out."""
    path = run_dir / "rollouts.jsonl"
    counts = step_counts(path, problems)
    chosen = spread_steps(sorted(counts), counts)
    by_step: dict[int, dict] = {}
    for _, record in read_jsonl(path, problems, set(chosen)):
        rows = by_step.setdefault(record["step"], {})
        # NOTE: a record without "group" (not written by this project's trainer) is grouped by position
        position = sum(len(g) for g in rows.values())
        key = record.get("group") if isinstance(record.get("group"), int) else position // max(group_size, 1)
        rows.setdefault(key, []).append(record)
    components: list[str] = []
    for rows in by_step.values():
        for group in rows.values():
            for record in group:
                rewards = record.get("rewards") if isinstance(record.get("rewards"), dict) else {}
                components += [name for name in rewards if name not in components]
    steps = [
        {"step": step, "groups": [group_view(rows[g], components, texts, images) for g in sorted(rows)]}
        for step, rows in sorted(by_step.items())
    ]
    left_out = sorted(set(counts) - set(chosen))
    return {"components": components, "steps": steps, "left_out": left_out, "logged": len(counts)}


# --- Held-out samples: the first and the latest evaluation --------------------------------------------------


def eval_view(record: dict, texts: Texts, images: Images) -> dict:
    """One held-out sample's greedy answer at one evaluation."""
    view = {
        "completion": texts.add(record.get("completion", "")),
        "correct": bool(record.get("correct")),
        "reward": number(record.get("reward")),
        "rewards": record.get("rewards") if isinstance(record.get("rewards"), dict) else {},
        "length": record.get("length"),
        "truncated": bool(record.get("truncated")),
    }
    if isinstance(record.get("boxes_parsed"), list):
        view["boxes"] = record["boxes_parsed"]
    if (turns := turns_view(record.get("turns"), images)) is not None:
        view["turns"] = turns
    return view


def eval_pairs(run_dir: Path, texts: Texts, images: Images, problems: list[str]) -> dict | None:
    """The held-out samples of the first and the latest evaluation, paired by index (None: no
    eval_samples.jsonl). One pass: the latest step's records replace the kept ones as it appears."""
    path = run_dir / "eval_samples.jsonl"
    if not path.exists():
        return None
    steps: list[int] = []
    first: dict[int, dict] = {}
    last: dict[int, dict] = {}
    for _, record in read_jsonl(path, problems):
        step, index = record["step"], record.get("index")
        if not isinstance(index, int):
            problems.append(f"eval_samples.jsonl: a record of step {step} without an integer index")
            continue
        if not steps or step > steps[-1]:  # a new evaluation: the latest so far
            steps.append(step)
            last = {}
        if step == steps[0]:
            first[index] = record
        if step == steps[-1]:
            last[index] = record
    pairs = []
    for index in sorted(set(first) | set(last)):
        sample = first.get(index) or last[index]
        pair = {"index": index, "id": cut(sample.get("sample_id")) if sample.get("sample_id") else None}
        pair["prompt"] = texts.add(sample["prompt"]) if isinstance(sample.get("prompt"), str) else None
        pair["target"] = sample.get("target") if isinstance(sample.get("target"), dict) else None
        pair["images"] = image_entries(sample, images)
        for key, kept in (("before", first), ("after", last)):
            pair[key] = eval_view(kept[index], texts, images) if index in kept else None
        pairs.append(pair)
    return {"first": steps[0] if steps else None, "last": steps[-1] if steps else None, "pairs": pairs}


# --- Charts: matplotlib PNGs --------------------------------------------------------------------------------


def png_uri(figure: Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")  # a Figure with no canvas renders with Agg
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def metrics_grid(panels: dict[str, list[tuple[float, float]]], evals: list[float]) -> str:
    """Small multiples, one panel per metric against step: every step thin, its moving average thick
    (logs.draw_noisy), evaluations dotted. One figure with fixed margins: a layout engine would measure every
    panel's labels, several times the drawing's cost."""
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
        stats = f"last {logs.short(pts[-1][1])}" + (
            f", EMA {logs.short(smoothed)}" if smoothed is not None else ""
        )
        ax.set_title(key, loc="left", fontsize=10)
        ax.set_title(stats, loc="right", fontsize=8, color=logs.FAINT)
        ax.tick_params(labelsize=8)
        ax.grid(color="0.92")
    for ax in axes:  # the panels left over in the last row
        ax.set_axis_off()
    return png_uri(figure)


def charts(records: list[dict]) -> dict:
    """The main figure (reward, accuracy, KL) and the other numeric metrics: small multiples of those with at
    least MIN_CHART_POINTS values, a table of the values of the others."""
    keys = []
    for record in records:
        keys += [k for k, v in record.items() if k not in keys and k != "step" and number(v) is not None]
    evals = [s for s, _ in logs.series(records, "eval/accuracy")]
    panels, tables = {}, {}
    for key in keys:
        if key not in CHART_KEYS and (pts := logs.series(records, key)):
            (panels if len(pts) >= MIN_CHART_POINTS else tables)[key] = pts
    return {
        "main": png_uri(logs.curves_figure(records)) if records else None,
        "grid": metrics_grid(panels, evals) if panels else None,
        "grid_keys": list(panels),
        "tables": tables,
    }


# --- The page -----------------------------------------------------------------------------------------------


def run_view(run_dir: Path, run: dict, records: list[dict], problems: list[str]) -> dict:
    """The run's header: settings, model, data, time, progress, checkpoints."""
    settings = run.get("args") if isinstance(run.get("args"), dict) else {}
    flat = flat_settings(settings)
    timings = [r for _, r in read_jsonl(run_dir / "timings.jsonl", problems)]
    step_seconds = sum(number(v) or 0.0 for r in timings for k, v in r.items() if k.endswith("_s"))
    train = [r for r in records if r.get("step", 0) > 0]
    metrics = run_dir / "metrics.jsonl"
    evals = [r for r in records if "eval/accuracy" in r]
    return {
        "folder": run_dir.name,
        "path": str(run_dir.resolve()),
        "run_id": run.get("run_id"),
        "finished": run.get("finished"),
        "settings": flat,
        "model": flat.get("--model"),
        "data": {k: flat[k] for k in DATA_FLAGS if flat.get(k) not in (None, [], "")},
        "starts": [s for s in run.get("starts") or [] if isinstance(s, dict)],  # each start's time, command
        "summary": run.get("summary") if isinstance(run.get("summary"), dict) else None,
        "steps": flat.get("--steps"),
        "last_step": max((r["step"] for r in records), default=None),
        "step_seconds": step_seconds,
        "last_write": metrics.stat().st_mtime if metrics.is_file() else None,
        "checkpoints": sorted(
            p.name for p in run_dir.glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name)
        ),
        "last_metrics": train[-1] if train else None,
        "evals": [[r["step"], r["eval/accuracy"]] for r in evals if number(r["eval/accuracy"]) is not None],
    }


def report_data(run_dir: Path) -> dict:
    """Everything the page shows, as JSON-ready data."""
    problems: list[str] = []
    run = read_run_json(run_dir, problems)
    records = [r for _, r in read_jsonl(run_dir / "metrics.jsonl", problems)]
    if not (run_dir / "metrics.jsonl").exists():
        problems.append("metrics.jsonl: absent (no step logged yet)")
    view = run_view(run_dir, run, records, problems)
    group_size = view["settings"].get("--group-size")
    group_size = group_size if isinstance(group_size, int) else 1
    texts, images = Texts(), Images(run_dir)
    rollouts = rollout_steps(run_dir, group_size, texts, images, problems)
    evals = eval_pairs(run_dir, texts, images, problems)
    if images.missing:
        missing = f"{images.missing} image file(s) not in the report"
        problems.append(f"thumbs/: {missing} (each one is named where it would show)")
    accuracy = view["settings"].get("--accuracy-reward") or (rollouts["components"] or [None])[0]
    return {
        "run": view,
        "charts": charts(records),
        "rollouts": rollouts,
        "evals": evals,
        "accuracy": accuracy,
        "texts": texts.items,
        "images": images.uris,
        "problems": problems,
        "built": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def json_for_script(data: dict) -> str:
    """JSON that an HTML <script> element holds as it is: no '<' (so no '</script>' or '<!--' inside)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def page(data: dict) -> str:
    title = html.escape(f"GRPO run report: {data['run']['folder']}")
    style = (ASSETS / "report.css").read_text(encoding="utf-8")
    script = (ASSETS / "report.js").read_text(encoding="utf-8")
    policy = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
    return (
        "<!doctype html>\n<html lang=en>\n<head>\n<meta charset=utf-8>\n"
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">\n'
        f'<meta name=viewport content="width=device-width, initial-scale=1">\n<title>{title}</title>\n'
        f"<style>\n{style}</style>\n"
        # installed before the page's own script, so that its errors (a syntax error included) show
        f"<script>\n{ERROR_HOOK}</script>\n"
        f"</head>\n<body>\n<div id=errors hidden></div>\n<main id=report><p>Loading the report…</p></main>\n"
        f"<script type=application/json id=report-data>{json_for_script(data)}</script>\n"
        f"<script>\n{script}</script>\n</body>\n</html>\n"
    )


def build_report(run_dir: str | Path) -> str:
    """The report of `run_dir` as one HTML page; reads the folder, writes nothing."""
    return page(report_data(Path(run_dir)))


def write_report(run_dir: str | Path, dest: str | Path) -> Path:
    """The report of `run_dir` written whole to `dest` (files.atomic_write); returns `dest`."""
    files.atomic_write(dest := Path(dest), build_report(run_dir).encode("utf-8"))
    return dest


def check_run_dir(run_dir: Path) -> None:
    """A UsageError naming `run_dir` unless it is a folder with a run's files in it."""
    if not run_dir.is_dir():
        raise cli.UsageError(f"{run_dir}: no such folder")
    if not any((run_dir / name).is_file() for name in ("run.json", "metrics.jsonl", "rollouts.jsonl")):
        raise cli.UsageError(f"{run_dir}: not a run folder (no run.json, metrics.jsonl or rollouts.jsonl)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m grpo_vlm.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run folder (read only; its lock is never taken)")
    parser.add_argument("--out", type=Path, help="the HTML file to write (default: ./report-<folder>.html)")
    options = parser.parse_args(argv)

    def build(options: argparse.Namespace) -> None:
        check_run_dir(options.run_dir)
        dest = options.out or Path(f"report-{options.run_dir.resolve().name}.html")
        with cli.writing(dest):
            print(write_report(options.run_dir, dest))

    cli.run(build, options)


if __name__ == "__main__":
    main()
