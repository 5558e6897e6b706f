import numpy as np
import pytest

from jaxspec.rl.shaping import overlong_penalty, select_groups


def test_soft_overlong_penalty():
    """DAPO: no penalty up to N - buffer tokens, then linear down to -penalty at N (N = 16, buffer 4)."""
    lengths = np.array([1, 12, 13, 14, 16])
    np.testing.assert_allclose(overlong_penalty(lengths, 16, 4, 1.0), [0, 0, -0.25, -0.5, -1.0])
    np.testing.assert_allclose(overlong_penalty(lengths, 16, 4, 0.5), [0, 0, -0.125, -0.25, -0.5])
    assert not overlong_penalty(lengths, 16, 0, 1.0).any()


def test_select_groups_keeps_informative_groups_first():
    informative = np.array([False, True, False, True, True, False])
    assert select_groups(informative, 2).tolist() == [1, 3]
    assert select_groups(informative, 4).tolist() == [1, 3, 4, 0]  # too few: filtered groups fill up
    with pytest.raises(ValueError, match="6 groups cannot fill a batch of 7"):
        select_groups(informative, 7)
