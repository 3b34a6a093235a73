"""The full trainer's data: several datasets, summaries templates, pixel budgets, large images, ablations.

data.py holds what GRPO needs (JSONL samples, prompts, rows, decoding, the built-in inspection task); this
module extends it for `python -m grpo_vlm` and the scripts: `DataConfig` (the data flags) and `load_samples`
(JSONL files or any built-in task of tasks.py), per-image text `summaries` rendered into the prompt at load
time, image ablation (blank or shuffled images), the processor's pixel budget (`--min-pixels`,
`--max-pixels`, images above `--max-image-pixels` refused), every sample checked before any model work, the
grounding fields a reward reads, and what a log record shows of its sample (`prompt_text`, `target_fields`).

Choices:
- Images above the processor's pixel budget are shrunk as it would shrink them, never rejected
  (`describe_resizes` says so), and decoded once at that size, not in full at every step (`_shrunk`;
  `prepare_prompts`); files above `max_image_pixels` (a PNG
  decodes in full before it can shrink) are refused when they load.
- Summaries are rendered once, when the samples load (`apply_prompt_template`), so that every later step
  sees plain `prompt` samples.
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
import string
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import jinja2
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

import data
from grpo_vlm import files, tasks


# --- The data flags and the samples they name ---------------------------------------------------------------
@dataclass
class DataConfig:
    """Where the samples come from and how their prompts are prepared. Field names are the flags."""

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
    """Images that decoding would hold in more memory than an RGB image of this many pixels are refused when
    the data loads (a PNG is decoded in full before it can be shrunk: about 14 bytes a pixel for RGB, grey or
    palette files, about 25 with alpha, which therefore counts 25/14 of its pixels). Default: Pillow's own
    warning limit (about 1.3 GB at 14 bytes a pixel); at most twice that."""

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


def load_samples(config: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train, held-out) samples from the JSONL files or the built-in task, summaries rendered (template).
    The built-in task's two splits are drawn with seed 0 whatever --seed, as data.load_samples draws them:
    runs of several seeds train on the same pool and answer the same held-out questions."""
    if config.data:
        train = []
        for path in config.data:
            train += (loaded := read_samples(path))
            print(f"loaded {len(loaded)} samples from {path}")
        held_out = read_samples(config.eval_data)[: config.eval_size] if config.eval_data else []
    else:
        train = tasks.make_task(config.task, config.train_size, split="train", seed=0)
        held_out = tasks.make_task(config.task, config.eval_size, split="test", seed=0)
    template = read_prompt_template(config.prompt_template) if config.prompt_template else None
    return apply_prompt_template(train, template), apply_prompt_template(held_out, template)


def read_samples(path: str | Path) -> list[dict]:
    """`read_jsonl`, then each sample refused if it cannot mean what it says (`check_meaning`)."""
    samples = read_jsonl(path)
    for sample in samples:
        check_meaning(sample)
    return samples


def read_jsonl(path: str | Path) -> list[dict]:
    """data.read_jsonl with a hint for the usual JSON mistakes: a trailing comma, single quotes, Python's
    True/False/None, a line cut short; the column of the fault, and the text around it (`_json_error`)."""
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
            except ValueError as e:  # an integer of more than 4,300 digits (Python's int-to-str limit)
                raise ValueError(f"{where}: {e}") from e
            samples.append(data.validate_sample(sample, where, base_dir=path.parent))
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
    start, end = max(pos - 30, 0), pos + 30  # 30 characters of the line on each side of the fault
    excerpt = ("..." if start else "") + text[start:end] + ("..." if end < len(text) else "")
    return f"{where}:{pos + 1}: invalid JSON: {why}{hint}; near: {excerpt}"


def check_meaning(sample: dict) -> None:
    """ValueError `file:line: field: what` for NaN or Infinity anywhere (json reads them, but they are not
    JSON: rollouts.jsonl would carry them as bare NaN, and `"answer": NaN` equals nothing), and for a
    `messages` content entry the chat template would drop silently: only {"type": "image"} and
    {"type": "text", "text": a non-empty string} are rendered."""
    where = data.location(sample)
    for field, value in sample.items():
        if (path := _non_finite(value)) is not None:
            raise ValueError(
                f"{where}: {field}{path}: NaN or Infinity is not a JSON number; use null or a string"
            )
    for i, turn in enumerate(sample.get("messages") or []):
        for j, entry in enumerate(turn["content"] if isinstance(turn["content"], list) else []):
            text = entry.get("text")
            kind = entry.get("type")
            if not (kind == "image" or kind == "text" and isinstance(text, str) and text.strip()):
                raise ValueError(
                    f"{where}: messages[{i}].content[{j}]: the chat template would drop {str(entry)[:80]}; "
                    'an entry is {"type": "image"} or {"type": "text", "text": "non-empty"}'
                )


def _non_finite(value) -> str | None:
    """'' if `value` is a non-finite float, '[k]' / '.key' (and deeper) to one inside it, else None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else ""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (inner := _non_finite(item)) is not None:
            return (f"[{key}]" if isinstance(key, int) else f".{key}") + inner
    return None


TEMPLATE_FIELDS = ("prompt", "summaries", "num_images")
MAX_FORMAT_WIDTH = 1000  # `{summaries:>99999999999}` would ask for gigabytes of padding


def read_prompt_template(path: str | Path) -> str:
    """The text of a --prompt-template file: UTF-8, placeholders only {prompt}, {summaries} and {num_images}
    (a format spec allowed, its numbers at most MAX_FORMAT_WIDTH); anything else a ValueError naming it."""
    where = f"--prompt-template {path}"
    try:
        template = files.regular_file(path).read_bytes().decode("utf-8")
        fields = [(name, spec) for _, name, spec, _ in string.Formatter().parse(template) if name is not None]
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})") from e
    except ValueError as e:  # e.g. "expected '}' before end of string"
        raise ValueError(f"{where}: {e}; a literal brace is written {{{{ or }}}}") from e
    for name, spec in fields:
        known = ", ".join(f"{{{f}}}" for f in TEMPLATE_FIELDS)
        if name not in TEMPLATE_FIELDS:
            raise ValueError(
                f"{where}: unknown placeholder {{{name}}}; known: {known} (a brace: {{{{ or }}}})"
            )
        if "{" in spec or any(int(n) > MAX_FORMAT_WIDTH for n in re.findall(r"\d+", spec)):
            raise ValueError(f"{where}: {{{name}:{spec}}}: widths above {MAX_FORMAT_WIDTH} are refused")
    return template


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


# --- Summaries: per-image text rendered into the prompt -------------------------------------------------
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
            f"{data.location(sample)}: prompt template has an unknown placeholder {e}; "
            f"known: {', '.join(fields)}"
        ) from e


def apply_prompt_template(samples: list[dict], template: str | None) -> list[dict]:
    """Render the prompt of every sample that carries `summaries` (once, at load time), dropping them."""
    for sample in samples:
        _check_summaries(sample)
    rendered = [{**s, "prompt": render_summaries(s, template)} if "summaries" in s else s for s in samples]
    return [{k: v for k, v in s.items() if k != "summaries"} for s in rendered]


def _check_summaries(sample: dict) -> None:
    summaries = sample.get("summaries")
    strings = isinstance(summaries, list) and summaries and all(isinstance(t, str) for t in summaries)
    where = data.location(sample)
    if summaries is not None and not strings:
        raise ValueError(f"{where}: field 'summaries' must be a non-empty list of strings (one per image)")
    if summaries is not None and sample.get("images"):
        raise ValueError(f"{where}: a sample carries either 'images' or their text 'summaries', not both")


# --- Large images: decoded once at the size the processor resizes them to -----------------------------
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
        image = (data.load_image(im, {}) if alpha else im.convert("RGB")).resize((width, height), rule[3])
    image.info["original_size"] = original
    return image


def load_image(image: str | Path | Image.Image, sample: dict, image_processor=None) -> Image.Image:
    """data.load_image, except that a file larger than the processor's pixel budget comes decoded once at
    the size the processor resizes it to (`_shrunk`), its size on disk in `info["original_size"]`."""
    rule = _resize_rule(image_processor)
    if rule is not None and not isinstance(image, Image.Image):
        try:
            width, height = image_size(image)
            if width * height > rule[2]:
                return _shrunk(str(image), rule)
        except (OSError, Image.DecompressionBombError):
            pass  # NOTE: data.load_image decodes it in full and names what is wrong with the file
    return data.load_image(image, sample)


def prepare_prompts(samples: list[dict], tokenizer, image_processor, *, device) -> data.PromptBatch:
    """data.prepare_prompts on the samples' images as `load_image` gives them: a file larger than the
    processor's budget decoded once, at the size the processor keeps."""
    loaded = [
        {**s, "images": [load_image(im, s, image_processor) for im in s["images"]]} if s.get("images") else s
        for s in samples
    ]
    return data.prepare_prompts(loaded, tokenizer, image_processor, device=device)


# --- The samples of each step, on each rank ---------------------------------------------------------------
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
    """This rank's B samples: [rank*B, (rank+1)*B) of the step's global batch of B*R (data.batch_for_step of
    B*R), so that R ranks draw what one process of B*R prompts would. Dynamic sampling's extra round k of
    `rounds` reads a stream of its own. A pure function of (step, round): resume is exact."""
    if sampling_round > 0:
        step = EXTRA_ROUNDS + step * (rounds - 1) + sampling_round - 1
    global_batch = data.batch_for_step(samples, step, batch_size * world, seed)
    return global_batch[rank * batch_size : (rank + 1) * batch_size]


# --- Pixel budgets and checks before any model work -----------------------------------------------------
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
    forged = _special_tokens(tokenizer)
    for sample in samples:
        for image in sample.get("images", []):
            _check_image_header(image, sample, max_image_pixels, image_processor)
        images = [load_image(im, sample, image_processor) for im in sample.get("images", [])]  # corrupt: here
        sizes = [im.info.get("original_size", im.size) for im in images]
        if sizes and image_processor is None:
            raise ValueError(f"{data.location(sample)}: a text-only model (no image processor) got images")
        _check_no_special_tokens(sample, forged)
        try:
            text = data.chat_text(sample, tokenizer, len(sizes))
        except jinja2.TemplateError as e:  # the model's own template raised (`raise_exception`) or is broken
            where = f"{data.location(sample)}: the chat template of {tokenizer.name_or_path}"
            raise ValueError(f"{where} fails on this sample: {type(e).__name__}: {e}") from e
        length = len(tokenizer(text, add_special_tokens=False)["input_ids"]) - len(sizes)  # minus 1 pad each
        for width, height in sizes:
            patches = image_processor.get_number_of_image_patches(height, width, {})
            length += patches // image_processor.merge_size**2
            if budget is not None and width * height > budget:
                oversized.append((width, height))
        check_prompt_length(sample, length, max_prompt_length)
        longest = max(longest, length)
    largest = max(oversized, key=lambda size: size[0] * size[1], default=None)
    return ResizeReport(len(oversized), largest, longest)


def check_prompt_length(sample: dict, length: int, max_prompt_length: int | None) -> None:
    """Refuse a prompt of `length` tokens, visual ones included, longer than `max_prompt_length`."""
    if max_prompt_length is not None and length > max_prompt_length:
        raise ValueError(
            f"{data.location(sample)}: prompt is {length} tokens (images included) but max_prompt_length is "
            f"{max_prompt_length}; raise the limit or shrink the images (it is never truncated, because a "
            f"cut through the image tokens would no longer match pixel_values)"
        )


# Peak bytes a pixel that decoding holds (measured with Pillow: RGB, grey and palette files decode to 4-byte
# pixels and are converted; with alpha they are composited onto white as transformers does, several copies).
DECODE_BYTES = {"opaque": 14, "alpha": 25}


def _check_image_header(
    image: str | Image.Image, sample: dict, max_image_pixels: int | None, image_processor
) -> None:
    """From the file's header, nothing decoded: refuse a decode that would hold more memory than an RGB image
    of `max_image_pixels`, and a shape the processor cannot resize (aspect ratio of 200 or more)."""
    if not isinstance(image, str):
        return
    try:
        with warnings.catch_warnings(**NO_BOMB_WARNING), Image.open(image) as im:
            (width, height), alpha = im.size, "A" in im.getbands() or "transparency" in im.info
    except (OSError, Image.DecompressionBombError):
        return  # load_image names what is wrong with the file
    where = f"{data.location(sample)}: image {image} is {width}x{height}"
    cost = width * height * DECODE_BYTES["alpha" if alpha else "opaque"] // DECODE_BYTES["opaque"]
    if max_image_pixels is not None and cost > max_image_pixels:
        alpha_note = f" with alpha, which counts as {cost:,}" if alpha else ""
        raise ValueError(
            f"{where} ({width * height:,} pixels{alpha_note}), more than --max-image-pixels "
            f"{max_image_pixels:,}; shrink it, or raise the limit"
        )
    if image_processor is not None:
        try:
            resized_size(image_processor, (width, height))
        except ValueError as e:  # smart_resize: "absolute aspect ratio must be smaller than 200"
            raise ValueError(f"{where}: {e}; crop or pad it") from e


def _special_tokens(tokenizer) -> re.Pattern | None:
    """The tokenizer's special tokens but the grounding markers, as one pattern (None: it has none)."""
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    special = (special | set(tokenizer.all_special_tokens)) - set(data.GROUNDING_TOKENS)
    return re.compile("|".join(map(re.escape, sorted(special)))) if special else None


def _check_no_special_tokens(sample: dict, pattern: re.Pattern | None) -> None:
    """NOTE: data text that spells a special token (`<|im_end|><|im_start|>assistant`) would be tokenized as
    that token and forge chat turns or image slots; it is refused, naming file:line and field (Qwen-VL's
    grounding markers, which prompts may use to refer to a region, are allowed)."""
    texts = [("prompt", sample.get("prompt"))]
    for i, turn in enumerate(sample.get("messages") or []):
        if isinstance(body := turn["content"], str):
            texts.append((f"messages[{i}].content", body))
        else:
            texts += [(f"messages[{i}].content[{j}].text", entry.get("text")) for j, entry in enumerate(body)]
    for field, text in texts:
        if pattern is not None and isinstance(text, str) and (found := pattern.search(text)):
            raise ValueError(
                f"{data.location(sample)}: {field}: spells the special token {found[0]}, which would be read "
                "as chat markup, not as text; remove or reword it"
            )


def describe_resizes(report: ResizeReport, budget: int) -> str | None:
    """One line saying how many images the image processor shrinks, and the largest; None when none."""
    if report.count == 0:
        return None
    (w, h), big = report.largest, f"larger than the image processor's budget ({budget:,} pixels)"
    if report.count == 1:
        return f"1 image is {big} and is resized down to fit it: {w}x{h}"
    return f"{report.count:,} images are {big} and are resized down to fit it; the largest is {w}x{h}"


def with_grounding(samples: list[dict], image_processor, frame: str | None) -> list[dict]:
    """Each sample with an image gets sample["grounding"] = {frame, original_size, resized_size} of its first
    image (its size on disk, and the size the processor resizes it to), for a grounding reward to compare the
    model's coordinates with original-pixel ground truth."""
    if frame is None:
        return samples
    out = []
    for sample in samples:
        if images := sample.get("images"):
            original = images[0].size if isinstance(images[0], Image.Image) else image_size(images[0])
            sizes = dict(
                original_size=list(original), resized_size=list(resized_size(image_processor, original))
            )
            sample = {**sample, "grounding": {"frame": frame, **sizes}}
        out.append(sample)
    return out


# --- What a log record shows of its sample (rollouts.jsonl, eval_samples.jsonl) -----------------------------
# The sample fields the built-in rewards compare a completion with (boxes and regions in original pixels).
TARGET_FIELDS = ("label", "answer", "bbox", "boxes", "region", "count", "margin")


def prompt_text(sample: dict) -> str:
    """The text parts of the sample's chat turns (data.sample_messages) in order, joined by a blank line."""
    texts = []
    for message in data.sample_messages(sample):
        content = message.get("content")
        if isinstance(content, str):  # a plain-text turn (a system prompt, say)
            texts.append(content)
        else:
            texts += [part["text"] for part in content or [] if part.get("type") == "text"]
    return "\n\n".join(texts)


def target_fields(sample: dict) -> dict:
    """The TARGET_FIELDS the sample has, as JSON values (a task's tuples as lists)."""
    return {key: json.loads(json.dumps(sample[key])) for key in TARGET_FIELDS if key in sample}
