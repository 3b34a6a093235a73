"""Grounding rewards (boxes, points, regions, counts) that are right in every Qwen-VL coordinate frame.

A grounding reward compares numbers the model wrote with numbers a dataset stores, and the two rarely share
a frame. Three frames meet (w x h is the ORIGINAL image, as stored on disk):
- original: the dataset's ground truth, pixels of the original image, x in [0, w], y in [0, h].
- absolute: Qwen2.5-VL writes pixels of the RESIZED W' x H' image its vision tower saw, x * W' / w and
  y * H' / h. The image processor's `smart_resize` rounds both sides to multiples of patch_size * merge_size
  = 14 * 2 = 28 within [min_pixels, max_pixels], so 333 x 517 is seen as 336 x 504 and 1001 x 77 as 1008 x 84.
- relative1000: Qwen2-VL and Qwen3-VL write a 0-1000 grid over the image, whatever its size: x * 1000 / w,
  y * 1000 / h (so Qwen3-VL's resizing to multiples of 16 * 2 = 32 never shows). Qwen2-VL writes a box as
  `<|object_ref_start|>name<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>`; Qwen3-VL, like
  Qwen2.5-VL, as JSON `{"bbox_2d": [x1, y1, x2, y2], "label": "name"}`.

Both model frames scale the original one along its axes (s_x, s_y > 0): IoU and inside-ness agree in every
frame, distances do not (a 10-pixel margin is 30 units on a 0-1000 grid over a 333-pixel-wide image). So
every reward maps the PREDICTION back to original pixels (`to_original_frame`, the inverse of
`to_model_frame`, which writes targets or prompts) and compares there, never touching ground truth.

The sample contract (the trainer fills "grounding"; the dataset the rest, all in ORIGINAL pixels):
- sample["grounding"] = {"frame": "absolute" | "relative1000", "original_size": [w, h], "resized_size":
  [w', h']} of the sample's FIRST image, the one the rewards read. Absent: the model's frame is the data's.
- sample["bbox"] a box [x1, y1, x2, y2], sample["boxes"] a list of them (else [bbox]), sample["region"]
  polygons of [x, y] vertices, sample["margin"] pixels (negative_points), sample["count"] an int >= 0.

Choices:
- Parsing reads the answer text (the last `<answer>…</answer>` block, else the whole completion) and never
  raises. A box is any innermost JSON list of exactly four finite numbers (so `{"bbox_2d": [...]}`, lists of
  such dicts, ```json fences and bare lists all parse, keys unread) or a `(x1,y1),(x2,y2)` pair, box tokens
  optional; a point, any innermost JSON list of two numbers (`{"point_2d": [x, y]}`) or an `(x,y)` outside
  box tokens; both in the order written. Boxes with x2 <= x1 or y2 <= y1 and anything non-finite are
  dropped, never repaired (no swapping of corners, no clipping).
- Areas are continuous, (x2 - x1) * (y2 - y1), no +1 pixel convention. Boundaries count as inside.
- Multi-box matching is one-to-one and exact (Hungarian algorithm, `optimal_assignment`), not greedy:
  box_iou_mean maximises total IoU, box_f1 the number of pairs at IoU >= 0.5 (the best F1 there is).
- Malformed ground truth raises ValueError (a silent 0 would hide a broken dataset); a malformed completion
  earns 0. Where the ground truth has NO object (boxes = [] or count = 0), predicting none is right and
  earns 1 (box_iou_mean, box_f1, count).
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
Size = Sequence[float]  # width, height

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


def _json_lists(text: str, n: int) -> list[tuple[int, tuple[float, ...]]]:
    """(position, numbers) of every innermost [...] in `text` that is a JSON list of n finite numbers."""
    found = []
    for m in _LIST_RE.finditer(text):
        try:  # NOTE: json.loads accepts NaN and Infinity, and its exact ints can overflow float (10**400)
            values = json.loads(m.group())  # a list: the match starts with "["
            numbers = tuple(float(v) for v in values if type(v) in (int, float))  # a bool is no number
        except (ValueError, OverflowError):  # not JSON, an int past Python's digit limit, or past float's
            continue
        if len(numbers) == len(values) == n and all(math.isfinite(v) for v in numbers):
            found.append((m.start(), numbers))
    return found


def _is_box(box: Sequence[float]) -> bool:
    return len(box) == 4 and all(math.isfinite(v) for v in box) and box[2] > box[0] and box[3] > box[1]


def parse_boxes(text: str) -> list[Box]:
    """Every non-degenerate box in `text`, in the order written (the module docstring says which parse)."""
    found = _json_lists(text, 4)
    found += [(m.start(), tuple(float(g) for g in m.groups())) for m in _PAIR_BOX_RE.finditer(text)]
    return [box for _, box in sorted(found) if _is_box(box)]


def parse_points(text: str) -> list[Point]:
    """Every point in `text`, in the order written; `(x,y)` corners of a `<|box_start|>` box are none."""
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
    needed = model_type in _MODEL_TYPE_FRAMES or any(name in REWARDS for name in readers)
    return frame_for_model_type(model_type) if needed else None


def _size(value: Any, name: str) -> tuple[float, float]:
    try:
        w, h = (float(v) for v in value)
    except (TypeError, ValueError):
        w = h = math.nan
    if not (math.isfinite(w) and math.isfinite(h) and w > 0 and h > 0):
        raise ValueError(f"{name} must be [width, height], two positive numbers; got {value!r}")
    return w, h


def _scale(frame: str, original_size: Size, resized_size: Size | None) -> Point:
    """(s_x, s_y): model-frame units per original pixel."""
    w, h = _size(original_size, "original_size")
    if frame == "absolute":
        rw, rh = _size(resized_size, "resized_size (needed by the absolute frame)")
        return rw / w, rh / h
    if frame == "relative1000":
        return 1000.0 / w, 1000.0 / h
    raise ValueError(f"unknown box frame {frame!r}; frames are {', '.join(FRAMES)}")


def to_model_frame(
    coords: Sequence[float], *, frame: str, original_size: Size, resized_size: Size | None = None
) -> tuple[float, ...]:
    """A box (x1, y1, x2, y2) or point (x, y) in original pixels, written in the model's frame.
    `resized_size` (w', h' after smart_resize) is needed by the absolute frame only."""
    sx, sy = _scale(frame, original_size, resized_size)
    return tuple(v * (sx if i % 2 == 0 else sy) for i, v in enumerate(coords))  # x, y, x, y


def to_original_frame(
    coords: Sequence[float], *, frame: str, original_size: Size, resized_size: Size | None = None
) -> tuple[float, ...]:
    """The inverse of `to_model_frame`: a box or point in the model's frame, in original pixels."""
    sx, sy = _scale(frame, original_size, resized_size)
    return tuple(v / (sx if i % 2 == 0 else sy) for i, v in enumerate(coords))


def _to_original(sample: Mapping[str, Any]) -> Callable[[Sequence[float]], tuple[float, ...]]:
    """Model frame -> original pixels, as sample["grounding"] says (without one, the frames agree)."""
    spec = sample.get("grounding")
    if spec is None:
        return tuple
    if not isinstance(spec, Mapping) or "frame" not in spec or "original_size" not in spec:
        raise ValueError(f'sample["grounding"] must have "frame" and "original_size", got {spec!r}')
    sizes = {key: spec.get(key) for key in ("frame", "original_size", "resized_size")}
    _scale(**sizes)  # a bad spec fails on every sample, not only those with a box
    return functools.partial(to_original_frame, **sizes)


def predicted_boxes(completion: str, sample: Mapping[str, Any]) -> list[Box]:
    """The completion's boxes (answer text), in original pixels."""
    # NOTE: checked again after the mapping: [0, 0, 1e308, 1e308] on a large image scales to inf
    return [box for box in map(_to_original(sample), parse_boxes(answer_text(completion))) if _is_box(box)]


def predicted_points(completion: str, sample: Mapping[str, Any]) -> list[Point]:
    """The completion's points (answer text), in original pixels (finite after the mapping, as boxes)."""
    points = map(_to_original(sample), parse_points(answer_text(completion)))
    return [p for p in points if all(math.isfinite(v) for v in p)]


# --- geometry and matching --------------------------------------------------------------------------------


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two non-degenerate boxes (continuous areas, no +1)."""
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


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
    """Whether `p` is in `region`: even-odd rule over ALL its edges (a nested polygon is a hole), edges in."""
    if boundary_distance(p, region) == 0.0:
        return True
    crossings = 0
    for a, b in _edges(region):
        # An edge across the line y = p.y (half-open: a vertex counts once) and right of p crosses the +x ray.
        if (a[1] > p[1]) != (b[1] > p[1]):
            x = a[0] + (p[1] - a[1]) * (b[0] - a[0]) / (b[1] - a[1])
            crossings += x > p[0]
    return crossings % 2 == 1


def optimal_assignment(weights: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """Row-column pairs (each row and column at most once, min(rows, cols) pairs) of maximum total weight:
    Hungarian algorithm with potentials (Kuhn-Munkres, O(n^2 m) shortest augmenting paths) on cost = -weight,
    n <= m rows (else transposed), so a completion that spams boxes costs time linear in their number."""
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


# --- rewards and their ground truth -----------------------------------------------------------------------


def _gt_box(value: Any, name: str) -> Box:
    try:
        box = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        box = ()
    if not _is_box(box):
        raise ValueError(f"sample {name} {value!r} is not a box [x1, y1, x2, y2] with x2 > x1, y2 > y1")
    return box


def _gt_boxes(sample: Mapping[str, Any]) -> list[Box]:
    if "boxes" in sample:
        if not isinstance(sample["boxes"], list):
            raise ValueError(
                f"sample boxes must be a list of boxes [x1, y1, x2, y2], got {sample['boxes']!r}"
            )
        return [_gt_box(b, "boxes entry") for b in sample["boxes"]]
    return [_gt_box(sample["bbox"], "bbox")]


def _gt_region(sample: Mapping[str, Any]) -> list[Polygon]:
    region = [[(float(x), float(y)) for x, y in poly] for poly in sample["region"]]
    if not region or any(len(poly) < 3 for poly in region):
        raise ValueError(f"sample region must be polygons of >= 3 [x, y] vertices, got {sample['region']!r}")
    return region


def _check_margin(margin: Any) -> Any:
    if margin is not None and not (isinstance(margin, int | float) and margin >= 0):
        raise ValueError(f"sample margin must be a non-negative number of pixels, got {margin!r}")
    return margin


def _check_count(count: Any) -> int:
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"sample count must be a non-negative int, got {count!r}")
    return count


def iou_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """IoU in [0, 1] of the LAST box of the answer with sample["bbox"]; 0 when there is no box."""
    gold, boxes = _gt_box(sample["bbox"], "bbox"), predicted_boxes(completion, sample)
    return box_iou(boxes[-1], gold) if boxes else 0.0


def box_iou_mean(completion: str, sample: Mapping[str, Any]) -> float:
    """Sum of IoUs of the one-to-one matching of predicted and GT boxes (sample["boxes"], else [bbox])
    that maximises it, over max(#pred, #gt): every unmatched box, spare or missed, counts as IoU 0."""
    pred, gold = predicted_boxes(completion, sample), _gt_boxes(sample)
    if not pred and not gold:
        return 1.0  # NOTE: nothing to find and nothing found
    ious = [[box_iou(p, g) for g in gold] for p in pred]  # (#pred, #gt)
    return sum(ious[i][j] for i, j in optimal_assignment(ious)) / max(len(pred), len(gold))


def box_f1(completion: str, sample: Mapping[str, Any], *, iou_threshold: float = 0.5) -> float:
    """F1 = 2 TP / (#pred + #gt); TP: most one-to-one pairs at IoU >= iou_threshold (GT as box_iou_mean)."""
    pred, gold = predicted_boxes(completion, sample), _gt_boxes(sample)
    if not pred and not gold:
        return 1.0  # NOTE: nothing to find and nothing found
    # The matching maximises the count of hits itself, not total IoU: a higher-IoU matching can hold fewer.
    hits = [[float(box_iou(p, g) >= iou_threshold) for g in gold] for p in pred]  # (#pred, #gt)
    tp = sum(hits[i][j] for i, j in optimal_assignment(hits))
    return 2 * tp / (len(pred) + len(gold))


def point_in_box(completion: str, sample: Mapping[str, Any]) -> float:
    """Share of the predicted points in any GT box (sample["boxes"], else [bbox]; edges in); 0 with none."""
    points, gold = predicted_points(completion, sample), _gt_boxes(sample)
    inside = [any(g[0] <= p[0] <= g[2] and g[1] <= p[1] <= g[3] for g in gold) for p in points]
    return sum(inside) / len(points) if points else 0.0


def point_in_region(completion: str, sample: Mapping[str, Any]) -> float:
    """Share of the predicted points inside sample["region"] (even-odd rule, edges in); 0 with none."""
    points, region = predicted_points(completion, sample), _gt_region(sample)
    return sum(in_region(p, region) for p in points) / len(points) if points else 0.0


def negative_points(completion: str, sample: Mapping[str, Any]) -> float:
    """Share of the predicted points that are good NEGATIVE prompts for a point-prompted segmenter: outside
    sample["region"] (a hole is outside, an edge is not) and, given "margin", within that many original
    pixels of its boundary (near the object, not anywhere); 0 with none."""
    points, region = predicted_points(completion, sample), _gt_region(sample)
    margin = _check_margin(sample.get("margin"))
    good = [
        not in_region(p, region) and (margin is None or boundary_distance(p, region) <= margin)
        for p in points
    ]
    return sum(good) / len(points) if points else 0.0


def count_reward(completion: str, sample: Mapping[str, Any], *, graded: bool = False) -> float:
    """1 if the number n of objects listed (parsed boxes, else points; repeats count) equals sample["count"],
    else 0; `graded=True` (bind it in load_reward) gives max(0, 1 - |n - count| / max(count, 1)) instead."""
    count = _check_count(sample["count"])
    text = answer_text(completion)
    n = len(parse_boxes(text)) or len(parse_points(text))
    # NOTE: count 0 and nothing listed (or garbage) is right: 1.
    return max(0.0, 1.0 - abs(n - count) / max(count, 1)) if graded else float(n == count)


# What each reward reads, checked on every sample when the data loads (rewards.check_needs): a check of one
# field's value, or of the whole sample where fields go together (boxes, else bbox; region and margin).
def _check_boxes(sample: Mapping[str, Any]) -> None:
    if "boxes" not in sample and "bbox" not in sample:
        raise ValueError('needs "boxes" (or "bbox"); the sample has neither')
    _gt_boxes(sample)


def _check_region(sample: Mapping[str, Any]) -> None:
    try:
        _gt_region(sample)
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f'needs "region", polygons of >= 3 [x, y] vertices; got {sample.get("region")!r}'
        ) from None
    _check_margin(sample.get("margin"))


iou_reward.needs = {"bbox": functools.partial(_gt_box, name="bbox")}
box_iou_mean.needs = box_f1.needs = point_in_box.needs = _check_boxes
point_in_region.needs = negative_points.needs = _check_region
count_reward.needs = {"count": _check_count}

# Names for rewards.load_reward's `builtins`, next to rewards.BUILTIN_REWARDS.
REWARDS: dict[str, Callable[..., float]] = {
    "iou": iou_reward,
    "box_iou_mean": box_iou_mean,
    "box_f1": box_f1,
    "point_in_box": point_in_box,
    "point_in_region": point_in_region,
    "negative_points": negative_points,
    "count": count_reward,
}
