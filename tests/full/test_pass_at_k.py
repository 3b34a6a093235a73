"""pass_at_k.py: the unbiased pass@k estimator against hand-computed values, an enumeration of every k-subset,
exact binomials where they fit, and its product form where they do not."""

import itertools
import math
from fractions import Fraction

import pytest

from grpo_vlm.pass_at_k import pass_at_k, pass_at_k_curve


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 1 / 4),  # one correct of four: pass@1 is the share correct
        (4, 1, 2, 1 / 2),  # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
        (4, 1, 3, 3 / 4),  # 1 - C(3, 3) / C(4, 3) = 1 - 1/4
        (4, 1, 4, 1.0),  # any of the four
        (5, 2, 2, 7 / 10),  # 1 - C(3, 2) / C(5, 2) = 1 - 3/10
        (8, 3, 4, 13 / 14),  # 1 - C(5, 4) / C(8, 4) = 1 - 5/70
        (10, 0, 5, 0.0),  # none correct: never
        (10, 10, 1, 1.0),  # all correct: always
    ],
)
def test_pass_at_k_equals_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def enumerated(n: int, c: int, k: int) -> Fraction:
    """The share of the C(n, k) k-subsets of n completions (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in subset) for subset in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_correct_completion(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(enumerated(n, c, k)), abs=1e-12), (n, c, k)


def test_the_product_form_stays_exact_where_binomials_overflow_a_float():
    for n, c, k in [(200, 100, 50), (1000, 3, 500), (1000, 997, 2), (3000, 10, 1500), (5000, 20, 2500)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # exact integers, then one rounding
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15), (n, c, k)
    with pytest.raises(OverflowError):  # C(5000, 2500) ~ 1e1503: a float binomial cannot even be formed
        float(math.comb(5000, 2500))


def test_the_curve_averages_each_k_over_prompts_and_rises_to_the_share_with_any_correct():
    # two prompts of n = 4: one with a correct completion, one with none
    assert pass_at_k_curve([1, 0], 4) == pytest.approx([1 / 8, 1 / 4, 3 / 8, 1 / 2])
    curve = pass_at_k_curve([0, 1, 2, 4, 4], 4)
    assert curve[0] == pytest.approx((0 + 1 + 2 + 4 + 4) / (5 * 4))  # pass@1: the share correct
    assert curve[-1] == pytest.approx(4 / 5)  # pass@n: the share of prompts with any correct
    assert curve == sorted(curve)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_counts_that_cannot_be(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)
