"""Choosing a kernel implementation: an explicit argument, else an environment variable."""

from __future__ import annotations

import os


def requested_impl(impl: str, impls: tuple[str, ...], env_var: str, what: str) -> str:
    """`impl` if it is not "auto"; for "auto", the value of `env_var` when set (else "auto").
    Both must be one of `impls` (ValueError naming `what` or the variable otherwise)."""
    if impl not in impls:
        raise ValueError(f"{what} impl must be one of {impls}, got {impl!r}")
    if impl == "auto":
        impl = os.environ.get(env_var, "") or "auto"
        if impl not in impls:
            raise ValueError(f"{env_var} must be one of {impls}, got {impl!r}")
    return impl
