"""The reports of the adversarial run folders in headless Chromium: each opens within the bound, with no page
error and no console message (a policy violation, a script stopped by one bad record).

The folders are test_report_hostile.py's: a 1 MB unbroken target, 1,300 metric names on 12 lines, a step of
40,000 rows, a tool call record whose crop is "abc", a completion with a lone surrogate. The bound
(OPEN_BOUND_MS, the page's own data-settled-ms: first render and every image decoded) is a few seconds on the
2-core machine of CI; docs/report.md gives the figures measured.
"""

import json

import pytest

from full.test_report import jsonl, write_run_folder
from full.test_report_browser import chromium, open_report, problems
from full.test_report_hostile import metrics_with_many_names, rewrite
from grpo_vlm import report

OPEN_BOUND_MS = 5_000


def one_mb_target(folder):
    for name in ("rollouts.jsonl", "eval_samples.jsonl"):
        records = jsonl(folder / name)
        for record in records:
            record["target"] = {"answer": "C1=CC=C(C=C1)" * 80_000, "bbox": [4, 6, 30, 40]}
        rewrite(folder / name, records)


def forty_thousand_rows(folder):
    base = jsonl(folder / "rollouts.jsonl")[0]
    rewrite(
        folder / "rollouts.jsonl", [base | {"group": i // 8, "completion": f"row {i}"} for i in range(40_000)]
    )


def malformed_tool_call(folder):
    records = jsonl(folder / "rollouts.jsonl")
    for record in records:
        if "turns" in record:
            record["turns"][0]["call"]["images"][0]["crop"] = "abc"
    rewrite(folder / "rollouts.jsonl", records)


def lone_surrogate(folder):
    text = (folder / "rollouts.jsonl").read_text()
    (folder / "rollouts.jsonl").write_text(
        text.replace('"completion": "answer', '"completion": "\\ud83d answer')
    )


FOLDERS = {
    "1 MB target": one_mb_target,
    "1,300 metric names x 12 lines": metrics_with_many_names,
    "a step of 40,000 rows": forty_thousand_rows,
    "a tool call whose crop is 'abc'": malformed_tool_call,
    "a lone surrogate": lone_surrogate,
}


@pytest.mark.parametrize("case", FOLDERS)
def test_the_report_of_an_adversarial_folder_opens_within_the_bound(tmp_path, case):
    chromium()
    folder = write_run_folder(tmp_path / "run", steps=3)
    FOLDERS[case](folder)
    page = report.write_report(folder, tmp_path / "report.html")
    body, console = open_report(page, tmp_path)
    assert problems(body, console, pairs=True) == []
    assert int(body["data-settled-ms"]) < OPEN_BOUND_MS, json.dumps(body)
