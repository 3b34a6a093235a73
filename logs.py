"""What a run leaves behind besides its adapter: JSONL housekeeping, one record per sampled completion, the
progress line, the curves PNG and, on request, an experiment tracker (TensorBoard, Weights & Biases, trackio).

Legend: `B` prompts, `G` completions per prompt (the group), `N = B*G` rows; rows [g*G, (g+1)*G) are
prompt g's group.

Imports the standard library and PIL; torch's SummaryWriter and the wandb / trackio packages are imported
inside `open_tracker`, when `--report-to` asks for them, so no tracker is a dependency. Nothing from this
project is imported.

Choices:
- The JSONL files are the record of a run; a tracker mirrors metrics.jsonl and is never the only copy.
  They are appended one fsynced line at a time (`append_jsonl`), so a crash leaves at most one torn last
  line, and on --resume model_io.trim_jsonl cuts them back to the checkpoint's step: no step twice.
- Rollout records keep every float at full precision (Python's float repr round-trips exactly), so the
  advantages in rollouts.jsonl can be recomputed from its rewards and compared exactly; the completion
  text, not the digits, dominates the file's size.
- The curves are drawn with PIL alone (no matplotlib). The per-step reward and KL are noisy (one batch of
  N completions), so each is drawn thin and light with a debiased exponential moving average thick on top
  (the smoothing TensorBoard uses), and the x axis is shared by the three panels so that the evaluation
  marks line up with the accuracy dots.
- A tracker gets numbers only: strings (the `skipped` reason) and non-finite values (the loss of a skipped
  step) are left out of it; metrics.jsonl keeps them.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

# --------------------------------------------------------------------------------------------------
# JSONL lines: one per step, one per sampled completion


def append_jsonl(path: str | Path, record: dict) -> None:
    """One line per record, flushed and fsynced, so `tail -f` works and a crash loses at most one line."""
    with Path(path).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


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
) -> list[dict]:
    """One JSON-ready dict per sampled completion (N rows), for rollouts.jsonl.

    `samples` holds either the B prompts' samples or one per row (N, each repeated G times); every other
    list has N entries. Floats keep full precision. A length mismatch raises rather than pairing a
    completion with another prompt's sample or rewards.
    """
    N = len(texts)
    columns = {"reward": reward, "adv": adv, "lengths": lengths, "truncated": truncated, **components}
    wrong = {name: len(values) for name, values in columns.items() if len(values) != N}
    if group_size < 1 or N % group_size or wrong or len(samples) not in (N, N // group_size):
        raise ValueError(
            f"rollout_records: {N} completions, group_size {group_size}, {len(samples)} samples (expected "
            f"{N // max(group_size, 1)} or {N}); lists whose length is not {N}: {wrong}"
        )
    per_row = len(samples) == N
    rows = []
    for i in range(N):
        sample = samples[i if per_row else i // group_size]
        rows.append(
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
        )
    return rows


# --------------------------------------------------------------------------------------------------
# Progress on the terminal


def format_duration(seconds: float) -> str:
    """45s, 2m06s, 1h02m; "?" for a duration not known yet (non-finite or negative)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(
    step: int,
    total: int,
    record: dict,
    *,
    seconds_per_step: float,
    eta_seconds: float,
    accuracy: float | None,
) -> str:
    """`step  40/100  reward 1.234  kl 0.0123  acc 0.760  2.1 s/step  ETA 2m06s`, plus warnings.

    kl appears only when the record has it (beta > 0), acc only once an evaluation has run (the latest one).
    """
    parts = [f"step {step:>{len(str(total))}}/{total}"]
    if "reward/mean" in record:
        parts.append(f"reward {record['reward/mean']:.3f}")
    if "kl" in record:
        parts.append(f"kl {record['kl']:.3g}")  # 3 significant digits: early KL is far below 1e-4
    if accuracy is not None:
        parts.append(f"acc {accuracy:.3f}")
    parts.append(f"{seconds_per_step:.{2 if seconds_per_step < 1 else 1}f} s/step")
    parts.append(f"ETA {format_duration(eta_seconds)}")
    skipped = record.get("skipped")
    if skipped:
        parts.append(f"SKIPPED ({skipped})" if isinstance(skipped, str) else "SKIPPED")
    if record.get("frac_zero_std_groups") == 1.0:
        # NOTE: every advantage is 0, so the step changed nothing but the KL term
        parts.append("no learning signal (every group's rewards equal)")
    return "  ".join(parts)


def print_progress(line: str, *, tty: bool) -> None:
    """Redraw the line in place on a terminal; elsewhere (a log file, CI) print one line per call."""
    if tty:
        # \r goes back to column 0 and ESC[K clears what a longer previous line left; no newline, so the
        # next call overwrites this one (print a newline before any other output).
        sys.stdout.write(f"\r{line}\x1b[K")
        sys.stdout.flush()
    else:
        print(line, flush=True)


NO_SIGNAL_HINT = (
    "{n} steps in a row without a learning signal: every group's completions got the same reward, so every "
    "advantage is 0. Likely causes: a reward that is always 0 or always 1 on this data (look at a few with "
    "--dry-run, or in rollouts.jsonl), --group-size {G} too small, or --temperature {T} too low for the "
    "completions of a prompt to differ."
)


@dataclass
class StepLog:
    """What the writing rank keeps between training steps, and what it does with each step's record: append
    metrics.jsonl, timings.jsonl and rollouts.jsonl, mirror to the tracker, print progress and warnings."""

    out: Path
    tracker: Tracker | None
    t_start: float
    first_step: int  # the step the run (re)started from, for the s/step figure
    total_steps: int
    log_every: int
    group_size: int
    temperature: float
    accuracy: float | None = None  # the latest held-out accuracy, shown on the progress line
    no_signal_in_a_row: int = 0

    def first(self, record: dict) -> None:
        """The step-0 evaluation, before any training step: metrics.jsonl and the tracker."""
        append_jsonl(self.out / "metrics.jsonl", record)
        if self.tracker is not None:
            self.tracker.log(record, 0)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()

    def step(self, record: dict, timings: dict, completions: list[dict], bad_in_a_row: int) -> None:
        step = record["step"]
        for name, rows in (("metrics", [record]), ("timings", [timings]), ("rollouts", completions)):
            for row in rows:
                append_jsonl(self.out / f"{name}.jsonl", row)
        self.accuracy = record.get("eval/accuracy", self.accuracy)
        if self.tracker is not None:
            self.tracker.log(record, step)
            if "eval/accuracy" in record and completions:
                self.tracker.log_completions(completions[: self.group_size], step)
        seconds_per_step = (time.time() - self.t_start) / (step - self.first_step)
        if step % self.log_every == 0 or step == self.total_steps or record["skipped"]:
            eta = seconds_per_step * (self.total_steps - step)
            line = progress_line(
                step, self.total_steps, record, seconds_per_step=seconds_per_step, eta_seconds=eta,
                accuracy=self.accuracy,
            )  # fmt: skip
            print_progress(line, tty=sys.stdout.isatty())
        if record["skipped"]:
            print(f"\nstep {step}: optimizer step skipped ({record['skipped']}); {bad_in_a_row} in a row")
        self.no_signal_in_a_row = self.no_signal_in_a_row + 1 if record["frac_zero_std_groups"] == 1.0 else 0
        if self.no_signal_in_a_row == 3:  # once per streak
            hint = NO_SIGNAL_HINT.format(n=3, G=self.group_size, T=self.temperature)
            print(f"\nwarning: {hint}", flush=True)


def run_summary(records: list[dict], seconds: float) -> dict:
    """steps, wall time and the first and last held-out accuracy of a run's metrics records."""
    evals = [r for r in records if "eval/accuracy" in r]
    summary = {"steps": records[-1]["step"], "wall_time_s": round(seconds, 1)}
    if evals:
        summary.update(accuracy_start=evals[0]["eval/accuracy"], accuracy_end=evals[-1]["eval/accuracy"])
    return summary


# --------------------------------------------------------------------------------------------------
# Curves (PIL only)

WIDTH, PANEL_HEIGHT = 900, 280
INSET = 10  # pixels between the frame and the extreme data points, so no dot sits on the frame
RAW, SMOOTH = (170, 195, 235), (30, 85, 185)  # reward: every step thin and light, the EMA thick
KL_RAW, KL_SMOOTH = (222, 185, 222), (140, 45, 135)
EVAL_MARK = (238, 170, 115)  # where evaluations happened, on the reward and KL panels (dotted)
EVAL_DOT = (215, 95, 20)  # held-out accuracy points; drawn nowhere else, so they can be counted
SKIP_MARK = (205, 30, 30)
INK, FAINT, GRID = (35, 35, 35), (115, 115, 115), (232, 232, 232)


PANELS = (
    # key, title, y-axis label, (thin colour, thick colour), bounds of the y axis
    ("reward/mean", "train reward (mean of the N sampled completions)", "reward", (RAW, SMOOTH), None),
    ("eval/accuracy", "held-out accuracy (greedy decoding)", "accuracy", None, (0.0, 1.0)),
    ("kl", "KL to the reference policy", "KL", (KL_RAW, KL_SMOOTH), None),
)
EMPTY_PANEL = {
    "reward/mean": "no training step logged yet",
    "eval/accuracy": "no held-out evaluation in this run",
    "kl": "no KL in the metrics (it is logged when beta > 0)",
}


@dataclass
class Axis:
    """Data limits [lo, hi] (already expanded to round values) and the tick values with their labels."""

    lo: float
    hi: float
    ticks: list[float]
    labels: list[str]


def load_font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """PIL's bundled scalable font; Pillow < 10.1 has only a fixed bitmap one (load_default takes no size)."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:
        return ImageFont.load_default()


def nice_axis(lo: float, hi: float, *, count: int = 5, integer: bool = False, widen: bool = True) -> Axis:
    """About `count` ticks at 1, 2, 2.5 or 5 times a power of ten; `widen`: limits pushed out to round ticks.

    Without `widen` (the step axis) only the lower limit moves, down to a tick (so a run from step 1 starts
    its axis at 0); the upper one stays at the last step rather than leaving an empty stretch after it.
    """
    raw = (hi - lo) / (count - 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    # step counts stay whole: no 2.5 below 25, and nothing below 1
    multiples = (1, 2, 2.5, 5, 10) if not integer or magnitude >= 10 else (1, 2, 5, 10)
    step = next(m * magnitude for m in multiples if m * magnitude >= raw * (1 - 1e-9))
    if integer:
        step = max(1, round(step))
    first = math.floor(lo / step + 1e-9)  # the 1e-9s: 0.3 / 0.1 is 2.9999999999999996
    last = math.ceil(hi / step - 1e-9) if widen else math.floor(hi / step + 1e-9)
    ticks = [k * step for k in range(first, last + 1)]
    decimals = 0 if integer else max(0, -math.floor(math.log10(step) + 1e-9)) + (step / magnitude == 2.5)
    # + 0.0 turns -0.0 into 0.0, so the zero tick is not labelled "-0.0"
    labels = [f"{round(t, decimals) + 0.0:.{decimals}f}" for t in ticks]
    return Axis(ticks[0], ticks[-1] if widen else hi, ticks, labels)


def y_axis(values: list[float], bounds: tuple[float, float] | None) -> Axis:
    """The y axis of a panel; `bounds` (accuracy: 0..1) caps limits that the data does not reach beyond."""
    lo, hi = min(values), max(values)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        # NOTE: a constant series (e.g. every reward 0) has no range; centre it in one
        pad = max(0.5, 0.05 * abs(hi))
        lo, hi = (lo - pad if lo < 0 or lo - pad >= 0 else 0.0), hi + pad  # not below 0 if no value is
    axis = nice_axis(lo, hi)
    if bounds is not None:
        low, high = max(axis.lo, bounds[0]), min(axis.hi, bounds[1])
        keep = [i for i, t in enumerate(axis.ticks) if low - 1e-9 <= t <= high + 1e-9]
        axis = Axis(low, high, [axis.ticks[i] for i in keep], [axis.labels[i] for i in keep])
    return axis


def ema(values: list[float], span: int) -> list[float]:
    """Exponential moving average, debiased (divided by 1 - decay^t) so that it does not start at 0."""
    decay = 1 - 2 / (span + 1)  # the usual span convention: weights' centre of mass (span - 1) / 2 back
    out, acc = [], 0.0
    for t, v in enumerate(values, start=1):
        acc = decay * acc + (1 - decay) * v
        out.append(acc / (1 - decay**t))
    return out


def series(records: list[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) of every record holding a finite number under `key`, in step order."""
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), numbers.Real) and "step" in r]
    return sorted((s, float(v)) for s, v in pts if math.isfinite(v))


def text_size(draw: ImageDraw.ImageDraw, text: str, font) -> tuple[int, int]:
    """Width, and height from the drawing origin (so that it includes the space above the glyphs)."""
    x0, _, x1, y1 = draw.textbbox((0, 0), text, font=font)
    return x1 - x0, y1


def draw_vertical_text(image: Image.Image, center: tuple[int, int], text: str, font, fill) -> None:
    """Text rotated 90 degrees (read bottom to top), for the y-axis label: PIL draws horizontal text only."""
    probe = ImageDraw.Draw(image)
    w, h = text_size(probe, text, font)
    mask = Image.new("L", (w + 4, h + 4), 0)
    ImageDraw.Draw(mask).text((2, 0), text, font=font, fill=255)
    mask = mask.rotate(90, expand=True)
    corner = (center[0] - mask.width // 2, center[1] - mask.height // 2)
    image.paste(Image.new("RGB", mask.size, fill), corner, mask)


def draw_legend(draw: ImageDraw.ImageDraw, right: int, y: int, items: list[tuple], font) -> None:
    """Swatches with labels, right-aligned at `right`; kinds: thin, thick, dotted, dot, cross."""
    x = right
    for kind, colour, label in reversed(items):
        x -= text_size(draw, label, font)[0]
        draw.text((x, y), label, font=font, fill=INK)
        x -= 26
        cy = y + 8
        if kind in ("thin", "thick"):
            draw.line([(x, cy), (x + 20, cy)], fill=colour, width=1 if kind == "thin" else 3)
        elif kind == "dotted":
            for yy in range(cy - 7, cy + 7, 5):
                draw.line([(x + 10, yy), (x + 10, yy + 2)], fill=colour)
        elif kind == "dot":
            draw.ellipse((x + 6, cy - 4, x + 14, cy + 4), fill=colour)
        else:
            draw_crosses(draw, [x + 10], cy)
        x -= 18


def draw_crosses(draw: ImageDraw.ImageDraw, xs: list[int], y: int) -> None:
    """Small red crosses centred at (x, y): the skipped optimizer steps."""
    for x in xs:
        draw.line([(x - 4, y - 4), (x + 4, y + 4)], fill=SKIP_MARK, width=2)
        draw.line([(x - 4, y + 4), (x + 4, y - 4)], fill=SKIP_MARK, width=2)


def draw_axes(draw: ImageDraw.ImageDraw, frame: tuple, x_axis: Axis, y_axis: Axis, to_pixel, font) -> None:
    """Grid, tick marks and tick labels on both axes, then the frame."""
    left, _, right, bottom = frame
    for t, label in zip(y_axis.ticks, y_axis.labels):
        y = to_pixel(x_axis.lo, t)[1]
        draw.line([(left + 1, y), (right - 1, y)], fill=GRID)
        draw.line([(left - 4, y), (left, y)], fill=INK)
        w, h = text_size(draw, label, font)
        draw.text((left - 8 - w, y - h // 2 - 1), label, font=font, fill=INK)
    for t, label in zip(x_axis.ticks, x_axis.labels):
        x = to_pixel(t, y_axis.lo)[0]
        draw.line([(x, bottom), (x, bottom + 4)], fill=INK)
        draw.text((x - text_size(draw, label, font)[0] // 2, bottom + 6), label, font=font, fill=INK)
    draw.rectangle(frame, outline=FAINT)


def draw_noisy(draw: ImageDraw.ImageDraw, pts: list, colours: tuple, to_pixel) -> tuple[list, float | None]:
    """A per-step series thin and light, its moving average thick on top; the legend items and last EMA."""
    thin, thick = colours
    xy = [to_pixel(s, v) for s, v in pts]
    if len(pts) < 10:  # too few steps to smooth: the steps themselves, as dots on a line
        if len(xy) > 1:
            draw.line(xy, fill=thick, width=2)
        for x, y in xy:
            draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=thick)
        return [("dot", thick, "every step")], None
    span = min(50, max(3, len(pts) // 10))  # about a tenth of the run
    smooth = ema([v for _, v in pts], span)
    draw.line(xy, fill=thin, width=1)
    draw.line([to_pixel(s, v) for (s, _), v in zip(pts, smooth)], fill=thick, width=3, joint="curve")
    return [("thin", thin, "every step"), ("thick", thick, f"EMA over {span} steps")], smooth[-1]


def draw_accuracy(draw: ImageDraw.ImageDraw, pts: list, frame: tuple, to_pixel, font) -> None:
    """Evaluation points as dots on a light line, each labelled with its value while there are few."""
    xy = [to_pixel(s, v) for s, v in pts]
    if len(xy) > 1:
        draw.line(xy, fill=EVAL_MARK, width=2)
    for x, y in xy:
        draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=EVAL_DOT)
    if len(pts) > 12:  # labels would collide
        return
    left, top, right, _ = frame
    for (x, y), (_, v) in zip(xy, pts):
        label = f"{v:.2f}"
        w, h = text_size(draw, label, font)
        ty = y - h - 8 if y - h - 8 > top + 2 else y + 7  # above the dot, below it at the top of the frame
        draw.text((min(max(x - w // 2, left + 3), right - w - 3), ty), label, font=font, fill=INK)


def draw_vertical_marks(draw: ImageDraw.ImageDraw, steps: list, frame: tuple, to_pixel) -> None:
    """Dotted vertical lines at the given steps (PIL has no dashed lines: short segments)."""
    for s in steps:
        x = to_pixel(s, 0)[0]
        for y in range(frame[1] + 2, frame[3] - 2, 6):
            draw.line([(x, y), (x, y + 2)], fill=EVAL_MARK)


def pixel_mapping(frame: tuple, x_axis: Axis, y_axis: Axis):
    """(step, value) -> pixel in `frame`, y pointing up, INSET pixels inside the frame on every side."""
    left, top, right, bottom = frame

    def to_pixel(x: float, y: float) -> tuple[int, int]:
        px = left + INSET + (x - x_axis.lo) / (x_axis.hi - x_axis.lo) * (right - left - 2 * INSET)
        py = bottom - INSET - (y - y_axis.lo) / (y_axis.hi - y_axis.lo) * (bottom - top - 2 * INSET)
        return round(px), round(py)

    return to_pixel


def short(value: float) -> str:
    """A value for the panel headers: 4 significant digits, but never fewer than one decimal above 1000."""
    return f"{value:.1f}" if abs(value) >= 1000 else f"{value:.4g}"


def draw_panel_frame(draw: ImageDraw.ImageDraw, frame: tuple, message: str, font) -> None:
    """The empty frame of a panel with nothing to draw, and why."""
    draw.rectangle(frame, outline=GRID)
    w, h = text_size(draw, message, font)
    draw.text(
        ((frame[0] + frame[2] - w) // 2, (frame[1] + frame[3] - h) // 2), message, font=font, fill=FAINT
    )


def plot_curves(records: list[dict], path: Path) -> None:
    """Train reward, held-out accuracy and KL against step, three panels on one PNG (900 x 840 pixels).

    Each panel: title and last value on the first line, the legend on the second, then the plot with its
    y-axis label and ticks on the left and step ticks below. The step axis is the same in all three.
    """
    fonts = {"title": load_font(15), "text": load_font(13), "tick": load_font(12)}
    steps = [r["step"] for r in records if isinstance(r.get("step"), numbers.Real)]
    x_lo, x_hi = (min(steps), max(steps)) if steps else (0, 1)
    if x_hi - x_lo < 1:  # a single step: a short range around it rather than a zero-width one
        x_lo = max(0, x_lo - 1)
        x_hi = x_lo + 2
    x_axis = nice_axis(x_lo, x_hi, integer=True, widen=False)
    panels = [(spec, series(records, spec[0])) for spec in PANELS]
    y_axes = [y_axis([v for _, v in pts], spec[4]) if pts else None for spec, pts in panels]
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    widest = max((text_size(measure, t, fonts["tick"])[0] for a in y_axes if a for t in a.labels), default=0)
    left = 12 + 18 + 8 + widest + 8  # border, y label, gap, tick labels, tick mark; the same in every panel

    image = Image.new("RGB", (WIDTH, PANEL_HEIGHT * len(PANELS)), "white")
    draw = ImageDraw.Draw(image)
    evals = [s for s, _ in series(records, "eval/accuracy")]
    skipped = [r["step"] for r in records if r.get("skipped") and "step" in r]
    for p, ((key, title, y_label, colours, _), pts) in enumerate(panels):
        top = p * PANEL_HEIGHT
        frame = (left, top + 58, WIDTH - 32, top + PANEL_HEIGHT - 50)
        draw.text((left, top + 12), title, font=fonts["title"], fill=INK)
        if not pts:
            draw_panel_frame(draw, frame, EMPTY_PANEL[key], fonts["text"])
            continue
        to_pixel = pixel_mapping(frame, x_axis, y_axes[p])
        draw_axes(draw, frame, x_axis, y_axes[p], to_pixel, fonts["tick"])
        draw_vertical_text(image, (12 + 9, (frame[1] + frame[3]) // 2), y_label, fonts["text"], INK)
        w = text_size(draw, "step", fonts["text"])[0]
        draw.text(((frame[0] + frame[2] - w) // 2, frame[3] + 24), "step", font=fonts["text"], fill=INK)
        stats = f"last {short(pts[-1][1])} at step {pts[-1][0]}"
        legend = []
        if key == "eval/accuracy":
            draw_accuracy(draw, pts, frame, to_pixel, fonts["tick"])
        else:
            draw_vertical_marks(draw, evals, frame, to_pixel)
            if key == "reward/mean" and skipped:
                draw_crosses(draw, [to_pixel(s, 0)[0] for s in skipped], frame[3] - 8)
            legend, smoothed = draw_noisy(draw, pts, colours, to_pixel)
            stats += f", EMA {short(smoothed)}" if smoothed is not None else ""
            legend += [("dotted", EVAL_MARK, "evaluation")] if evals else []
            legend += [("cross", SKIP_MARK, "skipped step")] if key == "reward/mean" and skipped else []
        title_w = text_size(draw, title, fonts["title"])[0]
        draw.text((left + title_w + 14, top + 14), stats, font=fonts["tick"], fill=FAINT)
        draw_legend(draw, frame[2], top + 35, legend, fonts["tick"])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


# --------------------------------------------------------------------------------------------------
# Experiment trackers (optional; each package is imported only when asked for)

PROJECT = "grpo-vlm"  # the wandb / trackio project every run is filed under
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
COMPLETION_COLUMNS = ("step", "sample_id", "group", "reward", "advantage", "rewards", "completion")


def completion_table(rows: list[dict]) -> list[list]:
    """The rows as COMPLETION_COLUMNS, component rewards joined into one readable cell."""
    table = []
    for row in rows:
        parts = ", ".join(f"{name} {value:.3g}" for name, value in (row.get("rewards") or {}).items())
        cells = {**row, "rewards": parts, "sample_id": str(row.get("sample_id"))}
        table.append([cells.get(column) for column in COMPLETION_COLUMNS])
    return table


def completions_markdown(rows: list[dict]) -> str:
    """A markdown table; `|` and line breaks inside a cell are escaped so that they do not break it."""
    header = "| " + " | ".join(COMPLETION_COLUMNS) + " |"
    lines = [header, "|" + "---|" * len(COMPLETION_COLUMNS)]
    for cells in completion_table(rows):
        text = [
            f"{c:.4g}" if isinstance(c, float) else str(c).replace("|", "\\|").replace("\n", "<br>")
            for c in cells
        ]
        lines.append("| " + " | ".join(text) + " |")
    return "\n".join(lines)


@dataclass
class Tracker:
    """An open tracker. `backend`: a SummaryWriter (tensorboard), or the wandb / trackio module, whose
    module-level log and finish act on the run that `init` started."""

    kind: str
    backend: Any

    def log(self, metrics: dict, step: int) -> None:
        """The finite numbers of a metrics record (bools as 0/1), under their own names, at `step`."""
        scalars = {
            name: float(value)
            for name, value in metrics.items()
            if name != "step" and isinstance(value, numbers.Real) and math.isfinite(value)
        }
        if not scalars:
            return
        if self.kind == "tensorboard":
            for name, value in scalars.items():
                self.backend.add_scalar(name, value, global_step=step)
        else:
            self.backend.log(scalars, step=step)

    def log_completions(self, rows: list[dict], step: int) -> None:
        """A table of a few rollout records (see `rollout_records`): which prompt, the text, its rewards."""
        if not rows:
            return
        if self.kind == "tensorboard":  # the text plugin renders markdown, tables included
            self.backend.add_text("completions", completions_markdown(rows), global_step=step)
        elif hasattr(self.backend, "Table"):  # wandb; trackio since its early versions
            table = self.backend.Table(columns=list(COMPLETION_COLUMNS), data=completion_table(rows))
            self.backend.log({"completions": table}, step=step)
        else:
            self.backend.log({"completions": completions_markdown(rows)}, step=step)

    def close(self) -> None:
        """Flush and end the run (the wandb run is marked finished)."""
        if self.kind == "tensorboard":
            self.backend.close()
        else:
            self.backend.finish()


def import_tracker(kind: str) -> Any:
    """The tracker's package, or an ImportError that says which flag wanted it and how to install it."""
    package = TRACKER_PACKAGES[kind]
    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise ImportError(
            f"--report-to {kind} needs the {package} package, which is not installed: pip install {package}"
        ) from error


def open_tracker(kind: str, run_dir: Path, config: dict, run_name: str | None = None) -> Tracker | None:
    """Start logging to `kind` ("none": no tracker, None). TensorBoard writes its events under
    run_dir/tensorboard; wandb keeps its files under run_dir; trackio has no directory argument and keeps
    its own local database ($TRACKIO_DIR, else $HF_HOME/trackio, i.e. ~/.cache/huggingface/trackio)."""
    if kind == "none":
        return None
    if kind not in TRACKER_PACKAGES:
        raise ValueError(f"--report-to {kind!r}: expected one of none, {', '.join(TRACKER_PACKAGES)}")
    module = import_tracker(kind)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if kind == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        # flush every 30 s (default 120) so that a live `tensorboard --logdir` follows the run closely
        writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), flush_secs=30)
        writer.add_text(
            "config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", global_step=0
        )
        return Tracker(kind, writer)
    if kind == "wandb":
        module.init(project=PROJECT, dir=str(run_dir), config=config, name=run_name)
    else:
        module.init(project=PROJECT, name=run_name, config=config)
    return Tracker(kind, module)
