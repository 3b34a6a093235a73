"""pass@k from n samples per prompt: the unbiased estimator of Chen et al. 2021 (Codex, arXiv:2107.03374).

With n completions of a prompt, c of them correct, the chance that k completions drawn from the n without
replacement hold at least one correct one is

    pass@k = 1 - C(n - c, k) / C(n, k)        (1 if n - c < k: every k-subset holds a correct one)

and its mean over prompts estimates the policy's pass@k without bias, for every k <= n, from the same n
samples. "Any of the n correct" is the k = n point only; pass@1 is the share of correct completions. A curve
pass@1..n shows what RL did: a policy that sharpens raises pass@1 and leaves pass@n where it was (or lowers
it), one that widens its reach raises pass@n too.

Choice: the ratio of binomials is computed as the product prod_{i = n-c+1}^{n} (1 - k / i), Chen et al.'s
form, which never forms a binomial (C(1000, 500) overflows a float) and is exact to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of the n completions, c of them correct, hold one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # NOTE: every k-subset holds a correct completion (and the product below would hit 0 / 0)
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (i - k) / i: each factor in (0, 1], no large integers
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_curve(correct: Sequence[int], n: int) -> list[float]:
    """[pass@1, ..., pass@n], each the mean over prompts of `pass_at_k(n, c, k)`; `correct`: c per prompt."""
    if not correct:
        raise ValueError("pass@k needs at least one prompt")
    return [sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in range(1, n + 1)]
