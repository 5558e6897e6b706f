"""Triton's PTX version matched to the CUDA toolkit that assembles it.

Triton writes PTX of the newest version its ptxas knows: Triton 3.9 takes the `ptxas-blackwell` it
bundles (CUDA 13.4) for Hopper and newer (sm90+), so PTX 9.4 (Triton 3.7 takes it from sm100 on, its
CUDA 12.8 `ptxas` for sm90: PTX 8.7). jax-triton hands that PTX to
jaxlib's launcher, and XLA assembles it with the ptxas of the CUDA toolkit JAX runs on (the
`nvidia-cuda-nvcc` wheel its CUDA plugin installs) or leaves it to the driver. A CUDA 13 toolkit
(`jaxspec[cuda13]`) reads it; a CUDA 12 one (`jaxspec[cuda12]`: release 12.9 knows PTX up to 8.8)
stops at the first kernel with "ptxas ... Unsupported .version 9.4". Under JAX's CUDA 12 plugin,
`match` points Triton at that toolkit's ptxas (TRITON_PTXAS_BLACKWELL_PATH for sm90+ and
TRITON_PTXAS_PATH below), so it writes PTX the toolkit reads; a path the user set stays. Compiled
for sm90 without a device, every kernel of jaxspec assembles so (docs/gpus.md).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

TRITON_PTXAS_ENV = ("TRITON_PTXAS_BLACKWELL_PATH", "TRITON_PTXAS_PATH")  # Triton's ptxas for sm90+, and below
CUDA12_NVCC = "nvidia.cuda_nvcc"  # the nvidia-cuda-nvcc-cu12 wheel jax[cuda12] installs: bin/ptxas


def plugin_cuda_major() -> int | None:
    """The CUDA major version of the jaxlib plugin whose Triton launcher runs the kernels (12 for
    `jax_cuda12_plugin`, 13 for `jax_cuda13_plugin`), None without one."""
    from jax._src.lib import gpu_triton

    plugin = getattr(gpu_triton, "_cuda_triton", None)
    found = re.match(r"jax_cuda(\d+)_plugin\b", getattr(plugin, "__name__", ""))
    return int(found.group(1)) if found else None


def ptxas_release(path: str) -> tuple[int, int] | None:
    """(major, minor) of the CUDA release the ptxas at `path` belongs to, None if it does not run."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else None


def cuda12_ptxas() -> str | None:
    """A CUDA 12 ptxas: the nvidia-cuda-nvcc-cu12 wheel's, else the first on PATH if it is one."""
    candidates = []
    try:
        candidates += [Path(p) / "bin" / "ptxas" for p in importlib.import_module(CUDA12_NVCC).__path__]
    except ImportError:
        pass
    on_path = shutil.which("ptxas")
    candidates += [Path(on_path)] if on_path else []
    for path in candidates:
        release = ptxas_release(str(path)) if path.is_file() else None
        if release is not None and release[0] == 12:
            return str(path)
    return None


@functools.cache
def match() -> str | None:
    """Under JAX's CUDA 12 plugin, sets Triton's ptxas (`TRITON_PTXAS_ENV`, each unless already set)
    to a CUDA 12 one, once, before Triton compiles a kernel; the path set, else None (another
    plugin, the user's own setting, or no CUDA 12 ptxas found: then a warning says what to set)."""
    if plugin_cuda_major() != 12 or any(os.environ.get(name) for name in TRITON_PTXAS_ENV):
        return None
    path = cuda12_ptxas()
    if path is None:
        log.warning(
            "JAX's CUDA 12 plugin runs the Triton kernels but no CUDA 12 ptxas was found (%s or on PATH): "
            "Triton may write PTX newer than CUDA 12 reads; set TRITON_PTXAS_BLACKWELL_PATH to a CUDA 12 ptxas "
            "if compiling a kernel fails with 'Unsupported .version'",
            CUDA12_NVCC,
        )
        return None
    for name in TRITON_PTXAS_ENV:
        os.environ[name] = path
    log.info("Triton's PTX matched to JAX's CUDA 12 toolkit: %s=%s", " and ".join(TRITON_PTXAS_ENV), path)
    return path
