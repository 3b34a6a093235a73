"""Regenerate the embedded tiny Qwen2.5-VL checkpoint in assets/tiny-qwen2.5-vl (deterministic, CPU).

    python scripts/make_tiny_vlm.py            # about a minute on 2 CPU cores
    python scripts/make_tiny_vlm.py --out /tmp/tiny --target-accuracy 0.4
    python scripts/make_tiny_vlm.py --tools --batch-size 16 --eval-every 400 --eval-samples 100
                                               # assets/tiny-qwen2.5-vl-tools (--tools zoom), about 2 minutes

What it does, in order:
1. trains a byte-level BPE tokenizer (like Qwen's, but a few hundred tokens) on the text of the built-in
   tasks, with Qwen's chat special tokens and vision placeholder tokens and a Qwen-style chat template;
2. builds a `Qwen2_5_VLForConditionalGeneration` from a tiny config (same architecture as the real
   thing: windowed vision tower, 2x2 patch merger, 3D multimodal RoPE) with a fixed seed;
3. warm-starts it with a supervised next-token loss on the built-in tasks (the analogue of the SFT
   checkpoint a real GRPO run starts from) and STOPS as soon as greedy held-out accuracy on the target
   task reaches `--target-accuracy`: GRPO needs a model that is right only part of the time, so that
   the completions of a group get different rewards;
4. saves model, tokenizer and image processor with `save_pretrained` (safetensors), so that
   `from_pretrained` loads it exactly like a real Qwen2.5-VL checkpoint.

With --tools it makes the second asset, assets/tiny-qwen2.5-vl-tools, for multi-turn rollouts: `<tool_call>`
and `</tool_call>` are special tokens (one token each, as in Qwen's tokenizers), the chat template renders a
"tool" message as Qwen2.5's does (a user turn `<tool_response>\n...\n</tool_response>`), and the warm-start
is on the inspection-zoom task only, in two stages. First on crops alone (the panel's crop as the only
image, the verdict as the answer) until the greedy held-out verdict on crops is right 95% of the time,
checked every 50 steps: this model's 2-block vision tower does not learn the mark with the photo before
the crop (chance after 900 steps), but does from the crop alone (450 steps). Then on the full traces: a
share of them (--tool-share) call zoom on the panel's box, read the crop and answer, the others answer at
once, and --crop-share stay crop-only so the verdict is kept; the loss is on the assistant's tokens only
(the call with its `</tool_call>`, the answer with its `<|im_end|>`), never on the tool turn. It stops when
the greedy held-out completions are well formed (a call answered with a crop, then a verdict and a
reason), checked every --eval-every steps: 400, so that sampling at temperature 1 writes the call well
formed often enough (entropy about 1 at GRPO's first step; after 100 steps, 4.4: corrupted calls). The
default asset is untouched.

A bad flag, or a target accuracy not reached within --max-steps, prints one line `error: ...` naming the
flag and exits with status 2 (cli.py); nothing is written then.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data
import rewards
from grpo_vlm import cli, dataset, grounding, tasks, tools

SPECIAL_TOKENS = [
    "<|endoftext|>",  # pad
    "<|im_start|>",
    "<|im_end|>",  # end of a chat turn: the EOS of every completion
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL's chat template, minus the default system prompt (it would triple the tiny prompts).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

# The same, plus Qwen2.5-VL's rendering of a "tool" message: a user turn wrapping the result in
# <tool_response> tags (text, and here images too).
TOOLS_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}{{ '<|im_start|>user\n<tool_response>\n' }}"
    "{%- else -%}{{ '<|im_start|>' + message['role'] + '\n' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}{{ '\n</tool_response>' }}{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


@dataclass
class Args:
    out: str | None = None
    """Output folder. Default: assets/tiny-qwen2.5-vl, or assets/tiny-qwen2.5-vl-tools with --tools."""
    seed: int = 0
    """Seed for the tokenizer corpus, the weights and the warm-start batches."""
    target_task: str | None = None
    """Task whose held-out accuracy decides when the warm-start stops. Default: shapes, or inspection-zoom
    with --tools."""
    target_accuracy: float | None = None
    """Stop the warm-start at the first evaluation whose held-out exact-answer accuracy on the target task
    reaches this. Default 0.4, reached after 250 steps: shapes right about half the time, and the
    inspection task's two-line format learned but its verdict still at chance (one answer for all). With
    --tools: the share of well-formed held-out completions (greedy: a zoom call answered with a crop, then
    a verdict and a reason) in its second stage, default 0.9."""
    tools: bool = False
    """Make the tools asset instead (see above): tool-call tokens, Qwen2.5's tool turn, inspection-zoom."""
    tool_share: float = 0.75
    """With --tools: the share of the full warm-start traces that call zoom before answering."""
    crop_share: float = 0.3
    """With --tools: the share of the second stage's traces that are crops alone (see above)."""
    max_steps: int = 3000
    """Give up (error) if the target is not reached by then."""
    batch_size: int = 32
    lr: float = 1e-3
    eval_every: int = 25
    eval_samples: int = 200


TRAIN_SAMPLES = 4000  # warm-start samples per task; each batch is drawn from them without replacement


def build_tokenizer(seed: int, *, with_tools: bool = False) -> PreTrainedTokenizerFast:
    corpus = []
    for task in tasks.TOOL_TASKS if with_tools else tasks.TASKS:
        for s in tasks.make_task(task, 400, seed=seed):
            corpus += [s["prompt"], s["answer"]]
    if with_tools:  # the calls' JSON, the tags apart (special tokens): their merges make calls short
        corpus = [
            text.replace(tools.TOOL_CALL_START, " ").replace(tools.TOOL_CALL_END, " ") for text in corpus
        ]
        corpus += [
            zoom_call(s, 112, 112)[len(tools.TOOL_CALL_START) : -len(tools.TOOL_CALL_END)]
            for s in tasks.make_task("inspection-zoom", 40, seed=seed)
        ]
    special = SPECIAL_TOKENS + [tools.TOOL_CALL_START, tools.TOOL_CALL_END] * with_tools
    corpus += [
        "user",
        "assistant",
        "system",
        "pass",
        "fail",
        "<think> </think> <answer> </answer>",
        "[0, 1, 2, 3]",
    ]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512 if with_tools else 384,  # merges enough for the calls' JSON too
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no text is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # NOTE: added but not special, as in Qwen2.5's tokenizer: decoding with skip_special_tokens keeps a call.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in special[len(SPECIAL_TOKENS) :]])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    hf.chat_template = TOOLS_CHAT_TEMPLATE if with_tools else CHAT_TEMPLATE
    return hf


def build_model(tokenizer, seed: int) -> Qwen2_5_VLForConditionalGeneration:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            # head_dim 16 -> 8 rotary frequencies split over (temporal, height, width)
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            tie_word_embeddings=True,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    return model


def sft_batch(samples, tokenizer, image_processor):
    """Prompt (left-padded) + reference completion + EOS, with labels only on the completion tokens."""
    batch = data.prepare_prompts(samples, tokenizer, image_processor, device="cpu")
    P = batch.inputs["input_ids"].shape[1]
    targets = [
        tokenizer(s["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for s in samples
    ]
    T = max(len(t) for t in targets)
    completion = torch.full((len(samples), T), tokenizer.pad_token_id)
    labels = torch.full((len(samples), P + T), -100)
    for i, t in enumerate(targets):
        completion[i, : len(t)] = torch.tensor(t)
        labels[i, P : P + len(t)] = torch.tensor(t)
    inputs = dict(batch.inputs)
    inputs["input_ids"] = torch.cat([inputs["input_ids"], completion], 1)
    inputs["attention_mask"] = torch.cat([inputs["attention_mask"], (labels[:, P:] != -100).long()], 1)
    if "mm_token_type_ids" in inputs:
        inputs["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros_like(completion)], 1
        )
    return inputs, labels


def zoom_call(sample: dict, width: int, height: int) -> str:
    """The zoom call on the sample's panel, in the absolute frame of its photo resized to width x height."""
    size = sample["images"][0].size
    box = grounding.to_model_frame(
        sample["zoom_box"], frame="absolute", original_size=size, resized_size=(width, height)
    )
    call = {"name": "zoom", "arguments": {"image": 0, "bbox_2d": [round(v) for v in box]}}
    return f"{tools.TOOL_CALL_START}{json.dumps(call)}{tools.TOOL_CALL_END}"


def with_tool_turn(sample: dict, call: str, image_processor) -> dict:
    """The sample as the conversation before its answer: the prompt, the assistant's `call`, the tool's turn;
    `tool_call` is the call's record (tools.run_call)."""
    result = tools.run_call(
        call, sample, tools.BUILTIN_TOOLS, frame="absolute", image_processor=image_processor
    )
    turns = [{"role": "assistant", "content": call}, {"role": "tool", "content": result.content}]
    crops = [part["image"] for part in result.content if part["type"] == "image"]
    messages = [*data.sample_messages(sample), *turns]
    return {**sample, "messages": messages, "images": [*sample["images"], *crops], "tool_call": result.record}


def label_calls(inputs: dict, labels: torch.Tensor, samples: list[dict], tokenizer) -> None:
    """Labels on the assistant's call too (its last <tool_call> .. </tool_call> in the prompt, both tags in),
    never on the tool turn the template inserts after it."""
    start, end = tokenizer.convert_tokens_to_ids([tools.TOOL_CALL_START, tools.TOOL_CALL_END])
    for i, sample in enumerate(samples):
        if "tool_call" in sample:
            ids = inputs["input_ids"][i]
            a, b = (
                (ids == start).nonzero().max(),
                (ids == end).nonzero().max(),
            )  # NOTE: the prompt has a pair too
            labels[i, a : b + 1] = ids[a : b + 1]


def greedy(model, tokenizer, image_processor, samples: list[dict], stop_ids: list[int]) -> list[str]:
    """Each sample's greedy completion up to its first stop token (kept, special tokens in the text)."""
    batch = data.prepare_prompts(samples, tokenizer, image_processor, device="cpu")
    out = model.generate(
        **batch.inputs,
        do_sample=False,
        max_new_tokens=48,
        eos_token_id=stop_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    texts = []
    for row in out[:, batch.inputs["input_ids"].shape[1] :].tolist():
        stop = next((k for k, t in enumerate(row) if t in stop_ids), len(row) - 1)
        texts.append(tokenizer.decode(row[: stop + 1], skip_special_tokens=False))
    return texts


@torch.no_grad()
def held_out_with_tool(
    model, tokenizer, image_processor, samples, *, batch_size: int = 50
) -> dict[str, float]:
    """Greedy decoding with zoom available, one call at most (a second ends the rollout wrong): verdict
    accuracy, the share of completions that call, the share of crops of marked panels with the mark, and
    the share that are well formed (a call answered with a crop, then a verdict and a reason)."""
    model.eval()
    stop_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(tools.TOOL_CALL_END)]
    right, called, shown, formed = [], [], [], []
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        first = greedy(model, tokenizer, image_processor, chunk, stop_ids)
        follow = [
            with_tool_turn(s, t, image_processor)
            for s, t in zip(chunk, first)
            if t.endswith(tools.TOOL_CALL_END)
        ]
        answers = iter(greedy(model, tokenizer, image_processor, follow, stop_ids) if follow else [])
        follow = iter(follow)
        for sample, text in zip(chunk, first):
            calls = text.endswith(tools.TOOL_CALL_END)
            called.append(calls)
            crop = None
            if calls:
                text, images = next(answers), next(follow)["tool_call"]["images"]
                crop = images[0]["crop"] if images else None
                if sample["mark_box"] and crop:
                    (x1, y1, x2, y2), (m1, n1, m2, n2) = crop, sample["mark_box"]
                    shown.append(x1 <= m1 and y1 <= n1 and m2 <= x2 and n2 <= y2)
            answer = text.removesuffix(tokenizer.eos_token)
            formed.append(crop is not None and rewards.format_reward(answer, sample) == 1.0)
            right.append(
                rewards.label_reward(text, sample) if not text.endswith(tools.TOOL_CALL_END) else 0.0
            )
    model.train()
    share = lambda values: sum(values) / max(len(values), 1)
    shares = {"accuracy": right, "tool_calls": called, "crop_shows_mark": shown, "well_formed": formed}
    return {name: share(values) for name, values in shares.items()}


@torch.no_grad()
def held_out_metrics(model, tokenizer, image_processor, samples, *, batch_size: int = 50) -> dict[str, float]:
    """Greedy decoding: exact-answer accuracy, and for verdict tasks verdict accuracy and format validity."""
    model.eval()
    exact, verdict, valid = [], [], []
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        batch = data.prepare_prompts(chunk, tokenizer, image_processor, device="cpu")
        out = model.generate(
            **batch.inputs,
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(out[:, batch.inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        for text, sample in zip(texts, chunk):
            exact.append(text.strip() == sample["answer"])
            if "label" in sample:
                verdict.append(rewards.label_reward(text, sample))
                valid.append(rewards.format_reward(text, sample))
    model.train()
    metrics = {"accuracy": sum(exact) / len(exact)}
    if verdict:
        metrics.update(verdict_accuracy=sum(verdict) / len(verdict), format_valid=sum(valid) / len(valid))
    return metrics


def check_args(args: Args) -> None:
    """Every flag's range before any work (cli.UsageError)."""
    known = tasks.TOOL_TASKS if args.tools else tasks.TASKS
    cli.check(
        args.target_task in known, "--target-task", f"unknown {args.target_task!r}; known: {', '.join(known)}"
    )
    accuracy = args.target_accuracy
    cli.check(0 < accuracy <= 1, "--target-accuracy", f"must be in (0, 1], got {accuracy}")
    cli.check(0 <= args.tool_share <= 1, "--tool-share", f"must be in [0, 1], got {args.tool_share}")
    cli.check(0 <= args.crop_share <= 1, "--crop-share", f"must be in [0, 1], got {args.crop_share}")
    size = args.batch_size
    cli.check(1 <= size <= TRAIN_SAMPLES, "--batch-size", f"must be in [1, {TRAIN_SAMPLES}], got {size}")
    for flag, value in (
        ("--max-steps", args.max_steps),
        ("--eval-every", args.eval_every),
        ("--eval-samples", args.eval_samples),
    ):
        cli.check(value >= 1, flag, f"must be >= 1, got {value}")
    every = args.eval_every
    cli.check(
        every <= args.max_steps,
        "--eval-every",
        f"must be <= --max-steps (the target is checked then), got {every}",
    )
    cli.check(args.lr > 0 and math.isfinite(args.lr), "--lr", f"must be a positive number, got {args.lr}")
    cli.check(not Path(args.out).is_file(), "--out", f"{args.out} is a file, not a folder")


def warm_start(model, tokenizer, image_processor, args: Args) -> tuple[int, dict]:
    """Alternate the built-in image tasks until the target task's held-out accuracy is reached."""
    train = {t: tasks.make_task(t, TRAIN_SAMPLES, seed=args.seed) for t in tasks.TASKS}
    held_out = {t: tasks.make_task(t, args.eval_samples, split="test", seed=args.seed) for t in tasks.TASKS}
    rng = random.Random(args.seed)

    def batch(step: int) -> tuple[dict, torch.Tensor]:
        task = tasks.TASKS[step % len(tasks.TASKS)]  # alternate tasks: both stay in the warm-start
        return sft_batch(rng.sample(train[task], args.batch_size), tokenizer, image_processor)

    def evaluate() -> dict:
        return {t: held_out_metrics(model, tokenizer, image_processor, held_out[t]) for t in tasks.TASKS}

    return sft_loop(model, batch, evaluate, args)


def crop_only(sample: dict) -> dict:
    """The sample with its panel's crop as the only image and a short prompt: the verdict from the crop."""
    return {**sample, "images": [sample["images"][0].crop(tuple(sample["zoom_box"]))], "prompt": "mark?"}


def warm_start_with_tools(model, tokenizer, image_processor, args: Args) -> tuple[int, dict]:
    """inspection-zoom, fresh samples each step: crops alone until their verdict is learned, then traces
    of which --tool-share call zoom on the panel, then answer (--crop-share stay crops alone)."""
    held_out = tasks.make_task("inspection-zoom", args.eval_samples, split="test", seed=args.seed)
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)  # one for both stages

    def crops(step: int) -> tuple[dict, torch.Tensor]:
        samples = tasks.make_task(
            "inspection-zoom", args.batch_size, seed=args.seed * 1_000_000 + 500_000 + step
        )
        return sft_batch([crop_only(s) for s in samples], tokenizer, image_processor)

    def crop_verdicts() -> dict:
        crops = [crop_only(s) for s in held_out]
        return {"crops": held_out_metrics(model, tokenizer, image_processor, crops)}

    crop_args = dataclasses.replace(args, target_task="crops", target_accuracy=0.95, eval_every=50)
    crop_steps, _ = sft_loop(model, crops, crop_verdicts, crop_args, "verdict_accuracy", opt=opt)

    def batch(step: int) -> tuple[dict, torch.Tensor]:
        samples = tasks.make_task("inspection-zoom", args.batch_size, seed=args.seed * 1_000_000 + step)
        size = dataset.resized_size(image_processor, samples[0]["images"][0].size)  # one photo size for all
        kinds = [(rng.random() < args.crop_share, rng.random() < args.tool_share) for _ in samples]
        samples = [
            crop_only(s) if crop else with_tool_turn(s, zoom_call(s, *size), image_processor) if c else s
            for s, (crop, c) in zip(samples, kinds)
        ]
        inputs, labels = sft_batch(samples, tokenizer, image_processor)
        label_calls(inputs, labels, samples, tokenizer)
        return inputs, labels

    def evaluate() -> dict:
        return {"inspection-zoom": held_out_with_tool(model, tokenizer, image_processor, held_out)}

    step, accuracy = sft_loop(model, batch, evaluate, args, metric="well_formed", opt=opt)
    return crop_steps + step, accuracy


def sft_loop(model, batch, evaluate, args: Args, metric: str = "accuracy", opt=None) -> tuple[int, dict]:
    """Next-token loss on `batch(step)` until `evaluate()` reaches --target-accuracy on the target task."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    accuracy, t0 = {}, time.time()
    for step in range(1, args.max_steps + 1):
        inputs, labels = batch(step)
        logits = model(**inputs).logits[:, :-1]  # position i predicts token i+1
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.eval_every == 0:
            accuracy = evaluate()
            print(f"step {step:4d}  loss {loss.item():.3f}  held-out {accuracy}  ({time.time() - t0:.0f}s)")
            if accuracy[args.target_task][metric] >= args.target_accuracy:
                return step, accuracy
    raise cli.UsageError(
        f"--target-accuracy {args.target_accuracy} not reached in --max-steps {args.max_steps} steps "
        f"(last held-out {metric} {accuracy[args.target_task][metric]:.3f}); raise --max-steps or "
        "lower --target-accuracy"
    )


def main(args: Args) -> None:
    default_out = "assets/tiny-qwen2.5-vl-tools" if args.tools else "assets/tiny-qwen2.5-vl"
    args = dataclasses.replace(
        args,
        out=args.out or default_out,
        target_task=args.target_task or ("inspection-zoom" if args.tools else "shapes"),
        target_accuracy=args.target_accuracy or (0.9 if args.tools else 0.4),
    )
    check_args(args)
    # NOTE: float reductions depend on the number of threads, so the warm-start trajectory does too. The
    # committed assets were made with 2 threads (the default one) and 1 (the tools one, whose longer steps
    # run 4 times faster on one thread of a busy machine); a fixed count reproduces them on any machine.
    torch.set_num_threads(1 if args.tools else 2)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer(args.seed, with_tools=args.tools)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    model = build_model(tokenizer, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tokenizer)}, parameters {n_params:,}")
    step, accuracy = (warm_start_with_tools if args.tools else warm_start)(
        model, tokenizer, image_processor, args
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    stats = {"parameters": n_params, "warm_start_steps": step, "held_out": accuracy, "seed": args.seed}
    if args.tools:
        stats.update(tool_share=args.tool_share, crop_share=args.crop_share)
    (out / "warm_start.json").write_text(json.dumps(stats, ensure_ascii=False, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"saved {out} ({size / 1e6:.2f} MB) after {step} warm-start steps; held-out {accuracy}")


if __name__ == "__main__":
    cli.run(main, tyro.cli(Args))
