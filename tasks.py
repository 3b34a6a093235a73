"""The built-in synthetic tasks: small image (and text) problems the embedded tiny model learns on a CPU.

A GRPO run needs a policy that is right only part of the time, so that the completions of a group get
different rewards. The shipped tiny Qwen2.5-VL (assets/tiny-qwen2.5-vl, about half a million parameters) was
warm-started on the two image tasks until it reached that point, so `python train.py` shows a reward that
rises within minutes on a laptop, with no download and no dataset. Every sample is drawn with PIL from a
seeded `random.Random`: the same (task, split, seed) always gives the same samples, images included.

- shapes: one 56x56 photo of a coloured shape; the answer is "red circle" (reward: answer_match).
- inspection: 1-4 photos of one installation; it passes (通过) iff no photo shows a red defect mark; the
  answer is the verdict on line 1 and `理由: ...` on line 2 (rewards: label, format).
- summaries: the inspection task from text alone, each photo replaced by a one-line summary of it (the
  second stage of a "summaries first, verdict second" pipeline); the tiny model was not warm-started on it.

Samples are the plain dicts data.py reads from JSONL, with `PIL.Image` objects in `images` instead of paths.
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

# The rewards each built-in task trains with when --reward is not given.
TASK_REWARDS = {
    "shapes": ("answer_match",),
    "inspection": ("label", "format"),
    "summaries": ("label", "format"),
}
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")
IMAGE_SIZE = 56  # pixels; with 14-pixel patches and 2x2 merging one image is 4 visual tokens
SHAPES_PROMPT = "what colour and shape is this?"
INSPECTION_PROMPT = "inspect the installation. answer 通过 or 不通过 on line 1 and 理由: on line 2."
SUMMARIES_PROMPT = "inspect the installation from the photo summaries. answer 通过 or 不通过, then 理由:."
TASKS = ("shapes", "inspection")  # the image tasks the tiny model was warm-started on
TEXT_TASKS = ("summaries",)  # per-image text summaries instead of images (no vision needed)


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def _shapes_sample(rng: random.Random, index: int) -> dict:
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (235, 235, 235))
    size = rng.randint(30, 46)
    x0, y0 = rng.randint(2, IMAGE_SIZE - size - 2), rng.randint(2, IMAGE_SIZE - size - 2)
    _draw_shape(ImageDraw.Draw(image), shape, (x0, y0, x0 + size, y0 + size), COLOURS[colour])
    return {
        "id": f"shapes-{index}",
        "images": [image],
        "prompt": SHAPES_PROMPT,
        "answer": f"{colour} {shape}",
    }


def _inspection_sample(rng: random.Random, index: int) -> dict:
    """1-4 photos of one installation; it passes (通过) iff no photo shows a red defect mark.

    The per-photo defect probability makes pass and fail equally likely for every photo count.
    """
    n_images = rng.randint(1, 4)
    p_defect = 1 - 0.5 ** (1 / n_images)
    images, defective = [], []
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
    if defective:
        label, reason = "不通过", f"理由: 图片{defective[0]}有缺陷"
    else:
        label, reason = "通过", "理由: 无缺陷"
    return {
        "id": f"inspection-{index}",
        "images": images,
        "prompt": INSPECTION_PROMPT,
        "label": label,
        "answer": f"{label}\n{reason}",
    }


def _summaries_sample(rng: random.Random, index: int) -> dict:
    """The inspection task from text alone: each photo is replaced by a one-line summary of it.

    This is the second stage of a "summaries first, verdict second" pipeline, where another model has
    already described every photo; the same verdict rule and answer format apply.
    """
    sample = _inspection_sample(rng, index)

    # A red defect mark is the only saturated red in a photo, so the summary is read off the pixels.
    def red_mark(image: Image.Image) -> bool:  # getcolors: each (r, g, b) of the photo once, with its count
        return any(r > 200 and g < 80 for _, (r, g, _) in image.getcolors(image.width * image.height))

    summaries = [
        "面板有红色缺陷" if red_mark(image) else "面板正常, 四个螺栓" for image in sample.pop("images")
    ]
    return {**sample, "id": f"summaries-{index}", "summaries": summaries, "prompt": SUMMARIES_PROMPT}


def make_task(name: str, n: int, *, split: str = "train", seed: int = 0) -> list[dict]:
    """`n` samples of a built-in task; `split='test'` draws from a disjoint seed stream (held-out)."""
    makers = {"shapes": _shapes_sample, "inspection": _inspection_sample, "summaries": _summaries_sample}
    if name not in makers:
        raise ValueError(f"unknown built-in task {name!r}; known: {', '.join(makers)}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    # Disjoint streams per task and split: a held-out sample is never a training sample re-drawn.
    rng = random.Random(f"{name}/{split}/{seed}")
    return [makers[name](rng, i) for i in range(n)]
