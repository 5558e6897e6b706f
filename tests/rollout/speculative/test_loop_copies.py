"""The staged engine's adaptive loop updates the policy's KV cache in place: no computation inside
XLA's optimized loop copies the whole cache ([rows, slots, kv heads, head dim] per layer). A switch
in a loop's body, or a loop nested in a branch, made XLA copy every layer's cache at each iteration
that took them (JAX 0.10.2's XLA on the CPU and, by what a probe cost, 0.11.2's on a GPU; 0.12's
copies nothing there); the loop takes its branches with `jaxspec.rollout.branch.run_if`. Checked in
the HLO that XLA dumps on the CPU (`jaxspec.bench.hlo_copies`, whose reading is tested on its own).
The loop as it was, a switch over the autoregressive run and the drafting depths, fails this test
with JAX 0.10.2: 5 computations copy 8-10 cache buffers."""

import collections
import subprocess
import sys
import textwrap
from pathlib import Path

from jaxspec.bench.hlo_copies import loop_copies

KV_HEADS, HEAD_DIM = 2, 32  # the embedded tiny policy's
BUFFERS = 2 * 4  # its keys and values in 4 layers (the EAGLE-3 head's cache: 2 buffers of the same shape)

PROGRAM = textwrap.dedent(
    """
    import jax
    from jaxspec.assets import tiny_eagle3_path, tiny_policy_path
    from jaxspec.draft import load_eagle3
    from jaxspec.models.checkpoint import load_hf
    from jaxspec.rollout import Sampling, Spec, generate

    cfg, params = load_hf(tiny_policy_path())
    head = load_eagle3(tiny_eagle3_path(), policy=cfg)
    prompts = [[1, 5 + i, 7, 9] for i in range(4)]
    spec = Spec("eagle3", head, num_draft_tokens=3, adaptive=True)
    sampling = Sampling(temperature=0.0, max_new_tokens=8)
    generate(cfg, params, prompts, jax.random.key(0), sampling, spec=spec)
    """
)

PROGRAM_NAME = "speculative_decode"


def whole_cache_copies(hlo: str) -> dict[str, int]:
    """{computation: copies of a KV-cache-shaped buffer} for the computations inside the loop
    (`loop_copies`) that copy at least BUFFERS of them: the policy's whole cache."""
    copies = collections.Counter(
        c.computation for c in loop_copies(hlo) if len(c.shape) == 4 and c.shape[2:] == (KV_HEADS, HEAD_DIM)
    )
    return {name: n for name, n in copies.items() if n >= BUFFERS}


def test_the_adaptive_loop_copies_no_kv_cache(tmp_path):
    flags = f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*{PROGRAM_NAME}.*"
    env = {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, cwd=Path(__file__).parents[3])

    (path,) = tmp_path.glob(f"module_*{PROGRAM_NAME}*after_optimizations.txt")
    hlo = path.read_text()
    assert " while(" in hlo  # the loop program, as XLA optimized it
    assert whole_cache_copies(hlo) == {}
