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
    "8 decode time per token",
    "9 kernels per decoded token",
    "10 fp32 head as run = fp32",
]
# CUDA only (7, 12), or with flash-attn on CUDA (11): skipped on the CPU, said so in the table.
SKIPPED = [
    "7 CUDA graph = eager",
    "11 FlashAttention-2 sampler = sdpa",
    "12 trunk recorded under the graph = eager",
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
    assert found == {**dict.fromkeys(CHECKS, "PASS"), **dict.fromkeys(SKIPPED, "SKIP")}, result.stdout
    assert "equal tokens for 6 of 6 rows in fp32" in result.stdout  # B = 2 x G = 3, the sampler's rows
    table = [
        line.split()[0] for line in result.stdout.splitlines() if "n/a (CPU)" in line and "ms" not in line
    ]
    assert table == ["sampling", "trunk", "reference/old", "policy", "optimizer", "step"], result.stdout
    assert f"all {len(CHECKS) + len(SKIPPED)} checks passed" in result.stdout
    report = table_rows(result.stdout)
    phases = ["sampling", "trunk", "reference/old", "policy fwd+bwd", "optimizer", "step"]
    assert [m.split(":")[0] for m in report if m.startswith("phase ")] == [f"phase {p}" for p in phases]
    assert report["phases of one default step timed with"] == "host clock"
    # T = 8: 7 decoding steps, timed within one call from the second to the last
    assert float(report["decode ms/token, eager (host clock, 5 steps)"]) > 0
    assert int(report["aten ops (CPU; no kernels) per decoded token, eager (torch.profiler)"]) > 0
    measure = "the fp32 head as run vs plain fp32: max abs difference of logp; of the gradient / its largest"
    assert report[measure] == "0.0e+00; 0.0e+00"  # an fp32 model: the same matmuls
    assert report["decode ms/token, CUDA graph replayed"] == "SKIP (CUDA only)"
    assert report["kept decode graph: allocated GiB held between calls; estimate GiB"] == "SKIP (CUDA only)"
    assert report["recorded trunk under the CUDA graph vs eager"] == "SKIP (CUDA only)"
    assert report["FlashAttention-2 sampler vs sdpa"].startswith("SKIP (")


def table_rows(stdout: str) -> dict[str, str]:
    """The closing Markdown table: measure -> value (its header row and rule aside)."""
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| measured: random Qwen2.5-VL, tiny shapes") and lines[0].endswith(
        "| value |"
    )
    return dict(line[2:-2].rsplit(" | ", 1) for line in lines[1:])


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
        **dict.fromkeys(SKIPPED, "SKIP"),
    }
    assert verdicts(result.stdout) == expected, result.stdout
    assert "FAIL  1 sampler = generate: RuntimeError: injected" in result.stdout
    assert "max |logp difference| 1.0e-03 > 1.0e-04" in result.stdout
    assert "Traceback" in result.stderr and "RuntimeError: injected" in result.stderr  # for the one who reads
    assert f"3 of {len(CHECKS) + len(SKIPPED)} checks failed" in result.stdout


def test_decode_time_per_token_leaves_out_a_load_spike_outside_the_decoding_steps():
    """The host is shared: a stall of 3 s (another process's burst) lands in the second sampling call's
    prefill. The figure is read within one call, from its second decoding step to its last, so the stall,
    outside those steps, moves it neither below zero nor by 3 s / 5 steps."""
    stall_second_prefill = [
        "import time",
        "from grpo_vlm import speedups",
        "prefill, calls = speedups._prefill, []",
        "def stalled(*args):",
        "    calls.append(1)",
        "    time.sleep(3 if len(calls) == 2 else 0)",
        "    return prefill(*args)",
        "speedups._prefill = stalled",
    ]
    result = gpu_check(*stall_second_prefill, args=[*TINY, "--checks", "8"])
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    ms_per_token = float(table_rows(result.stdout)["decode ms/token, eager (host clock, 5 steps)"])
    assert 0 < ms_per_token < 600, result.stdout


def test_checks_picks_the_checks_to_run_as_the_determinism_child_on_cuda_does():
    result = gpu_check(args=[*TINY, "--checks", "6,10"])
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert verdicts(result.stdout) == {"6 determinism": "PASS", "10 fp32 head as run = fp32": "PASS"}
    assert "all 2 checks passed" in result.stdout


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
