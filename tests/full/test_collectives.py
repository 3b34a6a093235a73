"""What a step sends between ranks (distributed.py), on 2 gloo ranks started by torchrun: rollouts.jsonl's
rows and their thumbnails go to the writing rank only, in one collective; a two-rank run's rollouts.jsonl
holds every rank's rows once, with every thumbnail they name."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GATHER = """
import json, sys, torch
from grpo_vlm import distributed
rank, world = distributed.init_distributed(torch.device("cpu"))
sent = [{"rank": rank, "rows": list(range(rank + 2))}, {"jpeg": "x" * (1000 * (rank + 1))}]
calls = []
real = torch.distributed.all_gather_object
torch.distributed.all_gather_object = lambda *a, **k: calls.append("all_gather_object") or real(*a, **k)
got = distributed.gather_to_writer(sent)
json.dump({"got": got, "all_gathers": calls}, open(sys.argv[1] + f"/rank{rank}.json", "w"))
distributed.finish_distributed()
"""


def torchrun(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *argv]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_what_only_the_writer_needs_reaches_rank_0_alone_in_rank_order(tmp_path):
    (tmp_path / "gather.py").write_text(GATHER)
    torchrun(str(tmp_path / "gather.py"), str(tmp_path), cwd=tmp_path)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    sent = [[{"rank": r, "rows": list(range(r + 2))}, {"jpeg": "x" * (1000 * (r + 1))}] for r in range(2)]
    assert rank0["got"] == sent[0] + sent[1] and rank1["got"] == []  # nothing sent back to rank 1
    assert rank0["all_gathers"] == rank1["all_gathers"] == []  # a gather to one rank, not an all-gather


def test_a_two_rank_run_logs_every_ranks_rows_once_with_the_thumbnails_they_name(tmp_path):
    out = tmp_path / "run"
    flags = "--device cpu --train-size 8 --eval-size 4 --batch-size 2 --group-size 2 --max-new-tokens 6"
    torchrun("-m", "grpo_vlm", *flags.split(), "--steps", "2", "--output-dir", str(out), cwd=tmp_path)
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1] * 8 + [2] * 8  # 2 ranks x 2 prompts x G = 2, once each
    named = {entry["thumb"] for row in rows for entry in row["thumbs"]}
    named |= {entry["seen"] for row in rows for entry in row["thumbs"] if entry["seen"]}
    assert named and all((out / name).is_file() for name in named)
