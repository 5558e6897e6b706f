"""benchmarks/slot_profile.py: the rows' limits drawn from a workload's length law, and the kernel
phases read from a trace's scope names."""

from pathlib import Path

import numpy as np

from jaxspec.config_io import load_config
from jaxspec.data_cli import response_lengths
from jaxspec.pretrain.config import PretrainConfig
from jaxspec.tasks import generate_problems
from tests.benchmarks.scripts import load_script

slot_profile = load_script("slot_profile")
LONG = str(Path(__file__).resolve().parents[2] / "configs" / "pretrain_long.yaml")


def test_row_limits_are_the_workloads_response_lengths_capped():
    """One draw of the long workload's law per row: its first problems' response lengths under its
    tokenizer, each capped at the call's max_new_tokens."""
    data = load_config(PretrainConfig, LONG, []).data
    lengths = np.asarray(
        response_lengths(data, generate_problems(48, data.seed, data.levels, data.kinds, tally=data.tally))[0]
    )
    cap = int(np.median(lengths))
    limits = np.asarray(slot_profile.workload_lengths(LONG, 48, cap))
    np.testing.assert_array_equal(limits, np.minimum(lengths, cap))
    assert (limits == cap).sum() >= 24 and len(set(limits.tolist())) > 10  # capped half, the rest spread


def test_a_kernel_is_charged_to_its_innermost_phase():
    assert slot_profile.phase_of("jit__loop/while/body/verify_forward/layer/attention") == "verify_forward"
    assert slot_profile.phase_of("jit__loop/while/body/propose/verify/x") == "verify"
    assert slot_profile.phase_of("jit__loop/while/body/schedule/admit/gather") == "jit__loop/while/body/schedule"
