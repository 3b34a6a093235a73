"""Multi-turn rollouts with tool calls (multiturn.py), against independent references.

1. On Qwen2.5-VL, Qwen2-VL and Qwen3-VL (conftest's tiny random models, the embedded tokenizer with the two
   call tags added): the recompute of a 3-turn rollout with 2 returned images, in one forward (and through
   the frozen trunk in micro-batches), equals generate's log-probs on every model-written token; and equals
   one forward over the same conversation rendered from scratch by the chat template with all its images.
2. The mask: exactly zero gradient reaches the positions that predict tool-inserted tokens; the loss's
   normalisers count the model's tokens only.
3. A scripted policy (its turns written by hand) makes every malformed call: each is answered with its error
   and counted; a call past --max-tool-calls and the length bound end the rollout, truncated.
4. train.py: --max-tool-calls 0 never enters multiturn.py; a run with tools, interrupted and resumed, equals
   an uninterrupted one byte for byte; 2 gloo ranks give the one-process update on a multi-turn rollout;
   under trunk reuse the step's Rollout holds none of the N rows' pixels once its chunks are built.
The random models write calls by chance (their sampler allowed a few tokens only), and a stand-in tool
answers every call with a crop of the sample's image and a line of text, so that images come back.
"""

import dataclasses
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_CHECKPOINT, VLM_FAMILIES
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer

import data
import grpo
import lora
import model_io
from full.helpers import lora_model_with_gradients, make_run, train_args
from full.test_families import adapted
from grpo_vlm import (
    cli,
    dataset,
    distributed,
    files,
    memory,
    multiturn,
    sampling_config,
    speedups,
    tasks,
    tools,
    trainer,
)
from scripts import evaluate

ROOT = Path(__file__).resolve().parents[2]
# The embedded template, with a tool turn rendered as Qwen2.5's: a user turn inside <tool_response> tags.
TOOL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}{{ '<|im_start|>user\n<tool_response>\n' }}"
    "{%- else -%}{{ '<|im_start|>' + message['role'] + '\n' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}{{ '\n</tool_response>' }}{%- endif -%}{{ '<|im_end|>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
G = 4


def tool_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(TINY_CHECKPOINT)
    tokenizer.add_tokens([tools.TOOL_CALL_START, tools.TOOL_CALL_END])  # non-special, as in Qwen's
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


def crop_box(text: str) -> tuple[int, int, int, int]:
    """The stand-in tool's crop, a function of the call's text: sizes differ, so do the image grids."""
    n = text.count("x") + 2 * text.count("a")
    return (0, 0, 28 + 14 * (n % 3), 28 + 14 * ((n + 1) % 3))


def stand_in_call(call_text: str, sample: dict, tools_: dict, *, frame, image_processor=None):
    box = crop_box(call_text)
    crop = data.load_image(sample["images"][0], sample).crop(box)
    record = {"name": "zoom", "arguments": None, "error": None, "text": "ok", "images": [{"crop": list(box)}]}
    return tools.ToolResult([{"type": "image", "image": crop}, {"type": "text", "text": "ok"}], None, record)


def image(colour, size) -> Image.Image:
    return Image.new("RGB", size, colour)


SAMPLES = [
    {"id": "a", "images": [image((200, 10, 10), (56, 56))], "prompt": "look"},
    {"id": "b", "images": [image((10, 200, 10), (84, 56))], "prompt": "a b"},
]


def three_turn_rollout(model, tokenizer, image_processor, monkeypatch, temperature=0.7):
    """A rollout of 2 prompts x G with at least one row of 3 model turns and 2 returned images."""
    monkeypatch.setattr(tools, "run_call", stand_in_call)
    call_end = tokenizer.convert_tokens_to_ids(tools.TOOL_CALL_END)
    allowed = [tokenizer.eos_token_id, call_end, 71, 94]  # <|im_end|>, </tool_call>, "a", "x"
    options = sampling_config.sampler_options(tokenizer, max_new_tokens=24, temperature=temperature)
    options["suppress_token_ids"] = [t for t in range(len(tokenizer)) if t not in allowed]
    use = multiturn.ToolUse({}, 2, tokenizer, image_processor, None, max_length=4096)
    batch = data.prepare_prompts(SAMPLES, tokenizer, image_processor, device="cpu")
    for seed in range(20):
        torch.manual_seed(seed)
        turns = multiturn.sample(
            model, batch, SAMPLES, use, group_size=G, sampling=options, return_logprobs=True
        )
        three = [i for i, t in enumerate(turns.turns) if len(t) == 3 and not turns.truncated[i]]
        if three and turns.counts["calls"][three[0]] == 2:
            return turns, three[0]
    raise AssertionError("no 3-turn row in 20 seeds")


def make_model(family: str, tokenizer) -> torch.nn.Module:
    """A tiny random model of `family` for the tokenizer, LoRA in its last 2 blocks with B != 0."""
    return adapted(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def tokenizer():
    return tool_tokenizer()


@pytest.fixture(scope="module")
def image_processor():
    return AutoImageProcessor.from_pretrained(TINY_CHECKPOINT)


# --- 1. the recompute of a multi-turn sequence -----------------------------------------------------------


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_recompute_equals_generation_logprobs_on_every_model_token_of_a_three_turn_rollout(
    family, tokenizer, image_processor, monkeypatch
):
    model = make_model(family, tokenizer)
    turns, row = three_turn_rollout(model, tokenizer, image_processor, monkeypatch)
    grids = turns.inputs["image_grid_thw"]
    assert grids.shape[0] > 2 * G  # tool images beyond the prompts' one per row
    assert (turns.inputs["mm_token_type_ids"][:, -turns.completion_ids.shape[1] :] == 1).any()
    mask = turns.mask
    with torch.no_grad():
        logp, _ = grpo.completion_logprobs(model, turns.inputs, turns.completion_ids, temperature=0.7)
        # The frozen trunk captured once, in micro-batches of 3 rows that cut through groups and images.
        plan = speedups.choose(model, speedups.SpeedConfig(micro_batch_size=3), last_k=2)
        chunks = speedups.row_chunks(model, turns.inputs, turns.completion_ids, None, plan)
        trunk = torch.cat([speedups.chunk_logprobs(model, c, plan, temperature=0.7)[0] for c in chunks])
    full = (logp - turns.logp)[mask].abs().max().item()
    chunked = (trunk - turns.logp)[mask].abs().max().item()
    print(f"{family}: recompute vs generate, max |delta| {full:.1e}; trunk in micro-batches {chunked:.1e}")
    assert full <= 1e-5 and chunked <= 1e-5
    assert (
        mask[row].sum() < (turns.completion_ids[row] != tokenizer.pad_token_id).sum()
    )  # tool turns unmasked


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_a_multi_turn_sequence_has_the_logprobs_of_its_conversation_rendered_from_scratch(
    family, tokenizer, image_processor, monkeypatch
):
    model = make_model(family, tokenizer)
    turns, row = three_turn_rollout(model, tokenizer, image_processor, monkeypatch)
    sample, texts = turns.samples[row], [t["text"] for t in turns.turns[row]]
    # The conversation as a user would write it: each model turn, each tool answer (its crop and text).
    crops = [data.load_image(sample["images"][0], sample).crop(crop_box(t)) for t in texts[:2]]
    answer = [{"type": "image"}, {"type": "text", "text": "ok"}]
    messages = [*data.sample_messages(sample), {"role": "assistant", "content": texts[0]}]
    messages += [{"role": "tool", "content": answer}, {"role": "assistant", "content": texts[1]}]
    messages += [{"role": "tool", "content": answer}, {"role": "assistant", "content": texts[2]}]
    conversation = {"id": "c", "messages": messages, "images": [sample["images"][0], *crops]}
    scratch = data.prepare_prompts([conversation], tokenizer, image_processor, device="cpu").inputs
    # Its tokens: the row's prompt and completion (the template then adds "\n<|im_start|>assistant\n").
    T = int(turns.mask[row].nonzero().max()) + 1  # through the final end of turn
    real = turns.inputs["attention_mask"][row].bool()
    sequence = torch.cat([turns.inputs["input_ids"][row][real], turns.completion_ids[row, :T]])
    assert torch.equal(scratch["input_ids"][0, : len(sequence)], sequence)
    with torch.no_grad():
        logits = model(**scratch).logits[0].float()  # (L, V) one forward, positions from scratch
        logp, _ = grpo.completion_logprobs(model, turns.inputs, turns.completion_ids, temperature=1.0)
    start = len(sequence) - T  # the first completion token's index in the from-scratch sequence
    reference = torch.log_softmax(logits[start - 1 : start + T - 1], -1).gather(-1, sequence[start:, None])[
        :, 0
    ]
    delta = (logp[row, :T] - reference)[turns.mask[row, :T]].abs().max().item()
    print(f"{family}: multi-turn sequence vs the conversation rendered from scratch, max |delta| {delta:.1e}")
    assert delta <= 1e-5


def test_a_chat_template_that_rewrites_the_models_text_or_drops_tool_images_is_refused(image_processor):
    tokenizer, config = tool_tokenizer(), tools.ToolConfig(("zoom",), max_tool_calls=1)
    options = dict(box_frame="auto", model_type="qwen2_5_vl", max_length=99, suppressed=[])
    assert multiturn.tool_use(config, tokenizer, image_processor, **options).frame == "absolute"
    image = "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    tokenizer.chat_template = TOOL_TEMPLATE.replace(image, "{%- if false -%}")
    with pytest.raises(ValueError, match="--tools: the chat template renders no <|image_pad|>"):
        multiturn.tool_use(config, tokenizer, image_processor, **options)
    # As a template that writes a call on lines of its own would: the sequence would not be the model's text.
    content = "{{ message['content'] }}"
    tokenizer.chat_template = TOOL_TEMPLATE.replace(
        content, "{{ message['content'] | replace('>{', '>\\n{') }}"
    )
    with pytest.raises(ValueError, match="--tools: the chat template renders an assistant turn otherwise"):
        multiturn.tool_use(config, tokenizer, image_processor, **options)


# --- 2. the mask: the model's own tokens only ------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo"])
def test_tool_inserted_tokens_get_exactly_zero_gradient_and_normalisers_count_model_tokens_only(
    loss_type, tokenizer, image_processor, monkeypatch
):
    model = make_model("qwen2.5-vl", tokenizer)
    turns, _ = three_turn_rollout(model, tokenizer, image_processor, monkeypatch, temperature=1.0)
    args = train_args(loss_type=loss_type, beta=0.0, group_size=G, max_new_tokens=24)
    args.speed.shared_prefill = args.speed.trunk_reuse = False
    run = make_run(model, args)
    N, T = turns.completion_ids.shape
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5] * (N // 4))  # by hand
    chunks = speedups.row_chunks(model, turns.inputs, turns.completion_ids, None, run.speed)
    fields = dict(texts=[], samples=[], reward=adv, components={}, adv=adv, chunks=chunks)
    ro = trainer.Rollout(turns.inputs, turns.completion_ids, turns.mask, turns.truncated, **fields)
    norm = speedups.decoder_parts(model, 2)["norm"]
    hidden = []
    with norm.register_forward_hook(lambda module, args, out: hidden.append(out) or out.retain_grad()):
        loss, _, _ = trainer.accumulate_policy_gradient(run, ro, args, beta=0.0)
    grad = hidden[0].grad[:, -T - 1 : -1]  # (N, T, H): the positions that predict completion token t
    per_position = grad.abs().sum(-1)  # (N, T)
    assert bool((per_position[~turns.mask] == 0).all())  # tool turns and padding: exactly zero
    assert bool((per_position[turns.mask] > 0).all())
    # At ratio 1 each model token adds -A_i: dapo divides by the model's tokens, dr_grpo by N * 24.
    L = turns.mask.sum(1).float()  # (N,) the model's tokens per row; tool tokens not counted
    expected = -(adv * L).sum() / (L.sum() if loss_type == "dapo" else N * 24)
    assert loss == pytest.approx(expected.item(), abs=1e-6)
    last = torch.where(turns.mask, torch.arange(T), -1).max(dim=1).values  # (N,) each row's final token
    assert ((~turns.mask) & (torch.arange(T) < last[:, None])).any()  # tool turns between model turns


# --- 3. a scripted policy: every malformed call, the limits -----------------------------------------------


def call(name, **arguments) -> str:
    return f"{tools.TOOL_CALL_START}{json.dumps({'name': name, 'arguments': arguments})}{tools.TOOL_CALL_END}"


SCRIPT = {  # case -> the policy's turns, in order; the turn after the last is "done"
    "case 0": [call("zoom", image=0, bbox_2d=[56, 28, 112, 84])],
    "case 1": [f"{tools.TOOL_CALL_START}{{'name': zoom}}{tools.TOOL_CALL_END}", call("pan", dx=1)],
    "case 2": [call("zoom", image=0), call("zoom", image=0, bbox_2d=[0, 0, 500, 28])],
    "case 3": [
        call("zoom", image=3, bbox_2d=[0, 0, 5, 5]),
        call("boom"),
        call("zoom", image=0, bbox_2d=[0, 0, 9, 9]),
    ],
}


def scripted_sampler(tokenizer):
    """grpo.sample_completions for a policy that writes SCRIPT: its prompt says which case, its tool turns so
    far which turn; the tokens padded, cut at max_new_tokens as generate would."""

    def sample_completions(model, inputs, *, max_new_tokens, eos_token_id, pad_token_id, **options):
        rows = []
        for ids in inputs["input_ids"]:
            text = tokenizer.decode(ids)
            turns = SCRIPT[re.search(r"case \d", text)[0]]
            k = text.count("<tool_response>")
            turn = turns[k] if k < len(turns) else "done"
            written = tokenizer(turn, add_special_tokens=False)["input_ids"]
            rows.append((written + ([] if k < len(turns) else [tokenizer.eos_token_id]))[:max_new_tokens])
        T = max(map(len, rows))
        return torch.tensor([row + [pad_token_id] * (T - len(row)) for row in rows])

    return sample_completions


def scripted_rollout(tokenizer, image_processor, monkeypatch, tmp_path, **limits) -> multiturn.Rollouts:
    (tmp_path / "boom.py").write_text("def boom(arguments, sample):\n    raise RuntimeError('no')\n")
    monkeypatch.setattr(grpo, "sample_completions", scripted_sampler(tokenizer))
    loaded = tools.load_tools(["zoom", f"{tmp_path / 'boom.py'}:boom"])
    use = multiturn.ToolUse(loaded, 2, tokenizer, image_processor, "absolute", limits.get("max_length", 4096))
    samples = [{"id": c, "images": [image((9, 99, 9), (112, 84))], "prompt": c} for c in SCRIPT]
    options = sampling_config.sampler_options(
        tokenizer, max_new_tokens=limits.get("max_new_tokens", 200), temperature=1.0
    )
    batch = data.prepare_prompts(samples, tokenizer, image_processor, device="cpu")
    return multiturn.sample(None, batch, samples, use, group_size=1, sampling=options)


def test_every_malformed_call_is_answered_with_its_error_and_counted(
    tokenizer, image_processor, monkeypatch, tmp_path
):
    turns = scripted_rollout(tokenizer, image_processor, monkeypatch, tmp_path)
    kinds = [[(t.get("call") or {}).get("error") for t in row] for row in turns.turns]
    assert kinds == [
        [None, None],
        ["invalid_json", "unknown_tool", None],
        ["bad_arguments", "bad_box", None],
        ["bad_image_index", "tool_raised", "too_many_calls"],
    ]
    counts = {key: values.tolist() for key, values in turns.counts.items() if values.any()}
    assert counts == {
        "calls": [1, 2, 2, 2],
        "errors": [0, 2, 2, 3],
        **{f"errors/{kind}": [0, 1, 0, 0] for kind in ("invalid_json", "unknown_tool")},
        **{f"errors/{kind}": [0, 0, 1, 0] for kind in ("bad_arguments", "bad_box")},
        **{f"errors/{kind}": [0, 0, 0, 1] for kind in ("bad_image_index", "tool_raised", "too_many_calls")},
    }
    metrics = multiturn.tool_metrics(turns.counts)
    assert metrics["tools/calls"] == 7 / 4 and metrics["tools/errors/bad_box"] == 1 / 4
    assert turns.truncated.tolist() == [False, False, False, True]  # the call past the limit ends it
    for row, trajectory in enumerate(
        s["trajectory"] for s in turns.samples
    ):  # each error is the tool's answer
        assert all(
            f"error: {kind}: " in trajectory for kind in kinds[row] if kind not in (None, "too_many_calls")
        )
    assert turns.texts == ["done", "done", "done", call("zoom", image=0, bbox_2d=[0, 0, 9, 9])]
    assert turns.samples[1]["tool_calls"] == [t["call"] for t in turns.turns[1][:2]]
    # Case 0's zoom: the crop of original pixels [56, 28, 112, 84] came back as 4 visual tokens, unmasked.
    zoomed = turns.turns[0][0]["call"]
    assert zoomed["images"] == [{"crop": [56, 28, 112, 84], "size": [56, 56]}]
    types = turns.inputs["mm_token_type_ids"][0, -turns.completion_ids.shape[1] :]  # (T,) the completion's
    assert int(types.sum()) == 4 and not bool(turns.mask[0][types == 1].any())
    assert turns.inputs["image_grid_thw"].shape[0] == 4 + 1  # each prompt's image and the crop
    print(
        json.dumps(
            {"trajectory": turns.samples[0]["trajectory"], "turns": turns.turns[0]}, ensure_ascii=False
        )
    )


def test_the_token_budget_and_the_length_bound_end_a_rollout_truncated(
    tokenizer, image_processor, monkeypatch, tmp_path
):
    budget = scripted_rollout(tokenizer, image_processor, monkeypatch, tmp_path, max_new_tokens=12)
    assert budget.truncated.all() and budget.mask.sum(1).max() == 12  # the model's tokens over all turns
    # Case 0: a prompt of 33 tokens and a call of 72 fit in 120; the tool turn after them (its crop) does not.
    bound = scripted_rollout(tokenizer, image_processor, monkeypatch, tmp_path, max_length=120)
    assert bound.truncated[0] and len(bound.turns[0]) == 1 and bound.turns[0][0]["call"]["error"] is None
    assert bound.counts["calls"][0] == 1 and bound.mask[0].all()  # it ran, but nothing was inserted


# --- 4. train.py with tools --------------------------------------------------------------------------------


def save_tools_checkpoint(directory: Path) -> Path:
    """The embedded tiny model with the two call tags, written as often as its end of turn (their LM head
    rows are its row), and the tool template: it calls tools by chance, the stand-in answers with images."""
    model, _, image_processor = model_io.load_model(model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    tokenizer = tool_tokenizer()
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        for tag in (tools.TOOL_CALL_START, tools.TOOL_CALL_END):
            head[tokenizer.convert_tokens_to_ids(tag)] = head[tokenizer.eos_token_id]
    files.save_model(model, tokenizer, image_processor, directory)
    return directory


@pytest.fixture(scope="module")
def tools_checkpoint(tmp_path_factory) -> Path:
    return save_tools_checkpoint(tmp_path_factory.mktemp("tools") / "model")


TOOLS_RUN = dict(tools=("zoom",), max_tool_calls=2, batch_size=2, group_size=2, max_new_tokens=16)
TOOLS_RUN |= dict(train_size=16, eval_size=2, eval_every=2, save_every=100, warmup_steps=1, seed=3)


def test_max_tool_calls_0_never_enters_the_multi_turn_rollout(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("multiturn.sample was called")

    monkeypatch.setattr(multiturn, "sample", refuse)
    trainer.main(
        train_args(output_dir=str(tmp_path / "run"), steps=1, batch_size=2, group_size=2, eval_size=2)
    )
    lines = [(tmp_path / "run" / f"{name}.jsonl").read_text() for name in ("metrics", "rollouts")]
    assert "tools/" not in lines[0] and '"turns"' not in lines[1]


def test_a_run_with_tools_interrupted_and_resumed_equals_an_uninterrupted_one(
    tools_checkpoint, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(tools, "run_call", stand_in_call)
    flags = dict(TOOLS_RUN, model=str(tools_checkpoint), steps=3, micro_batch_size=3)
    trainer.main(train_args(output_dir=str(tmp_path / "whole"), **flags))
    assert "shared prefill is off" in capsys.readouterr().out
    real_update, calls = trainer.policy_update, []

    def update_then_signal(*args, **kwargs):
        stats = real_update(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while step 2 is still running
        return stats

    monkeypatch.setattr(trainer, "policy_update", update_then_signal)
    with pytest.raises(SystemExit, match="stopped after step 2"):
        trainer.main(train_args(output_dir=str(tmp_path / "cut"), **flags))
    monkeypatch.setattr(trainer, "policy_update", real_update)
    trainer.main(train_args(output_dir=str(tmp_path / "cut"), resume=str(tmp_path / "cut"), **flags))
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        assert (tmp_path / "cut" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    rows = [json.loads(line) for line in (tmp_path / "whole" / "rollouts.jsonl").read_text().splitlines()]
    images = [c["images"] for r in rows for t in r["turns"] if (c := t.get("call")) and c["images"]]
    assert len(images) >= 2  # tools answered with images, in more than one step's rollout
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("tools/calls", 0) for r in records) > 0 and "tools/errors/bad_box" in records[1]
    assert "eval/tools/calls" in records[0] and "eval/tools/calls" in records[2]  # steps 0 and 2


def test_a_tokenizer_without_the_call_tags_and_dynamic_sampling_are_refused_with_tools(tmp_path):
    with pytest.raises(cli.UsageError, match="--tools: the tokenizer has no <tool_call> and </tool_call>"):
        trainer.main(train_args(output_dir=str(tmp_path / "a"), steps=1, tools=("zoom",), max_tool_calls=1))
    with pytest.raises(cli.UsageError, match="--dynamic-sampling: cannot be combined with --max-tool-calls"):
        trainer.main(train_args(output_dir=str(tmp_path / "b"), dynamic_sampling=True, **TOOLS_RUN))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_evaluate_script_runs_tools_and_reports_the_calls(tools_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(tools, "run_call", stand_in_call)
    output = tmp_path / "eval.jsonl"
    flags = dict(
        model=str(tools_checkpoint), eval_size=4, num_samples=4, max_new_tokens=16, output=str(output)
    )
    summary = evaluate.main(evaluate.Args(**flags, tools=tools.ToolConfig(("zoom",), max_tool_calls=2)))
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    calls = [n for line in lines for n in line["tool_calls"]]
    assert summary["base"]["tool_calls/mean"] == sum(calls) / 16 > 0
    for line in lines:  # each completion: its turns, the last one's text the completion scored
        assert [turns[-1]["text"] for turns in line["turns"]] == line["completions"]
        ran = [
            [t for t in turns if t.get("call", {}).get("error", "") != "too_many_calls"]
            for turns in line["turns"]
        ]
        assert [sum("call" in t for t in turns) for turns in ran] == line["tool_calls"]
    settings = json.loads(output.with_suffix(".settings.json").read_text())
    assert settings["tools"] == ["zoom"] and settings["max_tool_calls"] == 2


# 2 gloo ranks, each on its B prompts' rows of one multi-turn rollout, give the one-process update.
B, WORLD = 2, 2


def update_args(**flags) -> trainer.Args:
    flags = dict(
        TOOLS_RUN, group_size=G, batch_size=B, num_iterations=2, micro_batch_size=3, beta=0.04, **flags
    )
    return train_args(**flags)


def keep_sampled(monkeypatch) -> list[multiturn.Rollouts]:
    """multiturn.sample's results as trainer.tool_rollout draws them (the N rows' inputs, pixels included)."""
    sampled, sample = [], multiturn.sample

    def keep(*args, **kwargs) -> multiturn.Rollouts:
        sampled.append(sample(*args, **kwargs))
        return sampled[-1]

    monkeypatch.setattr(multiturn, "sample", keep)
    return sampled


def tool_run(checkpoint: Path, args: trainer.Args) -> trainer.Run:
    """A run with the stand-in zoom on the tools checkpoint, as trainer.build_run makes it."""
    model, tokenizer, image_processor = lora_model_with_gradients(checkpoint)
    use = trainer.tool_use(args, model, tokenizer, image_processor, rank=1)
    fields = dict(tokenizer=tokenizer, image_processor=image_processor, tools=use, box_frame=None)
    return make_run(model, args, reward_fns=trainer.resolve_rewards(args, "inspection"), **fields)


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor `value` holds, through dataclasses, dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    return [t for v in values for t in tensors_in(v)]


@pytest.mark.parametrize("trunk_reuse", [True, False])
def test_a_tool_rollout_keeps_the_rows_pixels_only_where_a_log_prob_pass_reads_them(
    tools_checkpoint, monkeypatch, trunk_reuse
):
    monkeypatch.setattr(tools, "run_call", stand_in_call)
    sampled = keep_sampled(monkeypatch)
    args = update_args(trunk_reuse=trunk_reuse, shared_prefill=trunk_reuse)
    run = tool_run(tools_checkpoint, args)
    prompts = dataset.batch_for_step(tasks.make_task("inspection", 32, seed=0), 0, B, seed=0)
    torch.manual_seed(1)
    ro = trainer.tool_rollout(run, prompts, args)
    pixels = sampled[0].inputs["pixel_values"]  # (patches, D): the N rows' prompt and tool images
    assert sum(sampled[0].images_per_row) > sum(len(p["images"]) for p in prompts) * G  # tool images
    assert pixels.nbytes == memory.pixel_bytes(int(sampled[0].inputs["mm_token_type_ids"].sum()))
    storage = pixels.untyped_storage().data_ptr()
    held = [t for t in tensors_in(ro) if t.untyped_storage().data_ptr() == storage or t.shape == pixels.shape]
    # Under trunk reuse the trunk encoded them; the plain path's chunks read them (views of the one tensor).
    assert bool(held) == (not trunk_reuse)
    assert torch.equal(ro.inputs["image_grid_thw"], sampled[0].inputs["image_grid_thw"])
    trainer.frozen_logprobs(run, ro, args)  # the passes read the chunks only
    assert torch.isfinite(ro.old_logp).all() and torch.isfinite(ro.ref_logp).all()


def rank_update(fixed_path: Path, checkpoint: Path, rank: int, world: int) -> dict:
    """One policy_update on this rank's rows of the fixed rollout: the gradients, weights and stats after."""
    from full.test_distributed import rank_rollout

    fixed, (model, _, _) = torch.load(fixed_path), lora_model_with_gradients(checkpoint)
    with torch.no_grad():
        for p, saved in zip(lora.lora_parameters(model), fixed["lora"]):
            p.copy_(saved)
    args, params = update_args(), lora.lora_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    scheduler = model_io.cosine_with_warmup(optimizer, warmup_steps=1, total_steps=10)
    run = make_run(model, args, optimizer=optimizer, scheduler=scheduler, rank=rank, world=world)
    stats = trainer.policy_update(run, rank_rollout(run, fixed, args, rank, world), args, args.loss.beta)
    return {
        "grads": [p.grad.clone() for p in params],
        "params": [p.detach().clone() for p in params],
        **stats,
    }


def test_two_gloo_ranks_give_the_one_process_update_on_a_multi_turn_rollout(
    tools_checkpoint, tmp_path, monkeypatch
):
    from full.test_distributed import torchrun

    monkeypatch.setattr(tools, "run_call", stand_in_call)
    sampled = keep_sampled(monkeypatch)  # the rows with their pixels, which the Rollout no longer holds
    args = update_args()
    run = tool_run(tools_checkpoint, args)
    prompts = dataset.batch_for_step(tasks.make_task("inspection", 32, seed=0), 0, WORLD * B, seed=0)
    torch.manual_seed(1)
    ro = trainer.tool_rollout(run, prompts, args)
    trainer.frozen_logprobs(run, ro, args)
    assert ro.inputs["image_grid_thw"].shape[0] > sum(len(p["images"]) for p in prompts) * G  # tool images
    for r in range(WORLD):  # otherwise a rank would have no policy-gradient signal to sum
        assert ro.adv[r * B * G : (r + 1) * B * G].abs().sum() > 0, "pick another seed"
    fields = ("completion_ids", "mask", "truncated", "reward", "adv", "old_logp", "ref_logp")
    lora_weights = [p.detach().clone() for p in lora.lora_parameters(run.model)]
    fixed = {"lora": lora_weights, "inputs": sampled[0].inputs, **{k: getattr(ro, k) for k in fields}}
    torch.save(fixed, tmp_path / "rollout.pt")
    torchrun(__file__, str(tmp_path / "rollout.pt"), str(tools_checkpoint), cwd=tmp_path)
    one = rank_update(tmp_path / "rollout.pt", tools_checkpoint, 0, 1)
    # Adam divides by sqrt(v): where a gradient is near 0, its rounding moves a weight by up to ~lr * 1e-3.
    tolerance, delta = {"grads": 1e-6, "params": 1e-5}, {"grads": 0.0, "params": 0.0}
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name in ("grads", "params"):
            for a, b in zip(got[name], one[name], strict=True):
                torch.testing.assert_close(a, b, atol=tolerance[name], rtol=0, msg=f"rank {rank} {name}")
                delta[name] = max(delta[name], (a - b).abs().max().item())
        stats = {k: v for k, v in got.items() if k not in ("grads", "params")}
        assert stats == pytest.approx(
            {k: v for k, v in one.items() if k not in ("grads", "params")}, abs=1e-6
        )
    assert max(g.abs().max().item() for g in one["grads"]) > 1e-4
    grads, weights = delta["grads"], delta["params"]
    print(f"2 ranks vs 1 process with tools: max |delta| grads {grads:.1e}, weights {weights:.1e}")


if __name__ == "__main__":  # one rank, launched by the test above through torchrun
    torch.set_num_threads(1)
    rank, world = distributed.init_distributed(torch.device("cpu"))
    fixed_path = Path(sys.argv[1])
    torch.save(rank_update(fixed_path, Path(sys.argv[2]), rank, world), fixed_path.parent / f"rank{rank}.pt")
    distributed.finish_distributed()
