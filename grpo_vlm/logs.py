"""What a run leaves behind besides its adapter: metrics, timings, one record per sampled completion and one
per held-out sample at each evaluation as JSONL, the progress line and the curves PNG (trackers.py mirrors
the metrics to an experiment tracker). Imports the standard library and matplotlib, nothing from this project.

Legend: `B` prompts, `G` completions per prompt (the group), `N = B*G` rows; rows [g*G, (g+1)*G) are
prompt g's group.

Choices:
- The JSONL files are the record of a run, appended a step at a time (one write, fsynced): a crash leaves at
  most a torn last line, and on --resume checkpoints.trim_jsonl cuts them back to the checkpoint's step.
- Rollout records keep floats at full precision (Python's float repr round-trips), so rollouts.jsonl's
  advantages can be recomputed from its rewards exactly; the text, not the digits, dominates the size.
- The curves are drawn on a matplotlib Figure of its own, never through pyplot (no global state, no display).
  Reward and KL per step are noisy (one batch of N completions): a debiased EMA is drawn thick on top.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import numbers
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins a valid pair: what is left is lone


def strict(value: Any, path: str, found: dict) -> Any:
    """`value` as strict JSON can hold it: a NaN or inf float as None, a lone surrogate (no UTF-8 can hold
    one) as U+FFFD; `found` gets {"non_finite": {path: "NaN"}, "not_text": [path]} of what was replaced."""
    if isinstance(value, float) and not math.isfinite(value):
        found.setdefault("non_finite", {})[path] = json.dumps(value)  # "NaN", "Infinity", "-Infinity"
        return None
    if isinstance(value, str) and LONE_SURROGATE.search(value):
        found.setdefault("not_text", []).append(path)
        return LONE_SURROGATE.sub("\ufffd", value)
    inner = f"{path}." if path else ""
    if isinstance(value, dict):
        return {strict(str(k), path, {}): strict(v, f"{inner}{k}", found) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v, f"{inner}{i}", found) for i, v in enumerate(value)]
    return value


def json_line(record: dict) -> str:
    """`record` as one line of strict JSON (RFC 8259: no NaN or Infinity; text UTF-8 can hold). A value that
    is neither is replaced (`strict`), and the record says which: `"loss": null` of a skipped step comes with
    `"non_finite": {"loss": "NaN"}` (and the step's `skipped` reason); a line without either is unchanged."""
    try:
        line = json.dumps(record, ensure_ascii=False, allow_nan=False)
        line.encode("utf-8")
        return line
    except ValueError:  # NaN or inf; UnicodeEncodeError: a lone surrogate
        found: dict = {}
        repaired = strict(record, "", found)
        return json.dumps(repaired | found, ensure_ascii=False, allow_nan=False)


def append_jsonl(path: str | Path, *records: dict) -> None:
    """One line per record (`json_line`), in one write and one fsync (a step's rows: one per file per step),
    so `tail -f` works and the file always ends with a whole line: a write that fails (no space left, the
    folder removed) or a signal between two partial writes cuts the file back to its size before the
    append."""
    if not records:
        return
    line = memoryview("".join(json_line(r) + "\n" for r in records).encode("utf-8"))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    size = os.fstat(fd).st_size
    try:
        while line:  # NOTE: os.write may write a part only (a full disk takes what fits)
            line = line[os.write(fd, line) :]
        os.fsync(fd)
        if os.fstat(fd).st_nlink == 0:  # its folder was removed: the lines went nowhere
            raise FileNotFoundError(errno.ENOENT, "the file was removed while being written")
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    finally:
        os.close(fd)


def image_reference(image: Any) -> str:
    """A path as a string; an in-memory image (the synthetic tasks use PIL images) as a short description."""
    if isinstance(image, (str, os.PathLike)):
        return str(image)
    size = getattr(image, "size", None)
    return f"<in-memory image {size[0]}x{size[1]}>" if isinstance(size, tuple) else "<in-memory image>"


def rollout_records(
    step: int,
    samples: list[dict],
    texts: list[str],
    components: dict[str, list[float]],
    reward: list[float],
    adv: list[float],
    lengths: list[int],
    truncated: list[bool],
    group_size: int,
    turns: list[list[dict]] | None = None,
    extras: list[dict] | None = None,
) -> list[dict]:
    """One JSON-ready dict per sampled completion, for rollouts.jsonl. `samples`: the B prompts' or one per
    row; every other list has N entries. A length mismatch raises rather than mispair rows and samples.
    `turns` (multi-turn rollouts): each row's model turns, each with its tool call's record, in order.
    `extras`: each row's further fields (its prompt, target, thumbnails, parsed boxes), added at the end."""
    N = len(texts)
    columns = {"reward": reward, "adv": adv, "lengths": lengths, "truncated": truncated, **components}
    columns |= {"extras": extras} if extras is not None else {}
    wrong = {name: len(values) for name, values in columns.items() if len(values) != N}
    if group_size < 1 or N % group_size or wrong or len(samples) not in (N, N // group_size):
        raise ValueError(
            f"rollout_records: {N} completions, group_size {group_size}, {len(samples)} samples (expected "
            f"{N // max(group_size, 1)} or {N}); lists whose length is not {N}: {wrong}"
        )
    if len(samples) != N:
        samples = [sample for sample in samples for _ in range(group_size)]  # one per row
    records = [
        {
            "step": int(step),
            "sample_id": sample.get("id"),
            "group": i // group_size,
            "images": [image_reference(image) for image in sample.get("images") or []],
            "completion": texts[i],
            "rewards": {name: float(values[i]) for name, values in components.items()},
            "reward": float(reward[i]),
            "advantage": float(adv[i]),
            "length": int(lengths[i]),
            "truncated": bool(truncated[i]),
        }
        for i, sample in enumerate(samples)
    ]
    for record, row_turns in zip(records, turns or []):
        record["turns"] = row_turns  # the completion above is the last turn's text: the final answer
    for record, fields in zip(records, extras or []):
        record.update(fields)
    return records


def format_duration(seconds: float) -> str:
    """45s, 2m06s, 1h02m; "?" for a duration not known yet (non-finite or negative)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def progress_line(
    step: int,
    total: int,
    record: dict,
    *,
    seconds_per_step: float,
    eta_seconds: float,
    accuracy: float | None,
) -> str:
    """`step  40/100  reward 1.234  kl 0.0123  acc 0.760  2.1 s/step  ETA 2m06s`, plus warnings; kl only when
    the record has it (beta > 0), acc only once an evaluation has run (the latest one), tool calls and errors
    per completion only with tools."""
    parts = [f"step {step:>{len(str(total))}}/{total}"]
    if "reward/mean" in record:
        parts.append(f"reward {record['reward/mean']:.3f}")
    if "kl" in record:
        parts.append(f"kl {record['kl']:.3g}")  # 3 significant digits: early KL is far below 1e-4
    if accuracy is not None:
        parts.append(f"acc {accuracy:.3f}")
    if "tools/calls" in record:  # per completion
        parts.append(f"calls {record['tools/calls']:.2f}  errors {record['tools/errors']:.2f}")
    parts.append(f"{seconds_per_step:.{2 if seconds_per_step < 1 else 1}f} s/step")
    parts.append(f"ETA {format_duration(eta_seconds)}")
    if skipped := record.get("skipped"):
        parts.append(f"SKIPPED ({skipped})" if isinstance(skipped, str) else "SKIPPED")
    if record.get("frac_zero_std_groups") == 1.0:  # NOTE: every advantage is 0: only the KL term acted
        parts.append("no learning signal (every group's rewards equal)")
    return "  ".join(parts)


def print_progress(line: str, *, tty: bool) -> None:
    """Redraw the line in place on a terminal; elsewhere (a log file, CI) print one line per call."""
    # \r and ESC[K: rewrite from column 0, clearing the rest; no newline, so other output starts with \n
    print(f"\r{line}\x1b[K" if tty else line, end="" if tty else "\n", flush=True)


NO_SIGNAL_WARNING = (
    "\nwarning: {n} steps in a row without a learning signal: every group's completions got the same reward, "
    "so every advantage is 0. Likely causes: a reward that is always 0 or always 1 on this data (look at a "
    "few with --dry-run, or in rollouts.jsonl), --group-size {G} too small, or --temperature {T} too low for "
    "the completions of a prompt to differ."
)


@dataclass
class StepLog:
    """What the writing rank keeps between training steps, and what it does with each step's record: append
    metrics.jsonl, timings.jsonl, rollouts.jsonl and eval_samples.jsonl, mirror to the tracker, print progress
    and warnings."""

    out: Path
    tracker: Any  # a trackers.Tracker, or None
    t_start: float
    first_step: int  # the step the run (re)started from, for the s/step figure
    total_steps: int
    log_every: int
    group_size: int
    temperature: float
    accuracy: float | None = None  # the latest held-out accuracy, shown on the progress line
    no_signal_in_a_row: int = 0

    def first(self, record: dict, eval_samples: Sequence[dict] = ()) -> None:
        """The step-0 evaluation, before any training step: metrics.jsonl, eval_samples.jsonl (one record per
        held-out sample) and the tracker."""
        append_jsonl(self.out / "metrics.jsonl", record)
        append_jsonl(self.out / "eval_samples.jsonl", *({"step": 0, **r} for r in eval_samples))
        if self.tracker is not None:
            self.tracker.log(record, 0)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()

    def step(
        self,
        record: dict,
        timings: dict,
        completions: list[dict],
        bad_in_a_row: int,
        eval_samples: Sequence[dict] = (),
    ) -> None:
        """`eval_samples`: this step's evaluation's per-sample records (none: no evaluation), given "step"."""
        step, total = record["step"], self.total_steps
        evaluated = [{"step": step, **r} for r in eval_samples]
        files = (("metrics", [record]), ("timings", [timings]), ("rollouts", completions))
        for name, rows in (*files, ("eval_samples", evaluated)):
            append_jsonl(self.out / f"{name}.jsonl", *rows)
        self.accuracy = record.get("eval/accuracy", self.accuracy)
        if self.tracker is not None:
            self.tracker.log(record, step)
            if "eval/accuracy" in record:
                self.tracker.log_completions(completions[: self.group_size], step)
        if step % self.log_every == 0 or step == total or record["skipped"]:
            rate = (time.time() - self.t_start) / (step - self.first_step)  # seconds per step
            eta = rate * (total - step)
            line = progress_line(
                step, total, record, seconds_per_step=rate, eta_seconds=eta, accuracy=self.accuracy
            )
            print_progress(line, tty=sys.stdout.isatty())
        if record["skipped"]:
            print(f"\nstep {step}: optimizer step skipped ({record['skipped']}); {bad_in_a_row} in a row")
        self.no_signal_in_a_row = self.no_signal_in_a_row + 1 if record["frac_zero_std_groups"] == 1.0 else 0
        if self.no_signal_in_a_row == 3:  # once per streak
            print(NO_SIGNAL_WARNING.format(n=3, G=self.group_size, T=self.temperature), flush=True)


def run_summary(records: list[dict], seconds: float) -> dict:
    """steps, wall time and the first and last held-out accuracy of a run's metrics records."""
    evals = [a for _, a in series(records, "eval/accuracy")]  # finite: run.json is strict JSON
    summary = {"steps": records[-1]["step"], "wall_time_s": round(seconds, 1)}
    if evals:
        summary.update(accuracy_start=evals[0], accuracy_end=evals[-1])
    return summary


RAW, SMOOTH = "#aac3eb", "#1e55b9"  # reward: every step thin and light, the EMA thick on top
EVAL_MARK, EVAL_DOT = "#eeaa73", "#d75f14"  # evaluation marks and the accuracy line; accuracy points
SKIP_MARK, FAINT = "#cd1e1e", "0.45"  # skipped steps; a grey for what comments on the data, not shows it
PANELS = (
    ("reward/mean", "train reward (mean of the N sampled completions)", "reward", (RAW, SMOOTH)),
    ("eval/accuracy", "held-out accuracy (greedy decoding)", "accuracy", None),
    ("kl", "KL to the reference policy", "KL", ("#deb9de", "#8c2d87")),
)
EMPTY_PANEL = {
    "reward/mean": "no training step logged yet",
    "eval/accuracy": "no held-out evaluation in this run",
    "kl": "no KL in the metrics (it is logged when beta > 0)",
}


def ema(values: list[float], span: int) -> list[float]:
    """Exponential moving average, debiased (divided by 1 - decay^t) so that it does not start at 0."""
    decay = 1 - 2 / (span + 1)  # the usual span convention: weights' centre of mass (span - 1) / 2 back
    out, acc = [], 0.0
    for t, v in enumerate(values, start=1):
        acc = decay * acc + (1 - decay) * v
        out.append(acc / (1 - decay**t))
    return out


MAX_DRAWN = 1e300  # NOTE: matplotlib's ticker overflows on a range such as -1e308 .. 1e308


def series(records: list[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) of every record holding a number under `key` that a chart can place (finite, at most
    MAX_DRAWN in size: a NaN of a skipped step, or 1e308, is left out), in step order."""
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), numbers.Real) and "step" in r]
    return sorted((s, float(v)) for s, v in pts if abs(v) <= MAX_DRAWN)


def short(value: float) -> str:
    """A value for the panel headers: 4 significant digits, but never fewer than one decimal above 1000."""
    return f"{value:.1f}" if abs(value) >= 1000 else f"{value:.4g}"


def draw_noisy(ax: Axes, pts: list, colours: tuple) -> float | None:
    """A per-step series thin and light, its moving average thick on top; the last EMA (None: too few)."""
    (thin, thick), (steps, values) = colours, zip(*pts)
    if len(pts) < 10:  # too few steps to smooth: the steps themselves, as dots on a line
        ax.plot(steps, values, "o-", color=thick, lw=1.5, ms=4, label="every step")
        return None
    span = min(50, max(3, len(pts) // 10))  # about a tenth of the run
    smooth = ema(list(values), span)
    ax.plot(steps, values, color=thin, lw=1, label="every step")
    ax.plot(steps, smooth, color=thick, lw=2.5, label=f"EMA over {span} steps")
    return smooth[-1]


def draw_accuracy(ax: Axes, pts: list) -> None:
    """Evaluation points as dots on a light line, each labelled with its value while there are few."""
    steps, values = zip(*pts)
    ax.plot(steps, values, "o-", color=EVAL_MARK, mfc=EVAL_DOT, mec=EVAL_DOT, lw=2, ms=6, label="accuracy")
    if len(pts) <= 12:  # more labels would collide
        for s, v in pts:
            ax.annotate(f"{v:.2f}", (s, v), xytext=(0, 6), textcoords="offset points", ha="center", size=8)
    # NOTE: always 0 to 1, as accuracy can be, so that a constant one is not blown up; room above for labels
    ax.set(ylim=(-0.05, 1.15), yticks=[0, 0.25, 0.5, 0.75, 1])


def curves_figure(records: list[dict]) -> Figure:
    """Train reward, held-out accuracy and KL against step: three panels, one step axis."""
    figure = Figure(figsize=(9.0, 8.4), dpi=100)  # 900 x 840 pixels
    figure.set_layout_engine("constrained", w_pad=0.1, h_pad=0.1)  # labels fit, 10 white pixels around
    axes = figure.subplots(len(PANELS), sharex=True)
    evals = [s for s, _ in series(records, "eval/accuracy")]
    skipped = [r["step"] for r in records if r.get("skipped") and "step" in r]
    for ax, (key, title, y_label, colours) in zip(axes, PANELS):
        pts = series(records, key)
        ax.set_title(title, loc="left")
        if not pts:
            ax.text(0.5, 0.5, EMPTY_PANEL[key], transform=ax.transAxes, ha="center", va="center", color=FAINT)
            ax.set_yticks([])
            continue
        ax.set_ylabel(y_label)
        ax.grid(color="0.92")
        stats = f"last {short(pts[-1][1])} at step {pts[-1][0]}"
        if key == "eval/accuracy":
            draw_accuracy(ax, pts)
        else:
            smoothed = draw_noisy(ax, pts, colours)
            stats += f", EMA {short(smoothed)}" if smoothed is not None else ""
            # the marks span the panel's height (x in steps, y in axes coordinates), over the grid
            on_x = ax.get_xaxis_transform()
            if evals:
                marks = dict(colors=EVAL_MARK, linestyles=":", lw=1.3, zorder=1.8, label="evaluation")
                ax.vlines(evals, 0, 1, transform=on_x, **marks)
            if key == "reward/mean" and skipped:
                crosses = dict(color=SKIP_MARK, ms=7, mew=2, zorder=3, label="skipped step")
                ax.plot(skipped, [0.05] * len(skipped), "x", transform=on_x, **crosses)
            ax.legend(loc="best", ncols=4, fontsize="small", framealpha=0.85)  # one row: little hidden
        ax.set_title(stats, loc="right", fontsize="small", color=FAINT)
    axes[-1].set_xlabel("step")
    # whole steps, round multiples (20, not 15), and one tick for a one-step run rather than 0.96 ... 1.04
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10], min_n_ticks=1))
    return figure


def plot_curves(records: list[dict], path: Path) -> None:
    """The curves of `records` (metrics.jsonl's lines) as a PNG at `path` (900 x 840 pixels)."""
    (path := Path(path)).parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")  # renamed when whole: a full disk leaves no torn PNG
    try:
        curves_figure(records).savefig(tmp, format="png")  # a Figure with no canvas renders with Agg
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
