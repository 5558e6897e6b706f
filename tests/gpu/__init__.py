"""GPU correctness checks: the compiled kernels and multi-GPU paths against what the CPU tests cover.

Tests marked `gpu` are skipped where JAX's backend is not a GPU; on a GPU machine, from the
repository root, `pytest -m gpu tests/gpu` runs them (tests/conftest.py then leaves the session on
the GPUs, compiled as the CLI compiles). Each check_*.py module holds one check's logic and is also
its command (`python3 -m tests.gpu.check_spec --out FILE.json`), which prints every case and the
timings a measurement campaign records; the unmarked tests here run the checks' own cases on the
CPU in interpret mode, with a wrong kernel as the negative control.
"""

import sys
from collections.abc import Callable


def check_main(name: str, check: Callable[[], bool], argv: list[str]) -> int:
    """The command of a check that takes no arguments (`python3 -m tests.gpu.check_<name>`): 0 when
    `check()` passes, 1 when it does not, 2 off a GPU or given arguments."""
    import jax

    if jax.default_backend() != "gpu":
        print("needs a GPU", file=sys.stderr)
        return 2
    if argv:
        print(f"check_{name} takes no arguments, got {argv}", file=sys.stderr)
        return 2
    return 0 if check() else 1
