"""More built-in answer rewards for the package's commands (`--reward exact_match`, ...), beside the
reference's label, format and answer_match (rewards.py), in the same form: `fn(completion, sample) -> float`,
the answer text read from the last <answer>...</answer> block if there is one (rewards.answer_text).

- exact_match: the answer text equals str(sample["answer"]) after stripping both;
- numeric_match: the last number of the answer text is math.isclose to float(sample["answer"]);
- think_answer_format: exactly <think>...</think><answer>...</answer>, both non-empty (R1's format).
"""

import math
import re
import unicodedata
from collections.abc import Mapping
from typing import Any

import rewards

# Digits with optional thousands groups ("1,000" but not "1,0000"), decimals, exponent. The sign is only
# taken when not glued to a preceding ASCII letter/digit/dot, so ranges and dates do not read as negative.
_NUMBER_RE = re.compile(
    r"(?:(?<![0-9A-Za-z.])[-+])?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"
)

_THINK_ANSWER_RE = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def _number(answer: Any) -> None:
    try:
        float(answer)
    except (TypeError, ValueError):
        raise ValueError(f"needs a number, got {answer!r}") from None


@rewards.needs(answer=(str, int, float))
def exact_match(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 if the answer text equals str(sample["answer"]) after stripping both, else 0.0."""
    return float(rewards.answer_text(completion).strip() == str(sample["answer"]).strip())


@rewards.needs(answer=_number)
def numeric_match(
    completion: str, sample: Mapping[str, Any], *, rel_tol: float = 1e-6, abs_tol: float = 1e-6
) -> float:
    """1.0 if the last number in the answer text is math.isclose to float(sample["answer"]), else 0.0.
    Numbers: `-3`, `2.5`, `1e-3`, `1,000`; `5-3` reads 3; no fractions or words."""
    gold = float(sample["answer"])  # a non-numeric ground truth is a dataset bug: let ValueError out
    found = _NUMBER_RE.findall(
        unicodedata.normalize("NFKC", rewards.answer_text(completion))
    )  # full-width -> ASCII
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


REWARDS = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "think_answer_format": think_answer_format,
}
