"""Rewards for GRPO: plain functions `fn(completion, sample) -> float`, `score` to combine them, plug-ins.

Built-ins (`BUILTIN_REWARDS`, each 1.0 or 0.0): label and format (the inspection task's verdict) and
answer_match (a normalised answer); the package grpo_vlm adds more. `sample` is the dataset's dict: a
malformed completion earns 0, malformed ground truth raises ValueError (a silent 0 would hide a broken
dataset), found when the data loads (`check_needs`).
`score`: sum(weight * value), but 0 where a gate reward is <= 0 (no credit for a right verdict in a broken
format); a reward with a keyword-only `completion_length` gets the token count. Plug-ins (`load_reward`):
`module:function` (imported from sys.path) or `path/to/file.py:function`. Stdlib only.
"""

import dataclasses
import importlib
import importlib.util
import inspect
import re
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from pathlib import Path
from typing import Any

RewardFn = Callable[..., float]

# Keys are casefolded; Chinese is unaffected by casefold, English becomes case-insensitive.
_VERDICTS = {"通过": "pass", "不通过": "fail", "pass": "pass", "fail": "fail"}
# Half- or full-width colon, then a reason with something in it: "理由:" and only spaces is no reason.
_REASON_RE = re.compile(r"理由[:：]\s*\S.*")
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


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


def answer_text(completion: str) -> str:
    """Content of the last <answer>…</answer>, else the whole completion (NOTE: also if cut: "<answer>4")."""
    blocks = _ANSWER_RE.findall(completion)
    return blocks[-1] if blocks else completion


def _normalise_answer(text: str) -> str:
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())  # "ＡＢ１\n c" -> "ab1 c"
    # str.strip takes a set of characters: the text's own whitespace and punctuation come off both ends.
    return text.strip("".join({c for c in text if c.isspace() or unicodedata.category(c).startswith("P")}))


@needs(answer=(str, int, float))
def answer_match(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 if the answer text equals sample["answer"], both normalised (NFKC: full-width -> ASCII; casefold;
    one space per whitespace run; whitespace and punctuation P*, `%` too, off both ends), else 0.0."""
    return float(_normalise_answer(answer_text(completion)) == _normalise_answer(str(sample["answer"])))


BUILTIN_REWARDS = {"label": label_reward, "format": format_reward, "answer_match": answer_match}


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


def wants_completion_length(fn: RewardFn) -> bool:
    param = inspect.signature(fn).parameters.get("completion_length")
    return param is not None and param.kind is inspect.Parameter.KEYWORD_ONLY


def describe_completion(index: int, sample: Mapping[str, Any]) -> str:  # "completion 3 (sample id 's7')"
    return f"completion {index}" + (f" (sample id {sample['id']!r})" if "id" in sample else "")


def score(
    completions: Sequence[str],
    samples: Sequence[Mapping[str, Any]],
    rewards: Sequence[Reward],
    *,
    completion_lengths: Sequence[int] | None = None,
) -> Scores:
    """Evaluate every reward on every (completion, sample) pair and combine them with weights and gates. A
    keyword-only `completion_length` gets the token count. A value that is no finite number raises."""
    n = len(completions)
    for what, given in (("samples", samples), ("completion_lengths", completion_lengths)):
        if given is not None and len(given) != n:
            raise ValueError(f"got {n} completions but {len(given)} {what}")
    if len({r.name for r in rewards}) != len(rewards):
        raise ValueError(f"reward names must be unique, got {[r.name for r in rewards]}")
    components = {r.name: [] for r in rewards}  # reward name -> (N,) unweighted values
    for r in rewards:
        wants_length = wants_completion_length(r.fn)
        if wants_length and completion_lengths is None:
            raise ValueError(f"reward {r.name!r} needs completion_lengths= (it declares completion_length)")
        for i, (completion, sample) in enumerate(zip(completions, samples)):
            kwargs = {"completion_length": completion_lengths[i]} if wants_length else {}
            try:
                value = r.fn(completion, sample, **kwargs)
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


def load_rewards(
    names: Sequence[str], weights: Sequence[float] = (), gates: Sequence[str] = ()
) -> list[Reward]:
    """A Reward per name (`load_reward`), weighted (default 1.0 each), gating where named in `gates`."""
    weights = list(weights) or [1.0] * len(names)
    return [
        Reward(name=name, fn=load_reward(name), weight=weight, gate=name in gates)
        for name, weight in zip(names, weights, strict=True)
    ]


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


def load_reward(spec: str) -> RewardFn:
    """A built-in by name, or a plug-in `module:function` (imported from sys.path) or `file.py:function`."""
    if ":" not in spec:
        if spec not in BUILTIN_REWARDS:
            plugin = "or a plug-in module:function or path/to/file.py:function"
            raise ValueError(f"unknown reward {spec!r}; built-ins are {', '.join(BUILTIN_REWARDS)}, {plugin}")
        return BUILTIN_REWARDS[spec]
    source, _, name = spec.rpartition(":")
    try:
        if source.endswith(".py"):  # a file: run it as a fresh module named after it
            module_spec = importlib.util.spec_from_file_location(Path(source).stem, source)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(source)
    except (ImportError, OSError, SyntaxError) as e:
        raise ValueError(f"reward {spec!r}: cannot import {source} ({type(e).__name__}: {e})") from e
    fn = getattr(module, name, None)
    if callable(fn):
        return fn
    raise ValueError(f"reward {spec!r}: {source} has no function {name!r}")
