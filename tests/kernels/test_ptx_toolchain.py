"""jaxspec.kernels.ptx_toolchain: Triton's PTX matched to the CUDA 12 toolkit under JAX's CUDA 12 plugin."""

import importlib
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("triton")

from jaxspec.kernels import ptx_toolchain  # noqa: E402

ENV = ptx_toolchain.TRITON_PTXAS_ENV


def fake_ptxas(folder: Path, release: str) -> Path:
    """An executable `ptxas` in `folder` that reports CUDA `release` (e.g. "12.9") as ptxas does."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ptxas"
    path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def clean(monkeypatch):
    """No Triton ptxas setting in the environment, and `match` not yet run; what `match` sets is
    undone after the test (setenv first: pytest records nothing for deleting an absent variable)."""
    for name in ENV:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    ptx_toolchain.match.cache_clear()
    yield monkeypatch
    ptx_toolchain.match.cache_clear()


@pytest.mark.parametrize(
    "name, major", [("jax_cuda12_plugin._triton", 12), ("jax_cuda13_plugin._triton", 13), ("other._triton", None)]
)
def test_plugin_cuda_major_reads_the_plugin_module(monkeypatch, name, major):
    from jax._src.lib import gpu_triton

    monkeypatch.setattr(gpu_triton, "_cuda_triton", types.ModuleType(name), raising=False)
    assert ptx_toolchain.plugin_cuda_major() == major
    monkeypatch.setattr(gpu_triton, "_cuda_triton", None, raising=False)
    assert ptx_toolchain.plugin_cuda_major() is None


def test_ptxas_release(tmp_path):
    assert ptx_toolchain.ptxas_release(str(fake_ptxas(tmp_path / "a", "12.9"))) == (12, 9)
    assert ptx_toolchain.ptxas_release(str(tmp_path / "missing")) is None


def test_cuda12_ptxas_takes_the_wheel_s_then_path_s_and_only_cuda_12(tmp_path, clean):
    """The nvidia-cuda-nvcc-cu12 wheel's ptxas first; one on PATH only if it is CUDA 12."""
    clean.syspath_prepend(str(tmp_path))
    clean.setattr(ptx_toolchain, "CUDA12_NVCC", "fakenvidia.cuda_nvcc")
    on_path = tmp_path / "path"
    clean.setenv("PATH", str(on_path))
    fake_ptxas(on_path, "13.0")
    assert ptx_toolchain.cuda12_ptxas() is None  # no wheel, and PATH's is CUDA 13
    path_12 = fake_ptxas(on_path, "12.8")
    assert ptx_toolchain.cuda12_ptxas() == str(path_12)
    wheel = fake_ptxas(tmp_path / "fakenvidia" / "cuda_nvcc" / "bin", "12.9")
    importlib.invalidate_caches()  # the import system lists folders once
    assert ptx_toolchain.cuda12_ptxas() == str(wheel)
    for name in ("fakenvidia.cuda_nvcc", "fakenvidia"):
        sys.modules.pop(name, None)


def test_match_points_triton_at_the_cuda12_ptxas_under_the_cuda12_plugin(tmp_path, clean):
    path = str(fake_ptxas(tmp_path, "12.9"))
    clean.setattr(ptx_toolchain, "cuda12_ptxas", lambda: path)
    clean.setattr(ptx_toolchain, "plugin_cuda_major", lambda: 13)
    assert ptx_toolchain.match() is None and not any(os.environ.get(n) for n in ENV)
    ptx_toolchain.match.cache_clear()
    clean.setattr(ptx_toolchain, "plugin_cuda_major", lambda: 12)
    assert ptx_toolchain.match() == path
    assert [os.environ[n] for n in ENV] == [path, path]


def test_match_keeps_the_user_s_setting(tmp_path, clean):
    clean.setattr(ptx_toolchain, "cuda12_ptxas", lambda: str(fake_ptxas(tmp_path, "12.9")))
    clean.setattr(ptx_toolchain, "plugin_cuda_major", lambda: 12)
    clean.setenv("TRITON_PTXAS_BLACKWELL_PATH", "/opt/mine/ptxas")
    assert ptx_toolchain.match() is None
    assert os.environ["TRITON_PTXAS_BLACKWELL_PATH"] == "/opt/mine/ptxas"
    assert "TRITON_PTXAS_PATH" not in os.environ


def test_match_without_a_cuda12_ptxas_says_what_to_set(clean, caplog):
    clean.setattr(ptx_toolchain, "cuda12_ptxas", lambda: None)
    clean.setattr(ptx_toolchain, "plugin_cuda_major", lambda: 12)
    with caplog.at_level(logging.WARNING, logger=ptx_toolchain.__name__):
        assert ptx_toolchain.match() is None
    assert "set TRITON_PTXAS_BLACKWELL_PATH to a CUDA 12 ptxas" in caplog.text
    assert not any(os.environ.get(n) for n in ENV)


COMPILE = """
import json, re, jax.numpy as jnp
from tests.kernels.triton_compile import compile_for_hopper
from jaxspec.kernels import residual_norm_triton as kernel
constants = kernel.launch_constants(2048, has_delta=True, eps=1e-6)
warps = kernel.num_warps(2048)
out = compile_for_hopper(kernel._residual_norm, [jnp.bfloat16] * 5, constants, num_warps=warps, num_stages=1)
version = re.search(r"^\\.version (\\d+)\\.(\\d+)", out.asm["ptx"], re.M).groups()
from triton.backends.nvidia.compiler import get_ptxas
print(json.dumps({"ptx": version, "cubin": len(out.asm["cubin"]), "ptxas": get_ptxas(90).path}))
"""


def compile_norm(env: dict, cache: Path) -> dict:
    """The residual-norm kernel compiled for sm90 in a fresh process (Triton caches its ptxas's
    version per process) with `env` added and its own kernel cache `cache` (Triton's cache key
    leaves the sm90 ptxas out, so a cached kernel would answer for the other ptxas): its PTX
    version, cubin size and the ptxas Triton took for sm90."""
    full = {k: v for k, v in os.environ.items() if k not in ENV} | env | {"TRITON_CACHE_DIR": str(cache)}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", COMPILE], env=full, cwd=root, capture_output=True, text=True, check=True
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_matched_ptxas_makes_triton_write_ptx_cuda_12_assembles(tmp_path):
    """With the setting `match` makes, pointing at a CUDA 12 ptxas (Triton bundles release 12.x as
    its `ptxas` for pre-Hopper targets), a kernel for sm90 compiles to PTX of version <= 8.8 (what
    CUDA 12.9 reads) and to a cubin; Triton's default ptxas for sm90, where it is CUDA 13's (Triton
    3.9's `ptxas-blackwell`), writes PTX 9.x, which that toolkit refuses: the control."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    release = ptx_toolchain.ptxas_release(str(bundled / "ptxas"))
    if release is None or release[0] != 12:
        pytest.skip(f"Triton {triton.__version__} bundles no CUDA 12 ptxas ({release})")
    matched = compile_norm({name: str(bundled / "ptxas") for name in ENV}, tmp_path / "matched")
    assert matched["ptxas"] == str(bundled / "ptxas"), matched
    assert tuple(map(int, matched["ptx"])) <= (8, 8) and matched["cubin"] > 0, matched
    default = compile_norm({}, tmp_path / "default")
    default_release = ptx_toolchain.ptxas_release(default["ptxas"])
    if default_release is None or default_release[0] < 13:
        pytest.skip(f"Triton's own ptxas for sm90 is not CUDA 13's ({default}, release {default_release})")
    assert int(default["ptx"][0]) >= 9, (default, default_release)
