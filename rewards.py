"""Rewards for GRPO: plain functions `fn(completion, sample) -> float`, `score` to combine them, plug-ins.

Built-ins (`BUILTIN_REWARDS`, each 1.0 or 0.0): label, format, exact_match, answer_match, numeric_match,
think_answer_format. `sample` is the dataset's dict: a malformed completion earns 0, malformed ground truth
raises ValueError (a silent 0 would hide a broken dataset), found when the data loads (`check_needs`).
`score`: sum(weight * value), but 0 where a gate reward is <= 0 (no credit for a right verdict in a broken
format); a reward with a keyword-only `completion_length` gets the token count. Plug-ins: `module:function`,
`path/to/file.py:function`. Stdlib only.
"""

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import Any

RewardFn = Callable[..., float]

# Keys are casefolded; Chinese is unaffected by casefold, English becomes case-insensitive.
_VERDICTS = {"通过": "pass", "不通过": "fail", "pass": "pass", "fail": "fail"}
# Half- or full-width colon, then a reason with something in it: "理由:" and only spaces is no reason.
_REASON_RE = re.compile(r"理由[:：]\s*\S.*")
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Digits with optional thousands groups ("1,000" but not "1,0000"), decimals, exponent. The sign is only
# taken when not glued to a preceding ASCII letter/digit/dot, so ranges and dates do not read as negative.
_NUMBER_RE = re.compile(
    r"(?:(?<![0-9A-Za-z.])[-+])?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"
)
_THINK_ANSWER_RE = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def needs(**fields: type | tuple[type, ...] | Callable[[Any], Any]) -> Callable[[RewardFn], RewardFn]:
    """Declare the sample fields a reward reads, `@needs(label=str)`, for `check_needs` when the data loads:
    each a type, a tuple of types, or a function that raises ValueError on a bad value."""

    def declare(fn: RewardFn) -> RewardFn:
        fn.needs = fields
        return fn

    return declare


def _verdict(label: Any) -> None:
    if not (isinstance(label, str) and label.strip().casefold() in _VERDICTS):
        got = f"{label!r} ({type(label).__name__})"
        raise ValueError(f"needs a verdict, one of {sorted(_VERDICTS)}; got {got}")


def _number(answer: Any) -> None:
    try:
        float(answer)
    except (TypeError, ValueError):
        raise ValueError(f"needs a number, got {answer!r}") from None


@needs(label=_verdict)
def label_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 if the first line's verdict equals sample["label"] (通过 ≡ pass, 不通过 ≡ fail), else 0.0."""
    label = sample["label"]
    gold = _VERDICTS.get(str(label).strip().casefold())
    if gold is None:
        raise ValueError(f"sample label {label!r} is not a verdict; expected one of {sorted(_VERDICTS)}")
    # NOTE: leading blank lines are skipped on purpose; penalising layout is format_reward's job.
    return float(_VERDICTS.get(completion.lstrip().split("\n", 1)[0].strip().casefold()) == gold)


def format_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 for exactly `<verdict>\\n理由: <non-empty reason>` (trailing whitespace allowed), else 0.0."""
    # NOTE: rstrip() first, so trailing newlines before EOS are no third line; then each line (CRLF's \r too).
    lines = [line.rstrip() for line in completion.rstrip().split("\n")]
    if len(lines) != 2 or lines[0].casefold() not in _VERDICTS:  # "通过 ok" or " 通过" is no bare verdict
        return 0.0
    return float(_REASON_RE.fullmatch(lines[1]) is not None)


def _answer_text(completion: str) -> str:
    """Content of the last <answer>…</answer>, else the whole completion (NOTE: also if cut: "<answer>4")."""
    blocks = _ANSWER_RE.findall(completion)
    return blocks[-1] if blocks else completion


@needs(answer=(str, int, float))
def exact_match(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 if the answer text equals str(sample["answer"]) after stripping both, else 0.0."""
    return float(_answer_text(completion).strip() == str(sample["answer"]).strip())


def _normalise_answer(text: str) -> str:
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())  # "ＡＢ１\n c" -> "ab1 c"
    # str.strip takes a set of characters: the text's own whitespace and punctuation come off both ends.
    return text.strip("".join({c for c in text if c.isspace() or unicodedata.category(c).startswith("P")}))


@needs(answer=(str, int, float))
def answer_match(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 if the answer text equals sample["answer"], both normalised (NFKC: full-width -> ASCII; casefold;
    one space per whitespace run; whitespace and punctuation P*, `%` too, off both ends), else 0.0."""
    return float(_normalise_answer(_answer_text(completion)) == _normalise_answer(str(sample["answer"])))


@needs(answer=_number)
def numeric_match(
    completion: str, sample: Mapping[str, Any], *, rel_tol: float = 1e-6, abs_tol: float = 1e-6
) -> float:
    """1.0 if the last number in the answer text is math.isclose to float(sample["answer"]), else 0.0.
    Numbers: `-3`, `2.5`, `1e-3`, `1,000`; `5-3` reads 3; no fractions or words."""
    gold = float(sample["answer"])  # a non-numeric ground truth is a dataset bug: let ValueError out
    found = _NUMBER_RE.findall(unicodedata.normalize("NFKC", _answer_text(completion)))  # full-width -> ASCII
    pred = float(found[-1].replace(",", "")) if found else None
    return float(pred is not None and math.isclose(pred, gold, rel_tol=rel_tol, abs_tol=abs_tol))


def think_answer_format(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 for `<think>…</think><answer>…</answer>`, each tag once, nothing but whitespace outside and between
    the blocks, both non-empty (an empty think block is a collapse not worth paying for); else 0.0."""
    # NOTE: the tag count check stops the lazy regex from swallowing a second "</think>" into the body.
    if any(completion.count(tag) != 1 for tag in _TAGS):
        return 0.0
    m = _THINK_ANSWER_RE.fullmatch(completion)
    return float(m is not None and m.group(1).strip() != "" and m.group(2).strip() != "")


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "label": label_reward,
    "format": format_reward,
    "exact_match": exact_match,
    "answer_match": answer_match,
    "numeric_match": numeric_match,
    "think_answer_format": think_answer_format,
}


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


class RewardValueError(ValueError):
    """A reward returned something other than a finite int or float that float32 holds."""


def _wants_completion_length(fn: RewardFn) -> bool:
    param = inspect.signature(fn).parameters.get("completion_length")
    return param is not None and param.kind is inspect.Parameter.KEYWORD_ONLY


def describe_completion(index: int, sample: Mapping[str, Any]) -> str:
    """How messages name a completion: "completion 3 (sample id 's7')"."""
    return f"completion {index}" + (f" (sample id {sample['id']!r})" if "id" in sample else "")


def score(
    completions: Sequence[str],
    samples: Sequence[Mapping[str, Any]],
    rewards: Sequence[Reward],
    *,
    completion_lengths: Sequence[int] | None = None,
    call: Callable[[Reward, int, str, Mapping[str, Any], dict[str, Any]], Any] | None = None,
) -> Scores:
    """Evaluate every reward on every (completion, sample) pair and combine them with weights and gates. A
    keyword-only `completion_length` gets the token count. `call(r, index, completion, sample, kwargs)` makes
    each call (default: `r.fn(completion, sample, **kwargs)`); the value it returns is checked here."""
    n = len(completions)
    for what, given in (("samples", samples), ("completion_lengths", completion_lengths)):
        if given is not None and len(given) != n:
            raise ValueError(f"got {n} completions but {len(given)} {what}")
    if len({r.name for r in rewards}) != len(rewards):
        raise ValueError(f"reward names must be unique, got {[r.name for r in rewards]}")
    components = {r.name: [] for r in rewards}  # reward name -> (N,) unweighted values
    for r in rewards:
        wants_length = _wants_completion_length(r.fn)
        if wants_length and completion_lengths is None:
            raise ValueError(f"reward {r.name!r} needs completion_lengths= (it declares completion_length)")
        for i, (completion, sample) in enumerate(zip(completions, samples)):
            kwargs = {"completion_length": completion_lengths[i]} if wants_length else {}
            try:
                value = call(r, i, completion, sample, kwargs) if call else r.fn(completion, sample, **kwargs)
            except Exception as e:  # NOTE: not swallowed: raised again, naming the reward and the sample
                e.add_note(f"raised by reward {r.name!r} on {describe_completion(i, sample)}")
                raise
            if isinstance(value, bool) or not (isinstance(value, Real) and abs(value) <= 3.4028235e38):
                got = f"returned {value!r} ({type(value).__name__}) for {describe_completion(i, sample)}"
                rule = "must return a finite int or float that float32 holds (|value| <= 3.4028235e38)"
                raise RewardValueError(f"reward {r.name!r} {got}; rewards {rule}")
            components[r.name].append(float(value))
    gate_failed = {r.name: [v <= 0 for v in components[r.name]] for r in rewards if r.gate}
    weighted = [float(sum(r.weight * components[r.name][i] for r in rewards)) for i in range(n)]  # (N,)
    total = [0.0 if any(failed[i] for failed in gate_failed.values()) else w for i, w in enumerate(weighted)]
    return Scores(total=total, components=components, gate_failed=gate_failed)


def _field_problem(sample: Mapping[str, Any], field: str | None, kind: Any) -> str | None:
    """What is wrong with sample[field] (None: the whole sample) for a reward that `needs` it, or None."""
    if field is not None and field not in sample:
        return "needs this field; the sample has none"
    value = sample if field is None else sample[field]
    if isinstance(kind, type | tuple):
        names = " or ".join(t.__name__ for t in (kind if isinstance(kind, tuple) else (kind,)))
        return None if isinstance(value, kind) else f"needs {names}, got {value!r} ({type(value).__name__})"
    try:
        kind(value)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def check_needs(
    samples: Sequence[Mapping[str, Any]],
    rewards: Sequence[Reward],
    *,
    locate: Callable[[Mapping[str, Any]], str] = lambda sample: f"sample {sample.get('id', '?')!r}",
) -> None:
    """Check every sample against each reward's `needs` (or a check of the whole sample) when the data loads,
    not at the step that first draws it: ValueError "data.jsonl:5: label: reward 'label': needs a verdict"."""
    for r in rewards:
        declared = getattr(getattr(r.fn, "func", r.fn), "needs", None) or {}  # a functools.partial: its fn's
        for sample in samples:
            for field, kind in ({None: declared} if callable(declared) else declared).items():
                if (problem := _field_problem(sample, field, kind)) is not None:
                    where = f"{locate(sample)}: {field}:" if field is not None else f"{locate(sample)}:"
                    raise ValueError(f"{where} reward {r.name!r}: {problem}")


def import_plugin(module_spec: str, *, kind: str = "reward") -> Any:
    """Import `pkg.mod` from sys.path, or run `path/to/file.py` as a fresh module (`kind`: what it holds)."""
    if module_spec.endswith(".py") or "/" in module_spec or os.sep in module_spec:
        if not os.path.isfile(module_spec):
            raise ValueError(f"{kind} file {module_spec!r} does not exist")
        # NOTE: in sys.modules (dataclasses, pickle look it up) under a private name: no user file clashes.
        name = f"_{kind}_plugin_{os.path.splitext(os.path.basename(module_spec))[0]}"
        spec = importlib.util.spec_from_file_location(name, module_spec)
        assert spec is not None and spec.loader is not None  # None for a suffix Python cannot import
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException as e:  # leave no half-initialised module behind, whatever the module raised
            del sys.modules[name]
            if not isinstance(e, ImportError | SyntaxError):
                raise
            raise ValueError(f"could not import {kind} file {module_spec!r}: {e}") from e
        return module
    try:
        return importlib.import_module(module_spec)
    except (ImportError, SyntaxError) as e:
        missing = isinstance(e, ModuleNotFoundError) and e.name == module_spec.split(".")[0]
        hint = " (is its directory on sys.path? or pass a file: path/to/file.py:function)" if missing else ""
        raise ValueError(f"could not import {kind} module {module_spec!r}: {e}{hint}") from e


def load_reward(spec: str, *, builtins: Mapping[str, RewardFn] = BUILTIN_REWARDS, **bind: Any) -> RewardFn:
    """A built-in by name (from `builtins`) or a plug-in, keyword arguments bound
    (`load_reward("numeric_match", rel_tol=0.01)`). Every problem is a ValueError fit for a command line."""
    if ":" not in spec:
        if spec not in builtins:
            plugin = "or give a plug-in as module:function or path/to/file.py:function"
            raise ValueError(f"unknown reward {spec!r}; built-ins are {', '.join(builtins)}, {plugin}")
        fn = builtins[spec]
    else:
        module_spec, _, attr = spec.rpartition(":")
        if not module_spec or not attr:
            raise ValueError(f"reward {spec!r} must look like module:function or path/to/file.py:function")
        module = import_plugin(module_spec)
        if not hasattr(module, attr):
            raise ValueError(f"reward module {module_spec!r} has no attribute {attr!r}")
        fn = getattr(module, attr)
    if not callable(fn):  # ValueError, not TypeError: a command-line mistake like all the others
        raise ValueError(f"reward {spec!r} is not callable (got {type(fn).__name__})")  # noqa: TRY004
    fn = functools.partial(fn, **bind) if bind else fn
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward {spec!r}: cannot read its signature: {e}") from e
    try:  # exactly how score() will call it
        sig.bind("completion", {}, **({"completion_length": 0} if _wants_completion_length(fn) else {}))
    except TypeError as e:
        how = f"reward {spec!r} has signature {sig}, but must accept (completion, sample) positionally"
        raise ValueError(f"{how}; other parameters need defaults or must be bound when loading ({e})") from e
    return fn
