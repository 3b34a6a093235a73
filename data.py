"""Samples, image+text prompt preparation for Qwen-VL style models, and decoding completions.

A *sample* is a plain dict, one per JSONL line; other fields go to the reward functions untouched:

    {"id": "a1", "images": ["img/a1_0.png"], "prompt": "Inspect the installation.", "label": "通过"}

`images` are paths relative to the JSONL file (or absolute), possibly none, all shown in one prompt (the
built-in tasks of tasks.py put `PIL.Image` objects there); `prompt` follows them in one user turn, or
`messages` gives the chat turns, with one `{"type": "image"}` content entry per image, in order.

Prompts are prepared as the Qwen2-VL / Qwen2.5-VL / Qwen3-VL processors do, without torchvision: the chat
template writes `<|vision_start|><|image_pad|><|vision_end|>` per image, the image processor gives
`pixel_values` and `image_grid_thw`, and each `<|image_pad|>` becomes `grid_t*grid_h*grid_w / merge_size**2`
copies, one per visual token the merger emits. Prompts are LEFT-padded: every row's completion starts at
column P. Legend: `B` prompts, `G` completions per prompt, `N = B*G` rows, `P` padded prompt length.

Choices:
- A prompt longer than `max_prompt_length` raises, never truncated: a cut through the image tokens would
  desynchronise text and `pixel_values`, and a cut through the text changes the task.
- Images above the processor's pixel budget are shrunk as it would shrink them, never rejected
  (`describe_resizes` says so), and decoded once at that size, not in full at every step (`_shrunk`);
  files above `max_image_pixels` (a PNG decodes in full before it can shrink) are refused when they load.
- Rows are expanded like `repeat_interleave` (prompt b becomes rows b*G .. b*G+G-1), `pixel_values` and
  `image_grid_thw` per prompt block; a flat `repeat` would pair row b's text with another row's pixels.
- A completion ends at any end-of-turn id the checkpoint lists; vision and chat-control tokens are never
  sampled (an image token would have no pixels); decoding keeps Qwen-VL's grounding markers.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from PIL import Image
from transformers.image_transforms import convert_to_rgb
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from grpo_vlm import tasks

IMAGE_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
EXCERPT_CHARS = 30  # characters of the line shown on each side of a JSON error


# --- Samples: JSONL files, their images, the built-in tasks -------------------------------------------------
def location(sample: dict) -> str:
    """'file:line' of a sample read from JSONL, or its id / '<synthetic>' for generated samples."""
    return sample.get("_where") or f"sample {sample.get('id', '<synthetic>')}"


def read_jsonl(path: str | Path) -> list[dict]:
    """Read and validate a JSONL dataset, image paths resolved against its folder and checked to exist; every
    problem raises ValueError naming `file:line`, which each sample keeps as `_where`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    samples = []
    # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first line's JSON.
    with path.open(encoding="utf-8-sig", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            # NOTE: without its newline, or json puts a line cut short at "line 2 column 1" of one line.
            text = line.rstrip("\r\n")
            if bad := re.search("[\udc80-\udcff]", text):  # surrogateescape reads a bad byte b as U+DC00 + b
                byte, column = ord(bad[0]) - 0xDC00, bad.start() + 1
                raise ValueError(f"{where}: not UTF-8 (byte 0x{byte:02x} at column {column})")
            try:
                sample = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(_json_error(where, text, e)) from e
            except RecursionError as e:  # json's parser recurses once per '[' or '{'
                raise ValueError(f"{where}: JSON nested too deeply") from e
            samples.append(_validate_sample(sample, where, base_dir=path.parent))
    if not samples:
        raise ValueError(f"{path}: dataset is empty (no JSON lines)")
    return samples


def _json_error(where: str, text: str, e: json.JSONDecodeError) -> str:
    """'file:line:column: invalid JSON: why (a hint); near: <excerpt>' on one line, the column 1-based in
    `text`; a trailing comma is reported at the comma, not at the '}' after it where json notices it."""
    pos, hint = e.pos, ""
    at, before = text[pos : pos + 1], text[:pos].rstrip()
    if before.endswith(",") and at in ("}", "]"):
        pos, hint = len(before) - 1, f" (a trailing comma before '{at}'? JSON allows none)"
    elif at == "'":
        hint = " (single quotes? JSON needs double quotes around keys and strings)"
    elif text.startswith(("True", "False", "None"), pos):
        hint = " (Python's True/False/None? JSON spells them true/false/null)"
    elif e.msg.startswith("Unterminated string"):
        hint = " (the line ends inside this string: a missing '\"' or a line cut short?)"
    elif not text[pos:].strip():
        hint = " (the line ends before the JSON does: a missing '}' or ']'? JSONL needs one sample per line)"
    why = e.msg.removesuffix(" at")  # e.g. "Unterminated string starting at": the column says where
    start, end = max(pos - EXCERPT_CHARS, 0), pos + EXCERPT_CHARS
    excerpt = ("..." if start else "") + text[start:end] + ("..." if end < len(text) else "")
    return f"{where}:{pos + 1}: invalid JSON: {why}{hint}; near: {excerpt}"


def _validate_sample(sample: Any, where: str, *, base_dir: Path) -> dict:
    if not isinstance(sample, dict):
        raise ValueError(f"{where}: a line must be a JSON object, got {type(sample).__name__}")  # noqa: TRY004 (a data error, reported as one)
    has_prompt, has_messages = "prompt" in sample, "messages" in sample
    if has_prompt == has_messages:
        raise ValueError(f"{where}: a sample needs exactly one of 'prompt' (string) or 'messages' (list)")
    if has_prompt and not (isinstance(sample["prompt"], str) and sample["prompt"].strip()):
        raise ValueError(f"{where}: field 'prompt' must be a non-empty string")
    if has_messages and not (isinstance(sample["messages"], list) and sample["messages"]):
        raise ValueError(f"{where}: field 'messages' must be a non-empty list of chat turns")
    for i, turn in enumerate(sample.get("messages") or []):  # else the chat template fails or drops it
        body = turn.get("content") if isinstance(turn, dict) else None
        ok = isinstance(body, str) or isinstance(body, list) and all(isinstance(c, dict) for c in body)
        if not (ok and isinstance(turn.get("role"), str)):
            raise ValueError(
                f'{where}: messages[{i}]: must be {{"role": string, "content": string or list of objects}}'
            )
    summaries = sample.get("summaries")
    strings = isinstance(summaries, list) and summaries and all(isinstance(t, str) for t in summaries)
    if summaries is not None and not strings:
        raise ValueError(f"{where}: field 'summaries' must be a non-empty list of strings (one per image)")
    if summaries is not None and sample.get("images"):
        raise ValueError(f"{where}: a sample carries either 'images' or their text 'summaries', not both")
    images = sample.get("images", [])
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise ValueError(f"{where}: field 'images' must be a list of file paths (strings)")
    resolved = [(base_dir / p).resolve() for p in images]
    for p, full in zip(images, resolved):
        if not full.is_file():
            raise ValueError(f"{where}: image {p!r} not found (looked for {full})")
    return {**sample, "images": [str(full) for full in resolved], "_where": where}


def load_image(image: str | Image.Image, sample: dict, image_processor=None) -> Image.Image:
    """RGB as the image processor makes it (alpha onto white), a file shrunk as by it (`_decode`)."""
    if isinstance(image, Image.Image):
        return Image.fromarray(convert_to_rgb(image, return_numpy=True))
    try:  # converting forces a full decode, so truncated files fail here; missing or empty ones too
        return _decode(path := Path(image), _resize_rule(image_processor))
    except (OSError, Image.DecompressionBombError) as e:
        size = path.stat().st_size if path.is_file() else None
        why = "not found" if size is None else "is an empty file" if size == 0 else f"cannot be decoded ({e})"
        raise ValueError(f"{location(sample)}: image {path} {why}") from e


def _resize_rule(image_processor) -> tuple[int, int, int, int] | None:
    """(factor, min_pixels, max_pixels) of Qwen-VL's `smart_resize` and the resampling filter, or None."""
    if image_processor is None:
        return None
    size, factor = image_processor.size, image_processor.patch_size * image_processor.merge_size
    return factor, size["shortest_edge"], size["longest_edge"], image_processor.resample


def resized_size(image_processor, size: tuple[int, int]) -> tuple[int, int]:
    """(w', h'): the size the image processor resizes a (w, h) image to (`smart_resize`, its pixel budget)."""
    height, width = smart_resize(size[1], size[0], *_resize_rule(image_processor)[:3])
    return width, height


NO_BOMB_WARNING = dict(action="ignore", category=Image.DecompressionBombWarning)  # --max-image-pixels decides


def image_size(path: str | Path) -> tuple[int, int]:
    """(width, height) from the file's header, nothing decoded."""
    with warnings.catch_warnings(**NO_BOMB_WARNING), Image.open(path) as im:
        return im.size


def _decode(path: Path, rule: tuple[int, int, int, int] | None) -> Image.Image:
    """The file in RGB; one larger than the processor's budget (`rule`) comes shrunk to the size the processor
    resizes it to (`_shrunk`). `info["original_size"]` is (width, height) on disk either way."""
    width, height = image_size(path)
    if rule is not None and width * height > rule[2]:
        return _shrunk(str(path), rule)
    with Image.open(path) as im:
        image = load_image(im, {})
    image.info["original_size"] = image.size
    return image


@functools.lru_cache(maxsize=8)
def _shrunk(path: str, rule: tuple[int, int, int, int]) -> Image.Image:
    """An image larger than the budget, decoded once and resized as the processor would (to `smart_resize`'s
    size, with its filter), so that its own resize keeps it as it is: `pixel_values` are exactly those of the
    full image. NOTE: a JPEG decodes at a reduced DCT scale first (`draft`, never below that size), so it is
    never decoded in full, and its `pixel_values` are close to, not equal to, the full image's. The last 8
    stay in memory (at most 8 x max_pixels x 3 bytes): an image drawn again soon is not decoded again."""
    with warnings.catch_warnings(**NO_BOMB_WARNING), Image.open(path) as im:
        original = im.size
        height, width = smart_resize(original[1], original[0], *rule[:3])
        im.draft(None, (width, height))  # JPEG only; other formats ignore it
        # Without alpha, convert_to_rgb is convert("RGB"): one full-size copy instead of three (numpy, back).
        alpha = "A" in im.getbands() or im.info.get("transparency") is not None
        image = (load_image(im, {}) if alpha else im.convert("RGB")).resize((width, height), rule[3])
    image.info["original_size"] = original
    return image


@dataclass
class DataConfig:
    """Where the samples come from and how their prompts are prepared. Field names are train.py's flags."""

    data: tuple[str, ...] = ()
    """Training JSONL file(s). Empty: the built-in task `--task`."""
    eval_data: str | None = None
    """Held-out JSONL file. Default: the built-in task's held-out split (or none for --data)."""
    task: Literal["inspection", "shapes", "summaries", "inspection-zoom"] = "inspection"
    """Built-in synthetic task used when --data is empty: inspection (1-4 photos -> 通过/不通过 + 理由),
    shapes (one photo -> 'red circle'), summaries (the inspection verdict from per-photo text summaries),
    inspection-zoom (one large photo whose small defect mark shows only in a crop: --tools zoom)."""
    prompt_template: str | None = None
    """Text file with {prompt}, {summaries}, {num_images} for samples that carry per-image `summaries` instead
    of images (numbered 图片_1: ...). Default: prompt, newline, the numbered lines."""
    train_size: int = 2000
    """Number of built-in training samples."""
    eval_size: int = 200
    """Number of held-out samples evaluated (built-in task, or the first ones of --eval-data)."""
    max_prompt_length: int = 4096
    """Longest prompt in tokens, image tokens included. Longer prompts raise (never truncated)."""
    min_pixels: int | None = None
    """Qwen-VL resizes every image to at least this many pixels (default: the checkpoint's processor's)."""
    max_pixels: int | None = None
    """... and at most this many (e.g. 802816 = 1024 * 28 * 28); fewer pixels, fewer image tokens."""
    max_image_pixels: int = 89_478_485
    """Images with more pixels on disk are refused when the data loads (a PNG has to be decoded in full,
    3 bytes a pixel, before it can be shrunk). Default: Pillow's own warning limit; at most twice that."""

    def check(self) -> None:
        """Each value's range and each file named, with the flag at fault first in the message."""
        sizes = [("--max-prompt-length", self.max_prompt_length, 1), ("--train-size", self.train_size, 1)]
        sizes += [("--max-image-pixels", self.max_image_pixels, 1)]
        for flag, value, low in [*sizes, ("--eval-size", self.eval_size, 0)]:
            if value < low:
                raise ValueError(f"{flag}: must be >= {low}, got {value}")
        if self.max_image_pixels > 2 * Image.MAX_IMAGE_PIXELS:  # Pillow refuses these as decompression bombs
            raise ValueError(
                f"--max-image-pixels: at most {2 * Image.MAX_IMAGE_PIXELS:,}, got {self.max_image_pixels}"
            )
        files = [("--data", path) for path in self.data] + [("--eval-data", self.eval_data)]
        for flag, path in [*files, ("--prompt-template", self.prompt_template)]:
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag}: {path} does not exist (or is not a file)")


def load_samples(config: DataConfig, *, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) samples from the JSONL files or the built-in task, summaries rendered (template)."""
    if config.data:
        train = []
        for path in config.data:
            train += (loaded := read_jsonl(path))
            print(f"loaded {len(loaded)} samples from {path}")
        held_out = read_jsonl(config.eval_data)[: config.eval_size] if config.eval_data else []
    else:
        train = tasks.make_task(config.task, config.train_size, seed=seed)
        held_out = tasks.make_task(config.task, config.eval_size, split="test", seed=seed)
    template = Path(config.prompt_template).read_text(encoding="utf-8") if config.prompt_template else None
    return apply_prompt_template(train, template), apply_prompt_template(held_out, template)


# --- Image ablation: does the policy look at the images? ----------------------------------------------------
IMAGE_ABLATIONS = ("blank", "shuffle")


def ablate_images(samples: list[dict], mode: str, *, seed: int = 0) -> list[dict]:
    """The samples without their images: "blank" greys each out at its size (same image tokens); "shuffle"
    moves them between slots across samples, none in its own slot (though maybe in another of its sample)."""
    if mode not in IMAGE_ABLATIONS:
        raise ValueError(f"image ablation must be one of {IMAGE_ABLATIONS}, got {mode!r}")
    images = [image for sample in samples for image in sample.get("images") or []]
    if mode == "blank":
        sizes = [image_size(im) if isinstance(im, str) else im.size for im in images]
        replaced = [Image.new("RGB", size, (128, 128, 128)) for size in sizes]
    else:
        order = random.Random(seed).sample(range(len(images)), len(images))
        # Slot order[j] takes the image of slot order[j - 1]: a cycle through every slot, no fixed point.
        replaced = [images[source] for _, source in sorted(zip(order, order[-1:] + order[:-1]))]
    taken = iter(replaced)
    return [{**s, "images": [next(taken) for _ in s["images"]]} if s.get("images") else s for s in samples]


# --- Prompts: summaries rendered, chat text, tensors, the pixel budget, rows B -> N -------------------------
DEFAULT_SUMMARY_TEMPLATE = "{prompt}\n{summaries}"


def render_summaries(sample: dict, template: str | None = None) -> str:
    """The prompt of a sample with per-image text `summaries` instead of images: `template` (e.g. the text of
    assets/summaries_template.txt) filled with {prompt}, {num_images} and {summaries}, lines `图片_1: …`."""
    lines = "\n".join(f"图片_{i}: {text}" for i, text in enumerate(sample["summaries"], start=1))
    fields = {"prompt": sample.get("prompt", ""), "summaries": lines, "num_images": len(sample["summaries"])}
    try:
        return (template or DEFAULT_SUMMARY_TEMPLATE).format_map(fields)
    except KeyError as e:
        raise ValueError(
            f"{location(sample)}: prompt template has an unknown placeholder {e}; known: {', '.join(fields)}"
        ) from e


def apply_prompt_template(samples: list[dict], template: str | None) -> list[dict]:
    """Render the prompt of every sample that carries `summaries` (once, at load time), dropping them."""
    rendered = [{**s, "prompt": render_summaries(s, template)} if "summaries" in s else s for s in samples]
    return [{k: v for k, v in s.items() if k != "summaries"} for s in rendered]


def sample_messages(sample: dict) -> list[dict]:
    """Chat turns of a sample: `messages`, or one user turn of its images, then its prompt (or summaries)."""
    if "messages" in sample:
        return sample["messages"]
    if "summaries" in sample:
        return [{"role": "user", "content": [{"type": "text", "text": render_summaries(sample)}]}]
    images = [{"type": "image"} for _ in sample.get("images", [])]
    return [{"role": "user", "content": [*images, {"type": "text", "text": sample["prompt"]}]}]


@dataclass
class PromptBatch:
    """Model inputs (the keyword arguments of `model(...)` / `generate(...)`: `input_ids` (rows, P), left
    padded, `attention_mask` (rows, P), and with images `pixel_values` (patches, C*temporal*patch*patch),
    `image_grid_thw` (images, 3), `mm_token_type_ids` (rows, P)) and each row's image count."""

    inputs: dict[str, torch.Tensor]
    images_per_row: list[int]
    image_sizes: list[tuple[int, int]] = field(default_factory=list)  # (w, h) of each original
    resized_sizes: list[tuple[int, int]] = field(default_factory=list)  # (w, h) the model sees

    @property
    def prompt_length(self) -> int:
        return self.inputs["input_ids"].shape[1]


def prepare_prompts(
    samples: list[dict],
    tokenizer,
    image_processor,
    *,
    device: torch.device | str,
    max_prompt_length: int | None = None,
) -> PromptBatch:
    """Chat-template, tokenize, process images and left-pad a batch of samples (one row per sample)."""
    per_row = [[load_image(im, s, image_processor) for im in s.get("images", [])] for s in samples]
    texts = [_chat_text(sample, tokenizer, len(ims)) for sample, ims in zip(samples, per_row)]
    images, images_per_row = [im for ims in per_row for im in ims], [len(ims) for ims in per_row]
    inputs, resized = {}, []
    if images:
        if image_processor is None:
            raise ValueError(f"{location(samples[0])}: a text-only model (no image processor) got images")
        vision = image_processor(images=images, return_tensors="pt")
        grid = vision["image_grid_thw"]  # (images, 3): temporal, height, width in patches
        counts = iter((grid.prod(-1) // image_processor.merge_size**2).tolist())  # visual tokens of image k
        texts = [re.sub(re.escape(IMAGE_PAD), lambda _: IMAGE_PAD * next(counts), t) for t in texts]
        inputs.update(pixel_values=vision["pixel_values"], image_grid_thw=grid)
        resized = [tuple(s) for s in (grid[:, 1:].flip(-1) * image_processor.patch_size).tolist()]  # (w, h)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    for sample, row in zip(samples, ids):
        _check_prompt_length(sample, len(row), max_prompt_length)
    P = max(len(row) for row in ids)  # NOTE: left padding, so that every row's completion starts at column P
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (P - len(row)) + row for row in ids])  # (rows, P)
    mask = torch.tensor([[0] * (P - len(row)) + [1] * len(row) for row in ids])  # (rows, P)
    inputs.update(input_ids=input_ids, attention_mask=mask)
    if images:  # transformers builds Qwen-VL's 3D (t, h, w) rotary positions from this: 1 marks image tokens
        inputs["mm_token_type_ids"] = mask * input_ids.eq(tokenizer.convert_tokens_to_ids(IMAGE_PAD))
    inputs = {key: value.to(device) for key, value in inputs.items()}
    return PromptBatch(inputs, images_per_row, [i.info.get("original_size", i.size) for i in images], resized)


def _chat_text(sample: dict, tokenizer, num_images: int) -> str:
    """The chat-templated prompt with one `<|image_pad|>` per image (expanded later to the visual tokens)."""
    text = tokenizer.apply_chat_template(sample_messages(sample), tokenize=False, add_generation_prompt=True)
    if text.count(IMAGE_PAD) != num_images:
        raise ValueError(
            f"{location(sample)}: the chat text has {text.count(IMAGE_PAD)} image placeholders but the "
            f"sample has {num_images} images"
        )
    return text


def _check_prompt_length(sample: dict, length: int, max_prompt_length: int | None) -> None:
    if max_prompt_length is not None and length > max_prompt_length:
        raise ValueError(
            f"{location(sample)}: prompt is {length} tokens (images included) but max_prompt_length is "
            f"{max_prompt_length}; raise the limit or shrink the images (it is never truncated, because a "
            f"cut through the image tokens would no longer match pixel_values)"
        )


@dataclass
class ResizeReport:
    """Images larger than the image processor's pixel budget, which it resizes down silently."""

    count: int = 0
    largest: tuple[int, int] | None = None  # (width, height) of the largest such original
    longest_prompt: int = 0  # tokens, visual ones included: the P that memory estimates take


def set_pixel_budget(image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
    """--min-pixels / --max-pixels (None: the checkpoint's own), set on the processor itself so that prompts,
    the prompt-length check and the sizes reported agree. NOTE: `size` holds pixel counts despite its keys."""
    if image_processor is None or (min_pixels is None and max_pixels is None):
        return
    low = min_pixels if min_pixels is not None else image_processor.size["shortest_edge"]
    high = max_pixels if max_pixels is not None else image_pixel_budget(image_processor)
    if not 0 < low <= high:
        raise ValueError(f"--min-pixels/--max-pixels: need 0 < min <= max, got {low} and {high}")
    image_processor.size["shortest_edge"], image_processor.size["longest_edge"] = low, high


def image_pixel_budget(image_processor) -> int | None:
    """The most pixels an image keeps (`size["longest_edge"]`, a pixel count): Qwen-VL shrinks larger ones."""
    return None if image_processor is None else image_processor.size["longest_edge"]


def check_samples(
    samples: list[dict],
    tokenizer,
    image_processor,
    *,
    max_prompt_length: int | None,
    max_image_pixels: int | None = None,
) -> ResizeReport:
    """Fail fast, before any model work: refuse images above `max_image_pixels` before decoding them, decode
    every other one once, and bound every prompt's length (visual tokens from image sizes by the processor's
    own rule, no pixels processed); return the ones it shrinks."""
    budget, oversized, longest = image_pixel_budget(image_processor), [], 0
    for sample in samples:
        for image in sample.get("images", []):
            _check_pixel_count(image, sample, max_image_pixels)
        images = [load_image(im, sample, image_processor) for im in sample.get("images", [])]  # corrupt: here
        sizes = [im.info.get("original_size", im.size) for im in images]
        if sizes and image_processor is None:
            raise ValueError(f"{location(sample)}: a text-only model (no image processor) got images")
        text = _chat_text(sample, tokenizer, len(sizes))
        length = len(tokenizer(text, add_special_tokens=False)["input_ids"]) - len(sizes)  # minus 1 pad each
        for width, height in sizes:
            patches = image_processor.get_number_of_image_patches(height, width, {})
            length += patches // image_processor.merge_size**2
            if budget is not None and width * height > budget:
                oversized.append((width, height))
        _check_prompt_length(sample, length, max_prompt_length)
        longest = max(longest, length)
    largest = max(oversized, key=lambda size: size[0] * size[1], default=None)
    return ResizeReport(len(oversized), largest, longest)


def _check_pixel_count(image: str | Image.Image, sample: dict, max_image_pixels: int | None) -> None:
    if max_image_pixels is None or not isinstance(image, str):
        return
    try:
        width, height = image_size(image)
    except (OSError, Image.DecompressionBombError):
        return  # load_image names what is wrong with the file
    if width * height > max_image_pixels:
        raise ValueError(
            f"{location(sample)}: image {image} is {width}x{height} ({width * height:,} pixels), more than "
            f"--max-image-pixels {max_image_pixels:,}; shrink it, or raise the limit"
        )


def describe_resizes(report: ResizeReport, budget: int) -> str | None:
    """One line saying how many images the image processor shrinks, and the largest; None when none."""
    if report.count == 0:
        return None
    (w, h), big = report.largest, f"larger than the image processor's budget ({budget:,} pixels)"
    if report.count == 1:
        return f"1 image is {big} and is resized down to fit it: {w}x{h}"
    return f"{report.count:,} images are {big} and are resized down to fit it; the largest is {w}x{h}"


def with_grounding(samples: list[dict], batch: PromptBatch, frame: str | None) -> list[dict]:
    """Each sample with an image gets sample["grounding"] = {frame, original_size, resized_size} of its first
    image, for a grounding reward to compare the model's coordinates with original-pixel ground truth."""
    if frame is None:
        return samples
    first_image = [0, *itertools.accumulate(batch.images_per_row)]  # index of each row's first image
    out = list(samples)
    for row, (k, n) in enumerate(zip(first_image, batch.images_per_row)):
        if n:
            sizes = dict(original_size=list(batch.image_sizes[k]), resized_size=list(batch.resized_sizes[k]))
            out[row] = {**samples[row], "grounding": {"frame": frame, **sizes}}
    return out


def repeat_rows(batch: PromptBatch, group_size: int) -> PromptBatch:
    """Expand B prompts to N = B*G rows, each prompt's images with it (see the module docstring)."""
    keys = [key for key in ("input_ids", "attention_mask", "mm_token_type_ids") if key in batch.inputs]
    out = {key: batch.inputs[key].repeat_interleave(group_size, dim=0) for key in keys}  # (N, P) each
    if "image_grid_thw" in batch.inputs:
        grids_per_row = batch.inputs["image_grid_thw"].split(batch.images_per_row)  # (images of row, 3) each
        pixels_per_row = batch.inputs["pixel_values"].split([int(g.prod(-1).sum()) for g in grids_per_row])
        out["image_grid_thw"] = torch.cat([g for g in grids_per_row for _ in range(group_size)])
        out["pixel_values"] = torch.cat([p for p in pixels_per_row for _ in range(group_size)])
    return PromptBatch(out, [n for n in batch.images_per_row for _ in range(group_size)])


# --- Sampling and decoding: which tokens end or never appear in a completion --------------------------------
# Qwen-VL's grounding markers, special tokens a completion may contain (Qwen2-VL writes its boxes as
# <|object_ref_start|>name<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>).
GROUNDING_TOKENS = tuple(f"<|{k}_{e}|>" for k in ("object_ref", "box", "quad") for e in ("start", "end"))


def end_of_turn_ids(tokenizer, generation_config=None) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and those the checkpoint's generation config lists
    (Qwen-VL Instruct lists <|im_end|> and <|endoftext|>): generate would stop on any of them."""
    listed = getattr(generation_config, "eos_token_id", None)
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    return sorted({tokenizer.eos_token_id, *listed} - {None})


def _ids_of(tokenizer, tokens) -> set[int]:
    """Ids of the tokens the tokenizer has; a missing one maps to its unk id (or None) and is left out."""
    return {tokenizer.convert_tokens_to_ids(t) for t in tokens} - {None, tokenizer.unk_token_id}


def suppressed_tokens(tokenizer, eos_ids: Sequence[int] | None = None) -> list[int]:
    """Special tokens a completion must never contain: vision markers and chat control (every special token
    but the end-of-turn ids `eos_ids`, default the tokenizer's EOS, and the grounding markers)."""
    vision = _ids_of(tokenizer, (IMAGE_PAD, VISION_START, VISION_END, "<|video_pad|>"))
    allowed = set(eos_ids or [tokenizer.eos_token_id]) | _ids_of(tokenizer, GROUNDING_TOKENS)
    return sorted((set(tokenizer.all_special_ids) | vision) - allowed)


def sampling_options(
    tokenizer, generation_config=None, *, max_new_tokens: int, temperature: float, top_p: float = 1.0
) -> dict:
    """The samplers' keyword arguments (grpo.sample_completions, speedups.sample_shared_prefill)."""
    ends = end_of_turn_ids(tokenizer, generation_config)
    suppress = suppressed_tokens(tokenizer, ends)
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, eos_token_id=ends)
    return options | dict(pad_token_id=tokenizer.pad_token_id, suppress_token_ids=suppress)


def decode_completions(
    tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor, eos_ids: Sequence[int] | None = None
) -> list[str]:
    """Each row's text up to its end of turn (mask), special tokens left out except the grounding markers."""
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    special |= {*tokenizer.all_special_ids, *(eos_ids or [tokenizer.eos_token_id])}
    dropped = sorted(special - _ids_of(tokenizer, GROUNDING_TOKENS))
    keep = mask & ~torch.isin(completion_ids, torch.tensor(dropped, device=completion_ids.device))
    return tokenizer.batch_decode([ids[k].tolist() for ids, k in zip(completion_ids, keep)])


# --- The samples of each step -------------------------------------------------------------------------------
EXTRA_ROUNDS = 1_000_000  # the batch indices of dynamic sampling's extra rounds start here


def batch_for_step(
    samples: list[dict],
    step: int,
    batch_size: int,
    seed: int,
    rank: int = 0,
    world: int = 1,
    *,
    sampling_round: int = 0,
    rounds: int = 1,
) -> list[dict]:
    """This rank's B samples: [rank*B, (rank+1)*B) of the step's B*R, from epochs of seeded permutations,
    a pure function of (step, round), so resume is exact. NOTE: --adv-scale batch: the std of these B only."""
    if sampling_round > 0:  # dynamic sampling's extra round k of `rounds` reads a stream of its own
        step = EXTRA_ROUNDS + step * (rounds - 1) + sampling_round - 1
    global_size = batch_size * world
    epoch, k = divmod(step, max(len(samples) // global_size, 1))  # batches per epoch, at least one
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    global_batch = [samples[i] for i in order[k * global_size : (k + 1) * global_size].tolist()]
    return global_batch[rank * batch_size : (rank + 1) * batch_size]
