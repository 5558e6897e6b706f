"""The buffer copies XLA put inside a compiled program's loops and branches, read from its
optimized HLO (`--xla_dump_to ... --xla_dump_hlo_as_text`): a copy of a KV cache there runs at every
iteration that reaches it, where the loop meant to update the cache in place."""

from __future__ import annotations

import math
import re
from typing import NamedTuple

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_COPY = re.compile(r"^\s+(?:ROOT\s+)?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* copy\(")
_CALLED = re.compile(r"(?:branch_computations=\{([^}]*)\}|(?:body|condition|to_apply|calls)=%([\w.\-]+))")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


class Copy(NamedTuple):
    computation: str  # the HLO computation (a loop's body, a branch) that holds the copy
    name: str  # the copy instruction
    dtype: str
    shape: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * _ITEM_BYTES[self.dtype]


_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_ITEM_BYTES |= {"f64": 8, "s64": 8, "u64": 8}


def loop_copies(hlo: str) -> list[Copy]:
    """Every `copy` instruction of an optimized HLO module outside its entry computation (which
    runs once per call) and its fusions (a copy inside a fusion is a layout change within one
    kernel): those in loop bodies, loop conditions and branches."""
    copies, computation = [], None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            entry, name = header.groups()
            computation = None if entry or name.startswith("fused") else name
            continue
        match = _COPY.match(line) if computation else None
        if match:
            name, dtype, dims = match.groups()
            shape = tuple(int(d) for d in dims.split(",")) if dims else ()
            copies.append(Copy(computation, name, dtype, shape))
    return copies


def callers(hlo: str) -> dict[str, str]:
    """{computation: the op_name of the instruction that runs it (a conditional's branch, a loop's
    body or condition, a call)}: jax's path of the `cond`, `switch` or loop, with the named scopes
    around it, that a copy inside the computation belongs to. Computations whose caller carries no
    op_name are left out."""
    found = {}
    for line in hlo.splitlines():
        op_name = _OP_NAME.search(line)
        if op_name is None:
            continue
        for branches, called in _CALLED.findall(line):
            for name in branches.split(",") if branches else [called]:
                found.setdefault(name.strip().lstrip("%"), op_name.group(1))
    return found
