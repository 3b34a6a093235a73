"""Experiment trackers (`--report-to`): every step's metrics and, at each evaluation, a table of a few
completions, sent to TensorBoard, Weights & Biases or trackio.

No tracker is a dependency: each package is imported inside `open_tracker`, only when asked for; a missing
one is an ImportError naming the flag and the pip command. The standard library only at module scope.
Choices: metrics.jsonl (logs.py) is the run's record and a tracker mirrors it, numbers only (the `skipped`
reason and non-finite values stay in the JSONL); completions go as a table where the backend has one (wandb,
trackio), else as markdown (TensorBoard's text plugin), with `|` and line breaks escaped in the cells.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROJECT = "grpo-vlm"  # the wandb / trackio project every run is filed under
TRACKER_PACKAGES = ("tensorboard", "wandb", "trackio")  # each --report-to choice, named as its package
COMPLETION_COLUMNS = ("step", "sample_id", "group", "reward", "advantage", "rewards", "completion")


def completion_table(rows: list[dict]) -> list[list]:
    """Rollout records (logs.rollout_records) as COMPLETION_COLUMNS, component rewards in one cell."""
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
        """A table of a few rollout records: which prompt, the text, its rewards."""
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


def open_tracker(kind: str, run_dir: Path, config: dict, run_name: str | None = None) -> Tracker | None:
    """Start logging to `kind` ("none": no tracker, None). TensorBoard writes its events under
    run_dir/tensorboard; wandb keeps its files under run_dir; trackio has no directory argument and keeps
    its own local database ($TRACKIO_DIR, else $HF_HOME/trackio, i.e. ~/.cache/huggingface/trackio)."""
    if kind == "none":
        return None
    if kind not in TRACKER_PACKAGES:
        raise ValueError(f"--report-to {kind!r}: expected one of none, {', '.join(TRACKER_PACKAGES)}")
    try:
        module = importlib.import_module(kind)
    except ImportError as error:
        missing = f"--report-to {kind} needs the {kind} package, which is not installed: pip install {kind}"
        raise ImportError(missing) from error
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
