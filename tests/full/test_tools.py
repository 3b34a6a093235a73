"""tools.py: zoom crops the same original pixels from a box in every model frame, every malformed call is
answered with its error kind, plug-ins load, answer and fail as documented."""

import json
import random
import sys
from pathlib import Path

import pytest
from PIL import Image
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import rewards
from grpo_vlm import dataset, grounding, scoring, tools

TINY_CHECKPOINT = str(Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen2.5-vl")


def noise(size: tuple[int, int], seed: int = 0) -> Image.Image:
    """An image whose every pixel differs from its neighbours, so a crop one pixel off shows."""
    return Image.frombytes("RGB", size, random.Random(seed).randbytes(size[0] * size[1] * 3))


def call(name: str = "zoom", **arguments) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"some thought {tools.TOOL_CALL_START}{body}{tools.TOOL_CALL_END}"


@pytest.fixture(scope="module")
def processors():
    """The tiny model's resize rule (at most 112x112 pixels) and Qwen2-VL's (min 56*56, max 28*28*1280)."""
    qwen2_vl = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
    return {"tiny": AutoImageProcessor.from_pretrained(TINY_CHECKPOINT), "qwen2-vl": qwen2_vl}


# --- zoom in every frame ----------------------------------------------------------------------------------

# (original size, a box in original pixels)
CROPS = [((333, 517), (40, 100, 250, 300)), ((1001, 77), (100, 5, 400, 70)), ((448, 448), (0, 0, 448, 112))]


@pytest.mark.parametrize("size, box", CROPS)
@pytest.mark.parametrize(
    "frame, processor", [(None, None), ("relative1000", None), ("absolute", "tiny"), ("absolute", "qwen2-vl")]
)
def test_zoom_crops_the_same_original_pixels_from_a_box_written_in_each_frame(
    size, box, frame, processor, processors
):
    image, image_processor = noise(size), processors.get(processor)
    written = box
    if frame is not None:
        resized = dataset.resized_size(image_processor, size) if frame == "absolute" else None
        written = grounding.to_model_frame(box, frame=frame, original_size=size, resized_size=resized)
    result = tools.run_call(
        call(image=0, bbox_2d=list(written)),
        {"images": [image]},
        tools.load_tools(["zoom"]),
        frame=frame,
        image_processor=image_processor,
    )
    assert result.error is None, result.record
    [part] = result.content
    assert part["type"] == "image" and part["image"].tobytes() == image.crop(box).tobytes()
    assert result.record["images"] == [{"crop": list(box), "size": [box[2] - box[0], box[3] - box[1]]}]


def test_zoom_with_integer_coordinates_covers_the_box_they_round():
    # A model writes integers: the crop keeps every original pixel the rounded box touches.
    image, processor = noise((333, 517)), AutoImageProcessor.from_pretrained(TINY_CHECKPOINT)
    resized = dataset.resized_size(processor, image.size)  # (56, 84): about 6 original pixels a unit
    written = [
        round(v)
        for v in grounding.to_model_frame(
            (40, 100, 250, 300), frame="absolute", original_size=image.size, resized_size=resized
        )
    ]
    crop = tools.zoom(
        {"image": 0, "bbox_2d": written}, {"images": [image]}, frame="absolute", image_processor=processor
    )
    expected = grounding.to_original_frame(
        written, frame="absolute", original_size=image.size, resized_size=resized
    )
    left, top, right, bottom = crop.info["crop"]
    assert left <= expected[0] < left + 1 and top <= expected[1] < top + 1
    assert right - 1 < expected[2] <= right and bottom - 1 < expected[3] <= bottom


def test_zoom_reads_an_image_file_at_full_resolution(tmp_path, processors):
    # A file larger than the pixel budget: the crop is of the pixels on disk, not of the shrunk prompt image.
    path = tmp_path / "big.png"
    noise((600, 400)).save(path)
    crop = tools.zoom(
        {"image": 0, "bbox_2d": [0, 0, 500, 1000]}, {"images": [str(path)]}, frame="relative1000"
    )
    assert crop.size == (300, 400) and crop.tobytes() == noise((600, 400)).crop((0, 0, 300, 400)).tobytes()


# --- malformed calls --------------------------------------------------------------------------------------

ONE_IMAGE = {"images": [noise((56, 56))]}
BOX = [10, 10, 40, 40]
MALFORMED = [
    ("invalid_json", f'{tools.TOOL_CALL_START}{{"name": "zoom", "arguments": {{{tools.TOOL_CALL_END}'),
    ("invalid_json", f"{tools.TOOL_CALL_START}[0, 0, 10, 10]{tools.TOOL_CALL_END}"),
    ("invalid_json", f'{tools.TOOL_CALL_START}{{"arguments": {{}}}}{tools.TOOL_CALL_END}'),  # no name
    ("invalid_json", f'zoom {{"image": 0}}{tools.TOOL_CALL_END}'),  # no opening tag
    ("unknown_tool", call("crop", image=0, bbox_2d=BOX)),
    ("bad_arguments", f'{tools.TOOL_CALL_START}{{"name": "zoom", "arguments": [0, 1]}}{tools.TOOL_CALL_END}'),
    ("bad_arguments", f'{tools.TOOL_CALL_START}{{"name": "zoom"}}{tools.TOOL_CALL_END}'),  # no arguments
    ("bad_arguments", call(image=0)),  # missing bbox_2d
    ("bad_arguments", call(image=0, bbox_2d=BOX, scale=2)),  # extra
    ("bad_arguments", call(image=0, bbox_2d=[10, 10, 40])),
    ("bad_arguments", call(image=0, bbox_2d=[10, 10, 40, "40"])),
    ("bad_arguments", call(image=0, bbox_2d=[10, 10, 40, True])),
    ("bad_arguments", call(image=0, bbox_2d={"x1": 10})),
    ("bad_arguments", call(image=0, bbox_2d=[10, 10, 40, float("nan")])),  # json.dumps writes NaN
    ("bad_box", call(image=0, bbox_2d=[10, 10, 57, 40])),  # outside (the image is 56x56)
    ("bad_box", call(image=0, bbox_2d=[-1, 10, 40, 40])),
    ("bad_box", call(image=0, bbox_2d=[10, 10, 10, 40])),  # empty
    ("bad_box", call(image=0, bbox_2d=[40, 10, 10, 40])),  # inverted
    ("bad_image_index", call(image=1, bbox_2d=BOX)),
    ("bad_image_index", call(image=-1, bbox_2d=BOX)),
    ("bad_image_index", call(image=0.0, bbox_2d=BOX)),
    ("bad_image_index", call(image="0", bbox_2d=BOX)),
    ("bad_image_index", call(image=True, bbox_2d=BOX)),
]


@pytest.mark.parametrize("kind, text", MALFORMED)
def test_every_malformed_call_is_answered_with_its_error_kind(kind, text):
    result = tools.run_call(text, ONE_IMAGE, tools.load_tools(["zoom"]), frame=None)
    assert result.error == kind and result.record["error"] == kind
    [part] = result.content
    assert part["type"] == "text" and part["text"].startswith(f"error: {kind}: ") and "\n" not in part["text"]
    assert result.record["text"] == part["text"] and result.record["images"] == []


def test_a_crop_too_thin_for_the_image_processor_is_a_bad_box():
    image = {"images": [noise((1001, 77))]}
    result = tools.run_call(
        call(image=0, bbox_2d=[0, 0, 1000, 3]), image, tools.load_tools(["zoom"]), frame=None
    )
    assert result.error == "bad_box" and "1000x3" in result.record["text"]


def test_the_json_read_is_between_the_last_opening_tag_and_the_closing_one():
    text = f"I could write {tools.TOOL_CALL_START} here, but: {call(image=0, bbox_2d=BOX)}"
    result = tools.run_call(text, ONE_IMAGE, tools.load_tools(["zoom"]), frame=None)
    assert result.error is None and result.record["images"][0]["crop"] == BOX


# --- plug-ins ---------------------------------------------------------------------------------------------

PLUGIN_SOURCE = """
from PIL import Image

def describe(arguments, sample):
    return f"{len(sample['images'])} images, asked {arguments}"

def blank(arguments, sample):
    return Image.new("RGB", (arguments["w"], 10))

def both(arguments, sample):
    return ["before", Image.new("RGB", (5, 5)), "after"]

def divide(arguments, sample):
    return str(1 / arguments["by"])

def number(arguments, sample):
    return 42

def framed(arguments, sample, *, frame=None):
    return f"frame {frame}"

def no_sample(arguments):
    return ""

NOT_CALLABLE = 3
"""


@pytest.fixture
def plugin_file(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(PLUGIN_SOURCE)
    (tmp_path / "broken_tools.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "my_tools.py"
    for name in ("my_tools", "broken_tools", "_tool_plugin_my_tools"):
        sys.modules.pop(name, None)


def test_plugins_answer_with_text_an_image_or_a_list_of_both(plugin_file):
    loaded = tools.load_tools([f"{plugin_file}:describe", "my_tools:blank", "my_tools:both", "zoom"])
    assert list(loaded) == ["describe", "blank", "both", "zoom"]
    text = tools.run_call(call("describe", x=1), ONE_IMAGE, loaded, frame=None)
    assert text.content == [{"type": "text", "text": "1 images, asked {'x': 1}"}] and text.error is None
    image = tools.run_call(call("blank", w=7), ONE_IMAGE, loaded, frame=None)
    assert [p["image"].size for p in image.content] == [(7, 10)]
    assert image.record == {
        "name": "blank",
        "arguments": {"w": 7},
        "error": None,
        "text": "",
        "images": [{"crop": None, "size": [7, 10]}],
    }
    mixed = tools.run_call(call("both"), ONE_IMAGE, loaded, frame=None)
    assert [p["type"] for p in mixed.content] == ["text", "image", "text"]
    assert mixed.record["text"] == "beforeafter" and len(mixed.record["images"]) == 1


def test_a_plugin_declaring_frame_gets_the_models_frame(plugin_file):
    loaded = tools.load_tools(["my_tools:framed"])
    result = tools.run_call(call("framed"), ONE_IMAGE, loaded, frame="relative1000")
    assert result.content == [{"type": "text", "text": "frame relative1000"}]


def test_a_plugin_that_raises_is_answered_as_tool_raised_and_printed_once_with_its_place(plugin_file, capsys):
    loaded = tools.load_tools(["my_tools:divide"])
    for _ in range(3):
        result = tools.run_call(call("divide", by=0), ONE_IMAGE, loaded, frame=None)
        assert result.error == "tool_raised"
        assert result.record["text"] == "error: tool_raised: ZeroDivisionError: division by zero"
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and "'divide' raised ZeroDivisionError" in printed[0]
    assert "my_tools.py:14 in divide" in printed[0]
    assert tools.run_call(call("divide", by=4), ONE_IMAGE, loaded, frame=None).content[0]["text"] == "0.25"


def test_a_plugin_returning_something_else_is_answered_as_tool_raised(plugin_file):
    result = tools.run_call(call("number"), ONE_IMAGE, tools.load_tools(["my_tools:number"]), frame=None)
    assert result.error == "tool_raised" and "returned ['int']" in result.record["text"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("crop", "unknown tool 'crop'"),
        ("no_such_module_xyz:f", "could not import tool module 'no_such_module_xyz'"),
        ("broken_tools:f", "could not import tool module 'broken_tools'"),
        ("{dir}/nope.py:f", "tool file"),
        ("my_tools:missing", "is not a function of 'my_tools'"),
        ("my_tools:NOT_CALLABLE", "is not a function of 'my_tools'"),
        ("my_tools:no_sample", "must accept (arguments, sample)"),
        ("my_tools:", "must look like module:function"),
    ],
)
def test_plugin_loading_errors_are_one_line_naming_tools(plugin_file, spec, message):
    with pytest.raises(ValueError) as raised:
        tools.load_tools([spec.format(dir=plugin_file.parent)])
    text = str(raised.value)
    assert text.startswith("--tools: ") and message in text and "\n" not in text


def test_two_tools_of_one_name_are_refused(plugin_file):
    (plugin_file.parent / "other.py").write_text("def describe(arguments, sample):\n    return ''\n")
    with pytest.raises(ValueError, match="--tools: two tools are called 'describe'"):
        tools.load_tools(["my_tools:describe", f"{plugin_file.parent / 'other.py'}:describe"])


@pytest.mark.parametrize(
    "config, message",
    [
        (tools.ToolConfig(max_tool_calls=-1, tools=("zoom",)), "--max-tool-calls: must be >= 0"),
        (tools.ToolConfig(max_tool_calls=2), "--max-tool-calls: needs --tools"),
        (tools.ToolConfig(tools=("zoom",)), "--tools: needs --max-tool-calls >= 1"),
        (tools.ToolConfig(tools=("crop",), max_tool_calls=1), "--tools: unknown tool 'crop'"),
    ],
)
def test_tool_settings_are_checked_naming_the_flag(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        config.check()
    tools.ToolConfig().check()  # the default: single-turn, no tools
    tools.ToolConfig(tools=("zoom", "m:f"), max_tool_calls=3).check()


# --- the tool_format reward -------------------------------------------------------------------------------


def test_tool_format_is_the_fraction_of_well_formed_calls_and_zero_without_any(plugin_file):
    loaded = tools.load_tools(["zoom", "my_tools:divide"])
    texts = [call(image=0, bbox_2d=BOX), call(image=0, bbox_2d=[0, 0, 99, 9]), call("divide", by=0)]
    records = [tools.run_call(t, ONE_IMAGE, loaded, frame=None).record for t in texts]
    assert [r["error"] for r in records] == [None, "bad_box", "tool_raised"]
    [reward] = scoring.rewards_from_flags(["tool_format"])
    # ok, malformed, the plug-in's own failure (not the policy's): 2 of 3 well formed
    samples = [{**ONE_IMAGE, "tool_calls": records}, {**ONE_IMAGE, "tool_calls": records[1:2]}]
    samples += [{**ONE_IMAGE, "tool_calls": []}, ONE_IMAGE]  # no call; a single-turn run (no field)
    rewards.check_needs([ONE_IMAGE], [reward])  # it reads no dataset field
    assert rewards.score(["done"] * 4, samples, [reward]).total == [2 / 3, 0.0, 0.0, 0.0]


# --- the tools asset --------------------------------------------------------------------------------------

TOOLS_CHECKPOINT = Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen2.5-vl-tools"


def test_the_tools_asset_has_one_token_per_tag_and_renders_a_tool_turn_as_qwen25():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOOLS_CHECKPOINT)
    text = call(image=0, bbox_2d=BOX)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    start, end = tokenizer.convert_tokens_to_ids([tools.TOOL_CALL_START, tools.TOOL_CALL_END])
    assert ids.count(start) == ids.count(end) == 1 and ids[-1] == end
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "inspect"}]},
        {"role": "assistant", "content": text},
        {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "a crop"}]},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith(
        f"{text}<|im_end|>\n<|im_start|>user\n<tool_response>\n<|vision_start|><|image_pad|><|vision_end|>"
        "a crop\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
