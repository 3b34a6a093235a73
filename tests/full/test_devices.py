"""The step's tensor code on a device other than the CPU: every tensor it makes follows its inputs (#22).

A CPU-only machine cannot see a tensor made on the CPU meet one on a GPU, which CUDA refuses. Here the inputs
live on a stand-in device: inside `on_other_device()`, a tensor made with `device=OTHER` (or moved there)
reports `OTHER` but keeps real CPU data, and every op refuses, as CUDA does, to mix it with a CPU tensor
other than a 0-dim one. So a `torch.tensor(...)` made without the inputs' device fails the moment it meets
them, while `.item()`, `.tolist()`, boolean indexing and quantiles still compute on the data.

OTHER is the meta device, which every build knows. torch's FakeTensorMode with a fake "cuda" device was the
first choice, but on a CPU-only build it can neither slice (`x[1:]`: "PyTorch is not linked with support for
cuda devices") nor read a value (`.item()`), both of which the step does; a plain meta tensor has no data.

Covered: grpo's advantages (every scale and baseline, clipping, GDPO), the loss of every loss_type at token
and sequence level (delta, the bias-corrected KL, a token mask, the batch totals) and its gradient, the mask,
log-probs and entropy, high-entropy selection, rollout metrics, the recompute's inputs; speedups' sampler
draw, row splitting and fp32 row-by-row log-probs with their backward; distributed.batch_counts; train.py's
advantages (GDPO's reward weights) and dynamic sampling's choice (`groups_with_signal`, one round).
Then a whole `trainer.train_step` and `trainer.evaluate` with the shipped tiny model, its LoRA and AdamW on
the stand-in device, on the default path and the plain one (sampling, rewards, the trunk, the recompute,
the update, with GDPO, mu = 2, 80/20, micro-batches, dynamic sampling, checkpointing and image ablation).

Then the flags that pick kernels: --attn-implementation, --deterministic and torchrun's --dist-timeout.
"""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import tyro
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from transformers import AutoImageProcessor, AutoTokenizer

import grpo
import lora
import model_io
from grpo_vlm import cli, dataset, distributed, metrics, model_files, objectives, speedups, trainer

OTHER = torch.device("meta")


def _is_other(x) -> bool:
    return isinstance(x, (str, torch.device)) and str(x) == str(OTHER)


class OnOther(torch.Tensor):
    """A tensor that reports OTHER as its device and holds its values in a CPU tensor, `cpu`."""

    @staticmethod
    def __new__(cls, cpu: torch.Tensor):
        layout = dict(strides=cpu.stride(), storage_offset=cpu.storage_offset(), dtype=cpu.dtype)
        return torch.Tensor._make_wrapper_subclass(
            cls, cpu.shape, **layout, device=OTHER, requires_grad=cpu.requires_grad
        )

    def __init__(self, cpu: torch.Tensor):
        self.cpu_values = cpu

    def __repr__(self) -> str:
        return f"OnOther({self.cpu_values})"

    def tolist(self):  # torch refuses .tolist() on a subclass; a GPU tensor gives its values
        return self.cpu_values.tolist()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("OnOther tensors work inside on_other_device() only")


def _unwrap(x):
    return x.cpu_values if isinstance(x, OnOther) else torch.device("cpu") if _is_other(x) else x


def _wrap(x):
    return OnOther(x) if isinstance(x, torch.Tensor) and not isinstance(x, OnOther) else x


INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default}


class _Ops(TorchDispatchMode):
    """Every op: refuse a CPU tensor (not 0-dim, not an index, which CUDA accepts too) meeting OnOther ones,
    else compute on the CPU values; the results are OnOther when an input was, or when the op was told to
    make them on OTHER."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        operands = (args[:1] + args[2:], kwargs) if func in INDEXING else (args, kwargs)
        tensors = [t for t in tree_leaves(operands) if isinstance(t, torch.Tensor)]
        other = any(isinstance(t, OnOther) for t in tensors)
        cpu = [t for t in tensors if not isinstance(t, OnOther) and t.dim() > 0]
        if other and cpu:
            shape = tuple(cpu[0].shape)
            raise RuntimeError(f"{func}: a {cpu[0].device} tensor {shape} meets tensors on another device")
        device = kwargs.get("device")
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        return tree_map(_wrap, out) if (other and device is None) or _is_other(device) else out


def _listed(index):
    return OnOther(torch.tensor(index)) if isinstance(index, list) else index


class _Factories(TorchFunctionMode):
    """torch.tensor, torch.as_tensor, Tensor.new_tensor, Tensor.to(tensor) and indexing with a list place
    values without an op that _Ops would see: make them on the CPU, then wrap."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.new_tensor and isinstance(args[0], OnOther):
            return OnOther(torch.tensor(args[1], dtype=kwargs.get("dtype") or args[0].dtype))
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[0], OnOther):
            index = tree_map(_listed, args[1], is_leaf=lambda i: isinstance(i, list))  # x[[1, 2]], x[:, [1]]
            return func(args[0], index, *args[2:])
        targets = [x for x in tree_leaves((args[1:], kwargs)) if isinstance(x, OnOther)]
        if func is torch.Tensor.to and targets:  # .to(other_tensor): its device and dtype
            return func(args[0], OTHER, targets[0].dtype)
        if func in (torch.tensor, torch.as_tensor) and _is_other(kwargs.get("device")):
            return OnOther(
                func(*tree_map(_unwrap, args), **dict(kwargs, device="cpu"))
            )  # data: maybe OnOther
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_other_device():
    with _Factories(), _Ops():
        yield


def on_other(values, dtype=None) -> torch.Tensor:
    return torch.as_tensor(values, dtype=dtype, device=OTHER)


def assert_on_other(*tensors) -> None:
    for t in tensors:
        assert isinstance(t, OnOther) and t.device == OTHER, t


@pytest.fixture
def other_device():
    with on_other_device():
        yield


# --- the stand-in device itself ---------------------------------------------------------------------------


def test_the_stand_in_device_refuses_a_cpu_tensor_as_cuda_does_and_computes_on_values(other_device):
    x = on_other([0.0, 1.0, 2.0, 3.0])
    with pytest.raises(RuntimeError, match="meets tensors on another device"):
        x + torch.tensor([1.0, 1.0, 1.0, 1.0])
    with pytest.raises(RuntimeError, match="meets tensors on another device"):
        torch.isin(x, torch.as_tensor([1.0, 2.0]))
    assert_on_other(x + torch.tensor(1.0), x[x > 1], torch.arange(4, device=x.device), x.new_tensor(2.0))
    assert_on_other(torch.tensor([1.0]).to(x), torch.tensor([1.0]).to(x.device), torch.zeros_like(x))
    assert (x * 2).sum().item() == 12.0 and x[x > 1].tolist() == [2.0, 3.0]
    assert float(torch.quantile(x, 0.5)) == 1.5 and not isinstance(x.cpu(), OnOther)


# --- grpo.py and objectives.py ----------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("baseline", ["group", "rloo", "batch"])
def test_group_advantages_follow_the_rewards_device(scale, baseline, other_device):
    rewards = on_other([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])  # a zero-variance group too
    config = objectives.AdvantageConfig(adv_scale=scale, adv_baseline=baseline, adv_clip=1.5)
    adv = objectives.advantages(rewards, None, None, 2, config)
    assert_on_other(adv)
    assert adv.shape == (6,)


def test_gdpo_advantages_take_reward_weights_made_on_the_cpu_to_the_components_device(other_device):
    components = on_other([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    config = objectives.AdvantageConfig(multi_objective_aggregation="normalize_then_sum", adv_clip=2.0)
    adv = objectives.advantages(
        on_other([1.0, 1.0, 2.0, 1.0]), components, torch.tensor([1.0, 0.5]), 2, config
    )
    assert_on_other(adv, objectives.normalized_reward_sum(components, torch.tensor([1.0, 0.5]), 2))


def test_train_advantages_make_gdpo_weights_on_the_rewards_device(other_device):
    args = trainer.Args()
    args.group_size, args.adv.multi_objective_aggregation = 2, "normalize_then_sum"
    run = types.SimpleNamespace(
        reward_fns=[types.SimpleNamespace(weight=1.0), types.SimpleNamespace(weight=0.5)]
    )
    components = {"a": on_other([1.0, 0.0, 1.0, 1.0]), "b": on_other([0.0, 1.0, 0.0, 1.0])}
    assert_on_other(trainer.advantages(on_other([1.0, 1.0, 1.0, 2.0]), components, run, args))


def loss_inputs(N: int = 4, T: int = 5):
    gen = torch.Generator().manual_seed(0)
    logp = on_other(-torch.rand(N, T, generator=gen)).requires_grad_()
    old_logp = on_other(-torch.rand(N, T, generator=gen))
    ref_logp = on_other(-torch.rand(N, T, generator=gen))
    mask = on_other(torch.arange(T)[None] < torch.tensor([[5], [3], [1], [4]]))
    return logp, old_logp, ref_logp, on_other([1.0, -1.0, 0.5, -0.5]), mask


@pytest.mark.parametrize("loss_type", objectives.LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_every_loss_its_stats_and_its_gradient_follow_the_log_probs_device(loss_type, level, other_device):
    logp, old_logp, ref_logp, adv, mask = loss_inputs()
    config = objectives.LossConfig(loss_type=loss_type, importance_sampling_level=level, beta=0.04, delta=4.0)
    config.use_bias_correction_kl = level == "token"
    num_rows, num_tokens = distributed.batch_counts(mask)
    totals = objectives.BatchTotals(num_rows=num_rows, num_tokens=num_tokens)
    assert_on_other(totals.num_tokens)
    token_mask = objectives.high_entropy_mask(on_other(torch.rand(4, 5)), mask, 0.5)
    options = dict(token_mask=token_mask, totals=totals, max_completion_length=5)
    loss, stats = objectives.grpo_loss(logp, old_logp, ref_logp, adv, mask, config, **options)
    assert_on_other(loss)
    assert set(stats) == {"clip_frac_low", "clip_frac_high", "ratio_mean", "kl"}
    loss.backward()
    assert_on_other(logp.grad)


def test_mask_log_probs_entropy_and_high_entropy_selection_follow_their_inputs(other_device):
    ids = on_other([[5, 1, 0], [5, 6, 7], [1, 1, 1]])
    mask, truncated = grpo.completion_mask(ids, [1, 2])
    assert_on_other(mask, truncated, grpo.completion_mask(ids, 1)[0])
    assert mask.tolist() == [[True, True, False], [True, True, True], [True, False, False]]
    logits = on_other(torch.randn(3, 3, 8)).requires_grad_()
    logp, entropy = grpo.logprobs_from_logits(logits, ids, temperature=0.7, return_entropy=True)
    logp.sum().backward()
    assert_on_other(logp, entropy, logits.grad, grpo.kl_k3(logp, logp.detach() - 0.1))
    assert_on_other(objectives.high_entropy_mask(entropy, mask, 0.2, pool=entropy[mask]))


def test_rollout_metrics_and_recompute_inputs_follow_their_inputs(other_device):
    rewards, mask = on_other([1.0, 0.0, 1.0, 1.0]), on_other([[True, False], [True, True]] * 2)
    measured = metrics.rollout_metrics(
        rewards, {"a": rewards}, mask, on_other([False, True] * 2), on_other([True, False] * 2), 2
    )
    assert measured["frac_zero_std_groups"] == 0.5 and measured["completion_length/correct"] == 1.0
    inputs = {
        "input_ids": on_other([[0, 3, 5, 4, 9]] * 2),
        "attention_mask": on_other([[0, 1, 1, 1, 1]] * 2),
        "mm_token_type_ids": on_other([[0, 0, 1, 0, 0]] * 2),
        "pixel_values": on_other(torch.randn(8, 6)),
        "image_grid_thw": on_other([[1, 2, 2]] * 2),
    }
    assert_on_other(*grpo.recompute_inputs(inputs, on_other([[7, 1]] * 2)).values())
    text = {key: inputs[key] for key in ("input_ids", "attention_mask")}
    assert_on_other(*grpo.recompute_inputs(text, on_other([[7, 1]] * 2)).values())


# --- speedups.py ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (0.7, 0.8)])
def test_the_samplers_draw_follows_the_logits_device(temperature, top_p, other_device):
    suppressed = torch.zeros(16, dtype=torch.bool, device=OTHER)
    suppressed[[3, 4]] = True
    token = speedups._draw(
        on_other(torch.randn(4, 16)), temperature=temperature, top_p=top_p, suppressed=suppressed
    )
    assert_on_other(token)
    assert not set(token.tolist()) & {3, 4}


def test_fp32_row_by_row_log_probs_and_their_backward_follow_the_hidden_states_device(other_device):
    hidden = on_other(torch.randn(3, 4, 8).bfloat16()).requires_grad_()
    weight = on_other(torch.randn(32, 8).bfloat16()).requires_grad_()
    ids = on_other(torch.randint(0, 32, (3, 4)))
    logp, entropy = speedups.logprobs_row_by_row(hidden, weight, ids, temperature=0.7, return_entropy=True)
    logp.sum().backward()
    assert_on_other(logp, entropy, hidden.grad, weight.grad)
    assert logp.dtype == torch.float32 and hidden.grad.dtype == torch.bfloat16


def test_split_rows_keeps_each_chunks_images_on_their_device(other_device):
    inputs = {
        "input_ids": on_other([[3, 5, 4, 9]] * 3),
        "attention_mask": on_other([[1, 1, 1, 1]] * 3),
        "mm_token_type_ids": on_other([[0, 1, 0, 0]] * 3),
        "pixel_values": on_other(torch.randn(12, 6)),
        "image_grid_thw": on_other([[1, 2, 2]] * 3),
    }
    for _, chunk in speedups.split_rows(inputs, 2):
        assert_on_other(*chunk.values())


# --- train.py: dynamic sampling's choice --------------------------------------------------------------------


def test_dynamic_samplings_rollout_of_the_kept_groups_is_made_on_the_run_device(other_device):
    args = trainer.Args(batch_size=2, group_size=2, max_sampling_rounds=1, dynamic_sampling=True)
    args.samples.train_size, args.samples.eval_size = 4, 0
    samples, _ = dataset.load_samples(args.samples)
    path = model_io.DEFAULT_MODEL
    tokenizer, image_processor = AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
    tokenizer.padding_side = "left"
    weights = [types.SimpleNamespace(weight=1.0)]
    run = trainer.Run(None, tokenizer, image_processor, OTHER, train_samples=samples, reward_fns=weights)
    ids = on_other([[9, 1, 0], [9, 9, 1], [8, 1, 0], [7, 7, 7]])  # (N, T)
    mask, truncated = grpo.completion_mask(ids, 1)
    reward = on_other([1.0, 1.0, 0.0, 1.0])  # group 0 without signal, group 1 with
    fields = dict(prompts=None, completion_ids=ids, mask=mask, truncated=truncated, texts=list("abcd"))
    fields.update(samples=[], reward=reward, components={"format": reward}, adv=reward, chunks=[])
    kept, counts = trainer.groups_with_signal(run, trainer.Rollout(**fields), 1, args)
    assert counts == {"dynamic/groups_sampled": 2, "dynamic/groups_kept": 1, "dynamic/rounds": 1}
    assert kept.texts == ["c", "d", "a", "b"]  # the group with a signal first
    assert_on_other(
        kept.completion_ids, kept.mask, kept.truncated, kept.reward, kept.adv, *kept.inputs.values()
    )
    assert_on_other(*kept.chunks[0].inputs.values(), kept.chunks[0].completion_ids)


# --- the whole step on the stand-in device: the tiny model, its LoRA and AdamW all on OTHER -------------

STEP_FLAGS = ["--train-size", "8", "--eval-size", "2", "--batch-size", "2", "--group-size", "2"]
STEP_FLAGS += ["--max-new-tokens", "4", "--steps", "1", "--seed", "1"]
PATHS = {
    "default path, GDPO, mu = 2, 80/20, micro-batches": [
        *("--multi-objective-aggregation", "normalize_then_sum", "--num-iterations", "2"),
        *("--top-entropy-quantile", "0.5", "--micro-batch-size", "2", "--eval-image-ablation", "shuffle"),
    ],
    "plain path, dynamic sampling, checkpointing, sapo": [
        *("--no-shared-prefill", "--no-trunk-reuse", "--dynamic-sampling", "--max-sampling-rounds", "2"),
        *("--gradient-checkpointing", "--loss-type", "sapo", "--adv-baseline", "rloo"),
    ],
}


@pytest.mark.parametrize("path", PATHS)
def test_a_training_step_and_an_evaluation_run_wholly_on_the_stand_in_device(tmp_path, path):
    args = tyro.cli(trainer.Args, args=[*STEP_FLAGS, *PATHS[path], "--output-dir", str(tmp_path)])
    run = trainer.build_run(args, torch.device("cpu"), torch.float32, 0, 1)  # data, rewards, model, LoRA
    with on_other_device():
        run.model.to(OTHER)  # new Parameter objects: the optimizer and the speed-up plan are made for them
        run.device, params = OTHER, lora.lora_parameters(run.model)
        run.optimizer = torch.optim.AdamW(params, lr=args.lr)
        run.scheduler = model_io.cosine_with_warmup(run.optimizer, warmup_steps=0, total_steps=1)
        run.speed = speedups.choose(run.model, args.speed, last_k=args.lora.lora_last_k)
        before = [p.detach().clone() for p in params]
        record, _, ro = trainer.train_step(1, run, args, args.loss.beta)
        evaluation, _, _ = trainer.evaluate(run, args)
        assert_on_other(*params, *[p.grad for p in params if p.grad is not None], ro.reward, ro.adv, ro.mask)
        assert any(not torch.equal(a, b) for a, b in zip(params, before))  # AdamW stepped on OTHER
    assert not record["skipped"] and set(evaluation) >= {"eval/accuracy", "eval/reward"}


# --- the kernels a run may choose: attention, deterministic algorithms, the process group's timeout ---------

ROOT = Path(__file__).resolve().parents[2]
SMALL_FLAGS = ["--device", "cpu", "--train-size", "8", "--eval-size", "0", "--batch-size", "2"]
SMALL_FLAGS += ["--group-size", "2", "--max-new-tokens", "8", "--steps", "2"]


def child(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1")  # PYTHONPATH: conftest's
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_flash_attention_without_its_package_is_refused_in_one_line_and_so_is_a_zero_timeout(tmp_path):
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    out = str(tmp_path / "run")
    done = child(
        sys.executable, "-m", "grpo_vlm", "--attn-implementation", "flash_attention_2", "--output-dir", out
    )
    message = (
        "flash_attention_2 needs the flash-attn package (pip install flash-attn; CUDA only); or use sdpa"
    )
    assert (done.returncode, done.stderr) == (2, f"error: --attn-implementation: {message}\n")
    assert not (tmp_path / "run").exists()
    with pytest.raises(cli.UsageError, match=r"^--dist-timeout: must be > 0 minutes, got 0.0$"):
        trainer.check_args(trainer.Args(dist_timeout=0.0))


def test_attn_implementation_reaches_the_model_and_sdpa_is_transformers_own_default():
    assert trainer.Args().attn_implementation == "sdpa"
    for requested, loaded in ((None, "sdpa"), ("eager", "eager"), ("sdpa", "sdpa")):
        model, _, _ = model_files.load_model(
            model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32, attn_implementation=requested
        )
        assert model.config._attn_implementation == loaded


def test_a_deterministic_run_requests_deterministic_kernels_and_on_cpu_trains_as_any_run(tmp_path):
    # The child runs train.py's main with --deterministic and --attn-implementation eager, then reports the
    # switches and the attention the model was loaded with; the same run here, without --deterministic,
    # writes the same metrics (the CPU's kernels are deterministic anyway).
    report = (
        "import json, os, sys, torch, tyro, model_io\nfrom grpo_vlm import cli, trainer\n"
        "loaded = []\n"
        "load = model_io.load_model\n"
        "model_io.load_model = lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1]\n"
        "trainer.main(tyro.cli(trainer.Args, args=sys.argv[1:]))\n"
        "switches = [torch.are_deterministic_algorithms_enabled(), os.environ['CUBLAS_WORKSPACE_CONFIG']]\n"
        "print(json.dumps([*switches, loaded[0][0].config._attn_implementation]))\n"
    )
    flags = [*SMALL_FLAGS, "--attn-implementation", "eager"]
    done = child(sys.executable, "-c", report, *flags, "--deterministic", "--output-dir", str(tmp_path / "a"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [True, ":4096:8", "eager"]
    trainer.main(tyro.cli(trainer.Args, args=[*flags, "--output-dir", str(tmp_path / "b")]))
    metrics = [(tmp_path / name / "metrics.jsonl").read_bytes() for name in ("a", "b")]
    assert metrics[0] == metrics[1]


def test_deterministic_top_p_sampling_on_cuda_is_refused_before_anything_starts(monkeypatch, tmp_path):
    # torch raises at the first top-p cumsum on CUDA with deterministic algorithms: refused at start instead.
    monkeypatch.setattr(distributed, "use_deterministic_algorithms", lambda: None)  # no global switch here
    monkeypatch.setattr(distributed, "resolve_device", lambda name: torch.device("cuda"))
    args = tyro.cli(
        trainer.Args, args=["--deterministic", "--top-p", "0.9", "--output-dir", str(tmp_path / "r")]
    )
    with pytest.raises(cli.UsageError, match=r"^--deterministic: cannot sample with --top-p < 1 on CUDA"):
        trainer.main(args)
    assert not (tmp_path / "r").exists()


DIST_TIMEOUT_RANK = """
import sys, time, torch, tyro
from grpo_vlm import distributed, trainer
args = tyro.cli(trainer.Args, args=["--dist-timeout", sys.argv[1]])
rank, _ = distributed.init_distributed(torch.device("cpu"), timeout_minutes=args.dist_timeout)
start = time.time()
if rank == 1:
    time.sleep(6)  # rank 0 waits for it at the barrier, as the other ranks wait for rank 0's evaluation
try:
    distributed.barrier()
    print(f"rank {rank} passed after {time.time() - start:.1f} s", flush=True)
except RuntimeError as e:
    print(f"rank {rank} failed after {time.time() - start:.1f} s: {str(e)[-80:]}", flush=True)
"""


def test_dist_timeout_ends_a_collective_that_waits_longer_for_a_rank(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(DIST_TIMEOUT_RANK)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = child(*torchrun, str(script), "0.02", cwd=tmp_path)  # 1.2 s: less than rank 1's 6 s
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("rank 0"))
    assert "rank 0 failed after 1." in line and "Timed out" in line, line


def test_models_load_without_hub_kernels_in_either_mode():
    """transformers 5.25 kernelizes what from_pretrained loads unless told not to, and again at each train() /
    eval() (on CUDA: hub layers in place of RMSNorm and rotary forwards, which LoRA injection, the trunk
    recording and the log-prob equalities are not tested with; `kernels` refuses the stand-in device above):
    model_io loads with use_kernels=False, for both trainers, and switching modes keeps it so."""
    from grpo_vlm import model_files

    model, _, _ = model_files.load_model(model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    for switch in (model.train, model.eval):
        switch()
        assert not getattr(model, "use_kernels", False)  # transformers < 5.25: no such attribute
        assert getattr(model, "kernels_mode", None) is None
