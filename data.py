"""Samples, image+text prompt preparation for Qwen-VL style models, decoding completions, the default task.

A *sample* is a plain dict, one per JSONL line; other fields go to the reward functions untouched:

    {"id": "a1", "images": ["img/a1_0.png"], "prompt": "Inspect the installation.", "label": "通过"}

`images` are paths relative to the JSONL file (or absolute; `PIL.Image` objects in the built-in task), maybe
none, all in one prompt: `prompt` follows them in one user turn, or `messages` gives the chat turns, with one
`{"type": "image"}` content entry per image, in order.

Prompts are prepared as the Qwen2-VL / Qwen2.5-VL / Qwen3-VL processors do, without torchvision: the chat
template writes `<|vision_start|><|image_pad|><|vision_end|>` per image, the image processor gives
`pixel_values` and `image_grid_thw`, and each `<|image_pad|>` becomes `grid_t*grid_h*grid_w / merge_size**2`
copies, one per visual token the merger emits. Prompts are LEFT-padded: every row's completion starts at
column P. Legend: `B` prompts, `G` completions per prompt, `N = B*G` rows, `P` padded prompt length.

Choices:
- Prompts are never truncated: a cut through the image tokens would desynchronise text and `pixel_values`,
  and a cut through the text changes the task.
- Rows are expanded like `repeat_interleave` (prompt b becomes rows b*G .. b*G+G-1), `pixel_values` and
  `image_grid_thw` per prompt block; a flat `repeat` would pair row b's text with another row's pixels.
- A completion ends at any end-of-turn id the checkpoint lists; vision and chat-control tokens are never
  sampled (an image token would have no pixels); decoding keeps Qwen-VL's grounding markers.
"""

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from PIL import Image, ImageDraw
from transformers.image_transforms import convert_to_rgb

IMAGE_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"


# --- Samples: JSONL files and their images ------------------------------------------------------------------
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
    # A byte-order mark (Windows editors write one) is not part of the first line's JSON.
    for lineno, raw in enumerate(path.read_bytes().removeprefix(b"\xef\xbb\xbf").splitlines(), start=1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:  # the column in characters: what precedes the byte is valid UTF-8
            column = len(raw[: e.start].decode("utf-8")) + 1
            raise ValueError(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {column})") from None
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}:{e.colno}: invalid JSON: {e.msg}") from None
        except (ValueError, RecursionError) as e:  # a number of 5,000 digits; JSON nested thousands deep
            raise ValueError(f"{where}: invalid JSON: {e}") from None
        samples.append(validate_sample(sample, where, base_dir=path.parent))
    if not samples:
        raise ValueError(f"{path}: dataset is empty (no JSON lines)")
    return samples


def validate_sample(sample: Any, where: str, *, base_dir: Path) -> dict:
    """The sample with its image paths resolved against `base_dir` and `_where` set, or a ValueError naming
    `where: field`: a prompt or chat turns, text that UTF-8 can hold, image files that exist."""
    if type(sample) is not dict:  # json.loads makes plain dicts; a data error, so a ValueError
        raise ValueError(f"{where}: a line must be a JSON object, got {type(sample).__name__}")
    # NOTE: JSON's "\ud800" reads as a lone surrogate, which no tokenizer or UTF-8 file takes.
    for key, value in sample.items():
        text = value if isinstance(value, str) else json.dumps([key, value], ensure_ascii=False)
        if bad := re.search("[\ud800-\udfff]", text):
            field = key.encode("utf-8", "backslashreplace").decode()
            at = bad.start() + 1
            raise ValueError(f"{where}: {field}: not valid text (a lone surrogate at character {at})")
    has_prompt, has_messages = "prompt" in sample, "messages" in sample
    if has_prompt == has_messages:
        raise ValueError(f"{where}: a sample needs exactly one of 'prompt' (string) or 'messages' (list)")
    if has_prompt and not (isinstance(sample["prompt"], str) and sample["prompt"].strip()):
        raise ValueError(f"{where}: prompt: must be a non-empty string")
    if has_messages and not (isinstance(sample["messages"], list) and sample["messages"]):
        raise ValueError(f"{where}: messages: must be a non-empty list of chat turns")
    for i, turn in enumerate(sample.get("messages") or []):  # else the chat template fails or drops it
        body = turn.get("content") if isinstance(turn, dict) else None
        ok = isinstance(body, str) or isinstance(body, list) and all(isinstance(c, dict) for c in body)
        if not (ok and isinstance(turn.get("role"), str)):
            raise ValueError(f'{where}: messages[{i}]: must be {{"role": string, "content": string or list}}')
    images = sample.get("images", [])
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise ValueError(f"{where}: images: must be a list of file paths (strings)")
    for name in images:  # NOTE: a NUL byte, or a name too long for the OS, makes is_file() raise
        try:
            found = "\x00" not in name and (base_dir / name).is_file()
        except OSError as e:
            raise ValueError(f"{where}: images: {name[:80]!r}... not a usable path ({e.strerror})") from e
        if not found:
            raise ValueError(f"{where}: images: {name!r} not found (looked in {base_dir.resolve()})")
    resolved = [str((base_dir / name).resolve()) for name in images]
    return {**sample, "images": resolved, "_where": where}


def load_image(image: str | Path | Image.Image, sample: dict) -> Image.Image:
    """RGB as transformers' image processors make it (alpha composited onto white); a file decoded in full."""
    if isinstance(image, Image.Image):
        return Image.fromarray(convert_to_rgb(image, return_numpy=True))
    path = Path(image)
    try:  # converting forces a full decode, so truncated files fail here; missing or empty ones too
        with Image.open(path) as im:
            return load_image(im, sample)
    except (OSError, Image.DecompressionBombError) as e:
        size = path.stat().st_size if path.is_file() else None
        why = "not found" if size is None else "is an empty file" if size == 0 else f"cannot be decoded ({e})"
        raise ValueError(f"{location(sample)}: image {path} {why}") from e


# --- The built-in inspection task: the default run's samples, drawn with PIL -------------------------------
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
IMAGE_SIZE = 56  # pixels; with 14-pixel patches and 2x2 merging one image is 4 visual tokens
INSPECTION_PROMPT = "inspect the installation. answer 通过 or 不通过 on line 1 and 理由: on line 2."


def inspection_sample(rng: random.Random, index: int) -> dict:
    """1-4 photos of one installation; it passes (通过) iff no photo shows a red defect mark. The per-photo
    defect probability makes pass and fail equally likely for every photo count."""
    n_images = rng.randint(1, 4)
    p_defect = 1 - 0.5 ** (1 / n_images)
    images, defective = [], []  # the photos, and the numbers (from 1) of those with a defect mark
    for k in range(n_images):
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (200, 200, 205))
        draw = ImageDraw.Draw(image)
        draw.rectangle((6, 6, 49, 49), fill=(120, 125, 135))  # the panel
        for bx, by in ((12, 12), (40, 12), (12, 40), (40, 40)):  # four bolts
            draw.ellipse((bx - 3, by - 3, bx + 3, by + 3), fill=(60, 60, 60))
        if rng.random() < p_defect:
            cx, cy, r = rng.randint(16, 40), rng.randint(16, 40), rng.randint(6, 9)
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=COLOURS["red"])
            defective.append(k + 1)
        images.append(image)
    label = "不通过" if defective else "通过"
    answer = f"{label}\n理由: 图片{defective[0]}有缺陷" if defective else f"{label}\n理由: 无缺陷"
    sample = {"id": f"inspection-{index}", "images": images, "prompt": INSPECTION_PROMPT}
    return sample | {"label": label, "answer": answer}  # what the label and answer_match rewards compare with


def inspection_samples(n: int, *, split: Literal["train", "test"] = "train", seed: int = 0) -> list[dict]:
    """`n` inspection samples, the same for the same (split, seed); split "test" is a disjoint stream."""
    rng = random.Random(f"inspection/{split}/{seed}")  # disjoint streams: a test sample is no train sample
    return [inspection_sample(rng, i) for i in range(n)]


def load_samples(path: str | None, eval_path: str | None, *, train_size: int, eval_size: int) -> tuple:
    """(training, held-out) samples: the JSONL files (the first `eval_size` of `eval_path`), or the built-in
    task's two splits, the same for every --seed: runs of several seeds answer the same held-out questions."""
    if path is None:
        return inspection_samples(train_size, split="train"), inspection_samples(eval_size, split="test")
    return read_jsonl(path), read_jsonl(eval_path)[:eval_size] if eval_path else []


# --- Prompts: chat text, tensors, rows B -> N ---------------------------------------------------------------
def sample_messages(sample: dict) -> list[dict]:
    """Chat turns of a sample: `messages`, or one user turn of its images, then its prompt."""
    if "messages" in sample:
        return sample["messages"]
    images = [{"type": "image"} for _ in sample.get("images", [])]
    return [{"role": "user", "content": [*images, {"type": "text", "text": sample["prompt"]}]}]


@dataclass
class PromptBatch:
    """Model inputs, `generate`'s keywords: `input_ids`, `attention_mask` (rows, P), left-padded; with images
    `pixel_values` (patches, 3*2*14*14), `image_grid_thw` (images, 3), `mm_token_type_ids` (rows, P)."""

    inputs: dict[str, torch.Tensor]
    images_per_row: list[int]


def prepare_prompts(
    samples: list[dict], tokenizer, image_processor, *, device: torch.device | str
) -> PromptBatch:
    """Chat-template, tokenize, process images (files or PIL images, in RGB) and left-pad a batch of samples
    (one row per sample)."""
    per_row = [[load_image(im, s) for im in s.get("images", [])] for s in samples]
    texts = [chat_text(sample, tokenizer, len(ims)) for sample, ims in zip(samples, per_row)]
    images = [im for ims in per_row for im in ims]
    images_per_row = [len(ims) for ims in per_row]
    inputs = {}
    if images:
        if image_processor is None:
            raise ValueError(f"{location(samples[0])}: a text-only model (no image processor) got images")
        vision = image_processor(images=images, return_tensors="pt")
        grid = vision["image_grid_thw"]  # (images, 3): temporal, height, width in patches
        counts = iter((grid.prod(-1) // image_processor.merge_size**2).tolist())  # visual tokens of image k
        texts = [re.sub(re.escape(IMAGE_PAD), lambda _: IMAGE_PAD * next(counts), t) for t in texts]
        inputs.update(pixel_values=vision["pixel_values"], image_grid_thw=grid)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    P = max(len(row) for row in ids)  # NOTE: left padding, so that every row's completion starts at column P
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (P - len(row)) + row for row in ids])  # (rows, P)
    mask = torch.tensor([[0] * (P - len(row)) + [1] * len(row) for row in ids])  # (rows, P)
    inputs.update(input_ids=input_ids, attention_mask=mask)
    if images:  # transformers builds Qwen-VL's 3D (t, h, w) rotary positions from this: 1 marks image tokens
        inputs["mm_token_type_ids"] = mask * input_ids.eq(tokenizer.convert_tokens_to_ids(IMAGE_PAD))
    inputs = {key: value.to(device) for key, value in inputs.items()}
    return PromptBatch(inputs, images_per_row)


def chat_text(sample: dict, tokenizer, num_images: int) -> str:
    """The chat-templated prompt with one `<|image_pad|>` per image (expanded later to the visual tokens)."""
    text = tokenizer.apply_chat_template(sample_messages(sample), tokenize=False, add_generation_prompt=True)
    if text.count(IMAGE_PAD) != num_images:
        placeholders = f"the chat text has {text.count(IMAGE_PAD)} image placeholders"
        raise ValueError(f"{location(sample)}: {placeholders} but the sample {num_images} images")
    return text


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
# Special tokens a completion may keep: Qwen-VL's grounding markers (<|box_start|>(x1,y1),(x2,y2)<|box_end|>)
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


def decode_completions(
    tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor, eos_ids: Sequence[int] | None = None
) -> list[str]:
    """Each row's text up to its end of turn (mask), special tokens left out except the grounding markers."""
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    special |= {*tokenizer.all_special_ids, *(eos_ids or [tokenizer.eos_token_id])}
    dropped = sorted(special - _ids_of(tokenizer, GROUNDING_TOKENS))
    keep = mask & ~torch.isin(completion_ids, torch.tensor(dropped, device=completion_ids.device))
    ids, keep = completion_ids.tolist(), keep.tolist()  # two copies to the host, not one per row
    return tokenizer.batch_decode([[t for t, k in zip(row, kept) if k] for row, kept in zip(ids, keep)])


# --- The samples of each step -------------------------------------------------------------------------------
def batch_for_step(samples: list[dict], step: int, batch_size: int, seed: int) -> list[dict]:
    """The B samples of step `step` (0-based): epochs of seeded permutations, a pure function of (step, seed),
    so a resumed run draws the batches an uninterrupted one would. NOTE: an epoch's last partial batch is
    never drawn (every batch holds B samples)."""
    epoch, k = divmod(step, max(len(samples) // batch_size, 1))  # batches per epoch, at least one
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return [samples[i] for i in order[k * batch_size : (k + 1) * batch_size].tolist()]
