"""The report in a real browser: headless Chromium (the Debian package) opens report.html from the file
system, runs its scripts and dumps the DOM they built; the page's own record of itself (its <body> data
attributes) and the browser's console say whether it rendered, with its images and without an error.

Skipped when no Chromium is installed, unless GRPO_REQUIRE_BROWSER=1 (CI: .ci/run installs it). A screenshot
of each report is written to the test's folder and, when REPORT_SCREENSHOT_DIR is set, there too.
"""

import html.parser
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from full.test_report import short_run, write_run_folder
from grpo_vlm import report

FLAGS = [
    "--headless",
    "--no-sandbox",  # NOTE: Chromium refuses to run as root with its sandbox
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",  # console messages: "...:CONSOLE:12] "Uncaught Error: ..."
    "--v=0",
    "--virtual-time-budget=15000",  # the page's timers and image decoding run to completion first
]


def chromium() -> str:
    """The browser's path; a skip (a failure with GRPO_REQUIRE_BROWSER=1) when there is none."""
    found = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if found is None:
        reason = "no Chromium (apt-get install chromium): the report is not checked in a browser"
        if os.environ.get("GRPO_REQUIRE_BROWSER") == "1":
            pytest.fail(f"GRPO_REQUIRE_BROWSER=1 and {reason}")
        pytest.skip(reason)
    return found


def run_chromium(page: Path, folder: Path, *extra: str) -> subprocess.CompletedProcess:
    profile = folder / f"profile-{len(list(folder.glob('profile-*')))}"  # a new, empty one each time
    command = [chromium(), *FLAGS, f"--user-data-dir={profile}", *extra, page.resolve().as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


class BodyAttributes(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.body: dict = {}

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "body":
            self.body = dict(attrs)


def open_report(page: Path, folder: Path) -> tuple[dict, list[str]]:
    """(the <body> attributes after the page's scripts ran, the console messages) of `page` in Chromium,
    and a screenshot of it beside it (and in REPORT_SCREENSHOT_DIR)."""
    dumped = run_chromium(page, folder, "--dump-dom")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    parser = BodyAttributes()
    parser.feed(dumped.stdout)
    console = [line for line in dumped.stderr.splitlines() if ":CONSOLE" in line]
    shot = folder / f"{page.stem}.png"
    run_chromium(page, folder, f"--screenshot={shot}", "--window-size=1400,2000")
    assert shot.is_file() and shot.stat().st_size > 10_000
    if where := os.environ.get("REPORT_SCREENSHOT_DIR"):
        Path(where).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(where) / shot.name)
    return parser.body, console


def problems(body: dict, console: list[str], *, pairs: bool) -> list[str]:
    """What is wrong with a rendered report: an error, a console message, an unfinished render, no group
    (or no before/after pair, `pairs`), no image loaded, a broken image."""
    found = [f"console: {line}" for line in console]
    if body.get("data-ready") != "1":
        found.append("the page's script did not finish its first render")
    if int(body.get("data-errors", 0)):
        found.append(f"{body['data-errors']} script errors")
    if int(body.get("data-groups", 0)) == 0:
        found.append("no rollout group rendered")
    if pairs and int(body.get("data-pairs", 0)) == 0:
        found.append("no before/after pair rendered")
    if int(body.get("data-images-loaded", 0)) == 0:
        found.append("no image loaded")
    if int(body.get("data-images-broken", 0)):
        found.append(f"{body['data-images-broken']} images broken")
    if int(body.get("data-missing-glyphs", 0)):  # e.g. 通过 drawn as empty boxes: no CJK font installed
        found.append(f"{body['data-missing-glyphs']} characters drawn as missing glyphs (no font has them)")
    return found


def test_the_report_of_a_real_run_renders_in_chromium(tmp_path):
    chromium()
    folder = tmp_path / "real-run"
    short_run(folder)
    body, console = open_report(folder / "report.html", tmp_path)
    has_pairs = (folder / "eval_samples.jsonl").exists()  # written by this version's trainer on
    assert problems(body, console, pairs=has_pairs) == []
    assert int(body["data-groups"]) == 2 and int(body["data-render-ms"]) < 2000


def test_a_report_with_every_field_renders_its_images_in_chromium(tmp_path):
    chromium()
    folder = write_run_folder(tmp_path / "contract-run")
    page = report.write_report(folder, tmp_path / "contract-run.html")
    body, console = open_report(page, tmp_path)
    assert problems(body, console, pairs=True) == []
    # the main chart, each group's picture and its row 0's crop, each pair's picture
    assert int(body["data-images-loaded"]) == 1 + 2 * int(body["data-groups"]) + int(body["data-pairs"])


@pytest.mark.parametrize("damage", ["image", "script"])
def test_the_browser_check_fails_on_a_broken_image_or_script(tmp_path, damage, monkeypatch):
    chromium()
    if (
        damage == "script"
    ):  # a syntax error in the page's script (the policy allows it: its hash is the page's)
        assets = tmp_path / "assets"
        assets.mkdir()
        shutil.copy(report.ASSETS / "report.css", assets)
        script = (report.ASSETS / "report.js").read_text()
        (assets / "report.js").write_text(script.replace("function render() {", "function render() {{", 1))
        monkeypatch.setattr(report, "ASSETS", assets)
    page = report.write_report(write_run_folder(tmp_path / "run"), tmp_path / f"broken-{damage}.html")
    text = page.read_text()
    if damage == "image":  # the first embedded JPEG, cut to bytes that decode to no picture
        broken = "data:image/jpeg;base64,/9j/AAAA"
        text = re.sub(r"data:image/jpeg;base64,[A-Za-z0-9+/=]+", broken, text, count=1)
    page.write_text(text)
    body, console = open_report(page, tmp_path)
    found = problems(body, console, pairs=True)
    if damage == "image":
        assert found == ["1 images broken"]
    else:
        assert "the page's script did not finish its first render" in found
        assert "1 script errors" in found and any("SyntaxError" in line for line in found)


def test_a_script_that_is_not_the_pages_own_does_not_run(tmp_path):
    """Escaping failed, say, and a completion's <script> reached the page as markup: the policy (the SHA-256
    of the page's own two scripts) blocks it, and the page counts the violation as an error."""
    chromium()
    page = report.write_report(write_run_folder(tmp_path / "run"), tmp_path / "injected.html")
    injected = '<script>document.title = "INJECTED"; document.body.dataset.injected = "1";</script>'
    page.write_text(page.read_text().replace("<main id=report>", injected + "<main id=report>", 1))
    body, console = open_report(page, tmp_path)
    assert "data-injected" not in body
    assert int(body["data-errors"]) == 1 and any("Content Security Policy" in line for line in console)
    assert int(body["data-groups"]) > 0  # the page's own script ran


def test_the_glyph_check_finds_characters_no_font_has(tmp_path):
    """The check the verdicts rely on can fail: a private-use character (U+E000) has a glyph in no font."""
    chromium()
    folder = write_run_folder(tmp_path / "run", steps=1)
    (folder / "rollouts.jsonl").write_text(
        (folder / "rollouts.jsonl").read_text().replace("answer 1/0/0", "\ue000 1/0/0")
    )
    body, _ = open_report(report.write_report(folder, tmp_path / "glyphs.html"), tmp_path)
    assert int(body["data-missing-glyphs"]) >= 1 and int(body["data-errors"]) == 0
