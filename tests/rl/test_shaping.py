import numpy as np
import pytest

from jaxspec.rl.config import GRPOLossConfig
from jaxspec.rl.shaping import overlong_penalty, select_groups, trained_rollouts, truncated_rollouts


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


def test_truncated_rollouts_are_masked_on_request():
    """Rollouts cut at max_new_tokens without an eos (not those whose last token is the eos)
    leave the loss with loss.mask_truncated; filter_groups drops whole uninformative groups."""
    eos, max_new = 2, 4
    tokens = np.array([[5, 6, 7, 8], [5, 6, 7, eos], [5, eos, 0, 0], [5, 6, 7, 9]])
    lengths = np.array([4, 4, 2, 4])
    truncated = truncated_rollouts(tokens, lengths, max_new, eos)
    assert truncated.tolist() == [True, False, False, True]
    informative = np.array([True, False])  # groups of 2: rows 0-1 and rows 2-3

    def kept(**loss):
        return trained_rollouts(informative, truncated, 2, GRPOLossConfig(**loss)).tolist()

    assert kept() == [True, True, True, True]
    assert kept(filter_groups=True) == [True, True, False, False]
    assert kept(mask_truncated=True) == [False, True, True, False]
    assert kept(filter_groups=True, mask_truncated=True) == [False, True, False, False]
