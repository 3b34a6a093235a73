"""Several ranks (torchrun, gloo, CPU) equal one process: the same LoRA update and one writer of every file.

The equivalence test fixes one rollout of 2B prompts x G completions on the shipped tiny VLM (LoRA B made
non-zero so that every A and B gets a gradient), then takes one `trainer.policy_update` (mu = 2 AdamW steps,
micro-batches of 4 rows) (a) in this process on all 2B*G rows and (b) on 2 gloo ranks, rank r on its B whole
groups, rows
[r*B*G, (r+1)*B*G). Each rank normalises its loss by the global counts and the LoRA gradients are summed, so
gradients, loss, stats and the LoRA weights after the update must match (a) to float tolerance, on both
ranks and for every loss_type. Gradients are compared too: AdamW's first steps are nearly invariant to the
gradient's scale, so equal weights alone would not catch a missing or doubled 1/R.

Then `train.py` itself under torchrun: one writer of metrics, timings, checkpoints and adapter, and a resumed
two-rank run equal to an uninterrupted one (each rank reseeds from (seed, step, rank)).
The ranks are real processes: `torchrun --standalone` (it picks a free port) runs this file or train.py.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import grpo
import lora
import model_io
from full.helpers import lora_model_with_gradients, make_run, train_args
from grpo_vlm import checkpoints, dataset, distributed, objectives, speedups, tasks, trainer

ROOT = Path(__file__).resolve().parents[2]
B, G, WORLD = 2, 4, 2  # per-rank prompts, group size, ranks
TIMEOUT_S = 120


def update_args(loss_type: str) -> trainer.Args:
    return train_args(
        device="cpu",
        batch_size=B,
        group_size=G,
        max_new_tokens=12,
        loss_type=loss_type,
        num_iterations=2,  # stores old_logp, and the second iteration's ratio is not 1 (the clip can bind)
        micro_batch_size=4,
        beta=0.04,
        lr=2e-3,
    )


def rank_rollout(
    run: trainer.Run, fixed: dict, args: trainer.Args, rank: int, world_size: int
) -> trainer.Rollout:
    """Rank `rank`'s share of the fixed rollout: whole groups, rows [rank*n, (rank+1)*n), with their
    images."""
    n = fixed["completion_ids"].shape[0] // world_size
    rows, inputs = speedups.split_rows(fixed["inputs"], n)[rank]
    ids = fixed["completion_ids"][rows]
    return trainer.Rollout(
        prompts=None,  # the update reads the chunks' rows only
        completion_ids=ids,
        mask=fixed["mask"][rows],
        truncated=fixed["truncated"][rows],
        texts=[],
        samples=[],
        reward=fixed["reward"][rows],
        components={},
        adv=fixed["adv"][rows],
        chunks=speedups.row_chunks(run.model, inputs, ids, None, run.speed),
        old_logp=fixed["old_logp"][rows],
        ref_logp=fixed["ref_logp"][rows],
    )


def one_update(fixed: dict, rank: int, world_size: int) -> dict:
    """For each loss_type: one policy_update from the fixed LoRA weights; the gradients, weights and stats
    after."""
    model, _, _ = lora_model_with_gradients()
    results = {}
    for loss_type in objectives.LOSS_TYPES:
        args = update_args(loss_type)
        with torch.no_grad():
            for p, saved in zip(lora.lora_parameters(model), fixed["lora"]):
                p.copy_(saved)
        params = lora.lora_parameters(model)
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
        scheduler = model_io.cosine_with_warmup(optimizer, warmup_steps=args.warmup_steps, total_steps=10)
        run = make_run(model, args, optimizer=optimizer, scheduler=scheduler, rank=rank, world=world_size)
        ro = rank_rollout(run, fixed, args, rank, world_size)
        stats = trainer.policy_update(run, ro, args, args.loss.beta)
        results[loss_type] = {
            "grads": [p.grad.clone() for p in params],
            "params": [p.detach().clone() for p in params],
            "stats": stats,
        }
    return results


@pytest.fixture(scope="module")
def fixed_rollout(tmp_path_factory) -> Path:
    """One rollout of WORLD*B prompts, saved for the ranks: inputs, completions, advantages, old/ref
    log-probs."""
    model, tokenizer, image_processor = lora_model_with_gradients()
    args = update_args("dapo")
    prompts = dataset.batch_for_step(tasks.make_task("inspection", 32, seed=0), 0, WORLD * B, seed=0)
    torch.manual_seed(1)
    reward_fns = trainer.resolve_rewards(args, "inspection")
    run = make_run(model, args, tokenizer=tokenizer, image_processor=image_processor, reward_fns=reward_fns)
    ro = trainer.rollout(run, prompts, args)
    trainer.frozen_logprobs(run, ro, args)
    for r in range(WORLD):  # otherwise a rank would have no policy-gradient signal to sum
        assert ro.adv[r * B * G : (r + 1) * B * G].abs().sum() > 0, "pick another seed"
    path = tmp_path_factory.mktemp("distributed") / "rollout.pt"
    fields = ("inputs", "completion_ids", "mask", "truncated", "reward", "adv", "old_logp", "ref_logp")
    lora_weights = [p.detach().clone() for p in lora.lora_parameters(model)]
    torch.save({"lora": lora_weights, **{k: getattr(ro, k) for k in fields}}, path)
    return path


def torchrun(*argv: str, cwd: Path, succeeds: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1")  # PYTHONPATH: conftest's
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    done = subprocess.run(
        [*command, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert (done.returncode == 0) == succeeds, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def two_rank_results(fixed_rollout) -> list[dict]:
    torchrun(str(Path(__file__).resolve()), str(fixed_rollout), cwd=fixed_rollout.parent)
    return [torch.load(fixed_rollout.parent / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def one_process_results(fixed_rollout) -> dict:
    return one_update(torch.load(fixed_rollout), rank=0, world_size=1)  # no process group: plain train.py


@pytest.mark.parametrize("loss_type", objectives.LOSS_TYPES)
def test_two_ranks_with_b_prompts_each_give_the_one_process_lora_update_on_2b_prompts(
    fixed_rollout, one_process_results, two_rank_results, loss_type
):
    one = one_process_results[loss_type]
    delta = {"grads": 0.0, "params": 0.0}
    for rank, results in enumerate(two_rank_results):
        got = results[loss_type]
        for name in ("grads", "params"):
            for a, b in zip(got[name], one[name], strict=True):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=f"rank {rank} {name}")
                delta[name] = max(delta[name], (a - b).abs().max().item())
        assert got["stats"] == pytest.approx(one["stats"], abs=1e-6)
    # The step moved the weights far more than the tolerance, so the comparison above means something.
    moved = max((a - b).abs().max().item() for a, b in zip(one["params"], torch.load(fixed_rollout)["lora"]))
    largest_grad = max(g.abs().max().item() for g in one["grads"])
    assert moved > 1e-4 and largest_grad > 1e-4
    print(
        f"{loss_type}: 2 ranks vs 1 process, max |delta| grads {delta['grads']:.1e} "
        f"(largest {largest_grad:.1e})"
    )
    print(f"{loss_type}: 2 ranks vs 1 process, max |delta| weights {delta['params']:.1e} (step {moved:.1e})")


def test_ranks_take_consecutive_slices_of_one_global_batch_and_one_rank_is_the_plain_batch():
    samples = [{"id": i} for i in range(10)]
    for step in range(4):  # crosses an epoch boundary (10 // 4 = 2 global batches per epoch)
        slices = [dataset.batch_for_step(samples, step, 2, 0, r, 2) for r in range(2)]
        assert slices[0] + slices[1] == dataset.batch_for_step(samples, step, 4, 0)
        assert dataset.batch_for_step(samples, step, 2, 0, 0, 1) == dataset.batch_for_step(
            samples, step, 2, 0
        )


FLAGS = (
    "--device cpu --batch-size 2 --group-size 2 --train-size 16 --eval-size 4 --eval-every 1 --save-every 1"
)


def train_on_two_ranks(out: Path, *flags: str) -> subprocess.CompletedProcess:
    return torchrun("-m", "grpo_vlm", *FLAGS.split(), *flags, "--output-dir", str(out), cwd=out.parent)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("main") / "run"
    return out, train_on_two_ranks(out, "--steps", "2")


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_main_on_two_ranks_writes_metrics_checkpoints_and_adapter_once(two_rank_run):
    out, done = two_rank_run
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]  # one writer: no line twice
    assert all("eval/accuracy" in r for r in records) and "reward/mean" in records[1]
    assert len((out / "timings.jsonl").read_text().splitlines()) == 2
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000001", "checkpoint-000002"]
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "curves.png").is_file()
    assert done.stdout.count("done:") == 1 and "2 ranks x 2 prompts" in done.stdout


def test_resume_on_two_ranks_reproduces_an_uninterrupted_two_rank_run(two_rank_run, tmp_path):
    # Each rank reseeds its sampling from (seed, step, rank), so rank 0's RNG state in the checkpoint
    # suffices.
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    shutil.copytree(two_rank_run[0], resumed)
    train_on_two_ranks(resumed, "--steps", "3", "--resume", str(resumed))
    train_on_two_ranks(straight, "--steps", "3")
    assert [r["step"] for r in read_metrics(resumed)] == [0, 1, 2, 3]
    assert (resumed / "metrics.jsonl").read_bytes() == (straight / "metrics.jsonl").read_bytes()
    adapters = [load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (resumed, straight)]
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[1])


# --- the held-out evaluation, split across the ranks -------------------------------------------------------


def held_out_evaluation(rank: int, world_size: int) -> dict:
    """trainer.evaluate of 5 held-out samples and their blanked copies in batches of 2: the metrics, the
    per-sample records and thumbnail file names, and the size of every batch this rank decoded."""
    model, tokenizer, image_processor = lora_model_with_gradients()
    args = train_args(device="cpu", max_new_tokens=8, eval_image_ablation="blank")
    held_out = tasks.make_task("inspection", 5, split="test", seed=0)
    reward_fns = trainer.resolve_rewards(args, "inspection")
    run = make_run(
        model,
        args,
        tokenizer=tokenizer,
        image_processor=image_processor,
        reward_fns=reward_fns,
        accuracy_name=reward_fns[0].name,
        held_out=held_out,
        held_out_ablated=dataset.ablate_images(held_out, "blank", seed=0),
        rank=rank,
        world=world_size,
    )
    decoded, real_sample, real_batch_size = [], speedups.sample, trainer.EVAL_BATCH_SIZE

    def sample(model, inputs, *args, **options):
        decoded.append(len(inputs["input_ids"]))
        return real_sample(model, inputs, *args, **options)

    speedups.sample = sample
    trainer.EVAL_BATCH_SIZE = 2  # batches [0, 2), [2, 4), [4, 5): rank 0 takes the first and the last
    try:
        metrics, samples, made = trainer.evaluate(run, args)
        return {"metrics": metrics, "samples": samples, "thumbs": sorted(made), "decoded": decoded}
    finally:
        speedups.sample, trainer.EVAL_BATCH_SIZE = real_sample, real_batch_size


def test_two_ranks_evaluate_half_the_held_out_batches_each_and_get_the_one_process_metrics(tmp_path):
    one = held_out_evaluation(0, 1)
    torchrun(str(Path(__file__).resolve()), "evaluate", str(tmp_path), cwd=tmp_path)
    ranks = [json.loads((tmp_path / f"evaluate{r}.json").read_text()) for r in range(WORLD)]
    assert one["decoded"] == [2, 2, 1] * 2  # one process: every batch of the held-out set, then the blanked
    assert [r["decoded"] for r in ranks] == [[2, 1] * 2, [2] * 2]  # the same batches, shared out
    assert set(one["metrics"]) == {f"eval/{m}{s}" for m in ("accuracy", "reward") for s in ("", "_blank")}
    for r in ranks:  # each sample's greedy completion is the one of the same batch: the same numbers
        assert r["metrics"] == pytest.approx(one["metrics"], abs=1e-12)
        # every rank's records, in held-out order, and every rank's thumbnails: the one process's
        assert [s["index"] for s in r["samples"]] == list(range(5))
        assert r["samples"] == one["samples"] and r["thumbs"] == one["thumbs"]


def test_a_reward_failing_on_another_ranks_evaluation_share_stops_every_rank_after_rank_0s_checkpoint(
    tmp_path,
):
    # Fails on rank 1 from its 6th completion (step 0's evaluation: 1, step 1's training: 2 x 2).
    plugin = tmp_path / "judge.py"
    plugin.write_text(
        "import os\ncalls = 0\n"
        "def judge(completion, sample):\n"
        "    global calls\n    calls += 1\n"
        "    if calls > 5 and os.environ['RANK'] == '1':  # step 1's evaluation\n"
        "        raise ValueError('judge is broken')\n"
        "    return 1.0\n"
    )
    out = tmp_path / "run"
    flags = f"{FLAGS} --eval-size 51 --max-new-tokens 4 --save-every 100 --steps 2"  # rank 1: sample 50
    command = [*flags.split(), "--reward", f"{plugin}:judge", "--output-dir", str(out)]
    done = torchrun("-m", "grpo_vlm", *command, cwd=tmp_path, succeeds=False)
    assert (
        f'File "{ROOT / "grpo_vlm" / "train.py"}"' not in done.stderr
    )  # no rank's traceback (torchrun prints its own)
    assert "error: raised by reward" in done.stderr  # rank 1's own error
    assert (  # and rank 0's: it wrote the checkpoint before any rank exited
        "error: evaluation on rank 1: raised by reward" in done.stderr
        and "judge is broken (at " in done.stderr
        and "checkpoint of step 1 written. Once that is fixed, continue with: "
        f"python -m grpo_vlm --resume {out}"
        in done.stderr
    )
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000001"]
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1] and "eval/accuracy" not in records[1]


# --- dynamic sampling chooses over the global batch -------------------------------------------------------


def scripted_rollout(run: trainer.Run, prompts: list[dict], args: trainer.Args, *, chunks: bool = True):
    """A rollout whose completions and rewards are functions of the prompts alone (no model, no RNG), so one
    process and the ranks see the same groups: prompts whose id is a multiple of 3 get equal rewards."""
    G, eos = args.group_size, 2
    rows = [(p["id"], j) for p in prompts for j in range(G)]
    ids = torch.tensor([[10 + i % 7, 11 + j, eos if (i + j) % 2 else 12, eos] for i, j in rows])
    mask, truncated = grpo.completion_mask(ids, eos)
    reward = torch.tensor([0.5 if i % 3 == 0 else float(j % 2) for i, j in rows])
    batch = trainer.prompt_batch(run, prompts, args)
    return trainer.Rollout(
        prompts=batch,
        completion_ids=ids,
        mask=mask,
        truncated=truncated,
        texts=[f"{i}/{j}" for i, j in rows],
        samples=[p for p in prompts for _ in range(G)],
        reward=reward,
        components={"r": reward},
        adv=trainer.advantages(reward, {"r": reward}, run, args),
        chunks=[],
    )


def dynamic_choice(rank: int, world_size: int, batch_size: int) -> list[dict]:
    """groups_with_signal at steps 1..3 on text prompts with `scripted_rollout`: what each step trains on."""
    tokenizer = model_io.load_model(model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32)[1]
    args = train_args(batch_size=batch_size, group_size=G, dynamic_sampling=True, max_sampling_rounds=3)
    args.speed.trunk_reuse = args.speed.shared_prefill = False
    run = make_run(None, args, tokenizer=tokenizer, rank=rank, world=world_size)
    run.train_samples = [{"id": i, "prompt": f"question {i}"} for i in range(40)]
    real_rollout, trainer.rollout = trainer.rollout, scripted_rollout  # extra rounds sample through it
    try:
        steps = []
        for step in (1, 2, 3):
            prompts = dataset.batch_for_step(run.train_samples, step - 1, batch_size, 0, rank, world_size)
            ro, counts = trainer.groups_with_signal(run, scripted_rollout(run, prompts, args), step, args)
            texts = [t for t, m in zip(ro.texts, ro.mask.any(dim=1)) if m]
            steps.append(
                {
                    "ids": [s["id"] for s in ro.samples[::G]],
                    "texts": texts,
                    "reward": ro.reward.tolist(),
                    **counts,
                }
            )
    finally:
        trainer.rollout = real_rollout
    return steps


def test_dynamic_sampling_on_two_ranks_trains_on_the_groups_one_process_chooses_from_the_global_batch(
    tmp_path,
):
    one = dynamic_choice(0, 1, WORLD * B)
    torchrun(str(Path(__file__).resolve()), "dynamic", str(tmp_path), cwd=tmp_path)
    ranks = [json.loads((tmp_path / f"dynamic{r}.json").read_text()) for r in range(WORLD)]
    assert any(s["dynamic/rounds"] > 1 for s in one)  # some step needed a second round
    for step, whole in enumerate(one):
        assert ranks[0][step]["ids"] + ranks[1][step]["ids"] == whole["ids"]
        assert ranks[0][step]["reward"] + ranks[1][step]["reward"] == whole["reward"]
        assert ranks[0][step]["texts"] + ranks[1][step]["texts"] == whole["texts"]
        for key in ("dynamic/groups_sampled", "dynamic/groups_kept", "dynamic/rounds"):
            assert ranks[0][step][key] == ranks[1][step][key] == whole[key]


if __name__ == "__main__":  # one rank, launched by the tests above through torchrun
    torch.set_num_threads(1)
    rank, world_size = distributed.init_distributed(torch.device("cpu"))
    if sys.argv[1] == "dynamic":
        out = Path(sys.argv[2]) / f"dynamic{rank}.json"
        out.write_text(json.dumps(dynamic_choice(rank, world_size, B)))
    elif sys.argv[1] == "evaluate":
        (Path(sys.argv[2]) / f"evaluate{rank}.json").write_text(
            json.dumps(held_out_evaluation(rank, world_size))
        )
    else:
        rollout_path = Path(sys.argv[1])
        results = one_update(torch.load(rollout_path), rank, world_size)
        torch.save(results, rollout_path.parent / f"rank{rank}.pt")
    distributed.finish_distributed()
