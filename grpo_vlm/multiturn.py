"""Multi-turn rollouts in which the policy calls tools ("thinking with images"), trained on its own tokens.

The policy writes a call in Qwen's chat format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
sampling stops at `</tool_call>`, the tool runs (tools.py), its result (text and/or images) is appended as the
chat template's tool turn, and sampling goes on, at most `max_tool_calls` calls per completion. A row's
completion is everything after its prompt: the model's turns and the inserted tool turns, one sequence that
the log-prob passes (grpo.completion_logprobs, speedups.py) read in one forward with every image.

Letters as in grpo.py: B prompts, G completions per prompt, N = B*G rows, P prompt length (left-padded),
T completion length (model and tool tokens, right-padded after the row's end).

Choices:
- The mask is the model's tokens: every token it wrote, each `</tool_call>` and the final end of turn
  included; the tool turns' text, the template's turn markers and the returned images' vision tokens are not
  (zero gradient, in no normaliser, KL or entropy statistic).
- --max-new-tokens bounds the model's tokens over all turns; prompt + completion (tool turns included) is
  bounded by `max_length` (--max-prompt-length + --max-new-tokens). A row that would pass either ends there,
  truncated; so does one that calls a tool once more than `max_tool_calls` (the call is not run). Truncated
  means: no final end of turn.
- Each turn is one `grpo.sample_completions` (generate) over the rows still running, re-batched with left
  padding: the G rows of a prompt diverge (one calls a tool, another answers). Its input is the whole
  sequence so far with every image; Qwen-VL numbers the tokens of an image that appears mid-sequence by its
  grid from the row's real tokens (`get_rope_index`), the same in every turn and in the recompute.
  NOTE: each turn re-prefills, vision tower included; transformers 5.24 cannot continue a re-batched turn
  from the last turn's cache: its caches never move a row along the sequence (cache_utils.py:146-150,
  475-482), Qwen-VL's continuation reads `rope_deltas` left on the model for the last call's rows
  (models/qwen2_5_vl/modeling_qwen2_5_vl.py:1405-1414, 1156-1166), and new images need `image_grid_thw`
  both for the new images only (1214-1222) and for all (1424-1428). docs/tools.md has the details.
- The tool turn is the chat template's own: the conversation rendered with the tool's message, minus the
  same conversation rendered up to the model's text, so that each checkpoint's template decides.
- The rows' inputs hold every image of the row in order (the prompt's, then the tools') and
  `mm_token_type_ids` over prompt AND completion (N, P + T): grpo.recompute_inputs and speedups.split_rows
  read the tool images' tokens from there.
- Rewards see the final answer (the last model turn) as the completion, so the label and format rewards work
  unchanged, and a copy of the sample with the whole `trajectory` text and the `tool_calls` records.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import data
import grpo
from grpo_vlm import dataset, grounding, tools

ERROR_KINDS = (*tools.ERROR_KINDS, "too_many_calls")  # the last: a call past max_tool_calls, not run


@dataclass
class ToolUse:
    """What a multi-turn rollout needs besides the model and its sampling options; set up once per run."""

    tools: dict[str, tools.Tool]  # tools.load_tools
    max_tool_calls: int
    tokenizer: Any  # its chat template renders the tool turns
    image_processor: Any  # processes the returned images (None: a text-only model)
    frame: str | None  # the frame the model writes boxes in (grounding.py); None: original pixels
    max_length: int  # prompt + completion tokens at most


def tool_use(
    config: tools.ToolConfig,
    tokenizer,
    image_processor,
    *,
    box_frame: str,
    model_type: str,
    max_length: int,
    suppressed: Sequence[int],
    max_image_pixels: int | None = dataset.DataConfig.max_image_pixels,
) -> ToolUse:
    """A run's ToolUse from --tools / --max-tool-calls: the tools loaded, bounded by --tool-timeout, the
    data's `max_image_pixels` and the tokenizer's special tokens (tools.Limits); the call's tags checked (one
    token each, and not among the `suppressed` ids: a special token is); the frame the model writes boxes in
    ("auto": its family's, grounding.py). A ValueError names the flag."""
    special = tuple(token.content for token in tokenizer.added_tokens_decoder.values() if token.special)
    limits = tools.Limits(config.tool_timeout, max_image_pixels, special)
    loaded = tools.load_tools(config.tools, limits)
    ids = {tokenizer.convert_tokens_to_ids(tag) for tag in (tools.TOOL_CALL_START, tools.TOOL_CALL_END)}
    if ids & {None, tokenizer.unk_token_id, *suppressed}:
        raise ValueError(
            f"--tools: the tokenizer has no {tools.TOOL_CALL_START} and {tools.TOOL_CALL_END} tokens (each "
            "one non-special token, as in Qwen's tokenizers) for the model to write a call with"
        )
    # The template must render a tool turn after the model's text as it is, and an image in it (a
    # placeholder per image, else the pixels would have no tokens).
    call = f'{tools.TOOL_CALL_START}{{"name": "zoom", "arguments": {{}}}}{tools.TOOL_CALL_END}'
    answer = [{"type": "image"}] if image_processor is not None else []
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": call}]
    inserted = _inserted_text(
        tokenizer, [*probe, {"role": "tool", "content": [*answer, {"type": "text", "text": "ok"}]}]
    )
    if inserted.count(data.IMAGE_PAD) != len(answer):
        raise ValueError(
            f"--tools: the chat template renders no {data.IMAGE_PAD} for an image in a tool turn"
        )
    frame = None
    if image_processor is not None:
        try:
            frame = grounding.frame_for_model_type(model_type) if box_frame == "auto" else box_frame
        except ValueError as e:
            raise ValueError(f"--box-frame: {e}") from e
    return ToolUse(loaded, config.max_tool_calls, tokenizer, image_processor, frame, max_length)


def tool_image_tokens(max_tool_calls: int, image_processor) -> int:
    """The visual tokens a row's tool turns may add, for memory.estimate: one image a call (zoom's) at the
    data's pixel budget (dataset.set_pixel_budget)."""
    if image_processor is None:
        return 0
    side = image_processor.patch_size * image_processor.merge_size  # pixels of one visual token, each way
    return max_tool_calls * dataset.image_pixel_budget(image_processor) // side**2


@dataclass
class _Row:
    """One row while it is sampled: its real tokens (no padding) and images so far, and its conversation."""

    sample: dict
    messages: list[dict]  # the chat so far, for the template: the sample's turns, then assistant / tool
    ids: list[int]  # prompt, then completion tokens
    types: list[int]  # mm_token_type_ids of `ids`: 1 on image tokens
    pixels: list[Tensor]  # (patches, D) of each image, the prompt's then the tools'
    grids: list[Tensor]  # (3,) of each image
    prompt_length: int
    mask: list[bool] = field(default_factory=list)  # per completion token: written by the model
    logp: list[float] = field(default_factory=list)  # per completion token: generation-time (tests)
    pieces: list[str] = field(default_factory=list)  # model turns and tool turns as text: the trajectory
    turns: list[dict] = field(default_factory=list)  # rollouts.jsonl's: {"text", "call"?}
    calls: int = 0  # tool calls run
    errors: list[str] = field(default_factory=list)  # their error kinds, and too_many_calls
    done: bool = False
    truncated: bool = False


@dataclass
class Rollouts:
    """The N rows of a multi-turn rollout, as the step reads them."""

    inputs: dict[str, Tensor]  # prompts (N, P) with every image of each row; mm_token_type_ids (N, P + T)
    completion_ids: Tensor  # (N, T) model and tool turns, right-padded
    mask: Tensor  # (N, T) bool: the model's tokens
    truncated: Tensor  # (N,) bool: no final end of turn
    texts: list[str]  # each row's final answer (its last model turn)
    samples: list[dict]  # each row's sample with "trajectory" and "tool_calls"
    turns: list[list[dict]]  # each row's turns, for rollouts.jsonl
    images_per_row: list[int]  # the prompt's and the tools' images, in `inputs`' order
    counts: dict[str, Tensor]  # (N,) each: "calls", "errors", "errors/<kind>"
    logp: Tensor | None = None  # (N, T) generation-time log-probs on the model's tokens (return_logprobs)


def _rows(batch: data.PromptBatch, samples: list[dict], group_size: int) -> list[_Row]:
    """The N = B*G rows of B prompts: each prompt's real tokens and images, G times."""
    inputs, rows, first = batch.inputs, [], 0
    # Images on the CPU, where the tools' are processed; each turn's batch moves them to the device.
    grids = list(inputs["image_grid_thw"].cpu()) if "image_grid_thw" in inputs else []  # (3,) each
    pixels = list(inputs["pixel_values"].cpu().split([int(g.prod()) for g in grids])) if grids else []
    types = inputs.get("mm_token_type_ids", torch.zeros_like(inputs["input_ids"]))  # (B, P)
    for b, (sample, n) in enumerate(zip(samples, batch.images_per_row)):
        real = inputs["attention_mask"][b].bool()  # left padding dropped
        ids, row_types = inputs["input_ids"][b][real].tolist(), types[b][real].tolist()
        images = slice(first, first + n)
        for _ in range(group_size):  # each row its own lists: its turns grow them
            messages = list(data.sample_messages(sample))
            row = _Row(sample, messages, list(ids), list(row_types), pixels[images], grids[images], len(ids))
            rows.append(row)
        first += n
    return rows


def _left_padded(rows: list[_Row], pad_token_id: int, device: torch.device | str) -> dict[str, Tensor]:
    """The rows' sequences so far as one LEFT-padded batch with their images: generate's input."""
    L = max(len(r.ids) for r in rows)
    ids = torch.tensor([[pad_token_id] * (L - len(r.ids)) + r.ids for r in rows], device=device)  # (n, L)
    mask = torch.tensor([[0] * (L - len(r.ids)) + [1] * len(r.ids) for r in rows], device=device)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if grids := [g for r in rows for g in r.grids]:
        types = [[0] * (L - len(r.types)) + r.types for r in rows]
        inputs["mm_token_type_ids"] = torch.tensor(types, device=device)  # (n, L)
        inputs["pixel_values"] = torch.cat([p for r in rows for p in r.pixels]).to(device)
        inputs["image_grid_thw"] = torch.stack(grids).to(device)  # (images, 3)
    return inputs


def _inserted_text(tokenizer, messages: list[dict]) -> str:
    """The text the chat template puts between the model's last turn and the next assistant turn: the
    conversation `messages` (..., assistant turn, tool turn) rendered, minus it rendered up to the model's
    text. NOTE: a template that renders an earlier turn otherwise than the model wrote it is refused."""
    template = dict(tokenize=False, add_generation_prompt=True)
    before = tokenizer.apply_chat_template(messages[:-2], **template) + messages[-2]["content"]
    after = tokenizer.apply_chat_template(messages, **template)
    if not after.startswith(before):
        raise ValueError(
            "--tools: the chat template renders an assistant turn otherwise than the model wrote it, or no "
            "tool turn after it; a multi-turn rollout needs the model's text as it is"
        )
    return after[len(before) :]


def _tool_turn(row: _Row, text: str, result: tools.ToolResult, use: ToolUse) -> bool:
    """Append the tool turn after the model's `text` (ending with `</tool_call>`): the chat template's text
    between it and the next assistant turn, its tokens and its images. False if it does not fit."""
    parts = [{"type": "image"} if p["type"] == "image" else p for p in result.content]
    messages = [*row.messages, {"role": "assistant", "content": text}, {"role": "tool", "content": parts}]
    inserted = expanded = _inserted_text(use.tokenizer, messages)
    images = [data.load_image(p["image"], row.sample) for p in result.content if p["type"] == "image"]
    if inserted.count(data.IMAGE_PAD) != len(images) or (images and use.image_processor is None):
        raise ValueError(f"a tool turn of {len(images)} images rendered as {inserted!r}")
    grids, pixels = [], []
    if images:  # as data.prepare_prompts: one <|image_pad|> per visual token; the pixel budget applies
        vision = use.image_processor(images=images, return_tensors="pt")
        grid = vision["image_grid_thw"]  # (images, 3)
        counts = iter((grid.prod(-1) // use.image_processor.merge_size**2).tolist())
        expanded = re.sub(re.escape(data.IMAGE_PAD), lambda _: data.IMAGE_PAD * next(counts), inserted)
        grids, pixels = list(grid), list(vision["pixel_values"].split(grid.prod(-1).tolist()))
    ids = use.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    if len(row.ids) + len(ids) >= use.max_length:  # no room for one more model token after it
        return False
    image_pad = use.tokenizer.convert_tokens_to_ids(data.IMAGE_PAD)
    row.messages, row.grids, row.pixels = messages, row.grids + grids, row.pixels + pixels
    row.ids += ids
    row.types += [int(t == image_pad) for t in ids]
    row.mask += [False] * len(ids)
    row.logp += [0.0] * len(ids)
    row.pieces.append(inserted)
    return True


def _take_turn(
    row: _Row, new: list[int], logp: list[float], ends: list[int], budget: int, use: ToolUse
) -> None:
    """After the row's model turn `new` (through its first stop, or cut at its allowance): record it, and run
    its tool call if it ends with one and may (`budget`: the model's tokens over all turns)."""
    row.ids += new
    row.types += [0] * len(new)
    row.mask += [True] * len(new)
    row.logp += logp
    everything = torch.ones(1, len(new), dtype=torch.bool)
    text = data.decode_completions(use.tokenizer, torch.tensor([new]), everything, ends)[0]  # no end of turn
    row.pieces.append(text)
    row.turns.append(turn := {"text": text})
    row.done, stop = True, new[-1] if new else None
    if stop in ends:  # the final answer
        return
    row.truncated = True  # unless a call runs and its turn fits; a turn the budget cut ends the rollout
    if stop != use.tokenizer.convert_tokens_to_ids(tools.TOOL_CALL_END) or sum(row.mask) >= budget:
        return
    if row.calls == use.max_tool_calls:  # NOTE: not run; the rollout ends on it
        turn["call"] = {
            "name": None,
            "arguments": None,
            "error": "too_many_calls",
            "text": None,
            "images": [],
        }
        row.errors.append("too_many_calls")
        return
    result = tools.run_call(text, row.sample, use.tools, frame=use.frame, image_processor=use.image_processor)
    turn["call"], row.calls = result.record, row.calls + 1
    row.errors += [result.error] if result.error is not None else []
    row.done = row.truncated = not _tool_turn(row, text, result, use)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    batch: data.PromptBatch,
    samples: list[dict],
    use: ToolUse,
    *,
    group_size: int,
    sampling: dict,
    return_logprobs: bool = False,
) -> Rollouts:
    """G multi-turn completions of each of the B prompts of `batch` (rows b*G .. b*G+G-1: prompt b), turn by
    turn: `grpo.sample_completions` with `sampling` (sampling.sampler_options) on the rows still running,
    their tool calls run, the tool turns appended. [return_logprobs: generate's log-probs
    (`generation_logits`), for tests.]"""
    rows, device = _rows(batch, samples, group_size), batch.inputs["input_ids"].device
    ends, budget = list(sampling["eos_token_id"]), sampling["max_new_tokens"]  # budget: over all turns
    stops = [*ends, use.tokenizer.convert_tokens_to_ids(tools.TOOL_CALL_END)]  # end of turn, or a call
    logits = generation_logits(model) if return_logprobs else contextlib.nullcontext([])
    with logits as seen:
        while running := [r for r in rows if not r.done]:
            # Each row's allowance: what is left of the model's token budget and of the length bound.
            allowance = [min(budget - sum(r.mask), use.max_length - len(r.ids)) for r in running]
            options = dict(sampling, max_new_tokens=max(allowance), eos_token_id=stops)
            inputs = _left_padded(running, sampling["pad_token_id"], device)  # the n rows still running
            ids = grpo.sample_completions(model, inputs, **options)
            logp = None
            if seen:  # this turn's generate logits (return_logprobs)
                temperature = sampling["temperature"]
                logp, _ = grpo.logprobs_from_logits(
                    seen.pop(), ids, temperature=temperature, return_entropy=False
                )
            _take_turns(running, allowance, ids, logp, stops, ends, budget, use)
    return _collect(rows, batch, group_size, sampling["pad_token_id"], return_logprobs)


def _take_turns(
    running: list[_Row],
    allowance: list[int],
    ids: Tensor,
    logp: Tensor | None,
    stops: list[int],
    ends: list[int],
    budget: int,
    use: ToolUse,
) -> None:
    """Each running row's turn: its new tokens through its first stop, cut at its allowance."""
    for i, (row, room) in enumerate(zip(running, allowance)):
        new = ids[i, :room].tolist()  # cut at the row's allowance
        end = next((k + 1 for k, t in enumerate(new) if t in stops), len(new))  # through its first stop
        turn_logp = logp[i, :end].tolist() if logp is not None else []
        _take_turn(row, new[:end], turn_logp, ends, budget, use)


@contextlib.contextmanager
def generation_logits(model: torch.nn.Module) -> Iterator[list[Tensor]]:
    """Inside, every `model.generate` call also appends its raw logits (N, T, V) (`output_logits`) to the
    list it yields: generation-time log-probs for tests, from the very sampler the trainer runs."""
    generate, seen = model.generate, []

    def with_logits(**kwargs: Any) -> Any:
        out = generate(**kwargs, output_logits=True)
        seen.append(torch.stack(out.logits, dim=1))  # (N, T, V): before temperature, top_p and suppression
        return out

    model.generate = with_logits
    try:
        yield seen
    finally:
        del model.generate  # the instance's attribute: the class's method is back


def _collect(
    rows: list[_Row], batch: data.PromptBatch, group_size: int, pad_token_id: int, return_logprobs: bool
) -> Rollouts:
    """The finished rows as tensors: the prompts as `batch` padded them, completions right-padded to T."""
    device = batch.inputs["input_ids"].device
    inputs = data.repeat_rows(batch, group_size).inputs  # (N, P) ids and attention mask, as `rollout`'s
    P, T = inputs["input_ids"].shape[1], max(len(r.ids) - r.prompt_length for r in rows)

    def padded(lists: list[list], pad, width: int = T) -> Tensor:  # right-padded: (N, width)
        return torch.tensor([x + [pad] * (width - len(x)) for x in lists], device=device)

    if grids := [g for r in rows for g in r.grids]:  # each row's images in order; their tokens over P + T
        types = [[0] * (P - r.prompt_length) + r.types for r in rows]  # left padding, prompt, completion
        inputs["mm_token_type_ids"] = padded(types, 0, P + T)  # (N, P + T)
        inputs["pixel_values"] = torch.cat([p for r in rows for p in r.pixels]).to(device)
        inputs["image_grid_thw"] = torch.stack(grids).to(device)  # (images, 3)
    counts = {"calls": [r.calls for r in rows], "errors": [len(r.errors) for r in rows]}
    counts |= {f"errors/{kind}": [r.errors.count(kind) for r in rows] for kind in ERROR_KINDS}
    calls = [[t["call"] for t in r.turns if "call" in t] for r in rows]
    return Rollouts(
        inputs=inputs,
        completion_ids=padded([r.ids[r.prompt_length :] for r in rows], pad_token_id),
        mask=padded([r.mask for r in rows], False),
        truncated=torch.tensor([r.truncated for r in rows], device=device),
        texts=[r.turns[-1]["text"] for r in rows],
        samples=[{**r.sample, "trajectory": "".join(r.pieces), "tool_calls": c} for r, c in zip(rows, calls)],
        turns=[r.turns for r in rows],
        images_per_row=[len(r.grids) for r in rows],
        counts={key: torch.tensor(values, device=device) for key, values in counts.items()},
        logp=padded([r.logp for r in rows], 0.0) if return_logprobs else None,
    )


def tool_metrics(counts: dict[str, Tensor]) -> dict[str, float]:
    """tools/calls, tools/errors and tools/errors/<kind>: per completion, as the other metrics."""
    return {f"tools/{key}": float(values.float().mean()) for key, values in counts.items()}
