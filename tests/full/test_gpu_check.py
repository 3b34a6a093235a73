"""scripts/gpu_check.py at tiny shapes on the CPU, run as a user runs it (a subprocess), so that the script a
GPU's first hour depends on cannot rot: every check passes and the phase table prints; a wrong number or an
exception fails its own check, the others still run, and the exit status is 1."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--shapes", "tiny"]
CHECKS = [
    "1 sampler = generate",
    "2 left-padded rows",
    "3 recorded trunk = full forward",
    *(f"4 step, {name}" for name in ("dapo", "grpo", "dr_grpo", "gspo", "cispo", "sapo", "rloo")),
    *(
        f"4 step, {name}"
        for name in ("plain path", "micro-batches of 2 rows, checkpointing", "num_iterations 2")
    ),
    "5 phases",
    "6 determinism",
]


def gpu_check(*prelude: str, args: list[str] = TINY) -> subprocess.CompletedProcess:
    """The script in a fresh interpreter, after the Python lines `prelude` (which may patch a module)."""
    run = f"import runpy, sys; sys.argv = {['scripts/gpu_check.py', *args]!r}"
    code = "\n".join([*prelude, run, "runpy.run_path('scripts/gpu_check.py', run_name='__main__')"])
    command = [sys.executable, "-c", code]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


def verdicts(stdout: str) -> dict[str, str]:
    """check label -> PASS / FAIL / SKIP, from the lines `VERDICT  label: figure`."""
    lines = [line.split("  ", 1) for line in stdout.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")]
    return {label.partition(": ")[0]: verdict for verdict, label in lines}


def test_every_check_passes_at_tiny_shapes_on_the_cpu_and_the_phase_table_prints():
    result = gpu_check()
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    found = verdicts(result.stdout)
    assert found == {**dict.fromkeys(CHECKS, "PASS"), "7 CUDA graph = eager": "SKIP"}, result.stdout
    assert "equal tokens for 6 of 6 rows in fp32" in result.stdout  # B = 2 x G = 3, the sampler's rows
    table = [
        line.split()[0] for line in result.stdout.splitlines() if "n/a (CPU)" in line and "ms" not in line
    ]
    assert table == ["sampling", "trunk", "reference/old", "policy", "optimizer", "step"], result.stdout
    assert f"all {len(CHECKS) + 1} checks passed" in result.stdout


def test_a_wrong_figure_or_an_exception_fails_only_its_own_checks_and_the_script_exits_1():
    shifted_full_forward = [  # a full forward 1e-3 off: the recorded trunk no longer matches it
        "import grpo",
        "full = grpo.completion_logprobs",
        "grpo.completion_logprobs = lambda *a, **k: (full(*a, **k)[0] + 1e-3, None)",
    ]
    generate_raises = [  # generate: the sampler check and the plain path's step
        "def broken(*args, **kwargs): raise RuntimeError('injected')",
        "grpo.sample_completions = broken",
    ]
    result = gpu_check(*shifted_full_forward, *generate_raises)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    failed = ["1 sampler = generate", "3 recorded trunk = full forward", "4 step, plain path"]
    expected = {
        **dict.fromkeys(CHECKS, "PASS"),
        **dict.fromkeys(failed, "FAIL"),
        "7 CUDA graph = eager": "SKIP",
    }
    assert verdicts(result.stdout) == expected, result.stdout
    assert "FAIL  1 sampler = generate: RuntimeError: injected" in result.stdout
    assert "max |logp difference| 1.0e-03 > 1.0e-04" in result.stdout
    assert "Traceback" in result.stderr and "RuntimeError: injected" in result.stderr  # for the one who reads
    assert f"3 of {len(CHECKS) + 1} checks failed" in result.stdout


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--group-size", "1", "must be >= 2, got 1"),
        ("--lora-last-k", "7", "must be <= the 6 blocks of tiny, got 7"),
    ],
)
def test_a_bad_flag_exits_2_naming_it_before_any_model_is_built(flag, value, message):
    result = gpu_check(args=[*TINY, flag, value])
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    assert result.stderr.strip() == f"error: {flag}: {message}"
    assert result.stdout == ""
