"""Reward functions for GRPO, the gate-aware combiner, and plug-in loading.

Every reward is a pure function `fn(completion: str, sample: Mapping[str, Any]) -> float`. `sample` is the
dataset sample dict, passed through untouched, so a reward reads whatever ground truth it needs
(`sample["label"]`, `sample["answer"]`, `sample["bbox"]`). This module uses the Python standard library
only and imports nothing from the project, so it can be copied alone into another codebase.

Built-ins (`BUILTIN_REWARDS` name -> function):
    label               1 if the verdict on the first line equals `sample["label"]`, else 0. The first line
                        is read after stripping leading whitespace (strictness is `format`'s job).
    format              1 if the completion is exactly two lines: the verdict alone, then `理由:` or
                        `理由：` followed by a NON-EMPTY reason; trailing whitespace on each line and at the
                        end of the completion is allowed (trailing blank lines are not counted), leading
                        whitespace is not.
    exact_match         1 if the answer text, stripped, equals `str(sample["answer"])`, stripped.
    answer_match        the same after normalising both sides: Unicode NFKC (full-width letters and digits
                        become ASCII), casefold, whitespace runs -> one space, then strip whitespace and
                        punctuation (Unicode category P*, which includes `%`) at both ends. Inner
                        punctuation and symbols (`$`, `+`) are kept.
    numeric_match       1 if the LAST number in the answer text is within `rel_tol`/`abs_tol`
                        (`math.isclose`, both 1e-6 by default, keyword-only) of `float(sample["answer"])`.
                        Numbers are decimal or scientific (`-3`, `2.5`, `1e-3`, `1,000`); a sign counts
                        only when not glued to a preceding letter/digit, so `5-3` reads 3 and `1-5` reads 5.
                        No fractions, no words.
    think_answer_format 1 if the completion is `<think>…</think><answer>…</answer>`, whitespace allowed
                        between and around the blocks, nothing else outside, each tag exactly once, and both
                        blocks non-empty (an empty think block is a collapse we do not want to pay for).
    overlong            DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), from the completion's token
                        count L, not its text. With L_max = `max_length` and L_cache = `cache_length`:
                        0 if L <= L_max - L_cache; ((L_max - L_cache) - L) / L_cache up to L_max; -1 beyond.
                        `max_length` and `cache_length` have no defaults: bind them with `load_reward(
                        "overlong", max_length=..., cache_length=...)` or `functools.partial`.

Grounding rewards (iou, box_iou_mean, box_f1, point_in_box, point_in_region, negative_points, count) live
in grounding.py (`grounding.REWARDS`), which explains Qwen-VL's coordinate frames. A caller that wants them
by name passes `builtins={**BUILTIN_REWARDS, **grounding.REWARDS}` to `load_reward` / `parse_reward_specs`,
as train.py and the scripts do.

"Answer text" (exact_match, answer_match, numeric_match, and the grounding rewards) is the content of
the last `<answer>…</answer>` block when there is one, else the whole completion; so these compose with
`think_answer_format` and also work on bare answers.

Verdict vocabulary (label, format): `通过` / `不通过` and `pass` / `fail` (English case-insensitive), with
通过 ≡ pass and 不通过 ≡ fail. A completion with any other verdict gets 0; a sample label outside the
vocabulary is a dataset bug and raises ValueError.

Ground truth that is malformed (non-numeric answer for numeric_match, bad bbox) raises: a silent 0 would
hide a broken dataset. A malformed COMPLETION is never an error, it just earns 0.

Combining (`score`): total = sum(weight * value) over the rewards, except that if ANY gate reward of a
completion has value <= 0 its total is 0 (no credit for a right verdict in a broken format). Gates should
therefore be 0/1 rewards; never gate `overlong`, which is <= 0 by construction. `score` reports each
reward's unweighted values and which gates failed.

Plug-in contract (`load_reward("module:function")` or `load_reward("path/to/file.py:function")`): a
callable that accepts `(completion, sample)` positionally and returns a finite real number (int or float;
bool, None, NaN, inf and anything else raise ValueError naming the reward, the completion index and the
sample id). A reward that needs the completion's token count declares a KEYWORD-ONLY parameter
`completion_length`; `score` passes `completion_length=` to exactly those rewards (found with
`inspect.signature`) and to no others. Any other parameter must have a default or be bound at load time.
"""

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import traceback
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

RewardFn = Callable[..., float]

# --- verdicts ---------------------------------------------------------------------------------------------

# Keys are casefolded; Chinese is unaffected by casefold, English becomes case-insensitive.
_VERDICTS = {"通过": "pass", "不通过": "fail", "pass": "pass", "fail": "fail"}


def _parse_verdict(text: str) -> str | None:
    """'pass' / 'fail' for a verdict word (no surrounding whitespace allowed), else None."""
    return _VERDICTS.get(text.casefold())


def label_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 if the first line's verdict equals sample["label"] (通过 ≡ pass, 不通过 ≡ fail), else 0.0."""
    label = sample["label"]
    gold = _parse_verdict(str(label).strip())
    if gold is None:
        raise ValueError(f"sample label {label!r} is not a verdict; expected one of {sorted(_VERDICTS)}")
    # NOTE: leading blank lines are skipped here on purpose; penalising layout is format_reward's job.
    first_line = completion.lstrip().split("\n", 1)[0].strip()
    return float(_parse_verdict(first_line) == gold)


_REASON_RE = re.compile(r"理由[:：](.*)")  # half- or full-width colon, then the reason


def format_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 for exactly `<verdict>\\n理由: <non-empty reason>` (trailing whitespace allowed), else 0.0."""
    # NOTE: rstrip() first, so a trailing newline (or several) before EOS does not count as a third line.
    lines = completion.rstrip().split("\n")
    if len(lines) != 2:
        return 0.0
    verdict_line, reason_line = (line.rstrip() for line in lines)  # rstrip also drops '\r' of CRLF
    if _parse_verdict(verdict_line) is None:  # "通过 ok" or " 通过" are not a bare verdict
        return 0.0
    m = _REASON_RE.fullmatch(reason_line)
    # NOTE: "理由:" with nothing (or only spaces) after it fails: an empty reason is not a reason.
    return float(m is not None and m.group(1).strip() != "")


# --- answers ----------------------------------------------------------------------------------------------

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _answer_text(completion: str) -> str:
    """Content of the last <answer>…</answer> block, or the whole completion if there is none."""
    # NOTE: a truncated "<answer>42" (no closing tag) falls back to the whole completion.
    blocks = _ANSWER_RE.findall(completion)
    return blocks[-1] if blocks else completion


def exact_match(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 if the answer text equals str(sample["answer"]) after stripping both, else 0.0."""
    return float(_answer_text(completion).strip() == str(sample["answer"]).strip())


def _normalise_answer(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()  # NFKC: full-width "ＡＢ１" -> "ab1"
    text = " ".join(text.split())  # every whitespace run (incl. newlines) becomes one space
    start, end = 0, len(text)
    while start < end and (text[start].isspace() or unicodedata.category(text[start]).startswith("P")):
        start += 1
    while end > start and (text[end - 1].isspace() or unicodedata.category(text[end - 1]).startswith("P")):
        end -= 1
    return text[start:end]


def answer_match(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 if the normalised answer text equals the normalised sample["answer"], else 0.0."""
    return float(_normalise_answer(_answer_text(completion)) == _normalise_answer(str(sample["answer"])))


# Digits with optional thousands groups ("1,000" but not "1,0000"), decimals, exponent. The sign is only
# taken when not glued to a preceding ASCII letter/digit/dot, so ranges and dates do not read as negative.
_NUMBER_RE = re.compile(
    r"(?:(?<![0-9A-Za-z.])[-+])?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"
)


def _last_number(text: str) -> float | None:
    matches = _NUMBER_RE.findall(unicodedata.normalize("NFKC", text))  # NFKC: full-width digits -> ASCII
    return float(matches[-1].replace(",", "")) if matches else None


def numeric_match(
    completion: str, sample: Mapping[str, Any], *, rel_tol: float = 1e-6, abs_tol: float = 1e-6
) -> float:
    """1.0 if the last number in the answer text is close to float(sample["answer"]), else 0.0."""
    gold = float(sample["answer"])  # a non-numeric ground truth is a dataset bug: let ValueError out
    pred = _last_number(_answer_text(completion))
    return float(pred is not None and math.isclose(pred, gold, rel_tol=rel_tol, abs_tol=abs_tol))


_THINK_ANSWER_RE = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def think_answer_format(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 for `<think>…</think><answer>…</answer>` with nothing but whitespace outside, else 0.0."""
    # NOTE: the tag count check stops the lazy regex from swallowing a second "</think>" into the body.
    if any(completion.count(tag) != 1 for tag in _TAGS):
        return 0.0
    m = _THINK_ANSWER_RE.fullmatch(completion)
    return float(m is not None and m.group(1).strip() != "" and m.group(2).strip() != "")


# --- length -----------------------------------------------------------------------------------------------


def overlong_penalty(
    completion: str, sample: Mapping[str, Any], *, completion_length: int, max_length: int, cache_length: int
) -> float:
    """DAPO soft overlong punishment (eq. 13): 0, then linear to -1 over the last `cache_length` tokens."""
    if not 0 <= cache_length <= max_length:
        raise ValueError(f"need 0 <= cache_length <= max_length, got {cache_length=} {max_length=}")
    soft_limit = max_length - cache_length
    if completion_length <= soft_limit:
        return 0.0
    if completion_length <= max_length:  # cache_length > 0 here, since soft_limit < L <= max_length
        return (soft_limit - completion_length) / cache_length
    return -1.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "label": label_reward,
    "format": format_reward,
    "exact_match": exact_match,
    "answer_match": answer_match,
    "numeric_match": numeric_match,
    "think_answer_format": think_answer_format,
    "overlong": overlong_penalty,
}


# --- combining --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reward:
    name: str
    fn: RewardFn
    weight: float = 1.0
    gate: bool = False  # if this reward is <= 0 for a completion, that completion's total is 0


@dataclasses.dataclass
class Scores:
    total: list[float]  # (N,) weighted sum, zeroed where a gate failed
    components: dict[str, list[float]]  # reward name -> (N,) unweighted values
    gate_failed: dict[str, list[bool]]  # gate reward name -> (N,) value <= 0


def _wants_completion_length(fn: RewardFn) -> bool:
    param = inspect.signature(fn).parameters.get("completion_length")
    return param is not None and param.kind is inspect.Parameter.KEYWORD_ONLY


def _describe(index: int, sample: Mapping[str, Any]) -> str:
    return f"completion {index}" + (f" (sample id {sample['id']!r})" if "id" in sample else "")


def _name_the_failure(error: Exception, name: str, index: int, sample: Mapping[str, Any]) -> None:
    """Name the reward and the sample on an exception a reward function raised. `user_message` is the one
    line a command prints for it (cli.run: a failure in the user's code, not a bug of the trainer)."""
    where = f"raised by reward {name!r} on {_describe(index=index, sample=sample)}"
    error.add_note(where)
    frame = traceback.extract_tb(error.__traceback__)[-1]  # where in the user's function it failed
    error.user_message = f"{where}: {type(error).__name__}: {error} (at {frame.filename}:{frame.lineno})"


def _user_error(error: Exception) -> Exception:
    """`error`, marked to be printed by a command as its one line (cli.run), without a traceback."""
    error.user_message = str(error)
    return error


def _checked_value(value: Any, name: str, index: int, sample: Mapping[str, Any]) -> float:
    # numbers.Real admits int, float and numpy scalars; bool is an int subclass but almost always a bug
    # (a forgotten float()), and a non-finite reward would poison the group's mean and std.
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise _user_error(
        ValueError(
            f"reward {name!r} returned {value!r} ({type(value).__name__}) for {_describe(index, sample)}; "
            "rewards must return a finite int or float"
        )
    )


def score(
    completions: Sequence[str],
    samples: Sequence[Mapping[str, Any]],
    rewards: Sequence[Reward],
    *,
    completion_lengths: Sequence[int] | None = None,
) -> Scores:
    """Evaluate every reward on every (completion, sample) pair and combine them with weights and gates."""
    # NOTE: samples are NOT broadcast over the group; the trainer repeats each sample G times.
    n = len(completions)
    if len(samples) != n:
        raise ValueError(f"got {n} completions but {len(samples)} samples")
    if completion_lengths is not None and len(completion_lengths) != n:
        raise ValueError(f"got {n} completions but {len(completion_lengths)} completion_lengths")
    names = [r.name for r in rewards]
    if len(set(names)) != len(names):
        raise ValueError(f"reward names must be unique, got {names}")
    components: dict[str, list[float]] = {}
    for r in rewards:
        wants_length = _wants_completion_length(r.fn)
        if wants_length and completion_lengths is None:
            raise ValueError(f"reward {r.name!r} needs completion_lengths= (it declares completion_length)")
        values = []
        for i, (completion, sample) in enumerate(zip(completions, samples)):
            kwargs = {"completion_length": completion_lengths[i]} if wants_length else {}
            try:
                value = r.fn(completion, sample, **kwargs)
            except Exception as e:  # NOTE: not swallowed: re-raised as is, with the reward and sample named
                _name_the_failure(e, r.name, i, sample)
                raise
            values.append(_checked_value(value, r.name, i, sample))
        components[r.name] = values
    gate_failed = {r.name: [v <= 0 for v in components[r.name]] for r in rewards if r.gate}
    total = []
    for i in range(len(completions)):
        weighted = sum(r.weight * components[r.name][i] for r in rewards)
        total.append(0.0 if any(failed[i] for failed in gate_failed.values()) else float(weighted))
    return Scores(total=total, components=components, gate_failed=gate_failed)


# --- loading ----------------------------------------------------------------------------------------------


def _import_module_for(module_spec: str) -> Any:
    """Import `pkg.mod` from sys.path, or execute `path/to/file.py` as a fresh module."""
    if module_spec.endswith(".py") or "/" in module_spec or os.sep in module_spec:
        if not os.path.isfile(module_spec):
            raise ValueError(f"reward file {module_spec!r} does not exist")
        # NOTE: a private module name, so a user file called e.g. "rewards.py" cannot replace this module
        # in sys.modules; it is registered there because dataclasses and pickling look modules up by name.
        stem = os.path.splitext(os.path.basename(module_spec))[0]
        name = f"_reward_plugin_{stem}"
        spec = importlib.util.spec_from_file_location(name, module_spec)
        assert spec is not None and spec.loader is not None  # always set for an existing .py path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        imported = False
        try:
            spec.loader.exec_module(module)
            imported = True
        except (ImportError, SyntaxError) as e:
            raise ValueError(f"could not import reward file {module_spec!r}: {e}") from e
        finally:
            if not imported:  # leave no half-initialised module behind, whatever the module raised
                del sys.modules[name]
        return module
    try:
        return importlib.import_module(module_spec)
    except (ImportError, SyntaxError) as e:
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name == module_spec.split(".")[0]:
            hint = " (is its directory on sys.path? or pass a file: path/to/file.py:function)"
        raise ValueError(f"could not import reward module {module_spec!r}: {e}{hint}") from e


def _check_reward_signature(fn: RewardFn, spec: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward {spec!r}: cannot read its signature: {e}") from e
    extra = {"completion_length": 0} if _wants_completion_length(fn) else {}
    try:
        sig.bind("completion", {}, **extra)  # exactly how score() will call it
    except TypeError as e:
        raise ValueError(
            f"reward {spec!r} has signature {sig}, but must accept (completion, sample) positionally; "
            f"other parameters need defaults or must be bound when loading ({e})"
        ) from e


def load_reward(spec: str, *, builtins: Mapping[str, RewardFn] | None = None, **bind: Any) -> RewardFn:
    """A built-in by name (from `builtins`, default BUILTIN_REWARDS), or a plug-in `module:function` /
    `path/to/file.py:function`.

    Keyword arguments are bound with functools.partial, e.g. `load_reward("overlong", max_length=1024,
    cache_length=256)` or `load_reward("numeric_match", abs_tol=0.01)`. Raises ValueError with a message
    fit for a command line on any problem.
    """
    builtins = BUILTIN_REWARDS if builtins is None else builtins
    if ":" not in spec:
        if spec not in builtins:
            raise ValueError(
                f"unknown reward {spec!r}; built-ins are {', '.join(builtins)}, "
                "or give a plug-in as module:function or path/to/file.py:function"
            )
        fn = builtins[spec]
    else:
        module_spec, _, attr = spec.rpartition(":")
        if not module_spec or not attr:
            raise ValueError(f"reward {spec!r} must look like module:function or path/to/file.py:function")
        module = _import_module_for(module_spec)
        if not hasattr(module, attr):
            raise ValueError(f"reward module {module_spec!r} has no attribute {attr!r}")
        fn = getattr(module, attr)
    # ValueError rather than TypeError: this is a command-line mistake, reported like all the others.
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable (got {type(fn).__name__})")  # noqa: TRY004
    if bind:
        fn = functools.partial(fn, **bind)
    _check_reward_signature(fn, spec)
    return fn


def parse_reward_specs(
    specs: Sequence[str],
    weights: Sequence[float] | None = None,
    gates: Sequence[str] | None = None,
    builtins: Mapping[str, RewardFn] | None = None,
) -> list[Reward]:
    """Command-line lists -> Rewards: each spec is loaded with load_reward and named by its spec string.

    `weights` defaults to 1.0 each and must match `specs` in length; `gates` names which specs are gates.
    Rewards needing bound arguments (overlong) are built by the caller with load_reward(..., **bind).
    """
    weights = [1.0] * len(specs) if weights is None else list(weights)
    if len(weights) != len(specs):
        raise ValueError(f"got {len(specs)} rewards but {len(weights)} weights")
    if len(set(specs)) != len(specs):
        raise ValueError(f"rewards must be unique, got {list(specs)}")
    gates = list(gates or [])
    unknown = [g for g in gates if g not in specs]
    if unknown:
        raise ValueError(f"gates {unknown} are not among the rewards {list(specs)}")
    return [
        Reward(s, load_reward(s, builtins=builtins), float(w), s in gates) for s, w in zip(specs, weights)
    ]


@dataclasses.dataclass
class RewardConfig:
    """Which rewards score a completion, how they combine, and which one means "correct". Field names are
    the commands' flags (train.py, scripts/evaluate.py)."""

    reward: tuple[str, ...] = ()
    """Reward functions, summed with --reward-weight. REQUIRED with --data; the built-in tasks default to
    answer_match (shapes) or label and format (inspection, summaries). Built-ins, each 0 or 1 unless said:
    label: the first line's verdict (通过/不通过) equals the sample's "label";
    format: exactly two lines, a verdict, then "理由: <reason>";
    exact_match: the answer text (inside <answer>, if any) equals the sample's "answer";
    answer_match: the same after normalising case, spaces and punctuation;
    numeric_match: the last number of the answer is close to the sample's "answer";
    think_answer_format: <think>...</think><answer>...</answer> and nothing else;
    iou: IoU in [0, 1] of the answer's last box with the sample's "bbox";
    box_iou_mean, box_f1: boxes matched one-to-one with "boxes" (mean IoU; F1 at IoU 0.5);
    point_in_box, point_in_region, negative_points: points inside "bbox"/"boxes", inside the polygons
    "region", or outside them within "margin"; count: the number of boxes (or points) equals "count".
    The grounding rewards read coordinates in --box-frame and compare in original pixels (grounding.py).
    Or a plug-in 'module:function' or 'path/to/file.py:function': fn(completion, sample) -> float."""
    reward_weight: tuple[float, ...] = ()
    """One weight per --reward (default 1.0 each)."""
    gate: tuple[str, ...] = ()
    """Rewards (from --reward) that zero the total when they fail, e.g. format."""
    accuracy_reward: str | None = None
    """The reward whose value 1.0 means 'correct' (accuracy, length of correct completions). Default:
    the first --reward."""
    box_frame: Literal["auto", "absolute", "relative1000"] = "auto"
    """The grounding rewards read the model's coordinates as pixels of the resized image (Qwen2.5-VL) or a
    0-1000 grid (Qwen2-VL, Qwen3-VL); auto: from the config. Ground truth: original pixels (grounding.py)."""


def rewards_from_flags(
    names: Sequence[str],
    weights: Sequence[float] = (),
    gates: Sequence[str] = (),
    builtins: Mapping[str, RewardFn] | None = None,
) -> list[Reward]:
    """--reward, --reward-weight and --gate, as every command of this project reads them: parse_reward_specs,
    with each mistake a ValueError whose message starts with the flag at fault."""
    if weights and len(weights) != len(names):
        raise ValueError(f"--reward-weight: has {len(weights)} values for {len(names)} rewards")
    unknown = sorted(set(gates) - set(names))
    if unknown:
        raise ValueError(f"--gate: {unknown} are not among the rewards {list(names)}")
    try:
        return parse_reward_specs(list(names), list(weights) or None, list(gates) or None, builtins)
    except ValueError as e:  # a plug-in that does not import, a name that is no reward: --reward's fault
        raise ValueError(f"--reward: {e}") from e
