"""benchmarks/hold_device_memory.py: the fraction it preallocates, and its refusal of a card too small."""

import pytest

from tests.benchmarks.scripts import load_script

hold = load_script("hold_device_memory")


def test_the_held_fraction_leaves_the_smaller_cards_memory():
    # an H200 (143,771 MiB) made an H100 80GB (81,559 MiB): the measured lease AA setting
    fraction = hold.hold_fraction(143771, 81559, 277)
    assert fraction == pytest.approx(0.4308, abs=1e-4)
    assert 143771 - fraction * 143771 - 277 == pytest.approx(81559)


def test_leaving_more_than_the_card_has_is_refused():
    with pytest.raises(ValueError, match="--leave-mib 81559: the GPU has 40960 MiB"):
        hold.hold_fraction(40960, 81559, 277)
