"""The slot engine on a mesh (`generate(..., slots=S, sharding=...)`).

On the embedded tiny policy and its EAGLE-3 head, 12 rows through 8 slots on 2 x 2 meshes (data x
tensor, fsdp x tensor): the rows, slots and pages split into 2 groups over the batch axis, each
device holds its group's pages with half the KV heads (the policy's pools and the head's), and
greedy autoregressive and greedy EAGLE-3 rollouts give the one-device slot engine's tokens,
log-probs and acceptance; sampled rows too (row r's token i is drawn with a key of (r, i) alone,
whichever group runs it), and coupled EAGLE-3 rows are the one-device autoregressive rows. A
mixture-of-experts policy too: the model runs every group's slots as one batch (its grouped
matmuls have no rule for a vmap over groups).
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxspec.models import Sharding, make_mesh, paged, shard_params
from jaxspec.rollout import Sampling, Spec, continuous, generate
from jaxspec.rollout.speculative import slots as speculative_slots
from tests.rollout.conftest import assert_same_rollout, random_params
from tests.rollout.test_recorded_experts import CFG as MOE_CFG
from tests.rollout.test_recorded_experts import PROMPTS as MOE_PROMPTS

pytestmark = pytest.mark.slow

MESHES = {"data-tensor": dict(data=2, fsdp=1, tensor=2), "fsdp-tensor": dict(data=1, fsdp=2, tensor=2)}
SLOTS = 8
CHAIN = dict(num_draft_tokens=3)


def spec_of(tiny, method):
    return None if method == "ar" else Spec("eagle3", tiny[2], **CHAIN)


@pytest.fixture(scope="module")
def one_device(tiny):
    """{method: the one-device slot engine's greedy rollout of the rows}."""
    cfg, params, _, rows, greedy, _ = tiny
    return {
        method: generate(cfg, params, rows, jax.random.key(0), greedy, spec=spec_of(tiny, method), slots=SLOTS)
        for method in ("ar", "eagle3")
    }


def run_on_mesh(tiny, mesh, sampling, key, method, monkeypatch):
    """(the rollout on `mesh`, the slot loop's final state) of the rows."""
    cfg, params, _, rows, _, _ = tiny
    module = continuous if method == "ar" else speculative_slots
    loop, states = module._loop, []

    def recording_loop(*args, **kwargs):
        states.append(loop(*args, **kwargs))
        return states[-1]

    monkeypatch.setattr(module, "_loop", recording_loop)
    sharding = Sharding(make_mesh(**MESHES[mesh], devices=jax.devices()[:4]))
    spec = spec_of(tiny, method)
    out = generate(cfg, shard_params(sharding, params), rows, key, sampling, spec=spec, slots=SLOTS, sharding=sharding)
    return out, states[0]


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("method", ["ar", "eagle3"])
def test_greedy_slots_on_a_mesh_equal_one_device(tiny, one_device, mesh, method, monkeypatch):
    out, state = run_on_mesh(tiny, mesh, tiny[4], jax.random.key(0), method, monkeypatch)
    want = one_device[method]
    assert_same_rollout(out, want)
    batch_axis = "data" if mesh == "data-tensor" else "fsdp"
    assert out.stats["groups"] == 2 and out.tokens.sharding.spec[0] == batch_axis  # rows stay split
    assert out.stats["prefix_pages_shared"] > 0  # the rows of a prompt share its pages within their group
    if method == "eagle3":
        assert out.stats["accepted_tokens"] == want.stats["accepted_tokens"] > 0
    pools = [state.cache.k[0], state.cache.v[-1]]
    if method == "eagle3":
        pools.append(state.draft.draft.cache.k[0])  # the head's own pages
    for pool in pools:  # [group, page, position, kv head, head dim]: a device holds its group's pages, 1 of 2 heads
        groups, pages, page_size, heads, dim = pool.shape
        parts = tuple(pool.sharding.spec) + (None,) * (pool.ndim - len(pool.sharding.spec))
        assert parts == (batch_axis, None, None, "tensor", None)
        assert {s.data.shape for s in pool.addressable_shards} == {(1, pages, page_size, heads // 2, dim)}
    assert state.pool.page_table.sharding.spec[0] == batch_axis


def test_sampled_slots_on_a_mesh_equal_one_device(tiny, monkeypatch):
    cfg, params, _, rows, _, sampled = tiny
    want = generate(cfg, params, rows, jax.random.key(5), sampled, slots=SLOTS)
    out, _ = run_on_mesh(tiny, "data-tensor", sampled, jax.random.key(5), "ar", monkeypatch)
    assert len(set(np.asarray(want.lengths).tolist())) > 2  # rows end at different lengths
    assert_same_rollout(out, want)


def test_coupled_eagle3_slots_on_a_mesh_equal_the_one_device_autoregressive_rollout(tiny, monkeypatch):
    """Coupled draws (`Sampling.coupled`) key every node by its row and position, whichever group runs
    it: sampled EAGLE-3 chains on the mesh give the one-device autoregressive rollout."""
    cfg, params, _, rows, _, sampled = tiny
    coupled = dataclasses.replace(sampled, coupled=True)
    want = generate(cfg, params, rows, jax.random.key(5), coupled, slots=SLOTS)
    out, _ = run_on_mesh(tiny, "data-tensor", coupled, jax.random.key(5), "eagle3", monkeypatch)
    assert out.stats["groups"] == 2 and out.stats["accepted_tokens"] > 0
    assert_same_rollout(out, want)


def test_a_mixture_of_experts_policy_on_a_mesh_equals_one_device():
    params = random_params(MOE_CFG, seed=3, std=0.2)
    rows = [p for p in MOE_PROMPTS for _ in range(2)]
    greedy = Sampling(temperature=0.0, max_new_tokens=8, eos_id=(42,))
    want = generate(MOE_CFG, params, rows, jax.random.key(0), greedy, slots=SLOTS)
    sharding = Sharding(make_mesh(**MESHES["data-tensor"], devices=jax.devices()[:4]))
    got = generate(
        MOE_CFG, shard_params(sharding, params), rows, jax.random.key(0), greedy, slots=SLOTS, sharding=sharding
    )
    assert got.stats["groups"] == 2
    assert_same_rollout(got, want)


KERNEL_SETS = {  # what runs each decoder layer's kernels, the kernel a step's trace must call
    "attention": ({"JAXSPEC_PAGED_ATTENTION": "triton-interpret"}, "kernel_attention"),
    "layer": (
        {
            "JAXSPEC_PAGED_ATTENTION": "triton-interpret",
            "JAXSPEC_ATTENTION_PROLOGUE": "triton",
            "JAXSPEC_RESIDUAL_NORM": "triton-interpret",
        },
        "attention_prologue",
    ),
}


@pytest.mark.parametrize("kernels", list(KERNEL_SETS))
@pytest.mark.parametrize("method", ["ar", "eagle3"])
def test_the_kernels_on_a_mesh_give_the_same_rollout(tiny, one_device, method, kernels, monkeypatch):
    """The paged attention kernel, alone or after the attention prologue with the residual norms
    (Triton's interpreter), on each device of the mesh, on its group's pages and KV heads, in the
    decode and verification steps: the one-device rollout. The kernel's traced calls show that the
    steps ran it on one group's pages and half the KV heads."""
    pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")
    env, name = KERNEL_SETS[kernels]
    module = paged if name == "kernel_attention" else pytest.importorskip("jaxspec.kernels.attention_prologue_triton")
    kernel, pools = getattr(module, name), []

    def counted(*args, **kwargs):
        pools.append(args[1 if name == "kernel_attention" else 8].shape)  # the k pool read on a device
        return kernel(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    jax.clear_caches()  # the loops read the variables when traced
    out, state = run_on_mesh(tiny, "data-tensor", tiny[4], jax.random.key(0), method, monkeypatch)
    jax.clear_caches()
    assert_same_rollout(out, one_device[method])
    groups, pages, page_size, heads, dim = state.cache.k[0].shape
    assert (pages, page_size, heads // 2, dim) in pools  # one group's pages, half the KV heads
