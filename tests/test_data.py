"""data.py: row expansion keeps text and pixels together, placeholder counts, JSONL validation.

The tensors are checked against independent references: `repeat_rows` against preparing the repeated list of
samples, placeholder runs against the grid arithmetic written out by hand, pixel values against the
checkpoint's image processor alone on the same PIL image, and the images' effect on the model through
`grpo.completion_logprobs` on the embedded tiny Qwen2.5-VL.
"""

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import data
import model_io

ASSET = Path(__file__).resolve().parents[1] / "assets" / "tiny-qwen2.5-vl"
G = 3


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer, image_processor) of the embedded asset, loaded once for the module."""
    return model_io.load_model(str(ASSET), device="cpu", dtype=torch.float32)


def solid(width: int, height: int, colour: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (width, height), colour)


def assert_same_inputs(a: data.PromptBatch, b: data.PromptBatch) -> None:
    assert set(a.inputs) == set(b.inputs)
    for key in a.inputs:
        assert torch.equal(a.inputs[key], b.inputs[key]), key
    assert a.images_per_row == b.images_per_row


# --- row expansion ------------------------------------------------------------------------------------------


def test_repeat_rows_of_a_mixed_text_and_image_batch_equals_the_repeated_list(tiny):
    _, tok, ip = tiny
    samples = [
        {"id": "text", "prompt": "what colour and shape is this?"},
        {"id": "img", "images": [solid(56, 56, (200, 0, 0)), solid(112, 84, (0, 0, 200))], "prompt": "why?"},
        {"id": "one", "images": [solid(84, 112, (0, 200, 0))], "prompt": "what colour and shape is this?"},
    ]
    expanded = data.repeat_rows(data.prepare_prompts(samples, tok, ip, device="cpu"), G)
    reference = data.prepare_prompts([s for s in samples for _ in range(G)], tok, ip, device="cpu")
    assert_same_inputs(expanded, reference)
    assert expanded.images_per_row == [0] * G + [2] * G + [1] * G


# --- placeholders, padding, text-only -----------------------------------------------------------------------


def test_image_pad_runs_match_each_images_grid_and_padding_is_on_the_left(tiny):
    _, tok, ip = tiny
    assert ip.merge_size == 2 and ip.patch_size == 14
    # Sizes are multiples of 28 inside [min_pixels, max_pixels], so the processor does not resize: the grid is
    # (1, h/14, w/14) and each image gets h*w / (14*14*4) visual tokens. PIL sizes are (width, height).
    small, wide = solid(56, 56, (250, 0, 0)), solid(112, 84, (0, 0, 250))
    expected_grids = [[(1, 4, 4), (1, 6, 8)], [(1, 6, 8)], [(1, 4, 4)]]
    expected_tokens = [[4, 12], [12], [4]]
    samples = [
        {"id": "two", "images": [small, wide], "prompt": "inspect the installation."},
        {
            "id": "wide",
            "images": [wide],
            "prompt": "what colour and shape is this? inspect the installation.",
        },
        {"id": "small", "images": [small], "prompt": "x"},
    ]
    batch = data.prepare_prompts(samples, tok, ip, device="cpu")
    ids, mask, types = (batch.inputs[k] for k in ("input_ids", "attention_mask", "mm_token_type_ids"))
    grid = batch.inputs["image_grid_thw"]
    assert grid.tolist() == [list(g) for row in expected_grids for g in row]
    assert batch.inputs["pixel_values"].shape[0] == int(grid.prod(-1).sum())  # one line per 14x14 patch
    assert batch.images_per_row == [2, 1, 1]

    pad, start, end = (
        tok.convert_tokens_to_ids(t) for t in (data.IMAGE_PAD, data.VISION_START, data.VISION_END)
    )
    row_grids = grid.split(batch.images_per_row)
    for r in range(len(samples)):
        assert int((ids[r] == pad).sum()) == int(row_grids[r].prod(-1).sum()) // ip.merge_size**2
        # Every image is <|vision_start|>, its own run of pads, <|vision_end|>, in image order.
        real = ids[r][mask[r].bool()].tolist()
        starts = [k for k, t in enumerate(real) if t == start]
        ends = [k for k, t in enumerate(real) if t == end]
        assert [e - s - 1 for s, e in zip(starts, ends)] == expected_tokens[r]
        assert all(real[k] == pad for s, e in zip(starts, ends) for k in range(s + 1, e))
    assert torch.equal(types, (ids == pad).long())  # 1 exactly on image pads (never on padding)

    lengths = mask.sum(1)
    assert len(set(lengths.tolist())) == 3  # the rows really have different lengths
    for r, n in enumerate(lengths.tolist()):
        P = ids.shape[1]
        assert mask[r].tolist() == [0] * (P - n) + [1] * n  # zeros only on the left
        assert (ids[r, : P - n] == tok.pad_token_id).all()


def test_text_only_samples_have_no_image_inputs_and_match_the_chat_template(tiny):
    _, tok, ip = tiny
    samples = [{"id": "a", "prompt": "hello"}, {"id": "b", "prompt": "inspect the installation. answer 通过"}]
    for processor in (ip, None):  # a text-only model has no image processor
        batch = data.prepare_prompts(samples, tok, processor, device="cpu")
        assert set(batch.inputs) == {"input_ids", "attention_mask"}
        assert batch.images_per_row == [0, 0]
        for r, s in enumerate(samples):
            text = tok.apply_chat_template(
                data.sample_messages(s), tokenize=False, add_generation_prompt=True
            )
            want = tok(text, add_special_tokens=False)["input_ids"]
            row = batch.inputs["input_ids"][r][batch.inputs["attention_mask"][r].bool()]
            assert row.tolist() == want
        assert set(data.repeat_rows(batch, G).inputs) == {"input_ids", "attention_mask"}


def test_chat_template_puts_vision_markers_before_the_prompt_and_messages_form_matches(tiny):
    _, tok, ip = tiny
    images = [solid(56, 56, (1, 2, 3)), solid(56, 56, (4, 5, 6))]
    prompt_form = {"id": "p", "images": images, "prompt": "inspect the installation."}
    text = tok.apply_chat_template(
        data.sample_messages(prompt_form), tokenize=False, add_generation_prompt=True
    )
    image_part = "<|vision_start|><|image_pad|><|vision_end|>"
    assert (
        text
        == f"<|im_start|>user\n{image_part * 2}inspect the installation.<|im_end|>\n<|im_start|>assistant\n"
    )

    messages_form = {
        "id": "m",
        "images": images,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "image"},
                    {"type": "text", "text": "inspect the installation."},
                ],
            }
        ],
    }
    assert_same_inputs(
        data.prepare_prompts([prompt_form], tok, ip, device="cpu"),
        data.prepare_prompts([messages_form], tok, ip, device="cpu"),
    )


def test_more_images_than_placeholders_in_messages_raises(tiny):
    _, tok, ip = tiny
    sample = {
        "id": "m",
        "images": [solid(56, 56, (0, 0, 0))],
        "messages": [{"role": "user", "content": "hi"}],
    }
    with pytest.raises(ValueError, match="sample m.*0 image placeholders.*1 images"):
        data.prepare_prompts([sample], tok, ip, device="cpu")


# --- images as the checkpoint's processor prepares them -----------------------------------------------------


def image_in_mode(mode: str) -> Image.Image:
    """56x56 noise in `mode` (a size the tiny processor keeps); where the mode has transparency, the left half
    is fully transparent (its colours hidden) and, for RGBA and LA, the rest partly."""
    rng = np.random.default_rng(0)
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 2**16, (56, 56), dtype=np.uint16))
    if mode == "P":  # palette index 0 is transparent (PNG's tRNS), index 1 is opaque in the same colour
        indices = rng.integers(1, 16, (56, 56), dtype=np.uint8)
        indices[:, :28] = 0
        image = Image.frombytes("P", (56, 56), indices.tobytes())
        colours = rng.integers(0, 256, 15 * 3, dtype=np.uint8).tolist()
        image.putpalette(colours[:3] + colours)
        image.info["transparency"] = 0
        return image
    rgba = rng.integers(0, 256, (56, 56, 4), dtype=np.uint8)
    rgba[:, :28, 3] = 0
    return Image.fromarray(rgba).convert(mode)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "I;16"])
def test_images_reach_the_model_as_the_checkpoints_processor_prepares_them_transparency_on_white(
    tiny, tmp_path, mode
):
    _, tok, ip = tiny
    image = image_in_mode(mode)
    image.save(tmp_path / "image.png")
    with Image.open(tmp_path / "image.png") as saved:
        assert saved.mode == mode
    # The reference: the checkpoint's processor alone, on the PIL image as opened.
    reference = ip(images=[image], return_tensors="pt")["pixel_values"]
    if mode != "I;16":  # 16-bit has no transparency: both conversions agree, and the case pins that
        # PIL's convert("RGB") shows the hidden colours of transparent pixels (often black), and for a palette
        # keeps the transparent entry as a colour key, which then hides the opaque entry of the same colour.
        converted = ip(images=[image.convert("RGB")], return_tensors="pt")["pixel_values"]
        assert (reference - converted).abs().max() > 1
    for source in (image, str(tmp_path / "image.png")):  # in memory and from a file
        batch = data.prepare_prompts([{"images": [source], "prompt": "p"}], tok, ip, device="cpu")
        torch.testing.assert_close(batch.inputs["pixel_values"], reference, rtol=0, atol=1e-6)


# --- JSONL --------------------------------------------------------------------------------------------------


def write_png(path: Path, colour=(10, 20, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    solid(56, 56, colour).save(path)
    return path


GOOD = json.dumps({"id": "ok", "prompt": "fine"})


@pytest.mark.parametrize(
    ("lines", "line", "message"),
    [
        (["", "", "{not json"], "3:2", "invalid JSON"),
        ([GOOD, "[1, 2]"], 2, "must be a JSON object, got list"),
        ([GOOD, "", json.dumps({"id": "x", "images": []})], 3, "exactly one of 'prompt'"),
        ([json.dumps({"prompt": "a", "messages": [{"role": "user", "content": "a"}]})], 1, "exactly one of"),
        ([json.dumps({"prompt": "   "})], 1, "prompt: must be a non-empty string"),
        ([GOOD, json.dumps({"prompt": "a", "images": "img.png"})], 2, "images: must be a list"),
        ([json.dumps({"prompt": "a", "images": ["missing.png"]})], 1, "images: 'missing.png' not found"),
        ([json.dumps({"prompt": "a", "images": ["a\u0000b.png"]})], 1, "images: 'a\\\\x00b.png' not found"),
        (
            ['{"prompt": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"],
            1,
            "invalid JSON: maximum recursion depth",
        ),
        (
            [GOOD, '{"prompt": "ab\\ud800c"}'],
            2,
            "prompt: not valid text \\(a lone surrogate at character 3\\)",
        ),
    ],
    ids=[
        "invalid-json-after-blank-lines",
        "not-an-object",
        "no-prompt",
        "both",
        "blank-prompt",
        "images-str",
        "missing",
        "nul-byte",
        "nested-too-deep",
        "lone-surrogate",
    ],
)
def test_malformed_jsonl_line_raises_naming_file_and_line(tmp_path, lines, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:{line}: .*{message}"):
        data.read_jsonl(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "is an empty file"), (random.Random(0).randbytes(300), "cannot be decoded")],
    ids=["zero-bytes", "random-bytes"],
)
def test_unreadable_image_raises_naming_file_and_line(tiny, tmp_path, content, message):
    _, tok, ip = tiny
    write_png(tmp_path / "good.png")
    (tmp_path / "bad.png").write_bytes(content)
    path = tmp_path / "data.jsonl"
    rows = [
        {"id": "a", "images": ["good.png"], "prompt": "a"},
        {"id": "b", "images": ["bad.png"], "prompt": "b"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    samples = data.read_jsonl(path)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: image .*bad\.png {message}"):
        data.prepare_prompts(samples, tok, ip, device="cpu")


def test_a_byte_that_is_not_utf8_names_file_line_the_byte_and_its_column(tmp_path):
    path = tmp_path / "data.jsonl"
    latin1 = '{"prompt": "café"}'.encode("latin-1")  # é is the 16th character, one byte 0xe9 in Latin-1
    # Columns count characters, as in the JSON errors: 图 is one column (three bytes).
    after_chinese = '{"prompt": "图'.encode() + b"\xff" + b'"}'
    path.write_bytes(b"\n".join([GOOD.encode(), latin1, after_chinese]) + b"\n")
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(path))}:2: not UTF-8 \(byte 0xe9 at column 16\)$"
    ):
        data.read_jsonl(path)
    path.write_bytes(b"\n".join([GOOD.encode(), after_chinese]) + b"\n")
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(path))}:2: not UTF-8 \(byte 0xff at column 14\)$"
    ):
        data.read_jsonl(path)


@pytest.mark.parametrize(
    "turn",
    [
        "hello",
        {"content": "a"},
        {"role": 1, "content": "a"},
        {"role": "user"},
        {"role": "user", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},
    ],
    ids=["not-an-object", "no-role", "role-int", "no-content", "content-null", "content-entry-str"],
)
def test_a_malformed_chat_turn_is_refused_at_load_naming_its_index(tmp_path, turn):
    good = {"role": "user", "content": [{"type": "text", "text": "a"}]}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": [good, turn]}) + "\n", encoding="utf-8")
    expected = 'messages[1]: must be {"role": string, "content": string or list}'
    with pytest.raises(ValueError, match=rf"^{re.escape(f'{path}:1: {expected}')}$"):
        data.read_jsonl(path)
    path.write_text(
        json.dumps({"messages": [good, {"role": "assistant", "content": "b"}]}) + "\n", encoding="utf-8"
    )
    assert data.read_jsonl(path)[0]["messages"][1]["content"] == "b"


def test_a_byte_order_mark_at_the_start_of_a_jsonl_file_is_not_part_of_the_json(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\n")
    assert [s["id"] for s in data.read_jsonl(path)] == ["ok"]


def test_empty_or_missing_dataset_raises_naming_the_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: dataset is empty"):
        data.read_jsonl(path)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        data.read_jsonl(tmp_path / "nope.jsonl")


def test_relative_image_paths_resolve_against_the_jsonl_folder(tiny, tmp_path, monkeypatch):
    _, tok, ip = tiny
    folder = tmp_path / "dataset"
    rel = write_png(folder / "img" / "a.png", (200, 10, 10))
    absolute = write_png(tmp_path / "elsewhere" / "b.png", (10, 10, 200))
    rows = [
        {
            "id": "a",
            "images": ["img/a.png", str(absolute)],
            "prompt": "inspect the installation.",
            "label": "通过",
        }
    ]
    (folder / "data.jsonl").write_text(json.dumps(rows[0], ensure_ascii=False) + "\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # the working directory must not matter
    (sample,) = data.read_jsonl(Path("dataset") / "data.jsonl")
    assert sample["images"] == [str(rel.resolve()), str(absolute.resolve())]
    assert sample["label"] == "通过"  # other fields pass through untouched
    from_file = data.prepare_prompts([sample], tok, ip, device="cpu")
    in_memory = {
        "id": "a",
        "images": [Image.open(rel), Image.open(absolute)],
        "prompt": "inspect the installation.",
    }
    assert_same_inputs(from_file, data.prepare_prompts([in_memory], tok, ip, device="cpu"))
