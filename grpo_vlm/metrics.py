"""What one rollout looks like, as the scalars metrics.jsonl logs each step: reward mean and std (in total and
per reward), the share of groups with no learning signal, completion lengths, truncated and empty shares.

Legend: `B` prompts, `G` completions per prompt (the group), `N = B*G` rows, `T` completion length; rows
[g*G, (g+1)*G) are prompt g's group. Choices: population stds (N = 1 gives 0, not NaN); a group has zero
std when its G rewards are exactly equal (a computed std may round to non-zero), as grpo.group_advantages
tests it; a mean over no rows (no correct completion) is left out rather than logged as NaN.
"""

import torch


def rollout_metrics(
    rewards: torch.Tensor,
    components: dict[str, torch.Tensor],
    mask: torch.Tensor,
    truncated: torch.Tensor,
    correct: torch.Tensor | None,
    group_size: int,
) -> dict[str, float]:
    """Scalars about one rollout (tensors per row (N,), mask (N, T)); population stds, so N = 1 gives 0."""
    lengths = mask.sum(dim=1).float()  # (N,)
    metrics = {}
    for name, values in {"reward": rewards, **{f"reward/{k}": v for k, v in components.items()}}.items():
        values = values.float()
        metrics[f"{name}/mean"], metrics[f"{name}/std"] = values.mean(), values.std(correction=0)
    grouped = rewards.view(-1, group_size)  # (B, G)
    metrics["frac_zero_std_groups"] = (grouped == grouped[:, :1]).all(dim=1).float().mean()  # equal, exactly
    metrics["completion_length/mean"], metrics["completion_length/max"] = lengths.mean(), lengths.max()
    metrics["frac_truncated"] = truncated.float().mean()
    if correct is not None:
        correct = correct.bool()
        metrics["frac_correct"] = correct.float().mean()
        for key, rows in (("correct", correct), ("incorrect", ~correct)):
            if bool(rows.any()):  # else left out: a mean of no rows is NaN
                metrics[f"completion_length/{key}"] = lengths[rows].mean()
    metrics["frac_empty"] = ((lengths == 1) & ~truncated).float().mean()  # the EOS alone: said nothing
    return {key: float(value) for key, value in metrics.items()}
