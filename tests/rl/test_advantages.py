"""Group-relative advantages (`jaxspec.rl.advantages`) against hand-computed values."""

import math

import numpy as np
import pytest

from jaxspec.rl.advantages import group_advantages


def test_group_advantages_by_hand():
    rewards = [1, 0, 0, 1, 1, 1, 1, 1, 0, 0.5, 1, 0.5]
    adv, informative = group_advantages(rewards, 4, "std", eps=0.0)
    a, b = 0.5 / math.sqrt(1 / 3), 0.5 / math.sqrt(1 / 6)  # unbiased std of each group
    np.testing.assert_allclose(adv, [a, -a, -a, a, 0, 0, 0, 0, -b, 0, b, 0], rtol=1e-6)
    assert informative.tolist() == [True, False, True]
    assert (adv[4:8] == 0).all()  # zero-variance group: exactly zero, no nan
    adv, _ = group_advantages(rewards, 4, "mean")
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.5, 0, 0.5, 0], rtol=1e-7)
    adv, _ = group_advantages([0.3, 0.3, 0.3], 3, "std", eps=1e-6)
    assert (adv == 0).all()
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1, 0, 1], 4)
