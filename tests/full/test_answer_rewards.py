"""grpo_vlm/answer_rewards.py: hand-computed values of the package's more answer rewards (exact_match,
numeric_match, think_answer_format); and the package's plug-in loader (plugins.reward_function): bound
arguments, signatures checked, nothing half-imported left behind."""

import functools
import sys

import pytest

from grpo_vlm import plugins, scoring
from grpo_vlm.answer_rewards import exact_match, numeric_match, think_answer_format

BUILTINS = scoring.BUILTIN_REWARDS


def test_exact_match_strips_but_is_otherwise_exact():
    assert exact_match("  Paris \n", {"answer": "Paris"}) == 1.0
    assert exact_match("paris", {"answer": "Paris"}) == 0.0
    assert exact_match("42", {"answer": 42}) == 1.0


def test_exact_match_reads_the_answer_block_when_present():
    assert exact_match("<think>maybe Rome</think><answer>Paris</answer>", {"answer": "Paris"}) == 1.0


# --- numeric ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("The answer is 3.14159", 3.14159),
        ("first 2 then 7", 7.0),
        ("total: 1,000 items", 1000.0),
        ("temperature -3", -3.0),
        ("5-3", 3.0),
        ("答案是４２", 42.0),
        ("1e-3", 1e-3),
        ("<think>maybe 5</think><answer>12</answer> then 99", 12.0),
    ],
)
def test_numeric_match_reads_last_number_or_answer_block(completion, expected):
    assert numeric_match(completion, {"answer": expected}) == 1.0


def test_numeric_match_default_tolerance_is_one_in_a_million():
    assert numeric_match("1000000.5", {"answer": 1000000}) == 1.0  # relative 5e-7
    assert numeric_match("1000002", {"answer": 1000000}) == 0.0  # relative 2e-6
    assert numeric_match("0.0000005", {"answer": 0}) == 1.0  # absolute 5e-7
    assert numeric_match("0.000002", {"answer": 0}) == 0.0


def test_numeric_match_tolerance_overridable_with_partial():
    loose = functools.partial(numeric_match, abs_tol=0.01)
    assert loose("3.145", {"answer": "3.14"}) == 1.0
    assert numeric_match("3.145", {"answer": "3.14"}) == 0.0


def test_numeric_match_without_a_number_scores_zero():
    assert numeric_match("no idea", {"answer": 3}) == 0.0


# --- think / answer format --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion", ["<think>a</think><answer>b</answer>", "\n<think>\na\n</think>\n\n<answer> b </answer>\n"]
)
def test_think_answer_format_accepts_blocks_with_whitespace(completion):
    assert think_answer_format(completion, {}) == 1.0


@pytest.mark.parametrize(
    "completion",
    [
        "so <think>a</think><answer>b</answer>",
        "<think>a</think>so<answer>b</answer>",
        "<think>a</think><answer>b</answer> done",
        "<answer>b</answer><think>a</think>",
        "<think>a</think>x</think><answer>b</answer>",
        "<think>a</think><answer>b</answer><answer>c</answer>",
        "<think>a</think><answer> </answer>",
        "<think></think><answer>b</answer>",
        "<think>a</think><answer>b",
    ],
    ids=[
        "text-before",
        "text-between",
        "text-after",
        "wrong-order",
        "extra-close",
        "two-answers",
        "empty-answer",
        "empty-think",
        "truncated",
    ],
)
def test_think_answer_format_rejects_anything_else(completion):
    assert think_answer_format(completion, {}) == 0.0


# --- loading plug-ins, as the package's command lines do ------------------------------------------------

PLUGIN_SOURCE = """
def good(completion, sample):
    return float(completion == sample["answer"])

def one_arg(completion):
    return 1.0
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


def test_the_package_names_every_builtin_answer_reward():
    assert BUILTINS["exact_match"] is exact_match and BUILTINS["numeric_match"] is numeric_match
    assert plugins.reward_function("think_answer_format", BUILTINS) is think_answer_format


def test_builtin_can_be_bound_at_load_time():
    fn = plugins.reward_function("numeric_match", BUILTINS, abs_tol=0.5)
    assert fn("3.4", {"answer": 3}) == 1.0


def test_missing_module_error_includes_original_message(plugin_dir):
    with pytest.raises(ValueError, match="No module named 'nonexistent_mod_xyz'.*sys.path") as info:
        plugins.reward_function("nonexistent_mod_xyz:fn", BUILTINS)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_module_with_syntax_error_reports_it(plugin_dir):
    with pytest.raises(ValueError, match="could not import reward module 'broken_syntax'") as info:
        plugins.reward_function("broken_syntax:f", BUILTINS)
    assert isinstance(info.value.__cause__, SyntaxError)


def test_file_with_failing_import_reports_it_and_leaves_no_module_behind(plugin_dir):
    with pytest.raises(ValueError, match="could not import reward file.*no_such_dependency_xyz"):
        plugins.reward_function(f"{plugin_dir / 'broken_import.py'}:f", BUILTINS)
    assert "_reward_plugin_broken_import" not in sys.modules


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        plugins.reward_function(f"{tmp_path / 'nope.py'}:f", BUILTINS)


def test_missing_attribute_is_reported(plugin_dir):
    with pytest.raises(ValueError, match="'my_rewards' has no attribute 'nope'"):
        plugins.reward_function("my_rewards:nope", BUILTINS)


def test_wrong_signature_is_reported(plugin_dir):
    with pytest.raises(ValueError, match=r"'my_rewards:one_arg' has signature \(completion\)"):
        plugins.reward_function("my_rewards:one_arg", BUILTINS)


@pytest.mark.parametrize("spec", ["my_rewards:", ":good"])
def test_incomplete_plugin_spec_is_reported(spec):
    with pytest.raises(ValueError, match="must look like module:function"):
        plugins.reward_function(spec, BUILTINS)
