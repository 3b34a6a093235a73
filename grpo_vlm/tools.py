"""Tools the policy calls in a multi-turn rollout: parsing a call, running it, the built-in `zoom`, plug-ins.

A tool is a function `fn(arguments: dict, sample: dict) -> str | PIL.Image.Image | list` (a list of str and
images, in order): `arguments` is what the model wrote, `sample` the dataset sample of the rollout (its
images, its ground truth). Its result becomes the chat template's tool turn, which the policy reads before it
writes on. The policy writes a call in Qwen's chat format, one JSON object between two special tokens:

    <tool_call>{"name": "zoom", "arguments": {"image": 0, "bbox_2d": [x1, y1, x2, y2]}}</tool_call>

Sampling stops at `</tool_call>`; multiturn.py runs the call (`run_call`) and appends its result.

`zoom` crops image `image` (0-based, in the sample's order) at `bbox_2d`, written in the model's coordinate
frame (grounding.py: Qwen2.5-VL pixels of the RESIZED image, Qwen2-VL and Qwen3-VL a 0-1000 grid), from the
ORIGINAL image at full resolution: the detail the resize to the processor's pixel budget blurred away comes
back, and the crop itself is resized to that budget like any image. The crop keeps every original pixel the
box touches (corners floored and ceiled, after rounding off float noise).

A malformed call is answered, never raised: the tool's result is one line `error: <kind>: <why>`, which the
policy reads as the tool turn, and multiturn.py counts it (tools/errors/<kind>). A bad call is the policy's
behaviour, to be scored and learnt from like a wrong answer, not a user's mistake that should stop a run.
The kinds: invalid_json (no JSON object {"name": str, "arguments": ...} between the tags), unknown_tool,
bad_arguments (missing, extra or wrong-typed arguments), bad_box (outside the image, empty, inverted, or a
crop of an aspect ratio the image processor refuses, over 200), bad_image_index (not an int, or no such
image), and the plug-in's own failures: tool_raised, timeout, bad_output.

A plug-in that raises (or returns something other than str, an image or a list of them) is answered the
same way, as `tool_raised` with the exception's one line, and counted. The first failure of each plug-in is
printed with the traceback's last frame (file:line), so a bug is never silent; a run is not stopped,
because a tool failing on some arguments (an odd crop, a service timing out) is part of the environment the
policy acts in, and a plug-in broken for every call shows at once as tools/errors/tool_raised equal to
tools/calls. A bug in `zoom` itself is no such failure: it raises.

A plug-in is bounded (`Limits`; each call by cli.call_plugin): a call past --tool-timeout is answered as
`timeout` (the run goes on: a slow service is the environment's, like a failure); an image it returns
that the data would refuse (over --max-image-pixels, or an aspect ratio over 200, which Qwen's resize
refuses) or text that spells one of the tokenizer's special tokens (`<|im_end|>`, `<|image_pad|>`: it
would forge the chat's turns or its image placeholders) is answered as `bad_output`, never processed.
A plug-in that calls sys.exit(), raises KeyboardInterrupt or another BaseException that is no Exception
stops the run instead (cli.PluginExit, one line naming it, exit 2): it asked to end the process, which
no answer to the policy honours; a signal stops a hanging call at once (cli.Signals).

The reward `tool_format` (--reward tool_format) is the fraction of the completion's tool calls that were
well formed, from `sample["tool_calls"]` (the calls' log records, which the trainer adds in a tools run),
each with an "error" kind or None; a call whose plug-in failed (TOOL_FAILURES) counts as well formed. No call
scores 0.0, so a task that needs a tool pays for calling it; a single-turn run has no "tool_calls" and scores
0.0 too, a constant that moves no advantage.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

import data
import rewards
from grpo_vlm import cli, dataset, grounding, plugins

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"  # each ONE token in Qwen tokenizers
TOOL_FAILURES = ("tool_raised", "timeout", "bad_output")  # the plug-in's, not the policy's
ERROR_KINDS = ("invalid_json", "unknown_tool", "bad_arguments", "bad_box", "bad_image_index", *TOOL_FAILURES)
MAX_ASPECT_RATIO = 200  # Qwen-VL's smart_resize refuses images longer than this many times their width

Tool = Callable[..., "str | Image.Image | list"]


class ToolError(Exception):
    """A call the tool cannot answer with a result: `kind` is one of ERROR_KINDS, the message says why."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class ToolConfig:
    """Which tools the policy may call in a rollout, and how often. Field names are the flags."""

    tools: tuple[str, ...] = ()
    """Tools the policy may call: zoom (a crop of image i at bbox_2d, in the model's box frame, taken from
    the original image at full resolution) or a plug-in 'module:function' or 'path/to/file.py:function',
    called by its function's name: fn(arguments: dict, sample: dict) -> str | PIL.Image.Image | list."""
    max_tool_calls: int = 0
    """Most tool calls per completion; 0: single-turn rollouts, no tools."""
    tool_timeout: float | None = None
    """Seconds one call of a plug-in tool may take; a longer one is answered to the policy as a `timeout`
    error and counted (tools/errors/timeout), and the run goes on. Default: no limit. Needs SIGALRM (not
    Windows). A signal stops a run within seconds whatever a tool does, with or without it."""

    def check(self) -> None:
        """Ranges and names; plug-ins are imported and checked by `load_tools`."""
        cli.check_time_limit("--tool-timeout", self.tool_timeout)
        if self.tool_timeout is not None and not self.tools:
            raise ValueError("--tool-timeout: needs --tools (a plug-in's calls are what it bounds)")
        if self.max_tool_calls < 0:
            raise ValueError(f"--max-tool-calls: must be >= 0, got {self.max_tool_calls}")
        if self.max_tool_calls > 0 and not self.tools:
            raise ValueError("--max-tool-calls: needs --tools (e.g. --tools zoom)")
        if self.tools and self.max_tool_calls == 0:
            raise ValueError("--tools: needs --max-tool-calls >= 1 (0 means single-turn rollouts)")
        for name in self.tools:
            if name not in BUILTIN_TOOLS and ":" not in name:
                raise ValueError(
                    f"--tools: unknown tool {name!r}; built-ins are {', '.join(BUILTIN_TOOLS)}, "
                    "or give a plug-in as module:function or path/to/file.py:function"
                )


@dataclass(frozen=True)
class Limits:
    """What a plug-in's call may take and return; a breach is answered to the policy as a tool error."""

    timeout: float | None = None  # seconds per call (--tool-timeout); None: no limit
    max_image_pixels: int | None = None  # a returned image's pixels at most (--max-image-pixels)
    special_tokens: tuple[str, ...] = ()  # strings a returned text may not contain (the chat's markers)


@dataclass
class ToolResult:
    """One call's answer: the tool turn's parts, its error kind (None when it ran), and its log record."""

    content: list[dict]  # {"type": "image", "image": PIL} / {"type": "text", "text": str}, in order
    error: str | None  # None, or one of ERROR_KINDS
    record: dict  # {"name", "arguments", "error", "text", "images": [{"crop": [x1, y1, x2, y2], "size"}]}


# --- zoom -------------------------------------------------------------------------------------------------


def _image_index(arguments: dict, sample: dict) -> int:
    index, count = arguments["image"], len(sample.get("images", []))
    if type(index) is not int:  # NOTE: a bool is an int to isinstance, and 0.0 or "0" is no index
        raise ToolError("bad_image_index", f"image must be an int index, got {json.dumps(index)}")
    if not 0 <= index < count:
        raise ToolError("bad_image_index", f"image {index} does not exist; the images are 0 to {count - 1}")
    return index


def _box(value) -> tuple[float, ...]:
    numbers = value if isinstance(value, list) and len(value) == 4 else ()
    if not (numbers and all(type(v) in (int, float) and math.isfinite(v) for v in numbers)):
        raise ToolError(
            "bad_arguments", f"bbox_2d must be [x1, y1, x2, y2], four numbers; got {json.dumps(value)}"
        )
    return tuple(float(v) for v in numbers)


def zoom(arguments: dict, sample: dict, *, frame: str | None = None, image_processor=None) -> Image.Image:
    """The crop of sample["images"][arguments["image"]] at arguments["bbox_2d"] (model frame `frame`; None:
    original pixels) from the original image; `crop` ([x1, y1, x2, y2], original pixels) in its `info`."""
    if set(arguments) != {"image", "bbox_2d"}:
        raise ToolError(
            "bad_arguments", f'zoom takes "image" and "bbox_2d", got {json.dumps(sorted(arguments))}'
        )
    box = _box(arguments["bbox_2d"])
    image = data.load_image(sample["images"][_image_index(arguments, sample)], sample)  # full resolution
    w, h = image.size
    sizes = dict(original_size=(w, h))
    if frame == "absolute":
        sizes["resized_size"] = dataset.resized_size(image_processor, (w, h))
    # The box must lie inside the frame's extent of the image: (w, h) pixels, (w', h') or 1000 x 1000.
    extent = (w, h) if frame is None else grounding.to_model_frame((w, h), frame=frame, **sizes)
    if not (0 <= box[0] < box[2] <= extent[0] and 0 <= box[1] < box[3] <= extent[1]):
        why = "empty or inverted" if box[2] <= box[0] or box[3] <= box[1] else "outside the image"
        raise ToolError(
            "bad_box", f"bbox_2d {json.dumps(arguments['bbox_2d'])} is {why}: {extent_text(extent)}"
        )
    x1, y1, x2, y2 = box if frame is None else grounding.to_original_frame(box, frame=frame, **sizes)
    # Every pixel the box touches; the 1e-6 absorbs the float noise of the frame's round trip.
    left, top = math.floor(x1 + 1e-6), math.floor(y1 + 1e-6)
    right, bottom = max(math.ceil(x2 - 1e-6), left + 1), max(math.ceil(y2 - 1e-6), top + 1)
    if max(right - left, bottom - top) > MAX_ASPECT_RATIO * min(right - left, bottom - top):
        raise ToolError("bad_box", f"the crop is {right - left}x{bottom - top} pixels, too thin to process")
    crop = image.crop((left, top, right, bottom))
    crop.info["crop"] = [left, top, right, bottom]
    return crop


def extent_text(extent: Sequence[float]) -> str:
    return f"x in [0, {extent[0]:g}], y in [0, {extent[1]:g}]"


BUILTIN_TOOLS: dict[str, Tool] = {"zoom": zoom}


# --- plug-ins ---------------------------------------------------------------------------------------------


def _check_output(output: object, limits: Limits) -> None:
    """ToolError("bad_output") for an image the data would refuse or text that spells a special token."""
    for part in output if isinstance(output, list) else [output]:
        if isinstance(part, Image.Image):
            (w, h), most = part.size, limits.max_image_pixels
            if most is not None and w * h > most:
                raise ToolError("bad_output", f"the tool's image is {w}x{h}, over --max-image-pixels {most}")
            if max(w, h) > MAX_ASPECT_RATIO * min(w, h):
                raise ToolError("bad_output", f"the tool's image is {w}x{h}, too thin to process")
        elif isinstance(part, str) and (spelt := [t for t in limits.special_tokens if t in part]):
            name = spelt[0].strip("<|>")  # NOTE: the answer must not spell it either
            raise ToolError("bad_output", f"the tool's text spells a special token of the chat ({name})")


def _answering(name: str, spec: str, fn: Tool, limits: Limits) -> Tool:
    """`fn` within `limits`, any failure turned into a ToolError ("tool_raised", "timeout", "bad_output"),
    the first one raised printed with its place; sys.exit() and the like stop the run (cli.PluginExit)."""
    reported = False

    @functools.wraps(fn)
    def call(arguments: dict, sample: dict, **context):
        nonlocal reported
        try:
            output = cli.call_plugin("tool", fn, (arguments, sample), context, timeout=limits.timeout)
        except cli.PluginTimeout:
            raise ToolError("timeout", f"took longer than --tool-timeout {limits.timeout:g} s") from None
        except cli.PluginExit as e:  # the plug-in asked to end the process: its failure, the run's end
            e.user_message = f"tool {spec!r} {e}"
            raise
        except Exception as e:  # NOTE: cli.Stopped (a signal) is a SystemExit and passes
            if not reported:
                last = traceback.extract_tb(e.__traceback__)[-1]
                where = f"{last.filename}:{last.lineno} in {last.name}"
                print(
                    f"tool {name!r} raised {type(e).__name__}: {e} ({where}); each failing call is answered "
                    "as a tool_raised error and counted (printed once)",
                    flush=True,
                )
                reported = True
            raise ToolError("tool_raised", f"{type(e).__name__}: {e}".splitlines()[0]) from e
        _check_output(output, limits)
        return output

    return call


def load_tools(names: Sequence[str], limits: Limits = Limits()) -> dict[str, Tool]:
    """The model's tool name -> its function: "zoom", or a plug-in "module:function" / "file.py:function"
    called by its function's name, within `limits`. Every problem is a ValueError starting with --tools."""
    loaded = {}
    for spec in names:
        if ":" not in spec:
            if spec not in BUILTIN_TOOLS:
                raise ValueError(f"--tools: unknown tool {spec!r}; built-ins are {', '.join(BUILTIN_TOOLS)}")
            name, fn = spec, BUILTIN_TOOLS[spec]
        else:
            module_spec, _, name = spec.rpartition(":")
            if not module_spec or not name:
                raise ValueError(
                    f"--tools: {spec!r} must look like module:function or path/to/file.py:function"
                )
            try:
                with cli.plugin_import(spec):
                    module = plugins.import_plugin(module_spec, kind="tool")
            except ValueError as e:
                raise ValueError(f"--tools: {e}") from e
            fn = getattr(module, name, None)
            if not callable(fn):
                raise ValueError(f"--tools: {spec!r} is not a function of {module_spec!r}")
            try:
                inspect.signature(fn).bind({}, {})
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"--tools: {spec!r} must accept (arguments, sample) positionally ({e})"
                ) from e
            fn = _answering(name, spec, fn, limits)
        if name in loaded:
            raise ValueError(f"--tools: two tools are called {name!r}")
        loaded[name] = fn
    return loaded


# --- one call ---------------------------------------------------------------------------------------------


def _parse(call_text: str) -> tuple[str, object]:
    """(name, arguments) of the JSON between the LAST <tool_call> and the </tool_call> ending the text."""
    body = call_text.rpartition(TOOL_CALL_END)[0]
    start = body.rfind(TOOL_CALL_START)
    try:
        call = json.loads(body[start + len(TOOL_CALL_START) :]) if start >= 0 else None
    except ValueError as e:  # json.JSONDecodeError, or an int past Python's digit limit
        raise ToolError("invalid_json", f"the call is not JSON ({e})") from None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        raise ToolError("invalid_json", 'a call is {"name": "<tool>", "arguments": {...}} between the tags')
    return call["name"], call.get("arguments")


def _keywords(fn: Tool, frame: str | None, image_processor) -> dict:
    """frame= and image_processor= for a tool that declares them (zoom; a plug-in may)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in (("frame", frame), ("image_processor", image_processor)) if k in params}


def run_call(
    call_text: str, sample: dict, tools: dict[str, Tool], *, frame: str | None, image_processor=None
) -> ToolResult:
    """Run the call that ends `call_text` (the model's turn, ending with </tool_call>) and answer it: the
    result's parts, or one error line (the module docstring lists the kinds). `frame`: the model's box frame
    ("absolute", "relative1000"; None: original pixels); the absolute frame needs `image_processor`."""
    name = arguments = None
    try:
        name, arguments = _parse(call_text)
        if name not in tools:
            raise ToolError("unknown_tool", f"no tool {name!r}; the tools are {', '.join(tools)}")
        if not isinstance(arguments, dict):
            raise ToolError("bad_arguments", f"arguments must be a JSON object, got {json.dumps(arguments)}")
        fn = tools[name]
        output = fn(arguments, sample, **_keywords(fn, frame, image_processor))
        parts = output if isinstance(output, list) else [output]
        if not all(isinstance(part, str | Image.Image) for part in parts):
            kinds = sorted({type(part).__name__ for part in parts})
            raise ToolError(
                "tool_raised", f"tool {name!r} returned {kinds}, not str, PIL.Image or a list of them"
            )
    except ToolError as e:
        text = f"error: {e.kind}: {e}"
        record = {"name": name, "arguments": arguments, "error": e.kind, "text": text, "images": []}
        return ToolResult([{"type": "text", "text": text}], e.kind, record)
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts
    ]
    text = "".join(p for p in parts if isinstance(p, str))
    images = [{"crop": p.info.get("crop"), "size": list(p.size)} for p in parts if isinstance(p, Image.Image)]
    record = {"name": name, "arguments": arguments, "error": None, "text": text, "images": images}
    return ToolResult(content, None, record)


# --- the tool_format reward -------------------------------------------------------------------------------


@rewards.needs()  # reads no dataset field: the trainer adds "tool_calls" to the rows of a tools run
def tool_format(completion: str, sample: Mapping[str, Any]) -> float:
    """The fraction of the completion's tool calls that were well formed (sample["tool_calls"]); 0.0 with
    none, so that a task that needs a tool pays for calling it."""
    calls = sample.get("tool_calls") or []  # NOTE: absent in a single-turn run: no tool, no call, 0.0
    # A plug-in that fails (raises, times out, returns what cannot be shown) is the tool's failure, not a
    # malformed call.
    return sum(call["error"] in (None, *TOOL_FAILURES) for call in calls) / len(calls) if calls else 0.0
