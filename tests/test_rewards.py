"""Tests for rewards.py: hand-computed values for every built-in, the gate rule, plug-in loading errors."""

import math
import sys

import pytest

from rewards import (
    BUILTIN_REWARDS,
    Reward,
    answer_match,
    format_reward,
    label_reward,
    load_reward,
    score,
)

PASS = {"label": "通过"}
FAIL = {"label": "不通过"}

# --- format -----------------------------------------------------------------------------------------------


def test_format_valid_two_lines_scores_one():
    assert format_reward("通过\n理由: 图片清晰，信息完整", PASS) == 1.0


def test_format_three_lines_scores_zero():
    assert format_reward("通过\n理由: 图片清晰\n另外补充一句", PASS) == 0.0


def test_format_one_line_scores_zero():
    assert format_reward("通过", PASS) == 0.0


def test_format_extra_tokens_after_verdict_score_zero():
    assert format_reward("通过 ok\n理由: 图片清晰", PASS) == 0.0


def test_format_missing_reason_prefix_scores_zero():
    assert format_reward("通过\n图片清晰", PASS) == 0.0


def test_format_full_width_colon_scores_one():
    assert format_reward("不通过\n理由：缺少签名", FAIL) == 1.0


def test_format_trailing_whitespace_scores_one():
    assert format_reward("通过  \n理由: 图片清晰 \t\n", PASS) == 1.0


@pytest.mark.parametrize("reason_line", ["理由:", "理由：", "理由:   "])
def test_format_empty_reason_scores_zero(reason_line):
    assert format_reward(f"通过\n{reason_line}", PASS) == 0.0


@pytest.mark.parametrize("verdict", ["pass", "FAIL", "Pass", "不通过"])
def test_format_accepts_every_verdict_word(verdict):
    assert format_reward(f"{verdict}\n理由: ok", PASS) == 1.0


@pytest.mark.parametrize(
    "completion",
    [" 通过\n理由: ok", "通过\n\n理由: ok", "通过\n 理由: ok", "maybe\n理由: ok", "\n通过\n理由: ok"],
    ids=["leading-space", "blank-line-between", "indented-reason", "bad-verdict", "leading-newline"],
)
def test_format_rejects_layout_deviations(completion):
    assert format_reward(completion, PASS) == 0.0


def test_format_accepts_crlf_line_endings():
    assert format_reward("通过\r\n理由: ok\r\n", PASS) == 1.0


# --- label ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, label",
    [
        ("通过\n理由: ok", "通过"),
        ("不通过\n理由: x", "不通过"),
        ("pass", "通过"),
        ("FAIL\n理由: x", "不通过"),
        ("通过", "pass"),
    ],
)
def test_label_correct_verdict_scores_one(completion, label):
    assert label_reward(completion, {"label": label}) == 1.0


@pytest.mark.parametrize("completion", ["不通过\n理由: x", "fail", "FAIL\n"])
def test_label_wrong_verdict_scores_zero(completion):
    assert label_reward(completion, PASS) == 0.0


@pytest.mark.parametrize("completion", ["maybe\n理由: x", "通过 ok", "", "理由: 通过"])
def test_label_invalid_verdict_scores_zero(completion):
    assert label_reward(completion, PASS) == 0.0


def test_label_ignores_leading_whitespace_and_trailing_reason():
    assert label_reward("\n  通过  \n理由: ok", PASS) == 1.0


def test_label_batch_of_three_scored_as_one_zero_one():
    completions = ["通过\n理由: 清晰", "通过\n理由: 清晰", "不通过\n理由: 模糊"]
    samples = [PASS, FAIL, FAIL]
    assert score(completions, samples, [Reward("label", label_reward)]).total == [1.0, 0.0, 1.0]


def test_label_not_a_verdict_in_sample_raises():
    with pytest.raises(ValueError, match="not a verdict"):
        label_reward("通过", {"label": "ok"})


# --- normalised answers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("  The   Eiffel\nTower. ", "the eiffel tower"),
        ("PARIS!", "Paris"),
        ("「北京」。", "北京"),
        ("ＡＢＣ", "abc"),
    ],
)
def test_answer_match_normalises_case_whitespace_and_end_punctuation(completion, answer):
    assert answer_match(completion, {"answer": answer}) == 1.0


def test_answer_match_keeps_inner_punctuation_and_symbols():
    assert answer_match("U.S.A.", {"answer": "USA"}) == 0.0
    assert answer_match("$42", {"answer": "42"}) == 0.0  # "$" is a symbol (Sc), "%" would be punctuation (Po)


def test_score_requires_completion_lengths_for_length_rewards():
    def by_length(completion, sample, *, completion_length):
        return float(completion_length)

    with pytest.raises(ValueError, match="completion_lengths"):
        score(["a"], [{}], [Reward("len", by_length)])


def test_score_passes_completion_length_only_to_rewards_that_declare_it():
    def by_length(completion, sample, *, completion_length):
        return float(completion_length)

    def text_only(completion, sample):  # would raise TypeError if given completion_length
        return 1.0

    rs = [Reward("len", by_length), Reward("text", text_only)]
    scores = score(["a", "b"], [{}, {}], rs, completion_lengths=[4, 7])
    assert scores.components == {"len": [4.0, 7.0], "text": [1.0, 1.0]}


# --- combining --------------------------------------------------------------------------------------------


def test_failed_gate_zeroes_total_even_with_correct_label():
    completions = ["通过\n理由: 清晰", "通过\n清晰", "不通过\n理由: 模糊"]
    rs = [Reward("format", format_reward, weight=0.5, gate=True), Reward("label", label_reward)]
    scores = score(completions, [PASS, PASS, PASS], rs)
    assert scores.total == [1.5, 0.0, 0.5]
    assert scores.components == {"format": [1.0, 0.0, 1.0], "label": [1.0, 1.0, 0.0]}
    assert scores.gate_failed == {"format": [False, True, False]}


def test_total_is_weighted_sum_of_unweighted_components():
    rs = [Reward("a", lambda c, s: 1.0, weight=2.0), Reward("b", lambda c, s: 0.5, weight=-4.0)]
    scores = score(["x"], [{}], rs)
    assert scores.total == [0.0]  # 2 * 1 - 4 * 0.5
    assert scores.components == {"a": [1.0], "b": [0.5]}


def test_score_rejects_mismatched_samples():
    with pytest.raises(ValueError, match="2 completions but 1 samples"):
        score(["a", "b"], [PASS], [Reward("label", label_reward)])


def test_score_rejects_duplicate_reward_names():
    with pytest.raises(ValueError, match="unique"):
        score(["a"], [PASS], [Reward("label", label_reward), Reward("label", format_reward)])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None, "1.0", True])
def test_non_finite_or_non_number_reward_raises_naming_reward_and_index(bad):
    rs = [Reward("flaky", lambda c, s: bad if c == "second" else 1.0)]
    samples = [{"id": "s-0"}, {"id": "s-1"}]
    with pytest.raises(ValueError, match=r"'flaky'.*completion 1 \(sample id 's-1'\)"):
        score(["first", "second"], samples, rs)


@pytest.mark.parametrize("value", [1e39, -1e39, 10**39, 10**400], ids=["1e39", "-1e39", "10**39", "10**400"])
def test_a_reward_that_float32_cannot_hold_raises_naming_reward_and_sample(value):
    # Finite in Python, inf in the trainer's float32 reward tensor.
    rs = [Reward("huge", lambda c, s: value if c == "second" else 1.0)]
    samples = [{"id": "s-0"}, {"id": "s-1"}]
    with pytest.raises(ValueError, match=r"'huge'.*completion 1 \(sample id 's-1'\).*float32"):
        score(["first", "second"], samples, rs)


@pytest.mark.parametrize("value", [3e38, -3e38, 3.4028235e38])
def test_a_reward_that_float32_holds_is_accepted(value):
    assert score(["x"], [{}], [Reward("big", lambda c, s: value)]).total == [value]


def test_integer_reward_is_accepted_as_float():
    assert score(["x"], [{}], [Reward("int", lambda c, s: 1)]).total == [1.0]


# --- loading ----------------------------------------------------------------------------------------------

PLUGIN_SOURCE = """
def good(completion, sample):
    return float(completion == sample["answer"])

def by_length(completion, sample, *, completion_length):
    return -float(completion_length)

def one_arg(completion):
    return 1.0

not_a_function = 3
"""


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(PLUGIN_SOURCE)
    (tmp_path / "broken_syntax.py").write_text("def f(:\n")
    (tmp_path / "broken_import.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("my_rewards", "broken_syntax", "broken_import", "_reward_plugin_my_rewards"):
        sys.modules.pop(name, None)


def test_builtin_names_resolve_to_builtin_functions():
    assert list(BUILTIN_REWARDS) == ["label", "format", "answer_match"]
    assert load_reward("label") is label_reward


def test_plugin_loads_from_module_on_sys_path(plugin_dir):
    fn = load_reward("my_rewards:good")
    assert fn("42", {"answer": "42"}) == 1.0


def test_plugin_loads_from_file_path(plugin_dir):
    fn = load_reward(f"{plugin_dir / 'my_rewards.py'}:good")
    assert fn("42", {"answer": "42"}) == 1.0


def test_plugin_declaring_completion_length_gets_it_from_score(plugin_dir):
    fn = load_reward("my_rewards:by_length")
    assert score(["a"], [{}], [Reward("len", fn)], completion_lengths=[9]).total == [-9.0]


def test_unknown_builtin_lists_known_names():
    with pytest.raises(ValueError, match="unknown reward 'lable'; built-ins are label, format, answer_match"):
        load_reward("lable")


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ("nonexistent_mod_xyz:fn", ModuleNotFoundError, "No module named 'nonexistent_mod_xyz'"),
        ("broken_syntax:f", SyntaxError, "cannot import broken_syntax"),
        ("broken_import:f", ModuleNotFoundError, "No module named 'no_such_dependency_xyz'"),
    ],
)
def test_a_module_that_does_not_import_is_one_error_naming_the_reward_and_why(
    plugin_dir, spec, error, message
):
    with pytest.raises(ValueError, match=f"reward '{spec}'.*{message}") as info:
        load_reward(spec)
    assert isinstance(info.value.__cause__, error)


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(ValueError, match=r"cannot import .*nope\.py \(FileNotFoundError"):
        load_reward(f"{tmp_path / 'nope.py'}:f")


@pytest.mark.parametrize("name", ["nope", "not_a_function"])
def test_a_name_that_is_no_function_of_the_module_is_reported(plugin_dir, name):
    with pytest.raises(ValueError, match=f"reward 'my_rewards:{name}': my_rewards has no function '{name}'"):
        load_reward(f"my_rewards:{name}")


# --- portability ------------------------------------------------------------------------------------------


def test_a_reward_that_raises_is_not_swallowed_and_the_error_names_the_reward_and_sample():
    def judge(completion, sample):
        raise RuntimeError("judge model unreachable")

    with pytest.raises(RuntimeError, match="judge model unreachable") as info:
        score(["通过\n理由: ok"], [{"id": "s7", "label": "通过"}], [Reward("judge", judge)])
    assert any("reward 'judge'" in note and "'s7'" in note for note in info.value.__notes__)
