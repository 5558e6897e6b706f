"""tokamax, the kernel library a benchmark's `--tokamax` rows time beside the project's own kernels
(`jaxspec bench mlp`, `tests/gpu/check_moe.py`): where one of its kernels is faster for a piece, the
project adopts it rather than keeping its own. Not a dependency: `pip install tokamax`."""

from __future__ import annotations

import types

IMPLEMENTATIONS = ("mosaic", "triton", "xla")  # tokamax's names; "xla" runs anywhere, the others on GPUs


def load_tokamax() -> types.ModuleType:
    """The tokamax module. Raises SystemExit naming the package when it is not installed."""
    try:
        import tokamax
    except ImportError as e:
        raise SystemExit(f"--tokamax needs the tokamax package (pip install tokamax): {e}") from e
    from absl import flags, logging  # tokamax dependencies

    if not flags.FLAGS.is_parsed():  # tokamax reads absl flags, and would parse sys.argv (not theirs)
        flags.FLAGS.mark_as_parsed()
    # each autotuning cache miss is a warning that prints the call's whole arguments (group sizes too)
    logging.set_verbosity(logging.ERROR)
    return tokamax
