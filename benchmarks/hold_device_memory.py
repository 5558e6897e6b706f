"""Makes each local GPU a smaller card for memory: holds all but `--leave-mib` MiB of every GPU
until killed, so that a run beside it meets the smaller card's physical limit. XLA's memory
fraction alone caps XLA's pool, not the CUDA driver's pools beside it (under `cuda_async` they
grew 24 GB past the cap on an H200, benchmarks/LABLOG.md lease Z).

    python3 benchmarks/hold_device_memory.py --leave-mib 81559 &   # an H100 80GB's 81,559 MiB
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.539 jaxspec train ...         # 0.95 x 81,559 MiB of an H200's

Start it before the run. It preallocates through XLA's BFC allocator: its own CUDA context
(`--context-mib`, 277 MiB measured on an H200 with JAX 0.11.2) counts toward what it holds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def hold_fraction(total_mib: int, leave_mib: int, context_mib: int) -> float:
    """The memory fraction XLA preallocates so that total - leave MiB are held in all."""
    held = total_mib - leave_mib - context_mib
    if held <= 0:
        raise ValueError(
            f"--leave-mib {leave_mib}: the GPU has {total_mib} MiB, with this process's context "
            f"({context_mib} MiB) nothing is left to hold"
        )
    return held / total_mib


def gpu_memory_mib() -> list[int]:
    """Total memory of each visible GPU, MiB (nvidia-smi)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [int(line) for line in out.split()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leave-mib", type=int, required=True, help="MiB left on each GPU (the smaller card's)")
    parser.add_argument("--context-mib", type=int, default=277, help="this process's CUDA context per GPU")
    args = parser.parse_args(argv)
    try:
        fraction = hold_fraction(min(gpu_memory_mib()), args.leave_mib, args.context_mib)
    except ValueError as err:
        parser.error(str(err))
    os.environ.update(XLA_PYTHON_CLIENT_MEM_FRACTION=f"{fraction:.4f}", XLA_PYTHON_CLIENT_PREALLOCATE="true")
    os.environ.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None)
    import jax

    devices = jax.local_devices()
    for device in devices:
        jax.device_put(0, device).block_until_ready()
    print(
        f"holding {fraction:.4f} of each of {len(devices)} GPUs, {args.leave_mib} MiB left on each; "
        f"kill this process to release them",
        flush=True,
    )
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
