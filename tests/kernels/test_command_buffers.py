"""command_buffers: jax-triton's custom call of a kernel becomes the typed-FFI call that XLA may record
into a command buffer, with the same operands, launch proto, aliasing and side effect.

jax-triton's lowering needs a CUDA jaxlib, so a primitive of this file lowers on the CPU to the custom
calls jax-triton emits (0.3: the legacy call with the compressed proto as its backend config; 0.4: a
typed call to jaxlib's launcher with the proto as `opaque`) and `as_typed_call` rewrites them; the
lowered module is read back op by op. On a GPU, `tests/gpu/check_*` run every kernel through it.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib.mlir import ir
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jaxspec.kernels import command_buffers

PROTO = zlib.compress(b"kernel, grid and parameters of one launch \x00\xff")


def jax_triton_03(ctx, *args, input_output_aliases, has_side_effect):
    return jax.ffi.ffi_lowering(
        "triton_kernel_call",
        api_version=2,
        backend_config=PROTO,
        operand_output_aliases=dict(input_output_aliases),
        has_side_effect=has_side_effect,
    )(ctx, *args)


def jax_triton_04(ctx, *args, input_output_aliases, has_side_effect):
    rule = jax.ffi.ffi_lowering(
        "triton_kernel_call_ffi",
        api_version=4,
        operand_output_aliases=dict(input_output_aliases),
        has_side_effect=has_side_effect,
    )
    return rule(ctx, *args, opaque=PROTO)


def kernel_primitive(rule) -> Primitive:
    """A primitive of two outputs like x, lowered on the CPU by `rule` then `as_typed_call`."""
    p = Primitive(f"kernel_call_{rule.__name__}")
    p.multiple_results = True
    p.def_abstract_eval(lambda x, y, **_: [jax.core.ShapedArray(x.shape, x.dtype)] * 2)
    mlir.register_lowering(p, functools.partial(command_buffers.as_typed_call, rule), platform="cpu")
    return p


def custom_calls(rule, aliases: tuple, side_effect: bool) -> list[ir.Operation]:
    p = kernel_primitive(rule)
    x = jnp.zeros((4, 8), jnp.float32)
    lowered = jax.jit(lambda x, y: p.bind(x, y, input_output_aliases=aliases, has_side_effect=side_effect))
    module = lowered.lower(x, x).compiler_ir("stablehlo")
    found = []

    def walk(op):
        if op.operation.name == "stablehlo.custom_call":
            found.append(op.operation)
        for region in op.operation.regions:
            for block in region.blocks:
                for inner in block.operations:
                    walk(inner)

    walk(module.operation)
    return found


@pytest.mark.parametrize("rule", [jax_triton_03, jax_triton_04])
@pytest.mark.parametrize(("aliases", "side_effect"), [((), False), (((1, 0),), True)])
def test_a_kernel_call_becomes_the_typed_call_of_the_target(rule, aliases, side_effect):
    (call,) = custom_calls(rule, aliases, side_effect)
    attrs = call.attributes
    assert ir.StringAttr(attrs["call_target_name"]).value == command_buffers.TARGET
    config = ir.DictAttr(attrs["mhlo.backend_config"])
    assert ir.StringAttr(config["opaque"]).value_bytes == PROTO
    assert len(config) == 1
    assert ir.BoolAttr(attrs["has_side_effect"]).value is side_effect
    written = [str(a) for a in ir.ArrayAttr(attrs["output_operand_aliases"])] if aliases else []
    assert len(written) == len(aliases)
    if aliases:
        assert "output_tuple_indices = [0]" in written[0] and "operand_index = 1" in written[0]
    assert len(call.operands) == 2 and len(call.results) == 2


def test_the_launch_proto_is_read_from_either_form():
    for rule in (jax_triton_03, jax_triton_04):
        p = Primitive(f"plain_{rule.__name__}")
        p.multiple_results = True
        p.def_abstract_eval(lambda x, y, **_: [jax.core.ShapedArray(x.shape, x.dtype)] * 2)
        seen = []

        def keep(ctx, *args, rule=rule, **params):
            results = rule(ctx, *args, **params)
            seen.append(command_buffers.launch_proto(results[0].owner.operation))
            return results

        mlir.register_lowering(p, keep, platform="cpu")
        x = jnp.zeros((2,), jnp.float32)
        jax.jit(lambda x: p.bind(x, x, input_output_aliases=(), has_side_effect=False)).lower(x)
        assert seen == [PROTO]


def test_the_setting_is_checked(monkeypatch):
    monkeypatch.setenv(command_buffers.ENV, "sometimes")
    with pytest.raises(ValueError, match="JAXSPEC_TRITON_COMMAND_BUFFERS='sometimes'"):
        command_buffers.install.__wrapped__()
    monkeypatch.setenv(command_buffers.ENV, "off")
    assert command_buffers.install.__wrapped__() is False


class _Plugin:
    """A CUDA jaxlib's Triton module whose launcher has the given stages."""

    def __init__(self, stages):
        self.stages = stages

    def registrations(self):
        return {command_buffers.LAUNCHER: dict.fromkeys(self.stages, object())}


def test_a_launcher_without_an_initialize_stage_is_left_alone(monkeypatch, caplog):
    # jaxlib 0.12.0.1's launcher (instantiate, execute) lacks the stage that loads a kernel before graph
    # capture; whether its execute is safe inside a graph has not run on a card, so it is left alone
    from jax._src.lib import gpu_triton

    monkeypatch.setenv(command_buffers.ENV, "on")
    monkeypatch.setattr(gpu_triton, "_cuda_triton", _Plugin(["instantiate", "execute"]), raising=False)
    registered = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda *a, **k: registered.append(a))
    with caplog.at_level("WARNING", logger=command_buffers.__name__):
        assert command_buffers.install.__wrapped__() is False
    assert registered == []
    assert "no 'initialize' stage (stages: execute, instantiate)" in caplog.text
    monkeypatch.setattr(gpu_triton, "_cuda_triton", None, raising=False)  # a jaxlib without CUDA
    assert command_buffers.install.__wrapped__() is False


def test_a_plugin_that_refuses_the_command_buffer_trait_is_left_alone(monkeypatch, caplog):
    # jaxlib 0.10.2's CUDA plugin (Python 3.11's newest JAX) has the initialize stage but raises on a
    # target registered with traits: that must leave the kernels on jax-triton's own lowering, not
    # fail the first kernel call (compiled for an H200 without a device, it did)
    import sys
    import types

    from jax._src.lib import gpu_triton

    monkeypatch.setenv(command_buffers.ENV, "on")
    monkeypatch.setattr(gpu_triton, "_cuda_triton", _Plugin(["execute", "initialize"]), raising=False)
    triton_lib = types.SimpleNamespace(get_cuda_backend=object(), triton_kernel_call_p=object())
    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_lib=triton_lib))

    def refuse(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("UNIMPLEMENTED: The plugin does not support custom call traits.")

    lowered = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target", refuse)
    monkeypatch.setattr(mlir, "register_lowering", lambda *a, **k: lowered.append(a))
    with caplog.at_level("WARNING", logger=command_buffers.__name__):
        assert command_buffers.install.__wrapped__() is False
    assert lowered == []
    assert "does not support custom call traits" in caplog.text and "launch on their own" in caplog.text
