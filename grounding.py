"""Grounding rewards (boxes, points, regions, counts) that are right in every Qwen-VL coordinate frame.

A grounding reward compares numbers the model wrote with numbers a dataset stores, and the two rarely live in
the same frame. Three frames meet (w x h is the ORIGINAL image, as stored on disk):

    original      the dataset's ground truth: pixels of the original image, x in [0, w], y in [0, h].
    absolute      Qwen2.5-VL writes pixels of the RESIZED image its vision tower saw. The image processor's
                  `smart_resize` rounds both sides to multiples of patch_size * merge_size = 14 * 2 = 28 and
                  scales the image into [min_pixels, max_pixels], so 333 x 517 is seen as 336 x 504 and
                  1001 x 77 as 1008 x 84: x_abs = x * W' / w, y_abs = y * H' / h for a resized W' x H'.
    relative1000  Qwen2-VL and Qwen3-VL write coordinates on a 0-1000 grid over the image, whatever its size:
                  x_rel = x * 1000 / w, y_rel = y * 1000 / h. Qwen2-VL writes a box as
                  `<|object_ref_start|>name<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>`;
                  Qwen3-VL as JSON, `{"bbox_2d": [x1, y1, x2, y2], "label": "name"}`, like Qwen2.5-VL.
                  (Qwen3-VL resizes to multiples of 16 * 2 = 32, which a relative frame never sees.)

Both model frames are an axis-aligned scaling of the original one (s_x, s_y > 0), so IoU and inside-ness
are the same in every frame, but distances are not (a 10-pixel margin is 30 units on a 0-1000 grid over a
333-pixel-wide image). Every reward therefore maps the PREDICTION back to original pixels and compares
there; ground truth is never touched. `to_model_frame` is the forward map (for writing targets or prompts),
`to_original_frame` its inverse, `frame_for_model_type` picks the frame from `config.model_type`.

The sample contract (the trainer fills "grounding"; the dataset the rest, all in ORIGINAL pixels):
    sample["grounding"] = {"frame": "absolute" | "relative1000", "original_size": [w, h],
                           "resized_size": [w', h']}   of the sample's FIRST image; grounding rewards use
                           the first image. Absent: the model's frame is taken to be the data's (identity).
    sample["bbox"]    one box [x1, y1, x2, y2];     sample["boxes"]  a list of boxes (else [bbox]);
    sample["region"]  polygons, each a list of [x, y] vertices;  sample["margin"]  pixels (negative_points);
    sample["count"]   a non-negative int.

Choices:
- Parsing reads the answer text (the last `<answer>…</answer>` block, else the whole completion) and never
  raises. A box is any innermost JSON list of exactly four finite numbers (so `{"bbox_2d": [...]}`, lists of
  such dicts, ```json fences and bare lists all parse, keys unread) or a `(x1,y1),(x2,y2)` pair, with or
  without Qwen2-VL's box tokens. A point is any innermost JSON list of two numbers (`{"point_2d": [x, y]}`)
  or an `(x,y)` outside box tokens. Boxes and points keep the order they are written in. Boxes with
  x2 <= x1 or y2 <= y1 and anything non-finite are dropped, never repaired (no swapping of corners, no
  clipping to the image).
- Areas are continuous, (x2 - x1) * (y2 - y1), no +1 pixel convention. Boundaries count as inside.
- Multi-box matching is one-to-one and exact (Hungarian algorithm, `optimal_assignment`), not greedy.
  box_iou_mean maximises total IoU; box_f1 maximises the number of pairs at IoU >= 0.5 (the best F1 there
  is, never below the IoU-optimal matching's count).
- Ground truth that is malformed raises ValueError (a silent 0 would hide a broken dataset); a malformed
  completion earns 0. Where the ground truth has NO object (boxes = [] or count = 0), predicting none is right
  and earns 1 (box_iou_mean, box_f1, count).
"""

import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Box = tuple[float, float, float, float]  # x1, y1, x2, y2
Point = tuple[float, float]  # x, y
Polygon = list[Point]

FRAMES = ("absolute", "relative1000")

# config.model_type -> the frame its grounding outputs are written in (see the module docstring).
_MODEL_TYPE_FRAMES = {
    "qwen2_5_vl": "absolute",
    "qwen2_vl": "relative1000",
    "qwen3_vl": "relative1000",
    "qwen3_vl_moe": "relative1000",
}

# --- parsing ----------------------------------------------------------------------------------------------

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_LIST_RE = re.compile(r"\[[^\[\]]*\]")  # innermost brackets: "[[1,2,3,4]]" yields the inner list
_NUM = r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_PAIR = rf"\(\s*({_NUM})\s*,\s*({_NUM})\s*\)"
_PAIR_RE = re.compile(_PAIR)
_PAIR_BOX_RE = re.compile(rf"{_PAIR}\s*,\s*{_PAIR}")
_BOX_TOKENS_RE = re.compile(r"<\|box_start\|>.*?<\|box_end\|>", re.DOTALL)


def answer_text(completion: str) -> str:
    """Content of the last <answer>…</answer> block, or the whole completion if there is none."""
    blocks = _ANSWER_RE.findall(completion)
    return blocks[-1] if blocks else completion


def _finite_numbers(value: Any, n: int) -> tuple[float, ...] | None:
    """`value` as n finite floats if it is a list of n real numbers (not bools), else None."""
    if not isinstance(value, list) or len(value) != n:
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return None
    try:
        floats = tuple(float(v) for v in value)
    except OverflowError:  # NOTE: json.loads gives exact ints, and float(10**400) overflows
        return None
    return floats if all(math.isfinite(v) for v in floats) else None  # json.loads accepts NaN, Infinity


def _json_lists(text: str, n: int) -> list[tuple[int, tuple[float, ...]]]:
    """(position, numbers) of every innermost [...] in `text` that is a JSON list of n finite numbers."""
    found = []
    for m in _LIST_RE.finditer(text):
        try:
            numbers = _finite_numbers(json.loads(m.group()), n)
        except ValueError:  # JSONDecodeError, and ints past Python's digit limit
            continue
        if numbers is not None:
            found.append((m.start(), numbers))
    return found


def _is_box(box: Sequence[float]) -> bool:
    return len(box) == 4 and all(math.isfinite(v) for v in box) and box[2] > box[0] and box[3] > box[1]


def parse_boxes(text: str) -> list[Box]:
    """Every non-degenerate box in `text`, in the order written: JSON lists of four numbers and
    `(x1,y1),(x2,y2)` pairs (Qwen2-VL's form, box tokens optional)."""
    found = _json_lists(text, 4)
    found += [(m.start(), tuple(float(g) for g in m.groups())) for m in _PAIR_BOX_RE.finditer(text)]
    return [box for _, box in sorted(found) if _is_box(box)]


def parse_points(text: str) -> list[Point]:
    """Every point in `text`, in the order written: JSON lists of two numbers and `(x,y)` pairs that are
    not the corners of a `<|box_start|>…<|box_end|>` box."""
    found = _json_lists(text, 2)
    # Blank out the box-token spans (same length, so positions still sort) before looking for (x,y).
    outside_boxes = _BOX_TOKENS_RE.sub(lambda m: " " * len(m.group()), text)
    found += [(m.start(), (float(m.group(1)), float(m.group(2)))) for m in _PAIR_RE.finditer(outside_boxes)]
    return [p for _, p in sorted(found) if all(math.isfinite(v) for v in p)]


# --- frames -----------------------------------------------------------------------------------------------


def frame_for_model_type(model_type: str) -> str:
    """The frame a model writes coordinates in, from its `config.model_type`."""
    if model_type not in _MODEL_TYPE_FRAMES:
        raise ValueError(
            f"no known box frame for model_type {model_type!r} (known: {', '.join(_MODEL_TYPE_FRAMES)}); "
            f"pass --box-frame with one of {', '.join(FRAMES)}"
        )
    return _MODEL_TYPE_FRAMES[model_type]


def resolve_frame(
    requested: str, model_type: str, image_processor: Any, reward_names: Sequence[str]
) -> str | None:
    """The frame a run hands its rewards (sample["grounding"]), or None: for a text-only model (no image
    processor), or when no reward may read coordinates (a grounding one, or a plug-in "module:function").
    "auto" reads `model_type`; an unknown family raises only when a grounding reward needs the frame."""
    readers = [name for name in reward_names if name in REWARDS or ":" in name]
    if image_processor is None or not readers:
        return None
    if requested != "auto":
        return requested
    if model_type in _MODEL_TYPE_FRAMES or any(name in REWARDS for name in readers):
        return frame_for_model_type(model_type)
    return None


def _size(value: Any, name: str) -> tuple[float, float]:
    try:
        w, h = (float(v) for v in value)
    except (TypeError, ValueError):
        w = h = math.nan
    if not (math.isfinite(w) and math.isfinite(h) and w > 0 and h > 0):
        raise ValueError(f"{name} must be [width, height], two positive numbers; got {value!r}")
    return w, h


def _scale(frame: str, original_size: Sequence[float], resized_size: Sequence[float] | None) -> Point:
    """(s_x, s_y): model-frame units per original pixel."""
    w, h = _size(original_size, "original_size")
    if frame == "absolute":
        rw, rh = _size(resized_size, "resized_size (needed by the absolute frame)")
        return rw / w, rh / h
    if frame == "relative1000":
        return 1000.0 / w, 1000.0 / h
    raise ValueError(f"unknown box frame {frame!r}; frames are {', '.join(FRAMES)}")


def to_model_frame(
    coords: Sequence[float],
    *,
    frame: str,
    original_size: Sequence[float],
    resized_size: Sequence[float] | None = None,
) -> tuple[float, ...]:
    """A box (x1, y1, x2, y2) or point (x, y) in original pixels, written in the model's frame.
    `resized_size` (w', h' after smart_resize) is needed by the absolute frame only."""
    sx, sy = _scale(frame, original_size, resized_size)
    return tuple(v * (sx if i % 2 == 0 else sy) for i, v in enumerate(coords))  # x, y, x, y


def to_original_frame(
    coords: Sequence[float],
    *,
    frame: str,
    original_size: Sequence[float],
    resized_size: Sequence[float] | None = None,
) -> tuple[float, ...]:
    """The inverse of `to_model_frame`: a box or point in the model's frame, in original pixels."""
    sx, sy = _scale(frame, original_size, resized_size)
    return tuple(v / (sx if i % 2 == 0 else sy) for i, v in enumerate(coords))


def _to_original(sample: Mapping[str, Any]) -> Callable[[Sequence[float]], tuple[float, ...]]:
    """The map from the model's frame to original pixels that sample["grounding"] describes (identity
    when the sample has none: the frames are taken to agree)."""
    spec = sample.get("grounding")
    if spec is None:
        return tuple
    if not isinstance(spec, Mapping) or "frame" not in spec or "original_size" not in spec:
        raise ValueError(f'sample["grounding"] must have "frame" and "original_size", got {spec!r}')
    frame, original_size, resized_size = spec["frame"], spec["original_size"], spec.get("resized_size")
    _scale(frame, original_size, resized_size)  # a bad spec fails on every sample, not only those with a box
    return functools.partial(
        to_original_frame, frame=frame, original_size=original_size, resized_size=resized_size
    )


def predicted_boxes(completion: str, sample: Mapping[str, Any]) -> list[Box]:
    """The completion's boxes (answer text), in original pixels."""
    to_original = _to_original(sample)
    return [to_original(b) for b in parse_boxes(answer_text(completion))]


def predicted_points(completion: str, sample: Mapping[str, Any]) -> list[Point]:
    """The completion's points (answer text), in original pixels."""
    to_original = _to_original(sample)
    return [to_original(p) for p in parse_points(answer_text(completion))]


# --- geometry ---------------------------------------------------------------------------------------------


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two non-degenerate boxes (continuous areas, no +1)."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def _in_box(p: Point, box: Sequence[float]) -> bool:
    return box[0] <= p[0] <= box[2] and box[1] <= p[1] <= box[3]


def _edges(region: Sequence[Polygon]):
    """Every edge (a, b) of every polygon, each closed (last vertex back to the first)."""
    for poly in region:
        yield from zip(poly, [*poly[1:], poly[0]])


def _segment_distance(p: Point, a: Point, b: Point) -> float:
    dx, dy = b[0] - a[0], b[1] - a[1]
    length2 = dx * dx + dy * dy
    t = 0.0 if length2 == 0 else max(0.0, min(1.0, ((p[0] - a[0]) * dx + (p[1] - a[1]) * dy) / length2))
    return math.hypot(p[0] - (a[0] + t * dx), p[1] - (a[1] + t * dy))


def boundary_distance(p: Point, region: Sequence[Polygon]) -> float:
    """Distance from `p` to the nearest edge of any polygon of `region`."""
    return min(_segment_distance(p, a, b) for a, b in _edges(region))


def in_region(p: Point, region: Sequence[Polygon]) -> bool:
    """Whether `p` is in `region`: even-odd rule over ALL its edges (a polygon inside another is a hole);
    a point on an edge is inside."""
    if boundary_distance(p, region) == 0.0:
        return True
    crossings = 0
    for a, b in _edges(region):
        # Edge straddles the horizontal line through p (half-open, so a vertex is counted once) and meets
        # it to the right of p: one crossing of the ray from p towards +x.
        if (a[1] > p[1]) != (b[1] > p[1]):
            x = a[0] + (p[1] - a[1]) * (b[0] - a[0]) / (b[1] - a[1])
            crossings += x > p[0]
    return crossings % 2 == 1


# --- matching ---------------------------------------------------------------------------------------------


def optimal_assignment(weights: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """Row-column pairs (each row and column at most once, min(rows, cols) pairs) of maximum total weight.

    Hungarian algorithm with potentials (Kuhn-Munkres; the O(n^2 m) shortest-augmenting-path form), on
    cost = -weight, with n <= m rows (the matrix is transposed otherwise), so a completion that spams boxes
    costs time linear in its box count."""
    if not weights or not weights[0]:
        return []
    if len(weights) > len(weights[0]):
        return [(i, j) for j, i in optimal_assignment([list(col) for col in zip(*weights)])]
    n, m = len(weights), len(weights[0])
    u, v = [0.0] * (n + 1), [0.0] * (m + 1)  # potentials; index 0 is the virtual start
    owner, way = [0] * (m + 1), [0] * (m + 1)  # owner[j]: the row (1-based) assigned to column j
    for i in range(1, n + 1):
        owner[0], j0 = i, 0
        slack, used = [math.inf] * (m + 1), [False] * (m + 1)
        while owner[j0] != 0:  # grow the tree of tight edges until it reaches a free column
            used[j0], i0, delta, j1 = True, owner[j0], math.inf, 0
            for j in range(1, m + 1):
                if not used[j]:
                    reduced = -weights[i0 - 1][j - 1] - u[i0] - v[j]
                    if reduced < slack[j]:
                        slack[j], way[j] = reduced, j0
                    if slack[j] < delta:
                        delta, j1 = slack[j], j
            for j in range(m + 1):
                if used[j]:
                    u[owner[j]] += delta
                    v[j] -= delta
                else:
                    slack[j] -= delta
            j0 = j1
        while j0:  # flip the augmenting path back to the start
            owner[j0] = owner[way[j0]]
            j0 = way[j0]
    return sorted((owner[j] - 1, j - 1) for j in range(1, m + 1) if owner[j])


# --- ground truth -----------------------------------------------------------------------------------------


def _gt_box(value: Any, name: str) -> Box:
    try:
        box = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        box = ()
    if not _is_box(box):
        raise ValueError(f"sample {name} {value!r} is not a box [x1, y1, x2, y2] with x2 > x1, y2 > y1")
    return box


def _gt_boxes(sample: Mapping[str, Any]) -> list[Box]:
    """sample["boxes"], or [sample["bbox"]] when there is no "boxes"."""
    if "boxes" in sample:
        return [_gt_box(b, "boxes entry") for b in sample["boxes"]]
    return [_gt_box(sample["bbox"], "bbox")]


def _gt_region(sample: Mapping[str, Any]) -> list[Polygon]:
    region = [[(float(x), float(y)) for x, y in poly] for poly in sample["region"]]
    if not region or any(len(poly) < 3 for poly in region):
        raise ValueError(f"sample region must be polygons of >= 3 [x, y] vertices, got {sample['region']!r}")
    return region


# --- rewards ----------------------------------------------------------------------------------------------


def iou_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """IoU in [0, 1] of the LAST box of the answer with sample["bbox"]; 0 when there is no box."""
    gold = _gt_box(sample["bbox"], "bbox")
    boxes = predicted_boxes(completion, sample)
    return box_iou(boxes[-1], gold) if boxes else 0.0


def _iou_matrix(pred: list[Box], gold: list[Box]) -> list[list[float]]:
    return [[box_iou(p, g) for g in gold] for p in pred]  # (#pred, #gt)


def box_iou_mean(completion: str, sample: Mapping[str, Any]) -> float:
    """Sum of IoUs of the one-to-one matching of predicted and GT boxes (sample["boxes"], else [bbox])
    that maximises it, over max(#pred, #gt): every unmatched box, spare or missed, counts as IoU 0."""
    pred, gold = predicted_boxes(completion, sample), _gt_boxes(sample)
    if not pred and not gold:
        return 1.0  # NOTE: nothing to find and nothing found
    ious = _iou_matrix(pred, gold)
    return sum(ious[i][j] for i, j in optimal_assignment(ious)) / max(len(pred), len(gold))


def box_f1(completion: str, sample: Mapping[str, Any], *, iou_threshold: float = 0.5) -> float:
    """F1 = 2 TP / (#pred + #gt), TP the most one-to-one pairs with IoU >= iou_threshold (GT boxes as in
    box_iou_mean)."""
    pred, gold = predicted_boxes(completion, sample), _gt_boxes(sample)
    if not pred and not gold:
        return 1.0  # NOTE: nothing to find and nothing found
    # The matching maximises the count of hits itself, not total IoU: a higher-IoU matching can hold fewer.
    hits = [[float(iou >= iou_threshold) for iou in row] for row in _iou_matrix(pred, gold)]
    tp = sum(hits[i][j] for i, j in optimal_assignment(hits))
    return 2 * tp / (len(pred) + len(gold))


def point_in_box(completion: str, sample: Mapping[str, Any]) -> float:
    """Share of the predicted points inside any GT box (sample["boxes"], else [bbox]; edges inside);
    0 with no point."""
    points, gold = predicted_points(completion, sample), _gt_boxes(sample)
    return sum(any(_in_box(p, g) for g in gold) for p in points) / len(points) if points else 0.0


def point_in_region(completion: str, sample: Mapping[str, Any]) -> float:
    """Share of the predicted points inside sample["region"] (even-odd rule, edges inside); 0 with no
    point."""
    points, region = predicted_points(completion, sample), _gt_region(sample)
    return sum(in_region(p, region) for p in points) / len(points) if points else 0.0


def negative_points(completion: str, sample: Mapping[str, Any]) -> float:
    """Share of the predicted points that are good NEGATIVE prompts for a point-prompted segmenter: outside
    sample["region"] (even-odd: a hole is outside; on an edge is not), and, when the sample has "margin",
    within that many original pixels of the region's boundary (near the object, not anywhere). 0 with no
    point."""
    points, region = predicted_points(completion, sample), _gt_region(sample)
    margin = sample.get("margin")
    if margin is not None and not (isinstance(margin, int | float) and margin >= 0):
        raise ValueError(f"sample margin must be a non-negative number of pixels, got {margin!r}")
    good = [
        not in_region(p, region) and (margin is None or boundary_distance(p, region) <= margin)
        for p in points
    ]
    return sum(good) / len(points) if points else 0.0


def count_reward(completion: str, sample: Mapping[str, Any], *, graded: bool = False) -> float:
    """1 if the number of objects listed equals sample["count"], else 0. Objects are the parsed boxes, or the
    parsed points when there is no box; repeats count. `graded=True` (bind it with load_reward) gives
    max(0, 1 - |n - count| / max(count, 1)) instead, partial credit for being close."""
    count = sample["count"]
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"sample count must be a non-negative int, got {count!r}")
    text = answer_text(completion)
    n = len(parse_boxes(text)) or len(parse_points(text))
    if graded:
        return max(0.0, 1.0 - abs(n - count) / max(count, 1))
    return float(n == count)  # NOTE: count 0 and nothing listed (or garbage) is right: 1


# The registered names (rewards.py registers these as built-ins).
REWARDS: dict[str, Callable[..., float]] = {
    "iou": iou_reward,
    "box_iou_mean": box_iou_mean,
    "box_f1": box_f1,
    "point_in_box": point_in_box,
    "point_in_region": point_in_region,
    "negative_points": negative_points,
    "count": count_reward,
}
