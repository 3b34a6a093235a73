"""Tests for grounding.py: the same physical box scores the same in every Qwen-VL frame (sizes from
transformers' own smart_resize), hand-computed rewards, exact matching, and completions that never raise.

`PYTHONPATH=.:tests python tests/full/test_grounding.py` (from the repository root) prints the frame table.
"""

import itertools
import json
import math
import random
from pathlib import Path

import pytest

import rewards
from grpo_vlm import grounding, plugins, scoring
from grpo_vlm.grounding import (
    FRAMES,
    box_f1,
    box_iou,
    box_iou_mean,
    count_reward,
    frame_for_model_type,
    iou_reward,
    negative_points,
    optimal_assignment,
    parse_boxes,
    parse_points,
    point_in_box,
    point_in_region,
    to_model_frame,
    to_original_frame,
)

try:  # transformers 5: the torchvision-free copy (image_processing_qwen2_vl itself needs torchvision there)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
except ImportError:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize


def spec(frame, original_size, resized_size=None):
    return {"frame": frame, "original_size": list(original_size), "resized_size": resized_size}


def qwen25_json(box):
    return f'```json\n[{{"bbox_2d": {json.dumps(list(box))}, "label": "cup"}}]\n```'


def qwen2_tokens(box):
    x1, y1, x2, y2 = box
    return f"<|object_ref_start|>cup<|object_ref_end|><|box_start|>({x1},{y1}),({x2},{y2})<|box_end|>"


# --- parsing ----------------------------------------------------------------------------------------------


def test_parse_boxes_reads_every_syntax_in_the_order_written():
    text = (
        'I see {"bbox_2d": [1, 2, 3, 4], "label": "a"} and '
        '```json\n[{"bbox_2d": [5, 6, 7, 8.5]}, {"bbox_2d": [9, 9, 10, 10]}]\n``` then '
        "<|object_ref_start|>b<|object_ref_end|><|box_start|>(10,20),(300,400)<|box_end|>, "
        "[11, 12, 13, 14] and [[20, 20, 30, 30], [40, 40, 50, 50]]"
    )
    assert parse_boxes(text) == [
        (1, 2, 3, 4),
        (5, 6, 7, 8.5),
        (9, 9, 10, 10),
        (10, 20, 300, 400),
        (11, 12, 13, 14),
        (20, 20, 30, 30),
        (40, 40, 50, 50),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "[3, 3, 1, 1]",
        "[1, 1, 1, 3]",
        "[NaN, 1, 3, 3]",
        "[1, 1, Infinity, 3]",
        "[true, 1, 3, 3]",
        '["1", 1, 3, 3]',
        "[1e999, 1, 3, 3]",
        f"[{10**400}, 1, 3, 3]",
        "(5,5),(1,1)",
        "[1, 1, 3]",
        "[1, 1, 3, 3",
    ],
)
def test_parse_boxes_drops_degenerate_and_non_finite_boxes(text):
    assert parse_boxes(text) == []
    assert parse_boxes(f"{text} [0, 0, 1, 1]") == [(0, 0, 1, 1)]  # the good box after it still counts


def test_parse_points_reads_every_syntax_and_skips_box_corners():
    text = (
        '[{"point_2d": [1, 2], "label": "a"}, {"point_2d": [3.5, 4]}] (5, 6) '
        "<|box_start|>(10,20),(30,40)<|box_end|> [7, 8] [NaN, 1] [1, 2, 3]"
    )
    assert parse_points(text) == [(1, 2), (3.5, 4), (5, 6), (7, 8)]


GARBAGE = [
    "",
    "no box here",
    "[",
    "[[[",
    "{bbox_2d: }",
    "<|box_start|>(1,2)<|box_end|>",
    "[1, 2, 3, 4",
    "(a,b),(c,d)",
    "<answer></answer>",
    "\x00\uffff",
    "[" * 1000,
    "1" * 5000,
]
GROUND_TRUTH = {
    "bbox": [10, 10, 50, 50],
    "region": [[[0, 0], [10, 0], [10, 10]]],
    "count": 2,
    "margin": 5,
}


@pytest.mark.parametrize("completion", GARBAGE)
@pytest.mark.parametrize("name", list(grounding.REWARDS))
def test_a_completion_without_a_box_or_point_scores_zero_without_raising(name, completion):
    sample = {**GROUND_TRUTH, "grounding": spec("relative1000", (333, 517))}
    assert grounding.REWARDS[name](completion, sample) == 0.0


# --- frames -----------------------------------------------------------------------------------------------


def test_to_model_frame_hand_computed_and_inverted_by_to_original_frame():
    # Original 200 x 100, resized 280 x 140 (x1.4 both ways). Box [10, 20, 110, 70]:
    # absolute: [10*1.4, 20*1.4, 110*1.4, 70*1.4] = [14, 28, 154, 98]
    # relative1000: [10*1000/200, 20*1000/100, 110*1000/200, 70*1000/100] = [50, 200, 550, 700]
    box, sizes = (10, 20, 110, 70), {"original_size": (200, 100), "resized_size": (280, 140)}
    expected = {"absolute": (14, 28, 154, 98), "relative1000": (50, 200, 550, 700)}
    for frame in FRAMES:
        written = to_model_frame(box, frame=frame, **sizes)
        assert written == pytest.approx(expected[frame])
        assert to_original_frame(written, frame=frame, **sizes) == pytest.approx(box)
    # a point maps the same way: (100, 50) is the centre, 500/500 on the grid
    assert to_model_frame((100, 50), frame="relative1000", original_size=(200, 100)) == (500, 500)


def test_frame_for_model_type_maps_the_qwen_families_and_names_the_flag_for_others():
    assert frame_for_model_type("qwen2_5_vl") == "absolute"
    assert {frame_for_model_type(t) for t in ("qwen2_vl", "qwen3_vl", "qwen3_vl_moe")} == {"relative1000"}
    with pytest.raises(ValueError, match="llava.*--box-frame"):
        frame_for_model_type("llava")


@pytest.mark.parametrize(
    "bad, match",
    [
        (spec("pixels", (10, 10), (28, 28)), "unknown box frame 'pixels'"),
        (spec("absolute", (10, 10)), "resized_size"),
        (spec("relative1000", (0, 10)), "original_size"),
        ({"frame": "absolute"}, "original_size"),
    ],
)
def test_a_malformed_grounding_spec_raises_even_without_a_box(bad, match):
    with pytest.raises(ValueError, match=match):
        iou_reward("no box", {"bbox": [0, 0, 1, 1], "grounding": bad})


def test_iou_hand_computed_in_each_frame():
    # Original 200 x 100, resized 280 x 140. GT [20, 10, 120, 60]. Predicted, in original pixels,
    # [0, 0, 100, 50]: intersection [20, 100] x [10, 50] = 80 * 40 = 3200;
    # union 100*50 + 100*50 - 3200 = 6800; IoU 3200 / 6800 = 8/17.
    gt = [20, 10, 120, 60]
    written = {
        "absolute": "[0, 0, 140, 70]",  # 100 * 1.4, 50 * 1.4
        "relative1000": "<|box_start|>(0,0),(500,500)<|box_end|>",  # 100/200, 50/100 of the image
    }
    for frame, text in written.items():
        sample = {"bbox": gt, "grounding": spec(frame, (200, 100), (280, 140))}
        assert iou_reward(text, sample) == pytest.approx(8 / 17)


def test_without_a_grounding_key_the_frames_are_taken_to_agree():
    # [0, 0, 2, 2] vs [1, 1, 3, 3]: intersection 1, union 4 + 4 - 1 = 7
    assert iou_reward("[0, 0, 2, 2]", {"bbox": [1, 1, 3, 3]}) == pytest.approx(1 / 7)


def test_iou_reads_the_last_box_of_the_answer():
    sample = {"bbox": [0, 0, 10, 10]}
    assert iou_reward("[0, 0, 10, 10] then [0, 0, 5, 10]", sample) == pytest.approx(0.5)
    assert iou_reward("<think>[0, 0, 5, 10]</think><answer>[0, 0, 10, 10]</answer>", sample) == 1.0


def test_degenerate_ground_truth_raises():
    with pytest.raises(ValueError, match="bbox"):
        iou_reward("[0, 0, 1, 1]", {"bbox": [1, 1, 1, 3]})
    with pytest.raises(ValueError, match="boxes entry"):
        box_iou_mean("[0, 0, 1, 1]", {"boxes": [[0, 0, 1, 1], [2, 2, 1, 1]]})


# --- the key property: one physical box, every frame, every syntax ----------------------------------------

# (original w x h, smart_resize keyword arguments, predicted physical box, ground truth), both in original
# pixels. Odd sizes on purpose: neither side is a multiple of 28, and 1001 x 77 is very elongated. The
# third case is the embedded tiny model's processor (min_pixels 3136, max_pixels 12544): 333 x 517 shrinks
# to 84 x 112.
CASES = [
    ((333, 517), {}, (50, 100, 200, 400), (40, 90, 210, 400)),
    ((1001, 77), {}, (100, 10, 700, 60), (120, 5, 650, 70)),
    ((333, 517), {"min_pixels": 3136, "max_pixels": 12544}, (50, 100, 200, 400), (40, 90, 210, 400)),
]
SYNTAXES = {"json": qwen25_json, "qwen2_tokens": qwen2_tokens}


def written_in(frame, box, original, resized):
    """`box` (original pixels) as a model in `frame` writes it, computed here from the definitions, not with
    grounding.to_model_frame: absolute x * W'/w, y * H'/h; relative1000 x * 1000/w, y * 1000/h."""
    (w, h), (rw, rh) = original, resized
    sx, sy = (rw / w, rh / h) if frame == "absolute" else (1000 / w, 1000 / h)
    x1, y1, x2, y2 = box
    return [x1 * sx, y1 * sy, x2 * sx, y2 * sy]


def resized_size(original_size, **kwargs):
    w, h = original_size
    # NOTE: transformers' smart_resize takes and returns (height, width); this file's sizes are (w, h).
    resized_h, resized_w = smart_resize(h, w, **kwargs)
    return resized_w, resized_h


def frame_table():
    """Rows (image, resized, frame, syntax, written box, IoU): the physical box of each CASE written as a
    model would (integers) in each frame and syntax, then the frame mismatch (relative numbers read as
    absolute)."""
    rows = []
    for original, kwargs, box, gt in CASES:
        resized = resized_size(original, **kwargs)
        rows.append((original, resized, "original", "-", box, box_iou(box, gt)))
        for frame, (syntax, write) in itertools.product(FRAMES, SYNTAXES.items()):
            written = [round(v) for v in written_in(frame, box, original, resized)]
            sample = {"bbox": gt, "grounding": spec(frame, original, resized)}
            rows.append((original, resized, frame, syntax, written, iou_reward(write(written), sample)))
        relative = [round(v) for v in written_in("relative1000", box, original, resized)]
        sample = {"bbox": gt, "grounding": spec("absolute", original, resized)}
        rows.append(
            (original, resized, "MISMATCH", "json", relative, iou_reward(qwen25_json(relative), sample))
        )
    return rows


def test_smart_resize_gives_the_sizes_this_file_assumes():
    # 333 -> round(333/28)=12 -> 336; 517 -> round(18.46)=18 -> 504; 1001 -> 36 -> 1008; 77 -> 3 -> 84.
    # Tiny processor: 336 * 504 > 12544, beta = sqrt(333*517/12544) = 3.705; floor(333/3.705/28) = 3 -> 84,
    # floor(517/3.705/28) = 4 -> 112.
    assert [resized_size(o, **kw) for o, kw, _, _ in CASES] == [(336, 504), (1008, 84), (84, 112)]


@pytest.mark.parametrize("original, kwargs, box, gt", CASES)
def test_the_same_physical_box_scores_the_same_iou_in_every_frame_and_syntax(original, kwargs, box, gt):
    resized = resized_size(original, **kwargs)
    truth = box_iou(box, gt)  # in original pixels: e.g. 150*300 / (150*300 + 170*310 - 150*300) = 0.8539
    for frame, write in itertools.product(FRAMES, SYNTAXES.values()):
        sample = {"bbox": gt, "grounding": spec(frame, original, resized)}
        exact = written_in(frame, box, original, resized)
        assert iou_reward(write(exact), sample) == pytest.approx(truth, abs=1e-9)
        # As a model writes it, in integers: each edge moves <= 0.5 unit, <= 2 original pixels at 84 x 112.
        assert iou_reward(write([round(v) for v in exact]), sample) == pytest.approx(truth, abs=0.03)


@pytest.mark.parametrize("original, kwargs, box, gt", CASES)
def test_relative_coordinates_read_as_absolute_give_a_clearly_lower_iou(original, kwargs, box, gt):
    resized = resized_size(original, **kwargs)
    relative = [round(v) for v in written_in("relative1000", box, original, resized)]
    mismatch = {"bbox": gt, "grounding": spec("absolute", original, resized)}
    assert iou_reward(qwen25_json(relative), mismatch) < box_iou(box, gt) / 2  # measured 0.04, 0 and 0


def test_resized_size_is_the_image_processors_grid_times_its_patch_size():
    # How the trainer gets resized_size: image_grid_thw (t, h, w) in patches, times patch_size.
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(
        str(Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen2.5-vl")
    )
    for original, _, _, _ in CASES:
        batch = processor(images=[Image.new("RGB", original)], return_tensors="np")
        _, grid_h, grid_w = batch["image_grid_thw"][0].tolist()
        size = processor.size
        expected = resized_size(original, min_pixels=size.shortest_edge, max_pixels=size.longest_edge)
        assert (grid_w * processor.patch_size, grid_h * processor.patch_size) == expected


# --- matching ---------------------------------------------------------------------------------------------


def test_optimal_assignment_equals_exhaustive_search_on_random_matrices():
    rng = random.Random(0)
    for _ in range(300):
        n, m = rng.randint(1, 5), rng.randint(1, 5)
        weights = [
            [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(m)] for _ in range(n)
        ]  # ties too
        pairs = optimal_assignment(weights)
        k = min(n, m)
        assert len(pairs) == k and len({i for i, _ in pairs}) == k and len({j for _, j in pairs}) == k
        best = max(
            sum(weights[i][j] for i, j in zip(rows, cols))
            for rows in itertools.combinations(range(n), k)
            for cols in itertools.permutations(range(m), k)
        )
        assert sum(weights[i][j] for i, j in pairs) == pytest.approx(best)


def test_box_iou_mean_matching_is_optimal_where_greedy_is_worse():
    # Every box spans y in [0, 10], so IoU is the IoU of the x intervals.
    # G1 = [0, 10], G2 = [8, 18], P1 = [2, 18], P2 = [12, 18]:
    #   P1-G1 8/18 = 0.444 (inter [2, 10], union [0, 18])   P1-G2 10/16 = 0.625
    #   P2-G1 0                                              P2-G2  6/10 = 0.6
    # Greedy takes the largest, P1-G2, then P2-G1 = 0: mean (0.625 + 0) / 2 = 0.3125.
    # Optimal: P1-G1 + P2-G2 = 4/9 + 3/5 = 47/45, mean 47/90 = 0.5222.
    sample = {"boxes": [[0, 0, 10, 10], [8, 0, 18, 10]]}
    assert box_iou_mean("[[2, 0, 18, 10], [12, 0, 18, 10]]", sample) == pytest.approx(47 / 90)


def test_box_iou_mean_counts_spare_and_missed_boxes_as_zero():
    sample = {"boxes": [[0, 0, 10, 10], [20, 0, 30, 10]]}
    assert box_iou_mean("[0, 0, 10, 10]", sample) == pytest.approx(1 / 2)  # (1 + missed 0) / 2
    assert box_iou_mean("[20, 0, 30, 10] [0, 0, 10, 10] [50, 50, 60, 60]", sample) == pytest.approx(2 / 3)
    assert box_iou_mean("[0, 0, 5, 10]", {"bbox": [0, 0, 10, 10]}) == pytest.approx(1 / 2)  # bbox as [bbox]


def test_box_f1_hand_computed():
    sample = {"boxes": [[0, 0, 10, 10], [20, 0, 30, 10], [40, 0, 50, 10]]}
    # one hit (IoU 1), one miss (IoU [20, 24] vs [20, 30]: 0.4 < 0.5), one spare, one GT unfound: 2*1/(3+3)
    assert box_f1("[0, 0, 10, 10] [20, 0, 24, 10] [60, 0, 70, 10]", sample) == pytest.approx(1 / 3)
    assert box_f1("[0, 0, 10, 10] [20, 0, 25, 10]", sample) == pytest.approx(2 * 2 / 5)  # 5/10 = 0.5 is a hit


def test_box_f1_counts_the_most_hits_even_where_the_iou_optimal_matching_has_fewer():
    # y in [0, 10] again. G1 = [0, 10], G2 = [1, 11], P1 = [0, 10], P2 = [0, 6]:
    #   P1-G1 1.0           P1-G2 9/11 = 0.818
    #   P2-G1 6/10 = 0.6    P2-G2 5/11 = 0.455 (inter [1, 6], union [0, 11])
    # Max total IoU: P1-G1 + P2-G2 = 1.455 > 0.818 + 0.6 = 1.418, but only one pair >= 0.5 there (F1 0.5);
    # P1-G2, P2-G1 has both: F1 = 2*2/(2+2) = 1.
    sample = {"boxes": [[0, 0, 10, 10], [1, 0, 11, 10]]}
    completion = "[[0, 0, 10, 10], [0, 0, 6, 10]]"
    assert box_iou_mean(completion, sample) == pytest.approx((1 + 5 / 11) / 2)
    assert box_f1(completion, sample) == 1.0


def test_multi_box_rewards_give_one_when_nothing_is_there_and_nothing_is_predicted():
    assert box_iou_mean("none", {"boxes": []}) == box_f1("none", {"boxes": []}) == 1.0
    assert box_iou_mean("[0, 0, 1, 1]", {"boxes": []}) == box_f1("[0, 0, 1, 1]", {"boxes": []}) == 0.0


# --- points and regions -----------------------------------------------------------------------------------

# A hand-drawn L (concave) with a square hole in its foot, in original pixels:
#
#   (0,30)+---+(10,30)
#         |   |
#         |   +-----------+ (30,10)        hole: [2,2]-[6,6]
#         |               |
#   (0,0) +---------------+ (30,0)
L_SHAPE = [[0, 0], [30, 0], [30, 10], [10, 10], [10, 30], [0, 30]]
HOLE = [[2, 2], [6, 2], [6, 6], [2, 6]]
REGION = {"region": [L_SHAPE, HOLE]}


def test_point_in_region_uses_the_even_odd_rule_with_holes_and_concavity():
    # (5, 20) in the upright, (20, 5) in the foot, (20, 20) in the notch (outside), (4, 4) in the hole
    # (outside), (30, 5) on an edge (inside): 3 of 5.
    completion = '[{"point_2d": [5, 20]}, {"point_2d": [20, 5]}, {"point_2d": [20, 20]}, [4, 4], (30, 5)]'
    assert point_in_region(completion, REGION) == pytest.approx(3 / 5)


def test_point_rewards_map_points_from_the_models_frame():
    # Original 300 x 300, region the square [200, 200]-[300, 300]. The point (250, 250) is (833.3, 833.3) on
    # the 0-1000 grid; the same numbers (250, 250) read on that grid are (75, 75) pixels: outside.
    sample = {"region": [[[200, 200], [300, 200], [300, 300], [200, 300]]], "bbox": [200, 200, 300, 300]}
    sample["grounding"] = spec("relative1000", (300, 300))
    for reward in (point_in_region, point_in_box):
        assert reward("(833, 833)", sample) == 1.0
        assert reward("(250, 250)", sample) == 0.0


def test_point_in_box_counts_points_inside_any_box():
    sample = {"boxes": [[0, 0, 10, 10], [20, 20, 30, 30]]}
    # (5, 5) in the first, (25, 30) on the second's edge, (15, 15) between, (40, 40) outside: 2 of 4
    assert point_in_box("(5, 5) (25, 30) (15, 15) (40, 40)", sample) == pytest.approx(1 / 2)
    assert point_in_box('{"point_2d": [1, 1]}', {"bbox": [0, 0, 2, 2]}) == 1.0


def test_negative_points_must_be_outside_the_region_and_within_the_margin():
    # (20, 20): in the notch, 10 from the nearest edges (x = 10 and y = 10 segments) -> good with margin 10.
    # (35, 5): right of the foot, 5 from the edge x = 30 -> good.   (4, 4): in the hole, 2 from it -> good.
    # (50, 50): outside, but sqrt(20^2 + 40^2) = 44.7 from the corners (30, 10) and (10, 30) -> too far.
    # (5, 20): inside -> bad.
    # (30, 5): on the edge -> bad (a negative prompt on the boundary says nothing).
    completion = "(20, 20) (35, 5) (4, 4) (50, 50) (5, 20) (30, 5)"
    assert negative_points(completion, {**REGION, "margin": 10}) == pytest.approx(3 / 6)
    # No margin: every point outside counts.
    assert negative_points(completion, REGION) == pytest.approx(4 / 6)
    assert negative_points(completion, {**REGION, "margin": 9.9}) == pytest.approx(2 / 6)  # (20, 20) too far


def test_negative_points_margin_is_in_original_pixels_whatever_the_frame():
    # Original 100 x 50, resized 200 x 100 (x2). Region: the square [10, 10]-[20, 20]; margin 5 pixels.
    # Written (50, 30) in absolute -> (25, 15) original: 5 from x = 20 -> good;
    # (52, 30) -> (26, 15): 6 from it -> bad.
    sample = {"region": [[[10, 10], [20, 10], [20, 20], [10, 20]]], "margin": 5}
    sample["grounding"] = spec("absolute", (100, 50), (200, 100))
    assert negative_points("(50, 30)", sample) == 1.0
    assert negative_points("(52, 30)", sample) == 0.0


# --- counting ---------------------------------------------------------------------------------------------


def test_count_is_exact_on_boxes_else_points_and_graded_on_request():
    sample = {"count": 3}
    assert count_reward("[0, 0, 1, 1] [1, 1, 2, 2] [2, 2, 3, 3]", sample) == 1.0
    assert count_reward("[0, 0, 1, 1] [1, 1, 2, 2]", sample) == 0.0
    assert count_reward('[{"point_2d": [1, 1]}, {"point_2d": [2, 2]}, {"point_2d": [3, 3]}]', sample) == 1.0
    assert count_reward("[0, 0, 1, 1] (5, 5) (6, 6)", sample) == 0.0  # one box: the points are not counted
    assert count_reward("nothing here", {"count": 0}) == 1.0
    # graded: 1 - |2 - 3| / 3 = 2/3; 1 - |7 - 3| / 3 < 0 -> 0; with count 0, 1 - |1 - 0| / 1 = 0
    assert count_reward("(1, 1) (2, 2)", sample, graded=True) == pytest.approx(2 / 3)
    assert count_reward(" ".join(["(1, 1)"] * 7), sample, graded=True) == 0.0
    assert count_reward("(1, 1)", {"count": 0}, graded=True) == 0.0
    with pytest.raises(ValueError, match="count"):
        count_reward("[0, 0, 1, 1]", {"count": "3"})


# --- registration -----------------------------------------------------------------------------------------


def test_grounding_rewards_load_by_name_and_score_through_rewards():
    builtins = scoring.BUILTIN_REWARDS  # as train.py and the scripts pass them
    for name, fn in grounding.REWARDS.items():
        assert plugins.reward_function(name, builtins) is fn
    with pytest.raises(ValueError, match="unknown reward"):  # rewards.py alone does not know them
        rewards.load_reward("box_f1")
    reward_list = scoring.rewards_from_flags(["box_f1", "count"], builtins=builtins)
    samples = [{"boxes": [[0, 0, 10, 10]], "count": 1}] * 2
    result = rewards.score(["[0, 0, 10, 10]", "no box"], samples, reward_list)
    assert result.total == [2.0, 0.0]
    strict = plugins.reward_function("box_f1", builtins, iou_threshold=0.9)
    assert strict("[0, 0, 8, 10]", samples[0]) == 0.0  # 0.8 < 0.9


# --- the single-box IoU (once rewards.py's `iou`) -----------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("[0, 0, 2, 2]", 1 / 7),  # intersection 1x1, union 4 + 4 - 1
        ("box: [1, 1, 3, 3]", 1.0),
        ("[0, 0, 2, 4]", 2 / 10),  # intersection 1x2, union 8 + 4 - 2
        ("[3, 3, 5, 5]", 0.0),  # touches at a corner only
        ('{"bbox_2d": [[1.0, 1.0, 2.0, 3.0]]}', 0.5),  # inside the gold box: 2 / 4
        ("<think>[9, 9, 10, 10]</think><answer>[1, 1, 3, 3]</answer>", 1.0),
    ],
)
def test_iou_hand_computed(completion, expected):
    assert math.isclose(grounding.iou_reward(completion, {"bbox": [1, 1, 3, 3]}), expected)


@pytest.mark.parametrize(
    "completion",
    [
        "no box",
        "[1, 1, 3]",
        "[1, 1, 3, 3",
        '["a", 1, 3, 3]',
        "[3, 3, 1, 1]",
        "[1, 1, 1, 3]",
        "[NaN, 1, 3, 3]",
        "[true, 1, 3, 3]",
    ],
)
def test_iou_malformed_or_degenerate_box_scores_zero(completion):
    assert grounding.iou_reward(completion, {"bbox": [1, 1, 3, 3]}) == 0.0


def test_iou_degenerate_ground_truth_raises():
    with pytest.raises(ValueError, match="bbox"):
        grounding.iou_reward("[0, 0, 1, 1]", {"bbox": [1, 1, 1, 3]})


if __name__ == "__main__":
    print("| image (w x h) | resized (smart_resize) | frame | syntax | written box | IoU |")
    print("|---|---|---|---|---|---|")
    for original, resized, frame, syntax, written, iou in frame_table():
        size = f"{original[0]} x {original[1]}"
        print(f"| {size} | {resized[0]} x {resized[1]} | {frame} | {syntax} | {list(written)} | {iou:.4f} |")
