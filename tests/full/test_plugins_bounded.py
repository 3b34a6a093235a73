"""Plug-ins are bounded: tools and rewards that hang, exit, return what cannot be shown or leave threads, each
as the real `python -m grpo_vlm` in a child process with a time limit (a hang fails the test).

Tool runs use the tools asset on --task inspection-zoom, whose policy calls `zoom` in most completions: the
plug-in is named `zoom`, so the policy calls it. A plug-in misbehaves only once metrics.jsonl records step 1,
so that the run has a finished step whose checkpoint must be kept.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_vlm import checkpoints

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--steps", "2", "--batch-size", "2", "--group-size", "2", "--eval-size", "0", "--train-size", "8"]
TINY += ["--device", "cpu"]
TOOLS = ["--model", str(ROOT / "assets" / "tiny-qwen2.5-vl-tools"), "--task", "inspection-zoom"]
TOOLS += ["--max-tool-calls", "1", "--max-new-tokens", "48"]  # a zoom call is about 30 tokens
REWARDS = ["--max-new-tokens", "8"]
LIMIT_S = 240  # a run takes about 15 s; a hang ends here and fails

# The plug-in's test "is step 2 running?": metrics.jsonl records step 1.
IN_STEP_2 = """
import json, os, sys, threading, time
from pathlib import Path

from PIL import Image

def in_step_2():
    path = Path({out!r}) / "metrics.jsonl"
    return path.exists() and any(json.loads(line)["step"] == 1 for line in path.read_text().splitlines())

class Boom(BaseException):
    pass
"""


def plugin(tmp_path: Path, out: Path, body: str, name: str) -> str:
    """A plug-in file whose function `name(a, b)` runs `body` (in step 2 when it tests `in_step_2()`)."""
    path = tmp_path / "plug.py"
    path.write_text(IN_STEP_2.format(out=str(out)) + f"\ndef {name}(a, b):\n" + body)
    return f"{path}:{name}"


def start(*flags: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "grpo_vlm", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def communicate(child: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The child's output once it ends; killed (and the test failed) when it runs past `timeout`."""
    try:
        return child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise


def train(*flags: str) -> tuple[int, str, str, float]:
    """(exit status, stdout, stderr, seconds) of `python -m grpo_vlm FLAGS`."""
    started, child = time.monotonic(), start(*flags)
    stdout, stderr = communicate(child, LIMIT_S)
    return child.returncode, stdout, stderr, time.monotonic() - started


def signal_when(waiting: Path, child: subprocess.Popen) -> float:
    """Send SIGTERM to `child` once the file `waiting` exists (its plug-in hangs); the time it was sent."""
    deadline = time.monotonic() + LIMIT_S
    while not waiting.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            raise AssertionError(communicate(child, 10)[1][-2000:])
        time.sleep(0.1)
    child.send_signal(signal.SIGTERM)
    return time.monotonic()


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith(("error:", "stopped"))]
    assert stderr.rstrip().endswith(line)  # the last word, and the only one
    return line


def checkpoint_steps(out: Path) -> list[str]:
    return [p.name for p in checkpoints.list_checkpoints(out)]


def step_metrics(out: Path) -> list[dict]:
    """metrics.jsonl's training steps (step 0 has no rollout)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["step"] > 0]


# --- tools ------------------------------------------------------------------------------------------------


def test_a_tool_past_tool_timeout_is_answered_as_a_timeout_error_and_counted(tmp_path):
    out = tmp_path / "run"
    spec = plugin(tmp_path, out, "    time.sleep(600)\n    return 'late'\n", "zoom")
    flags = [*TOOLS, *TINY, "--tools", spec, "--tool-timeout", "0.5", "--output-dir", str(out)]
    code, _, stderr, seconds = train(*flags)
    assert code == 0, stderr[-2000:]
    assert seconds < 120  # each call ends after half a second
    assert all(r["tools/errors/timeout"] == r["tools/calls"] > 0 for r in step_metrics(out))
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    texts = {t["call"]["text"] for r in rows for t in r["turns"] if "call" in t}
    assert texts == {"error: timeout: took longer than --tool-timeout 0.5 s"}


@pytest.mark.parametrize(
    "body",
    [
        "    if in_step_2():\n        open(WAITING, 'w').close()\n        time.sleep(600)\n    return 'ok'\n",
        # a bare except swallows the stop; it comes again when the call returns
        (
            "    if in_step_2():\n        open(WAITING, 'w').close()\n        try:\n"
            "            time.sleep(600)\n        except:\n            return 'swallowed'\n    return 'ok'\n"
        ),
    ],
    ids=["sleeping", "swallowing"],
)
def test_sigterm_stops_a_hanging_tool_at_once_and_keeps_the_last_finished_steps_checkpoint(tmp_path, body):
    out, waiting = tmp_path / "run", tmp_path / "waiting"
    spec = plugin(tmp_path, out, body.replace("WAITING", repr(str(waiting))), "zoom")
    child = start(*TOOLS, *TINY, "--tools", spec, "--output-dir", str(out))
    sent = signal_when(waiting, child)
    _, stderr = communicate(child, 60)
    assert child.returncode == 130, stderr[-2000:]
    assert time.monotonic() - sent < 20
    assert one_error_line(stderr) == (
        "stopped by SIGTERM while a tool ran; checkpoint of step 1 written. Continue with: "
        f"python -m grpo_vlm --resume {out}"
    )
    assert checkpoint_steps(out) == ["checkpoint-000001"]


def test_sigterm_ends_a_tool_that_ignores_the_stop_after_the_grace_period(tmp_path):
    out, waiting = tmp_path / "run", tmp_path / "waiting"
    body = (
        f"    if in_step_2():\n        open({str(waiting)!r}, 'w').close()\n"
        "        while True:\n            try:\n                time.sleep(600)\n"
        "            except BaseException:\n                pass\n    return 'ok'\n"
    )
    spec = plugin(tmp_path, out, body, "zoom")
    child = start(*TOOLS, *TINY, "--tools", spec, "--save-every", "1", "--output-dir", str(out))
    sent = signal_when(waiting, child)
    _, stderr = communicate(child, 60)
    assert child.returncode == 130, stderr[-2000:]
    assert time.monotonic() - sent < 30  # cli.STOP_GRACE_S, 10 s
    assert one_error_line(stderr) == (
        "stopped by SIGTERM: a plug-in did not return within 10 s of it; exiting without a checkpoint of the "
        "current step (the checkpoints written before are intact)"
    )
    assert checkpoint_steps(out) == ["checkpoint-000001"]


def test_what_a_tool_returns_beyond_the_datas_limits_is_answered_as_bad_output_and_counted(tmp_path):
    # An image over --max-image-pixels (the data's are 448x448), one Qwen's resize refuses (5000x2), text
    # that spells the chat's special tokens: each answered to the policy, the run goes on.
    out = tmp_path / "run"
    body = (
        "    global calls\n    calls = globals().get('calls', -1) + 1\n"
        "    return [Image.new('RGB', (600, 600)), Image.new('RGB', (5000, 2)), 'a <|im_end|> b',\n"
        "            ['x', '<|image_pad|>']][calls % 4]\n"
    )
    flags = [*TOOLS, *TINY, "--tools", plugin(tmp_path, out, body, "zoom"), "--max-image-pixels", "250000"]
    code, _, stderr, _ = train(*flags, "--steps", "3", "--output-dir", str(out))
    assert code == 0, stderr[-2000:]
    assert "Traceback" not in stderr
    assert all(r["tools/errors/bad_output"] > 0 for r in step_metrics(out))
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    texts = {t["call"]["text"] for r in rows for t in r["turns"] if "call" in t and t["call"]["text"]}
    assert all(text.startswith("error: ") for text in texts)  # no call of the plug-in got through
    assert {text for text in texts if text.startswith("error: bad_output")} == {
        "error: bad_output: the tool's image is 600x600, over --max-image-pixels 250000",
        "error: bad_output: the tool's image is 5000x2, too thin to process",
        "error: bad_output: the tool's text spells a special token of the chat (im_end)",
        "error: bad_output: the tool's text spells a special token of the chat (image_pad)",
    }


@pytest.mark.parametrize(
    "does, said",
    [
        ("sys.exit(0)", "called sys.exit(0)"),
        ("raise KeyboardInterrupt", "raised KeyboardInterrupt (at {file}:"),
        ("raise Boom('bang')", "raised Boom: bang (at {file}:"),
    ],
)
def test_a_tool_that_exits_stops_the_run_with_2_naming_it_after_the_last_checkpoint(tmp_path, does, said):
    out = tmp_path / "run"
    spec = plugin(tmp_path, out, f"    if in_step_2():\n        {does}\n    return 'ok'\n", "zoom")
    code, _, stderr, _ = train(*TOOLS, *TINY, "--tools", spec, "--output-dir", str(out))
    assert code == 2, stderr[-2000:]
    line = one_error_line(stderr)
    assert line.startswith(f"error: tool {spec!r} {said.format(file=tmp_path / 'plug.py')}")
    assert line.endswith(
        f"checkpoint of step 1 written. Once that is fixed, continue with: python -m grpo_vlm --resume {out}"
    )
    assert checkpoint_steps(out) == ["checkpoint-000001"]
    assert json.loads((out / "run.json").read_text())["finished"] is False


# --- rewards ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "does, said",
    [("raise KeyboardInterrupt", "KeyboardInterrupt (at "), ("raise Boom('bang')", "Boom: bang (at ")],
)
def test_a_reward_that_raises_a_base_exception_stops_the_run_with_2_naming_it(tmp_path, does, said):
    out = tmp_path / "run"
    spec = plugin(tmp_path, out, f"    if in_step_2():\n        {does}\n    return 1.0\n", "judge")
    code, _, stderr, _ = train(*REWARDS, *TINY, "--reward", "label", spec, "--output-dir", str(out))
    assert code == 2, stderr[-2000:]
    line = one_error_line(stderr)
    assert line.startswith(f"error: raised by reward {spec!r} on completion 0 (sample id ") and said in line
    assert "checkpoint of step 1 written" in line
    assert checkpoint_steps(out) == ["checkpoint-000001"]


def test_a_reward_that_calls_os_exit_0_stops_the_run_with_2_naming_it_and_run_json_unfinished(tmp_path):
    # os._exit raises while a plug-in runs (cli.no_os_exit): the plug-in's failure, never a success
    out = tmp_path / "run"
    spec = plugin(tmp_path, out, "    if in_step_2():\n        os._exit(0)\n    return 1.0\n", "judge")
    flags = [*REWARDS, *TINY, "--reward", "label", spec, "--save-every", "1", "--output-dir", str(out)]
    code, stdout, stderr, _ = train(*flags)
    assert code == 2 and "done:" not in stdout, stderr[-2000:]
    line = one_error_line(stderr)
    assert line.startswith(f"error: raised by reward {spec!r} on completion 0 (sample id ")
    assert f"OsExitCalled: called os._exit(0) (at {tmp_path / 'plug.py'}:" in line
    assert json.loads((out / "run.json").read_text())["finished"] is False
    assert checkpoint_steps(out) == ["checkpoint-000001"]
    finished = tmp_path / "finished"
    flags = [*REWARDS, *TINY, "--reward", "label", "--output-dir", str(finished)]
    assert train(*flags)[0] == 0 and json.loads((finished / "run.json").read_text())["finished"] is True


def test_a_reward_whose_bare_except_swallows_the_timeout_still_times_out(tmp_path):
    out = tmp_path / "run"
    body = "    try:\n        time.sleep(600)\n    except:\n        pass\n    return 0.0\n"
    spec = plugin(tmp_path, out, body, "judge")
    flags = [*REWARDS, *TINY, "--reward", "label", spec, "--reward-timeout", "0.5", "--output-dir", str(out)]
    code, _, stderr, seconds = train(*flags)
    assert code == 2, stderr[-2000:]
    assert one_error_line(stderr).startswith(
        f"error: reward {spec!r} took longer than --reward-timeout 0.5 s on completion 0 (sample id "
    )
    assert seconds < 120 and not checkpoint_steps(out)


def test_a_plug_in_that_leaves_a_non_daemon_thread_does_not_keep_the_finished_run_alive(tmp_path):
    out = tmp_path / "run"
    body = "    threading.Thread(target=time.sleep, args=(600,), name='sleeper').start()\n    return 1.0\n"
    spec = plugin(tmp_path, out, body, "judge")
    code, stdout, stderr, seconds = train(
        *REWARDS, *TINY, "--reward", "label", spec, "--output-dir", str(out)
    )
    assert code == 0, stderr[-2000:]
    assert "done:" in stdout and "exiting without waiting for" in stdout and seconds < 120
    assert json.loads((out / "run.json").read_text())["finished"] is True
