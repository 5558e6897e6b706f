"""XLA compiler options of the rollout loops, chosen by the policy's shape.

XLA's GPU compiler splits the contraction of a GEMM with few rows and a long inner dimension
(split-K): the GEMM writes float32 partial products [splits, rows, N] and a second kernel sums
them. For a decode step (1-64 rows against each weight) that is an extra launch and buffer per
projection. Timed both ways on one H100 (`jaxspec bench decode`, BENCHMARKS.md):

- Qwen3-8B (hidden 4096) without split-K reads at 0.87-0.88 of the in-loop copy rate at batch 1 /
  8 / 32 / 64, against 0.87 / 0.88 / 0.85 / 0.83 with it (6% faster at 64 rows, equal at 1-8);
- Qwen3-1.7B (hidden 2048) loses up to 7% without it at batch 1-32 and is equal at 64, and the
  32k-vocabulary `small` policy's slot decode step loses 13-20% at 16-64 slots.

So the rollout loops of a policy whose hidden size is at least `WIDE_HIDDEN` compile without
split-K and the others keep XLA's choice. Only the rollout loops take the option (per compilation,
`jax.jit(compiler_options=...)`): the trainer's programs, whose GEMMs have thousands of token rows,
keep XLA's choice (not timed without split-K). The option is a field of XLA's debug options on every
backend; off the GPU it changes nothing.

JAXSPEC_ROLLOUT_SPLIT_K overrides the rule: "auto" (the default), "xla" (XLA's choice for every
policy) or "off" (no split-K for every policy). It is read at each call, so one process can time
both ways.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from jaxspec.kernels.dispatch import requested_impl
from jaxspec.models.config import ModelConfig

CHOICES = ("auto", "xla", "off")
SPLIT_K_ENV = "JAXSPEC_ROLLOUT_SPLIT_K"
WIDE_HIDDEN = 4096
NO_SPLIT_K = {"xla_gpu_experimental_force_split_k": 1}


def splits_k(cfg: ModelConfig) -> bool:
    """Whether a rollout loop of a policy of `cfg`'s shape leaves split-K to XLA (module docstring)."""
    choice = requested_impl("auto", CHOICES, SPLIT_K_ENV, "rollout split-K")
    if choice == "auto":
        return cfg.hidden_size < WIDE_HIDDEN
    return choice == "xla"


def rollout_compiler_options(cfg: ModelConfig) -> dict | None:
    """The compiler options a rollout loop of a policy of `cfg`'s shape compiles with (None: XLA's)."""
    return None if splits_k(cfg) else NO_SPLIT_K


def rollout_jit(**jit_kwargs) -> Callable[[Callable], Callable]:
    """A decorator like `functools.partial(jax.jit, **jit_kwargs)` for a rollout program whose first
    argument is its policy's `ModelConfig` (static): the program is compiled with or without
    split-K as `splits_k` says for that config."""

    def wrap(fun: Callable) -> Callable:
        with_split_k = jax.jit(fun, **jit_kwargs)
        without = jax.jit(fun, compiler_options=NO_SPLIT_K, **jit_kwargs)

        def jitted(cfg: ModelConfig):
            return with_split_k if splits_k(cfg) else without

        @functools.wraps(fun)
        def call(cfg: ModelConfig, *args, **kwargs):
            return jitted(cfg)(cfg, *args, **kwargs)

        # `jax.jit`'s stages, for the program the rule picks, and its count of programs compiled so far
        # (both ways), which recompilation tests read
        call.trace = lambda cfg, *args, **kwargs: jitted(cfg).trace(cfg, *args, **kwargs)
        call.lower = lambda cfg, *args, **kwargs: jitted(cfg).lower(cfg, *args, **kwargs)
        call._cache_size = lambda: with_split_k._cache_size() + without._cache_size()
        return call

    return wrap
