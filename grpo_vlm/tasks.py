"""The built-in synthetic tasks: small image (and text) problems the embedded tiny model learns on a CPU.

A GRPO run needs a policy that is right only part of the time, so that the completions of a group get
different rewards. The shipped tiny Qwen2.5-VL (assets/tiny-qwen2.5-vl, about half a million parameters) was
warm-started on the two image tasks until it reached that point, so `python -m grpo_vlm` shows a reward that
rises within minutes on a laptop, with no download and no dataset. Every sample is drawn with PIL from a
seeded `random.Random`: the same (task, split, seed) always gives the same samples, images included.

- shapes: one 56x56 photo of a coloured shape; the answer is "red circle" (reward: answer_match).
- inspection: 1-4 photos of one installation; it passes (通过) iff no photo shows a red defect mark; the
  answer is the verdict on line 1 and `理由: ...` on line 2 (rewards: label, format). Its drawing is
  data.py's (`data.inspection_sample`), the reference's default task; make_task draws the same stream.
- inspection-zoom: one 448x448 photo of a small panel at its centre, with (probability 1/2) a 2x2-pixel
  red defect mark on it that the resize to the tiny model's budget (112x112) blurs into the photo's colour
  noise, but that a crop of the panel at full resolution shows (`zoom` in tools.py; rewards: label, format,
  tool_format). `zoom_box` is the panel's box, `mark_box` the mark's or None, both in original pixels.
- summaries: the inspection task from text alone, each photo replaced by a one-line summary of it (the
  second stage of a "summaries first, verdict second" pipeline); the tiny model was not warm-started on it.

Samples are the plain dicts data.py reads from JSONL, with `PIL.Image` objects in `images` instead of paths.
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

import data

# The rewards each built-in task trains with when --reward is not given.
TASK_REWARDS = {
    "shapes": ("answer_match",),
    "inspection": ("label", "format"),
    "summaries": ("label", "format"),
    "inspection-zoom": ("label", "format", "tool_format"),
}
SHAPES = ("circle", "square", "triangle")
SHAPES_PROMPT = "what colour and shape is this?"
SUMMARIES_PROMPT = "inspect the installation from the photo summaries. answer 通过 or 不通过, then 理由:."
TASKS = ("shapes", "inspection")  # the image tasks the tiny model was warm-started on
TOOL_TASKS = ("inspection-zoom",)  # a task the tools asset (assets/tiny-qwen2.5-vl-tools) was warm-started on
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
    colour, shape = rng.choice(list(data.COLOURS)), rng.choice(SHAPES)
    image = Image.new("RGB", (data.IMAGE_SIZE, data.IMAGE_SIZE), (235, 235, 235))
    size = rng.randint(30, 46)
    x0, y0 = rng.randint(2, data.IMAGE_SIZE - size - 2), rng.randint(2, data.IMAGE_SIZE - size - 2)
    _draw_shape(ImageDraw.Draw(image), shape, (x0, y0, x0 + size, y0 + size), data.COLOURS[colour])
    return {
        "id": f"shapes-{index}",
        "images": [image],
        "prompt": SHAPES_PROMPT,
        "answer": f"{colour} {shape}",
    }


# inspection-zoom: a photo 4 times the tiny processor's 112x112 budget per side, so that a 2x2 mark covers
# at most a quarter of a resized pixel. Its colours come from a palette ("P" mode: a byte a pixel, a third
# of RGB's memory): 64 background and 64 panel shades jittered per channel, whose colour noise, after the
# resize, reaches the red a blurred mark leaves: the largest R - (G+B)/2 of a resized photo is about 15
# without a mark and 21 with one, and 222 in a crop of the panel with one (mean over 200 samples).
# The panel sits at the centre, 8 pixels wide, so that its crop, enlarged to 56x56, shows the mark 14 pixels
# wide (one vision patch): the tiny model's 2-block vision tower learns to see that in a crop alone in 200
# steps, but not a mark 7 or 3.5 pixels wide (a 16 or 32 pixel panel) in 400, nor where a panel is.
ZOOM_PHOTO, ZOOM_PANEL, ZOOM_MARK = 448, 8, 2  # pixels
_RED = 128  # the palette index after the 2 x 64 shades
_BACKGROUND_SHADES = bytes(i % 64 for i in range(256))  # random bytes -> shade indices (bytes.translate)
_PANEL_SHADES = bytes(64 + i % 64 for i in range(256))
INSPECTION_ZOOM_PROMPT = (
    "inspect the panel for a small red mark. answer 通过 or 不通过, then 理由:. zoom in with "
    '<tool_call>{"name": "zoom", "arguments": {"image": 0, "bbox_2d": [x1, y1, x2, y2]}}</tool_call>'
)


def _zoom_palette() -> list[int]:
    rng = random.Random("inspection-zoom palette")  # fixed: the same shades in every sample and split
    shades = [(200, 200, 205)] * 64 + [(70, 75, 90)] * 64
    jittered = [min(255, max(0, v + rng.randint(-35, 35))) for shade in shades for v in shade]
    return [*jittered, *data.COLOURS["red"]]


def _inspection_zoom_sample(rng: random.Random, index: int) -> dict:
    """One photo of a panel at its centre; it fails (不通过) iff the panel has a red 2x2 mark."""
    S, P, M = ZOOM_PHOTO, ZOOM_PANEL, ZOOM_MARK
    image = Image.frombytes("P", (S, S), rng.randbytes(S * S).translate(_BACKGROUND_SHADES))
    image.putpalette(_zoom_palette())
    x0 = y0 = (S - P) // 2
    image.paste(Image.frombytes("P", (P, P), rng.randbytes(P * P).translate(_PANEL_SHADES)), (x0, y0))
    draw = ImageDraw.Draw(image)
    mark_box = None
    if rng.random() < 0.5:
        mx, my = x0 + rng.randint(0, P - M), y0 + rng.randint(0, P - M)
        draw.rectangle((mx, my, mx + M - 1, my + M - 1), fill=_RED)
        mark_box = [mx, my, mx + M, my + M]
    label, reason = ("不通过", "理由: 面板有红色缺陷") if mark_box else ("通过", "理由: 无缺陷")
    return {
        "id": f"inspection-zoom-{index}",
        "images": [image],
        "prompt": INSPECTION_ZOOM_PROMPT,
        "label": label,
        "answer": f"{label}\n{reason}",
        "zoom_box": [x0, y0, x0 + P, y0 + P],
        "mark_box": mark_box,
    }


def _summaries_sample(rng: random.Random, index: int) -> dict:
    """The inspection task from text alone: each photo is replaced by a one-line summary of it.

    This is the second stage of a "summaries first, verdict second" pipeline, where another model has
    already described every photo; the same verdict rule and answer format apply.
    """
    sample = data.inspection_sample(rng, index)

    # A red defect mark is the only saturated red in a photo, so the summary is read off the pixels.
    def red_mark(image: Image.Image) -> bool:  # getcolors: each (r, g, b) of the photo once, with its count
        return any(r > 200 and g < 80 for _, (r, g, _) in image.getcolors(image.width * image.height))

    summaries = [
        "面板有红色缺陷" if red_mark(image) else "面板正常, 四个螺栓" for image in sample.pop("images")
    ]
    return {**sample, "id": f"summaries-{index}", "summaries": summaries, "prompt": SUMMARIES_PROMPT}


def make_task(name: str, n: int, *, split: str = "train", seed: int = 0) -> list[dict]:
    """`n` samples of a built-in task; `split='test'` draws from a disjoint seed stream (held-out)."""
    makers = {"shapes": _shapes_sample, "inspection": data.inspection_sample, "summaries": _summaries_sample}
    makers["inspection-zoom"] = _inspection_zoom_sample
    if name not in makers:
        raise ValueError(f"unknown built-in task {name!r}; known: {', '.join(makers)}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    # Disjoint streams per task and split: a held-out sample is never a training sample re-drawn.
    rng = random.Random(f"{name}/{split}/{seed}")
    return [makers[name](rng, i) for i in range(n)]
