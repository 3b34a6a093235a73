"""Tests for grpo_vlm/scoring.py: the package's built-ins by name, the reward flags, and user reward functions
called through rewards.score with one-line failures (time limits: test_input_checks.py)."""

import functools
import math
import sys

import pytest

import rewards
from grpo_vlm import answer_rewards, cli, grounding, plugins, scoring, tools
from rewards import Reward, format_reward, label_reward


def test_builtins_are_the_references_then_the_answers_tool_format_and_groundings():
    expected = [
        *rewards.BUILTIN_REWARDS,
        *answer_rewards.REWARDS,
        "tool_format",
        *grounding.REWARDS,
        "overlong",
    ]
    assert list(scoring.BUILTIN_REWARDS) == expected
    assert scoring.BUILTIN_REWARDS["tool_format"] is tools.tool_format


@pytest.mark.parametrize(
    "weights, gates, spec, message",
    [
        ([1.0], (), "label", r"^--reward-weight: has 1 values for 2 rewards"),
        ((), ["iou"], "label", r"^--gate: \['iou'\] are not among the rewards"),
        ((), (), "no_such_reward", r"^--reward: .*no_such_reward"),
    ],
)
def test_rewards_from_flags_name_the_flag_at_fault(weights, gates, spec, message):
    with pytest.raises(ValueError, match=message):
        scoring.rewards_from_flags(["format", spec], weights, gates)


def test_rewards_from_flags_builds_weighted_gated_rewards():
    rs = scoring.rewards_from_flags(["format", "label"], [0.5, 1.0], ["format"])
    assert rs == [Reward("format", format_reward, 0.5, True), Reward("label", label_reward, 1.0, False)]


def test_a_plug_in_that_raises_fails_with_one_line_naming_the_reward_sample_and_line():
    def judge(completion, sample):
        raise RuntimeError("judge model unreachable")

    with pytest.raises(RuntimeError, match="judge model unreachable") as info:
        scoring.score(["x"], [{"id": "s7"}], [Reward("judge", judge)])
    where = f"{__file__}:{judge.__code__.co_firstlineno + 1}"
    assert info.value.user_message == (
        f"raised by reward 'judge' on completion 0 (sample id 's7'): RuntimeError: judge model unreachable "
        f"(at {where})"
    )
    assert info.value.__notes__ == ["raised by reward 'judge' on completion 0 (sample id 's7')"]


@pytest.mark.parametrize("code", [0, "judge unavailable"])
def test_a_plug_in_that_calls_sys_exit_fails_like_one_that_raises_naming_the_sample_and_line(code):
    def quits(completion, sample):
        if completion == "second":
            sys.exit(code)  # 0 would end a training run with status 0, as a success
        return 1.0

    samples = [{"id": "s-0"}, {"id": "s-1"}]
    with pytest.raises(RuntimeError) as info:
        scoring.score(["first", "second"], samples, [Reward("quits", quits)])
    where = f"{__file__}:{quits.__code__.co_firstlineno + 2}"
    assert info.value.user_message == (
        f"raised by reward 'quits' on completion 1 (sample id 's-1'): SystemExit: {code} (at {where})"
    )


@pytest.mark.parametrize("stop", [cli.Stopped("stopped by SIGINT"), KeyboardInterrupt()])
def test_a_signals_stop_inside_a_plug_in_passes_through_score_untouched(stop):
    # A signal's handler raises in whatever frame runs, a plug-in's too: a stop, not the plug-in's failure.
    def interrupted(completion, sample):
        raise stop

    with pytest.raises(type(stop)) as info:
        scoring.score(["x"], [{}], [Reward("slow", interrupted)])
    assert info.value is stop and not hasattr(stop, "user_message")


def test_a_value_float32_cannot_hold_fails_with_its_message_as_the_one_line():
    with pytest.raises(rewards.RewardValueError, match=r"'huge'.*completion 0.*float32") as info:
        scoring.score(["x"], [{}], [Reward("huge", lambda c, s: 1e39)])
    assert info.value.user_message == str(info.value)
    assert not hasattr(info.value, "__notes__")  # the value is wrong; the reward raised nothing


# --- DAPO's overlong penalty ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, expected",
    [(10, 0.0), (15, 0.0), (16, -0.2), (17, -0.4), (20, -1.0), (21, -1.0), (500, -1.0)],
)
def test_overlong_penalty_zero_then_ramp_then_minus_one(length, expected):
    # max_length 20, cache 5: free up to 15 tokens, then (15 - L) / 5, then -1 past 20.
    value = scoring.overlong_penalty("ignored", {}, completion_length=length, max_length=20, cache_length=5)
    assert math.isclose(value, expected)


def test_overlong_penalty_receives_token_counts_through_score():
    fn = plugins.reward_function("overlong", scoring.BUILTIN_REWARDS, max_length=20, cache_length=5)
    scores = rewards.score(
        ["a", "b", "c"], [{}] * 3, [Reward("overlong", fn)], completion_lengths=[3, 17, 40]
    )
    assert scores.components["overlong"] == pytest.approx([0.0, -0.4, -1.0])


def test_overlong_without_bound_lengths_fails_at_load_time():
    with pytest.raises(ValueError, match="bound when loading"):
        plugins.reward_function("overlong", scoring.BUILTIN_REWARDS)


def test_a_bound_overlong_penalty_needs_completion_lengths():
    fn = functools.partial(scoring.overlong_penalty, max_length=20, cache_length=5)
    with pytest.raises(ValueError, match="completion_lengths"):
        rewards.score(["a"], [{}], [Reward("overlong", fn)])
