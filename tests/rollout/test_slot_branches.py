"""The slot loop's branches (`jaxspec.rollout.slots.run_slots`), read from its traced program.

On a GPU each `cond` or `switch` of a compiled loop copies its predicate to the host before the
branch's kernels are launched, and a `while_loop` does so at every iteration (a `fori_loop` of a
static trip count, a `scan`, does not). So a decode step decides on the host once: one switch,
over nothing or the decode branch of its width (and, speculative, of its occupancy's draft depth),
with no branch or unbounded loop inside a decode branch; the prefill is a loop of its own, checked
once an iteration; what the step computes before its switch has one reduction (the count of its
decoding slots), each reduction being a kernel of its own. The iteration's schedule checks once
whether the pool is short, and preempts only then (`slot_schedule.make_room`). Traced only
(`jax.jit(...).trace`): nothing compiles. An adaptive loop's depth choice is a second switch inside
its branches (`spec.adaptive`), not checked here.
"""

import jax
import pytest

from jaxspec.assets import tiny_eagle3_path, tiny_policy_path
from jaxspec.draft import load_eagle3
from jaxspec.models import load_hf
from jaxspec.rollout import Sampling, Spec, continuous, generate
from jaxspec.rollout.slot_layout import DECODE_STEPS
from jaxspec.rollout.speculative import slots as speculative_slots

SAMPLED = Sampling(temperature=1.0, max_new_tokens=16, eos_id=2)
SLOTS = 16  # step widths 16 and 8
BRANCHING = ("cond", "while")  # the primitives that wait for the host (a switch is a cond)


class Traced(Exception):
    """Raised by the traced loop in place of running it."""


def traced_loop(monkeypatch, module, spec=None):
    """The jaxpr of `module._loop` as `generate` calls it (the tiny policy, 16 rows on 16 slots)."""
    loop, traced = module._loop, []

    def trace(*args):
        traced.append(loop.trace(*args).jaxpr.jaxpr)
        raise Traced

    monkeypatch.setattr(module, "_loop", trace)
    cfg, params = load_hf(tiny_policy_path(), dtype="float32")
    draft = None if spec is None else spec(load_eagle3(tiny_eagle3_path(), dtype="float32", policy=cfg))
    with pytest.raises(Traced):
        generate(cfg, params, [[5, 6, 7]] * SLOTS, jax.random.key(0), SAMPLED, spec=draft, slots=SLOTS)
    return traced[0]


def sub_jaxprs(eqn) -> list:
    """The jaxprs an equation runs (a loop's body and condition, a switch's branches, a call's)."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else [value]:
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                found.append(inner)
    return found


def control_flow(jaxpr, names=BRANCHING + ("scan",)) -> list:
    """Every equation of `names` in jaxpr, its calls included, outermost first (not inside those
    it finds)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            found.append(eqn)
        else:
            for inner in sub_jaxprs(eqn):
                found += control_flow(inner, names)
    return found


def branches_within(jaxpr) -> list:
    """Every cond and while anywhere inside jaxpr."""
    found = []
    for eqn in control_flow(jaxpr):
        found += [eqn] if eqn.primitive.name in BRANCHING else []
        for inner in sub_jaxprs(eqn):
            found += branches_within(inner)
    return found


def reductions(jaxpr) -> list[str]:
    """The reductions in jaxpr outside its loops and branches (its calls included): each is a kernel
    of its own on a GPU, that the predicate of the branch after it waits for."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in BRANCHING + ("scan",):
            continue
        if eqn.primitive.name.startswith(("reduce_", "argmax", "argmin")):
            found.append(eqn.primitive.name)
        for inner in sub_jaxprs(eqn):
            found += reductions(inner)
    return found


def iteration_of(jaxpr):
    """(the preemption's cond, the prefill loop, the decode steps' scan) of the slot loop's iteration."""
    (loop,) = control_flow(jaxpr)
    assert loop.primitive.name == "while"
    inner = control_flow(loop.params["body_jaxpr"].jaxpr)
    assert [eqn.primitive.name for eqn in inner] == ["cond", "while", "scan"]
    return inner


@pytest.mark.parametrize(
    "name, spec, depths",
    [
        ("ar", None, 1),
        ("eagle3 chain", lambda head: Spec("eagle3", head, num_draft_tokens=3), 1),
        ("eagle3 tree", lambda head: Spec("eagle3", head, num_draft_tokens=3, tree_width=2, tree_budget=6), 1),
        ("eagle3 by occupancy", lambda head: Spec("eagle3", head, num_draft_tokens=3, stage_draft_tokens=(2, 3)), 2),
    ],
)
def test_a_decode_step_decides_on_the_host_once(monkeypatch, name, spec, depths):
    module = continuous if spec is None else speculative_slots
    preemption, prefill, steps = iteration_of(traced_loop(monkeypatch, module, spec))
    not_short, short = preemption.params["branches"]
    assert not not_short.jaxpr.eqns and short.jaxpr.eqns  # nothing to run unless the pool is short
    assert steps.params["length"] == DECODE_STEPS  # a static trip count: no predicate read per step
    (switch,) = control_flow(steps.params["jaxpr"].jaxpr)
    assert switch.primitive.name == "cond"
    # the step's choice: one count of its decoding slots, the rest scalar (width, depth, counters)
    assert reductions(steps.params["jaxpr"].jaxpr) == ["reduce_sum"]
    branches = switch.params["branches"]
    assert len(branches) == 1 + depths * 2  # nothing, or a decode step at width 16 or 8 per depth
    for branch in branches:
        assert not branches_within(branch.jaxpr), f"{name}: a decode branch branches again"
    assert prefill.primitive.name == "while"  # the iteration's prefill chunks, before its decode steps
