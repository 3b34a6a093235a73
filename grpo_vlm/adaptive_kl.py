"""Adaptive KL: beta moves so that the measured KL stays in a band (PPO's adaptive KL penalty, Schulman et
al. 2017, "Proximal Policy Optimization Algorithms", section 4, with a band [low, high] instead of a target).

After each step the trainer hands `adapt_beta` the step's KL (the k3 estimate that grpo.grpo_loss reports)
and uses the beta it returns for the next step; checkpoints save it. Choices: beta is multiplied or divided
by one factor, never set (a bounded walk); beta = 0 stays 0 (no reference pass, no KL to measure); a
non-finite KL leaves beta as it is. Off by default (both targets None).
"""

import math
from dataclasses import dataclass


@dataclass
class AdaptiveKLConfig:
    """Adaptive KL's settings. Field names are the command line's flags."""

    kl_target_low: float | None = None
    """Adaptive KL (with --kl-target-high): divide beta by --kl-adapt-factor when the KL is below this."""
    kl_target_high: float | None = None
    """Adaptive KL: multiply beta by --kl-adapt-factor when the measured KL is above this."""
    kl_adapt_factor: float = 1.5
    """Adaptive KL: the factor beta is multiplied or divided by."""

    def check(self) -> None:
        """Raise ValueError('--flag: what is wrong, got value') for the first setting out of range."""
        if not self.kl_adapt_factor > 1:
            raise ValueError(f"--kl-adapt-factor: must be > 1, got {self.kl_adapt_factor}")
        low, high = self.kl_target_low, self.kl_target_high
        if (low is None) != (high is None):
            raise ValueError("--kl-target-low/--kl-target-high: give both or neither")
        if low is not None and not 0 <= low < high:
            raise ValueError("--kl-target-low: must be >= 0 and < --kl-target-high")


def adapt_beta(beta: float, kl: float, config: AdaptiveKLConfig) -> float:
    """Keep the KL in [kl_target_low, kl_target_high] (PPO's adaptive KL, Schulman et al. 2017, as a band).
    NOTE: beta = 0 stays 0 (no reference pass); a non-finite KL or no band (targets None) leaves it."""
    low, high, factor = config.kl_target_low, config.kl_target_high, config.kl_adapt_factor
    if low is None and high is None:
        return beta
    if low is None or high is None or not low < high or factor <= 1.0:
        raise ValueError("need kl_target_low < kl_target_high and kl_adapt_factor > 1")
    if not math.isfinite(kl) or low <= kl <= high:
        return beta
    return beta * factor if kl > high else beta / factor
