"""Sparse mixture-of-experts MLP (Qwen3-MoE) with dropless routing, and the router's
load-balancing loss.

A sparse layer's params (E experts of width I over hidden size H):

    {"router": [H, E], "experts_gate": [E, H, I], "experts_up": [E, H, I], "experts_down": [E, I, H]}

Routing follows transformers' Qwen3MoeSparseMoeBlock: float32 softmax over the router logits, the
top-k experts per token, their probabilities optionally renormalised to sum 1, cast back to the
activation dtype. Every token reaches all of its k experts (no capacity, nothing dropped): the N*k
token-expert assignments are sorted by expert and the experts run as grouped matmuls, then each
token sums its k weighted expert outputs.

The grouped matmuls have two implementations with one semantics (`grouped_matmul`):

* "ragged_dot": `jax.lax.ragged_dot`, the training path (XLA differentiates it);
* "triton": the `jaxspec.kernels.grouped_matmul` kernels (the Triton language through jax-triton,
  the `triton` extra), which read only the experts that rows pick and compute only their rows;
  differentiable (dX: the kernel on the transposed experts, dW: a grouped x.T @ dY kernel), but
  training does not select it by default. "triton-interpret" runs them in Triton's interpreter on
  the host (any backend, slow; needs torch).

`moe_mlp` and `transformer.forward` (`moe_impl=`) use "ragged_dot" unless told otherwise;
`transformer.extend` (prefill, decode and verification steps), the GRPO trainer's forward
(`rl.loss.sequence_forward`) and pretraining (`train.moe`) ask for
"auto": "triton" on a GPU where jax-triton imports (else ragged_dot, with one logged warning),
when activations and experts share a dtype, no mesh axis splits the experts and a call's experts
x rows (token-expert assignments per device) reach `KERNEL_MIN_WORK`, else "ragged_dot".
ragged_dot's cost grows with experts x rows (it makes [E, rows, K]-sized temporaries), the
kernel's with the experts rows touch; on an H100 (forward, in a compiled loop) ragged_dot was
faster at E x rows 8192 and 32768 (small_moe at 512 and 2048 rows: 2.5x, 1.3x), the kernel (then
lowered through Pallas' Triton backend, the same tiling) from 65536 on (Qwen3-30B-A3B at 512 rows
1.1x, at 2048 3.0x, at 32768 21x; small_moe at 32768 4.1x), with outputs equal to ragged_dot's and
no [E, rows, K] temporaries; a 30B-A3B verification step went from 3.2x to 1.4x a decode step
(`tests/gpu/check_moe.py`, BENCHMARKS.md lease U). The JAXSPEC_MOE_MATMUL environment variable
(auto, ragged_dot, triton, triton-interpret) overrides "auto" at trace time.

A decode-sized call (a decode or verification step of `extend`, at most the thin matmul's MAX_ROWS
tokens per device) can instead run the experts as two launches of the weight-streaming kernel
(`jaxspec.kernels.expert_matmul_triton`): every touched expert's gate and up with the
SwiGLU, then its down projection times the routing weight, one program per (expert, column block)
reading each touched expert once. `extend` asks for it with matmul_impl "auto", which follows the
thin matmul's choice (JAXSPEC_THIN_MATMUL; `expert_kernel_impl`); nothing differentiates through it.

On a mesh the kernels run per device on its rows (`jax.shard_map` over the batch axes), with the
experts whole on every device: fsdp gathers them as it gathers every weight of a layer. A mesh
that splits the experts (expert or tensor axis) keeps ragged_dot, which XLA partitions.

Routing replay (R3): `moe_mlp(..., experts=...)` runs each token on given experts (e.g. those the
rollout engine chose for it) instead of its own top-k; the gate weights are still the router's own
softmax probabilities, gathered at the given experts and renormalised as norm_topk_prob says, so the
router keeps its gradient. `top_experts` is the top-k choice `route` makes; expert ids are stored
compactly as `expert_id_dtype`.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp

from jaxspec.kernels.dispatch import requested_impl
from jaxspec.models import projection
from jaxspec.models.sharding import Sharding, on_devices

SPARSE_KEYS = ("router", "experts_gate", "experts_up", "experts_down")
IMPLS = ("auto", "ragged_dot", "triton", "triton-interpret")
IMPL_ENV = "JAXSPEC_MOE_MATMUL"
EXPERT_SPLITTING_AXES = ("expert", "tensor")  # mesh axes `PARAM_AXES` splits the experts over
KERNEL_MIN_WORK = 65536  # experts x rows from which "auto" takes the kernel (module docstring)
INSTALL = "pip install 'jaxspec[triton]'"

logger = logging.getLogger(__name__)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def resolve_impl(impl: str, dtypes_match: bool, sharding: Sharding | None = None, work: int | None = None) -> str:
    """The implementation ("ragged_dot", "triton" or "triton-interpret") that `impl` picks for activations
    and experts of one dtype or not (`dtypes_match`) on `sharding`'s mesh, for a call of `work` =
    experts x rows per device (None: large) (see the module docstring); ValueError for a kernel asked
    for on a mesh that splits the experts."""
    chosen = requested_impl(impl, IMPLS, IMPL_ENV, "moe grouped matmul")
    split = [ax for ax in EXPERT_SPLITTING_AXES if sharding is not None and sharding.mesh.shape.get(ax, 1) > 1]
    if chosen == "auto":
        large = work is None or work >= KERNEL_MIN_WORK
        kernel = on_gpu() and dtypes_match and not split and large and _kernels_import()
        return "triton" if kernel else "ragged_dot"
    if impl == "auto" and not dtypes_match:
        return "ragged_dot"
    if chosen != "ragged_dot" and split:
        raise ValueError(
            f"moe grouped matmul {chosen!r} runs on whole experts, but the mesh splits them over "
            f"{split}: use ragged_dot"
        )
    return chosen


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, impl: str = "ragged_dot") -> jax.Array:
    """`jax.lax.ragged_dot(x, w, group_sizes)`: x [M, K] rows sorted by group, w [E, K, N], group_sizes
    int32 [E] -> [M, N] (rows past sum(group_sizes) are 0), by the implementation `impl` names (see
    the module docstring). Differentiable in x and w with every implementation."""
    impl = resolve_impl(impl, x.dtype == w.dtype, work=w.shape[0] * x.shape[0])
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(x, w, group_sizes)
    return _grouped_matmul_kernel(x, w, group_sizes, impl == "triton-interpret")


def kernels():
    """`jaxspec.kernels.grouped_matmul`, imported on first use (triton is an optional dependency)."""
    try:
        from jaxspec.kernels import grouped_matmul
    except ImportError as e:
        raise ImportError(f"the grouped-matmul kernels need the triton package ({e}; {INSTALL})") from e
    return grouped_matmul


@functools.cache
def _kernels_import() -> bool:
    """Whether the kernels and jax_triton import; logs a warning (once) where they do not."""
    try:
        import jax_triton  # noqa: F401

        kernels()
    except ImportError as e:
        logger.warning(
            "moe grouped matmuls run ragged_dot on this GPU: the Triton kernels need jax-triton (%s): %s", INSTALL, e
        )
        return False
    return True


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul_kernel(x, w, group_sizes, interpret: bool):
    return kernels().grouped_matmul_triton(x, w, group_sizes, interpret=interpret)


def _kernel_fwd(x, w, group_sizes, interpret):
    return kernels().grouped_matmul_triton(x, w, group_sizes, interpret=interpret), (x, w, group_sizes)


def _kernel_bwd(interpret, residuals, grad):
    x, w, group_sizes = residuals
    grad = grad.astype(x.dtype)
    dx = kernels().grouped_matmul_triton(grad, w, group_sizes, transpose_w=True, interpret=interpret)
    dw = kernels().grouped_transposed_matmul_triton(x, grad, group_sizes, interpret=interpret)
    return dx, dw, None


_grouped_matmul_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def expert_id_dtype(num_experts: int):
    """The compact dtype of recorded expert ids: uint8 for up to 256 experts, else int16."""
    if num_experts <= 256:
        return jnp.dtype(jnp.uint8)
    if num_experts <= 32768:
        return jnp.dtype(jnp.int16)
    raise ValueError(f"{num_experts} experts do not fit int16 expert ids")


def top_experts(router_logits: jax.Array, top_k: int) -> jax.Array:
    """The experts `route` picks: router logits [..., E] -> int32 [..., k], the top-k of the float32
    softmax in descending order of probability (ties: the lower id first)."""
    return jax.lax.top_k(jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1), top_k)[1].astype(jnp.int32)


def route(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool, experts: jax.Array | None = None):
    """x [N, H] -> (router logits [N, E] float32, weights [N, k] in x.dtype, experts int32 [N, k]).

    experts: None picks each token's top-k experts; integer [N, k] replays the given ones (routing
    replay), weighted by the router's probabilities at them (renormalised with norm_topk_prob)."""
    logits = jnp.dot(x, router)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if experts is None:
        weights, experts = jax.lax.top_k(probs, top_k)
    else:
        experts = experts.astype(jnp.int32)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return logits.astype(jnp.float32), weights.astype(x.dtype), experts.astype(jnp.int32)


def moe_mlp(
    layer: dict,
    x: jax.Array,
    top_k: int,
    norm_topk_prob: bool,
    impl: str = "ragged_dot",
    sharding: Sharding | None = None,
    experts: jax.Array | None = None,
    matmul_impl: str = "xla",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sparse MLP of normed activations x [B, T, H] -> (output [B, T, H], router logits [B, T, E]
    float32, the experts each token ran on int32 [B, T, k]); impl: the grouped matmuls'
    implementation (`grouped_matmul`); sharding: the mesh x is laid out on, for the kernels'
    per-device call (see the module docstring); experts: None routes every token to its top-k,
    integer [B, T, k] (ids in [0, E)) replays the given experts (`route`); matmul_impl: a
    decode-sized call's expert kernel (`expert_kernel_impl`; "xla": the grouped matmuls)."""
    P = jax.sharding.PartitionSpec
    b, t, _ = x.shape
    batch_axes, seq_axes, _ = (None,) * 3 if sharding is None else sharding.spec(("batch", "seq", "act_embed"), x.shape)
    split = [] if sharding is None else jax.tree.leaves((batch_axes, seq_axes))  # mesh axes splitting the rows
    shards = math.prod(sharding.mesh.shape[a] for a in split)
    fused = expert_kernel_impl(matmul_impl, x, layer, sharding, b * t // shards)
    if fused is None:
        work = layer["router"].shape[1] * b * t * top_k // shards  # token-expert assignments x experts per device
        impl = resolve_impl(impl, x.dtype == layer["experts_gate"].dtype, sharding, work)
    if (fused is None and impl == "ragged_dot") or not on_devices(sharding):
        return _moe_mlp(layer, x, top_k, norm_topk_prob, impl, experts, fused)
    rows = P(batch_axes, seq_axes)
    sparse = {k: layer[k] for k in SPARSE_KEYS}
    return jax.shard_map(
        lambda sparse, x, experts: _moe_mlp(sparse, x, top_k, norm_topk_prob, impl, experts, fused),
        mesh=sharding.mesh,
        in_specs=(P(), rows, rows),
        out_specs=(rows, rows, rows),
        check_vma=False,
    )(sparse, x, experts)


def expert_kernel_impl(
    matmul_impl: str, x: jax.Array, layer: dict, sharding: Sharding | None, tokens: int
) -> str | None:
    """The expert kernel's implementation ("triton" or "triton-interpret") for a call of `tokens`
    token rows per device, or None for the grouped matmuls: the thin matmul's choice
    (`jaxspec.models.projection.requested`: "auto" reads JAXSPEC_THIN_MATMUL) where the kernel
    takes the call (at most its MAX_ROWS tokens, activations and experts of one of its dtypes, no
    mesh axis splitting the experts)."""
    chosen = projection.requested(matmul_impl)
    if chosen == "xla":
        return None
    kernel = projection.kernel_module()
    splits = any(sharding is not None and sharding.mesh.shape.get(ax, 1) > 1 for ax in EXPERT_SPLITTING_AXES)
    dtype = jnp.dtype(x.dtype)
    fits = dtype in map(jnp.dtype, kernel.DTYPES) and layer["experts_gate"].dtype == dtype
    return chosen if fits and not splits and 0 < tokens <= kernel.MAX_ROWS else None


def _moe_mlp(
    layer: dict,
    x: jax.Array,
    top_k: int,
    norm_topk_prob: bool,
    impl: str,
    experts: jax.Array | None,
    fused: str | None = None,
):
    b, t, h = x.shape
    num_experts = layer["router"].shape[1]
    flat = x.reshape(b * t, h)
    replayed = None if experts is None else experts.reshape(b * t, top_k)
    logits, weights, experts = route(flat, layer["router"], top_k, norm_topk_prob, replayed)
    assignment = experts.reshape(-1)  # [N*k]: token n's j-th expert at n*k + j
    if fused is None:
        order = jnp.argsort(assignment, stable=True)  # assignments grouped by expert
        group_sizes = jnp.bincount(assignment, length=num_experts).astype(jnp.int32)
        rows = flat[order // top_k]  # [N*k, H]
        gate = grouped_matmul(rows, layer["experts_gate"], group_sizes, impl)
        up = grouped_matmul(rows, layer["experts_up"], group_sizes, impl)
        out = grouped_matmul(jax.nn.silu(gate) * up, layer["experts_down"], group_sizes, impl)  # [N*k, H]
        out = out * weights.reshape(-1)[order][:, None]
        out = jnp.zeros_like(out).at[order].set(out)  # back to token-major order
    else:  # one sort, then two launches: gate and up with the SwiGLU, down times the routing weight
        from jaxspec.kernels.expert_matmul_triton import expert_matmul  # with the triton extra

        kernel = functools.partial(expert_matmul, interpret=fused == "triton-interpret")
        index = jnp.arange(assignment.size, dtype=jnp.int32)
        by_expert, order = jax.lax.sort((assignment, index), num_keys=1, is_stable=True)
        act = kernel(flat, layer["experts_gate"], by_expert, source=order, repeat=top_k, up=layer["experts_up"])
        out = kernel(act, layer["experts_down"], by_expert, dest=order, scale=weights.reshape(-1))  # token-major
    return (
        out.reshape(b, t, top_k, h).sum(axis=2),
        logits.reshape(b, t, num_experts),
        experts.reshape(b, t, top_k),
    )


def load_balancing_loss(router_logits: jax.Array, top_k: int, mask: jax.Array | None = None) -> jax.Array:
    """Switch-Transformer auxiliary loss as transformers' `load_balancing_loss_func`.

    router_logits [L, B, T, E] (one entry per sparse layer); mask bool [B, T] (False = padding,
    excluded). Returns the float32 scalar E * sum_e f_e * P_e, where f_e is the fraction of the
    top-k assignments that go to expert e and P_e its mean router probability, both averaged over
    layers and valid tokens; top_k for perfectly uniform routing. Weight it by
    `ModelConfig.router_aux_loss_coef` in a training loss.
    """
    num_experts = router_logits.shape[-1]
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    _, experts = jax.lax.top_k(probs, top_k)
    chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).sum(axis=-2)  # [L, B, T, E]
    weight = (jnp.ones(router_logits.shape[1:3], jnp.float32) if mask is None else mask.astype(jnp.float32))[
        None, :, :, None
    ]
    rows = router_logits.shape[0] * jnp.sum(weight)
    tokens_per_expert = jnp.sum(chosen * weight, axis=(0, 1, 2)) / rows
    prob_per_expert = jnp.sum(probs * weight, axis=(0, 1, 2)) / rows
    return num_experts * jnp.sum(tokens_per_expert * prob_per_expert)


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Mean number of distinct experts a layer runs for `tokens` tokens when each token picks top_k
    of num_experts experts uniformly at random: E * (1 - (1 - k/E)^tokens)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def distinct_experts(router_logits: jax.Array, top_k: int, window: int = 1) -> jax.Array:
    """Mean number of distinct experts per layer that a step over B rows x `window` consecutive
    positions runs: router_logits [L, B, T, E] (T a multiple of window) -> float32 [L], the mean
    over the T / window windows of how many experts any of their B * window tokens picks."""
    n_layers, b, t, e = router_logits.shape
    if t % window:
        raise ValueError(f"{t} positions do not split into windows of {window}")
    _, experts = jax.lax.top_k(router_logits, top_k)  # softmax keeps the order
    picked = jax.nn.one_hot(experts, e, dtype=jnp.int32).sum(axis=-2)  # [L, B, T, E]
    picked = picked.reshape(n_layers, b, t // window, window, e).sum(axis=(1, 3))  # [L, windows, E]
    return jnp.mean(jnp.sum(picked > 0, axis=-1).astype(jnp.float32), axis=-1)
