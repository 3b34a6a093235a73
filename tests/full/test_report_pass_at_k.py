"""The report draws held-out pass@k (`--eval-num-samples n`: eval/pass@1 .. eval/pass@n) as one curve per
evaluation, k on the x axis, instead of n small multiples against the step."""

import json
from pathlib import Path

from matplotlib.figure import Figure

from full.test_report import embedded, write_run_folder
from grpo_vlm import report


def add_pass_at_k(folder: Path, by_step: dict[int, list[float]]) -> None:
    """Each evaluation line of metrics.jsonl at a step of `by_step` gets eval/pass@1 .. pass@n."""
    path = folder / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        if record["step"] in by_step and "eval/accuracy" in record:
            record |= {f"eval/pass@{k}": v for k, v in enumerate(by_step[record["step"]], 1)}
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def watch_pass_at_k_lines(monkeypatch) -> list[tuple]:
    """(x, y, label) of every line the report's one-axes figures plot (the pass@k chart's)."""
    drawn = []

    class Watched(Figure):
        def subplots(self, *args, **kwargs):
            axes = super().subplots(*args, **kwargs)
            if not args and not kwargs:  # one axes: the pass@k chart (the grid asks for rows and columns)
                plot = axes.plot
                axes.plot = lambda *a, **k: drawn.append(([*a[0]], [*a[1]], k["label"])) or plot(*a, **k)
            return axes

    monkeypatch.setattr(report, "Figure", Watched)
    return drawn


def test_pass_at_k_is_one_chart_of_a_curve_per_evaluation_and_no_panel(tmp_path, monkeypatch):
    folder = write_run_folder(tmp_path / "run", steps=3)
    add_pass_at_k(folder, {0: [0.4, 0.6, 0.7, 0.75], 3: [0.6, 0.7, 0.75, 0.8]})
    drawn = watch_pass_at_k_lines(monkeypatch)
    data = embedded(report.build_report(folder))
    assert data["charts"]["pass_at_k"].startswith("data:image/png;base64,")
    assert drawn == [
        ([1, 2, 3, 4], [0.4, 0.6, 0.7, 0.75], "step 0"),
        ([1, 2, 3, 4], [0.6, 0.7, 0.75, 0.8], "step 3"),
    ]
    charts = data["charts"]
    charted = charts["grid_keys"] + list(charts["tables"]) + [row[0] for row in charts["rest"]]
    assert not [key for key in charted if key.startswith("eval/pass@")]


def test_a_run_without_pass_at_k_has_no_such_chart(tmp_path):
    data = embedded(report.build_report(write_run_folder(tmp_path / "run")))
    assert data["charts"]["pass_at_k"] is None


def test_at_most_eight_evaluations_are_drawn_the_first_and_the_last_among_them(monkeypatch):
    drawn = watch_pass_at_k_lines(monkeypatch)
    evaluations = [{"step": 10 * i, "eval/pass@1": i / 20, "eval/pass@2": i / 15} for i in range(12)]
    report.pass_at_k_chart(evaluations)
    labels = [label for _, _, label in drawn]
    assert len(labels) == len(set(labels)) == report.MAX_PASS_CURVES == 8
    assert labels[0] == "step 0" and labels[-1] == "step 110"
