"""Scoring in the package's commands (python -m grpo_vlm, scripts/evaluate.py, scripts/score_rollouts.py):
the reward flags (`RewardConfig`), every built-in by name, and user reward functions called safely.

`BUILTIN_REWARDS` is the reference's (rewards.py), then answer_rewards.py's, tools.py's `tool_format`,
grounding.py's rewards and DAPO's soft overlong penalty (`overlong_penalty`: its lengths bound by the
caller). `score` is rewards.score with each reward `bounded`: called through cli.call_plugin, under
--reward-timeout, by SIGALRM (main thread only, on POSIX; the previous SIGALRM handler and timer come back
after the call), and a call that took longer is a timeout whatever it returned (a bare `except:` around a
slow call swallows the alarm, not the clock). A failure in the user's code carries `user_message`, the one
line cli.run prints without a traceback (the user's code failed, not ours): an exception, sys.exit(),
os._exit() (cli.no_os_exit), KeyboardInterrupt or other BaseException a reward raised, with its file:line;
a value that is no number (rewards.RewardValueError); a call over the limit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import rewards
from grpo_vlm import answer_rewards, cli, grounding, plugins, tools


def overlong_penalty(
    completion: str, sample: Mapping[str, Any], *, completion_length: int, max_length: int, cache_length: int
) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) on the token count L: 0 up to L_max - L_cache,
    then ((L_max - L_cache) - L) / L_cache, -1 beyond L_max (bind max_length, cache_length when loading)."""
    if not 0 <= cache_length <= max_length:
        raise ValueError(f"need 0 <= cache_length <= max_length, got {cache_length=} {max_length=}")
    soft_limit = max_length - cache_length
    if completion_length <= soft_limit:
        return 0.0
    if completion_length <= max_length:  # cache_length > 0 here, since soft_limit < L <= max_length
        return (soft_limit - completion_length) / cache_length
    return -1.0


# --reward's names: the reference's built-ins, more answer rewards, the tools', grounding's, DAPO's penalty.
BUILTIN_REWARDS: dict[str, rewards.RewardFn] = {
    **rewards.BUILTIN_REWARDS,
    **answer_rewards.REWARDS,
    "tool_format": tools.tool_format,
    **grounding.REWARDS,
    "overlong": overlong_penalty,
}


@dataclasses.dataclass
class RewardConfig:
    """Which rewards score a completion, how they combine, and which one means "correct". Field names are
    the commands' flags (trainer.py, scripts/evaluate.py)."""

    reward: tuple[str, ...] = ()
    """Reward functions, summed with --reward-weight. REQUIRED with --data; the built-in tasks default to
    answer_match (shapes) or label and format (inspection, summaries). Built-ins, each 0 or 1 unless said:
    label: the first line's verdict (通过/不通过) equals the sample's "label";
    format: exactly two lines, a verdict, then "理由: <reason>";
    exact_match: the answer text (inside <answer>, if any) equals the sample's "answer";
    answer_match: the same after normalising case, spaces and punctuation;
    numeric_match: the last number of the answer is close to the sample's "answer";
    think_answer_format: <think>...</think><answer>...</answer> and nothing else;
    tool_format: the fraction of the completion's tool calls (--tools) that were well formed, 0 with none;
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
    reward_timeout: float | None = None
    """Seconds one reward call may take; a longer one stops the command with an error naming the reward and
    the sample (e.g. a plug-in waiting on a network judge). Default: no limit. Needs SIGALRM (not Windows)."""

    def check(self) -> None:
        """The values that need nothing loaded; the rewards themselves are checked when they load."""
        cli.check_time_limit("--reward-timeout", self.reward_timeout)


def rewards_from_flags(
    names: Sequence[str],
    weights: Sequence[float] = (),
    gates: Sequence[str] = (),
    builtins: Mapping[str, rewards.RewardFn] | None = None,
) -> list[rewards.Reward]:
    """--reward, --reward-weight and --gate, as every command of this project reads them: a rewards.Reward per
    name (plugins.reward_function over `builtins`, default BUILTIN_REWARDS), weights default 1.0 each, each
    mistake a ValueError whose message starts with the flag at fault. Rewards needing bound arguments
    (overlong) are built by the caller with plugins.reward_function(..., **bind)."""
    if weights and len(weights) != len(names):
        raise ValueError(f"--reward-weight: has {len(weights)} values for {len(names)} rewards")
    if unknown := sorted(set(gates) - set(names)):
        raise ValueError(f"--gate: {unknown} are not among the rewards {list(names)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--reward: rewards must be unique, got {list(names)}")
    builtins = BUILTIN_REWARDS if builtins is None else builtins
    loaded = []
    for name, weight in zip(names, list(weights) or [1.0] * len(names), strict=True):
        try:  # a plug-in that does not import, a name that is no reward: --reward's fault
            with cli.plugin_import(name):
                fn = plugins.reward_function(name, builtins)
        except ValueError as e:
            raise ValueError(f"--reward: {e}") from e
        loaded.append(rewards.Reward(name=name, fn=fn, weight=float(weight), gate=name in gates))
    return loaded


class RewardTimeout(TimeoutError):
    """A reward call that ran past --reward-timeout (whatever it returned or raised)."""


def bounded(r: rewards.Reward, timeout: float | None = None) -> rewards.Reward:
    """`r` whose every call goes through cli.call_plugin: within `timeout` seconds (None: no limit), and
    sys.exit(), KeyboardInterrupt or another BaseException the plug-in raised made its failure (a
    RuntimeError from it), never a result or a user's stop."""

    @functools.wraps(r.fn)  # its signature: rewards.score reads whether it takes completion_length
    def call(completion: str, sample: Mapping[str, Any], **kwargs: Any) -> Any:
        try:
            return cli.call_plugin("reward function", r.fn, (completion, sample), kwargs, timeout=timeout)
        except cli.PluginTimeout:
            error = RewardTimeout(f"reward {r.name!r} took longer than --reward-timeout {timeout} s")
            error.reward = r.name
            raise error from None
        except cli.PluginExit as e:
            raise RuntimeError(repr(e.__cause__)) from e.__cause__

    return dataclasses.replace(r, fn=call)


# `user_message`: the one line a command prints (cli.run), no traceback, as the user's code failed, not ours.
def _name_the_failure(error: Exception, where: str) -> None:
    """Set `user_message` from `where` (rewards.score's note: "raised by reward 'x' on completion 3 ...")."""
    if isinstance(error, RewardTimeout):  # "... took longer than --reward-timeout 1 s on completion 3 ..."
        error.user_message = f"{error} on {where.removeprefix(f'raised by reward {error.reward!r} on ')}"
        return
    exited = error.__cause__ is not None and not isinstance(error.__cause__, Exception)  # `bounded` made it
    cause = error.__cause__ if exited else error  # the SystemExit the plug-in raised, or what it raised
    frame = cli.plugin_frame(cause)  # where in the user's function it failed (not cli's os._exit guard)
    said = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    at = f" (at {frame.filename}:{frame.lineno})" if frame is not None else ""
    error.user_message = f"{where}: {said}{at}"


def score(
    completions: Sequence[str],
    samples: Sequence[Mapping[str, Any]],
    reward_fns: Sequence[rewards.Reward],
    *,
    completion_lengths: Sequence[int] | None = None,
    timeout: float | None = None,
) -> rewards.Scores:
    """rewards.score with every reward `bounded` (`timeout`: --reward-timeout, None: no limit); a failure of
    the user's code (it raised, exited, ran too long, returned no number) carries its `user_message`."""
    calls = [bounded(r, timeout) for r in reward_fns]
    try:
        return rewards.score(completions, samples, calls, completion_lengths=completion_lengths)
    except rewards.RewardValueError as e:
        e.user_message = str(e)
        raise
    except Exception as e:
        notes = getattr(e, "__notes__", [])  # rewards.score's: which reward, on which completion
        if notes and notes[-1].startswith("raised by reward "):
            _name_the_failure(e, notes[-1])
        raise
