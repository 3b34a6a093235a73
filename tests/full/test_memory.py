"""memory.py: the estimate against the measured live tensors of a real step, the micro-batch it chooses, and
--micro-batch-size auto through train.py."""

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

import lora
import model_io
from full.helpers import train_args
from grpo_vlm import lora_config, memory, speedups, tasks, trainer

ROOT = Path(__file__).resolve().parents[2]
README_SHAPES = dict(rows=64, prompt_len=1200, completion_len=256, last_k=4, lora_r=16, dtype_bytes=2)


def random_vlm(hidden: int, layers: int, vocab: int, dtype: torch.dtype):
    """A random Qwen2.5-VL, larger than the embedded one, with its tokenizer and image processor."""
    base, tokenizer, image_processor = model_io.load_model(
        model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32
    )
    config = copy.deepcopy(base.config)
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = hidden, 3 * hidden, layers
    text.num_attention_heads, text.num_key_value_heads, text.vocab_size = hidden // 64, hidden // 128, vocab
    text.layer_types = ["full_attention"] * layers
    text.rope_parameters = dict(text.rope_parameters, mrope_section=[8, 12, 12])  # head_dim 64
    config.vision_config.out_hidden_size = hidden
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval().requires_grad_(False).to(dtype)
    return model, tokenizer, image_processor


def measured_step(model, tokenizer, image_processor, args) -> tuple[dict[str, int], dict]:
    """One training step through train.py's functions, the bytes of the tensors it makes tracked phase by
    phase (the weights exist before); also the step's shapes."""
    lora_config.inject(model, args.lora)
    run = trainer.Run(
        model=model, tokenizer=tokenizer, image_processor=image_processor, device=torch.device("cpu")
    )
    run.optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-3)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda step: 1.0)
    run.sampling = trainer.sampling_options(args, tokenizer)
    run.speed = speedups.choose(model, args.speed, last_k=args.lora.lora_last_k)
    run.reward_fns = trainer.resolve_rewards(args, "inspection")
    run.accuracy_name = run.reward_fns[0].name
    prompts = tasks.make_task("inspection", args.batch_size, seed=0)
    with memory.track_peak() as counter:
        ro = trainer.rollout(run, prompts, args)
        measured = {"sampling": counter.peak, "trunk": counter.live}
        counter.peak = counter.live
        trainer.frozen_logprobs(run, ro, args)
        measured["logprob_pass"], counter.peak = counter.peak, counter.live
        trainer.policy_update(run, ro, args, args.loss.beta)
        measured["update"] = counter.peak
    image_tokens = ro.inputs["mm_token_type_ids"].sum().item() / ro.inputs["input_ids"].shape[0]
    N, P = ro.inputs["input_ids"].shape
    shapes = dict(rows=N, prompt_len=P, completion_len=ro.completion_ids.shape[1], image_tokens=image_tokens)
    return measured, shapes


@pytest.mark.parametrize(
    "dtype, micro_batch_size, checkpointing, speed_ups",
    [
        (torch.float32, None, False, True),
        (torch.bfloat16, None, False, True),
        (torch.float32, 4, False, True),
        (torch.bfloat16, None, True, True),
        (torch.float32, None, False, False),  # the plain path: generate, full forwards, (n, T, V) logits
    ],
)
def test_the_estimate_is_within_25_percent_of_a_steps_measured_memory(
    dtype, micro_batch_size, checkpointing, speed_ups
):
    model, tokenizer, image_processor = random_vlm(hidden=256, layers=4, vocab=4096, dtype=dtype)
    flags = dict(micro_batch_size=micro_batch_size, gradient_checkpointing=checkpointing)
    flags.update(trunk_reuse=speed_ups, shared_prefill=speed_ups)
    args = train_args(batch_size=4, group_size=4, max_new_tokens=32, lora_last_k=2, beta=0.04, **flags)
    args.num_iterations = 2  # the old policy's pass too
    measured, shapes = measured_step(model, tokenizer, image_processor, args)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    estimated = memory.estimate(
        model.config,
        **shapes,
        last_k=2,
        lora_r=8,
        dtype_bytes=dtype.itemsize,
        group_size=4,
        num_params=frozen,
        device_type="cpu",  # a bf16 head is copied to fp32 here, per sampling call and pass
        **flags,
    )
    made_before = estimated["weights"] + estimated["lora+adam"]  # the step's tensors only
    for phase in ("sampling", "logprob_pass", "update"):
        ratio = (estimated[phase] - made_before) / measured[phase]
        assert 0.75 <= ratio <= 1.25, (phase, ratio)


def test_a_kept_decode_graph_holds_the_bytes_the_estimate_counts_for_it():
    """A sampling call with the graph stand-in that holds a pool as a CUDA graph does (the peak of the bytes
    its captured step makes): what stays alive after the call, the kept decoder, against
    `memory.decode_graph_bytes` and the estimate's phases after sampling."""
    model, tokenizer, _ = random_vlm(hidden=256, layers=4, vocab=4096, dtype=torch.float32)
    G, T = 4, 16
    prompts = tokenizer(["a b c d e f g h", "a b c"], return_tensors="pt", padding=True, padding_side="left")
    inputs = {key: prompts[key] for key in ("input_ids", "attention_mask")}

    def capture(step):  # a graph's memory: the peak of the bytes its step makes, held while it is kept
        first = step()
        with memory.track_peak() as made:
            static = step()
        pool = torch.empty(made.peak - sum(x.untyped_storage().nbytes() for x in static), dtype=torch.uint8)
        return first, static, lambda: pool  # the pool lives as long as the replay

    graphs = speedups.DecodeGraphs(capture)
    options = dict(group_size=G, max_new_tokens=T, temperature=1.0, eos_token_id=[], pad_token_id=0)
    with memory.track_peak() as counter:
        speedups.sample_shared_prefill(model, inputs, capture=graphs, **options)
        held = counter.live  # the call's tensors are gone but the kept decoder's
    N, P = 2 * G, inputs["input_ids"].shape[1]
    counted = memory.decode_graph_bytes(model.config, N, P, T, 4)
    assert 0.75 <= counted / held <= 1.25, (counted, held)
    shapes = dict(rows=N, prompt_len=P, completion_len=T, last_k=2, lora_r=8, dtype_bytes=4, group_size=G)
    shapes.update(micro_batch_size=None, gradient_checkpointing=False)
    kept, plain = (memory.estimate(model.config, **shapes, cuda_graph=on) for on in (True, False))
    for phase in ("trunk", "logprob_pass", "update"):
        assert kept[phase] - plain[phase] == counted, phase  # held through the update


def test_the_estimate_counts_the_3b_decode_graph_the_attention_masks_and_no_fp32_head_copy_on_cuda():
    config = Qwen2_5_VLConfig(**memory.QWEN25_VL["3b"])
    shapes = dict(README_SHAPES, micro_batch_size=None, gradient_checkpointing=False)
    # 64 rows x (1200 + 256) positions x 36 blocks x (K, V) x 256 x 2 B; the mask; the step's fp32 logits
    # and their copy; one block's intermediates for 64 tokens; the attention's two masks of one query.
    cache, mask = 64 * 1456 * 36 * 2 * 256 * 2, 64 * 1456 * 8
    pool = 2 * 64 * 151936 * 4 + 64 * (3 * 11008 + 6 * 2048) * 2 + 64 * 1456 * 3
    assert memory.decode_graph_bytes(config, 64, 1200, 256, 2) == cache + mask + pool == 3_519_751_168
    kept = memory.estimate(config, **shapes, cuda_graph=True)
    plain = memory.estimate(config, **shapes)
    assert kept["update"] - plain["update"] == 3_519_751_168  # 3.3 GiB more through the update
    assert kept["sampling"] - plain["sampling"] == mask + pool  # its cache is the one sampling fills
    # SDPA's additive mask, (64, 1, S, S) bf16 with S = 1455, saved by each of the K = 4 adapted blocks.
    narrower = memory.estimate(config, **shapes | dict(last_k=3))
    per_block = plain["activations"] - narrower["activations"]
    saved_by_ops = 64 * 1455 * (2 * (7 * 2048 + 2 * 128 + 4 * 11008 + 7 * 16) + 4 * (16 + 2048))
    assert per_block == saved_by_ops + 64 * 1455 * 1455 * 2 + 64 * 1455 * 4 * 2048  # + the later norm's copy
    # The sampler's fp32 head on the CPU is a copy of the bf16 weight; on CUDA cuBLAS reads it as it is.
    cpu = memory.estimate(config, **shapes, device_type="cpu")
    assert cpu["sampling"] - plain["sampling"] == 151936 * 2048 * 4


def test_the_parameter_count_from_the_3b_and_7b_configs_is_the_models():
    for numbers in memory.QWEN25_VL.values():
        config = Qwen2_5_VLConfig(**numbers)
        with torch.device("meta"):
            model = Qwen2_5_VLForConditionalGeneration(config)
        assert memory.parameter_count(config) == sum(p.numel() for p in model.parameters())


def test_tool_rollouts_count_every_rows_pixels_re_encoded_and_re_prefilled_each_turn():
    # N = 64 rows, P = 1200, T = 256; 36 blocks, 2 KV heads of 128; the vision tower's width 1280, MLP 3420.
    config = Qwen2_5_VLConfig(**memory.QWEN25_VL["3b"])
    shapes = dict(README_SHAPES, image_tokens=1156, micro_batch_size=None, gradient_checkpointing=False)
    tool_tokens = 2 * 1156  # two zooms a row, each at the 952 x 952 photo's 34 x 34 tokens
    without = memory.estimate(config, **shapes)
    assert memory.estimate(config, **shapes, tool_image_tokens=0) == without  # off: the figures unchanged
    tools = memory.estimate(config, **shapes, tool_image_tokens=tool_tokens)
    pixels = 64 * (1156 + 2312) * 4 * 1176 * 4  # fp32, 4 patches a token, 3 x 2 x 14 x 14 values a patch
    cache = 64 * (1200 + 256) * 36 * 2 * 256 * 2  # generate's: every row, keys and values, bf16
    prefill = 64 * (1200 + 256) * 3 * 11008 * 2  # one block's MLP over each row's whole sequence
    encoder = 4 * 64 * (1156 + 2312) * (3 * 3420 + 4 * 1280) * 2  # one vision block over every patch
    draw = 3 * 64 * 151936 * 4
    made = tools["sampling"] - tools["weights"] - tools["lora+adam"]
    assert made == 2 * cache + prefill + draw + pixels + encoder == 44_626_796_544  # the encoder: 25.4 GiB
    assert tools["trunk"] == without["trunk"]  # trunk reuse: the rows' pixels dropped, each prompt's kept
    plain = dict(shapes, trunk_reuse=False, shared_prefill=False)
    extra = memory.estimate(config, **plain, tool_image_tokens=tool_tokens)["trunk"]
    assert extra - memory.estimate(config, **plain)["trunk"] == memory.pixel_bytes(64 * tool_tokens)


def test_auto_takes_the_largest_micro_batch_that_fits_then_checkpointing_then_one_row():
    config = Qwen2_5_VLConfig(**memory.QWEN25_VL["7b"])

    shapes = dict(README_SHAPES, rows=8, prompt_len=8000)  # long prompts: the update decides the peak

    def peak(size: int, checkpointing: bool) -> int:
        options = dict(micro_batch_size=size, gradient_checkpointing=checkpointing)
        return memory.estimate(config, **shapes, **options)["peak"]

    def choose(budget: int, **options) -> tuple[int, bool]:
        return memory.choose_micro_batch(config, budget_bytes=budget, **shapes, **options)

    assert peak(8, False) > peak(4, False) > peak(4, True)  # the estimate grows with what is kept
    assert choose(peak(8, False)) == (8, False)
    assert choose(peak(8, False) - 1) == (4, False)
    budget = peak(1, False) - 1  # then checkpointing, with the largest micro-batch that fits
    assert choose(budget) == (max(s for s in (1, 2, 4, 8) if peak(s, True) <= budget), True)
    assert choose(budget)[0] > 1
    assert choose(peak(8, True), gradient_checkpointing=True) == (8, True)  # asked for: kept
    assert choose(peak(1, True) - 1) == (1, True)  # nothing fits: the smallest, and train.py warns


def test_the_readme_gpu_commands_fit_an_80_gb_gpu_by_the_estimate_and_the_readme_shows_the_table():
    budget = int(79.1 * memory.SAFETY_FRACTION * memory.GIB)
    for numbers in memory.QWEN25_VL.values():
        config = Qwen2_5_VLConfig(**numbers)
        size, checkpointing = memory.choose_micro_batch(config, budget_bytes=budget, **README_SHAPES)
        options = dict(micro_batch_size=size, gradient_checkpointing=checkpointing)
        assert memory.estimate(config, **README_SHAPES, **options)["peak"] <= budget
    table = subprocess.run(
        [sys.executable, "scripts/memory_table.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    readme = (ROOT / "docs" / "full-trainer.md").read_text()  # the full trainer's GPU section
    assert all(line in readme for line in table.splitlines()[1:]), table


def test_on_cuda_the_default_micro_batch_is_chosen_to_fit_and_an_explicit_one_wins(tiny_model):
    model = tiny_model
    cuda = torch.device("cuda")  # a stand-in: with a budget given, fit_memory asks the device nothing
    args = train_args(batch_size=4, group_size=4, max_new_tokens=16)
    speed, lines = trainer.fit_memory(args, model, torch.device("cpu"), torch.float32, 60)
    assert speed == args.speed and lines == []  # the CPU's default: all N rows, nothing printed
    speed, lines = trainer.fit_memory(args, model, cuda, torch.float32, 60, budget=2**40)
    assert (speed.micro_batch_size, speed.gradient_checkpointing) == (16, False)
    assert "--micro-batch-size auto: 16 rows, gradient checkpointing off" in lines
    shapes = dict(rows=16, prompt_len=60, completion_len=16, last_k=4, lora_r=8, dtype_bytes=4, group_size=4)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    tight = memory.estimate(
        model.config, **shapes, num_params=frozen, micro_batch_size=2, gradient_checkpointing=True
    )
    speed, lines = trainer.fit_memory(args, model, cuda, torch.float32, 60, budget=tight["peak"])
    assert speed.gradient_checkpointing and speed.micro_batch_size in (2, 4, 8, 16)
    explicit = dataclasses.replace(args, speed=dataclasses.replace(args.speed, micro_batch_size=2))
    speed, lines = trainer.fit_memory(explicit, model, cuda, torch.float32, 60, budget=1)
    assert (speed.micro_batch_size, speed.gradient_checkpointing) == (2, False)
    assert any(line.startswith("warning: the estimated peak") for line in lines)


@pytest.fixture
def tiny_model():
    model, _, _ = model_io.load_model(model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    lora.inject_lora(model, r=8, alpha=16.0, last_k=4)
    return model


def test_micro_batch_size_auto_prints_its_choice_and_a_resume_may_change_it(tmp_path):
    out = tmp_path / "run"
    tiny = ["--batch-size", "2", "--group-size", "2", "--max-new-tokens", "8", "--eval-every", "1000"]
    command = [sys.executable, "-m", "grpo_vlm", *tiny, "--output-dir", str(out)]
    first = subprocess.run(
        [*command, "--steps", "1", "--micro-batch-size", "auto"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert first.returncode == 0, first.stderr
    assert "memory estimate (memory.py) for N=4 rows" in first.stdout
    assert "--micro-batch-size auto: 4 rows, gradient checkpointing off" in first.stdout
    assert json.loads((out / "run.json").read_text())["args"]["speed"]["micro_batch_size"] == "auto"
    resume = [
        sys.executable,
        "-m",
        "grpo_vlm",
        "--resume",
        str(out),
        "--steps",
        "2",
        "--micro-batch-size",
        "1",
    ]
    second = subprocess.run(resume, cwd=ROOT, capture_output=True, text=True, check=False)
    assert second.returncode == 0, second.stderr
    assert "memory estimate" not in second.stdout  # an explicit size, on the CPU: nothing to choose or print
