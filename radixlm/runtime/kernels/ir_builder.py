"""A small builder of LLVM IR functions that hands out SSA names and checks them in Python, when
the IR is generated: a name defined twice, or used where it is not defined (anywhere in the
function for a phi's or a branch's operand, earlier in the text for any other use), raises
`IRError` naming the function, the name and the line, rather than an LLVM parse error on a
user's machine at start-up. `check_module` applies the same check to every function of a module
text, builder-made or not.
"""

from __future__ import annotations

import re
from collections import Counter

from radixlm.runtime.kernels.native_abi import Function

_NAME = re.compile(r"%[A-Za-z0-9_.$-]+")
_DEF = re.compile(r"^\s*(%[A-Za-z0-9_.$-]+)\s*=")
_LABEL = re.compile(r"^([A-Za-z0-9_.$-]+):")
_USE = re.compile(r"(label\s+)?(%[A-Za-z0-9_.$-]+)")
_TYPE_DEF = re.compile(r"^(%[A-Za-z0-9_.$-]+)\s*=\s*type\b", re.MULTILINE)


class IRError(ValueError):
    """Generated IR that LLVM would reject: a duplicate or undefined SSA name."""


class FunctionBuilder:
    """One function's IR: its `define` line from `function`'s declaration, then lines added by
    `emit`, with fresh SSA names from `fresh`; `text()` checks it and closes it."""

    def __init__(self, function: Function, types: frozenset[str] = frozenset(), attributes: str = "") -> None:
        self.function, self.types = function, types
        self.lines: list[str] = [function.define(attributes)]
        self._taken: Counter[str] = Counter()

    def fresh(self, base: str) -> str:
        """A new SSA name `%base.N`, never handed out before in this function."""
        self._taken[base] += 1
        return f"%{base}.{self._taken[base]}"

    def emit(self, *lines: str) -> None:
        """Append lines (each may hold several, separated by newlines)."""
        self.lines.extend(line for text in lines for line in text.split("\n"))

    def text(self) -> str:
        """The function's text, checked (`check_function`)."""
        text = "\n".join([*self.lines, "}"]) + "\n"
        check_function(text, self.types)
        return text


def check_function(text: str, types: frozenset[str] = frozenset()) -> None:
    """Raise IRError where `text` (one `define ... { ... }`) defines an SSA name or label twice,
    or uses a name it never defines, or (outside a phi) before the line that defines it.
    `types`: the module's named types (`%Name`), not values."""
    lines = [line.split(";", 1)[0] for line in text.split("\n")]
    opened = next((i for i, line in enumerate(lines) if line.rstrip().endswith("{")), 0)
    head = " ".join(lines[: opened + 1])
    lines = [head] + [""] * opened + lines[opened + 1 :]  # (line numbers kept)
    name = head.split("@", 1)[1].split("(", 1)[0] if "@" in head else "?"
    params = set(_NAME.findall(head.split("(", 1)[1] if "(" in head else "")) - types
    defined_at: dict[str, int] = {}
    labels: set[str] = set()
    for number, line in enumerate(lines[1:], 2):
        label, definition = _LABEL.match(line), _DEF.match(line)
        if label:
            if label.group(1) in labels:
                raise IRError(f"@{name}: label {label.group(1)} defined twice (line {number})")
            labels.add(label.group(1))
        elif definition:
            ssa = definition.group(1)
            if ssa in defined_at or ssa in params:
                first = defined_at.get(ssa, 1)
                raise IRError(f"@{name}: {ssa} defined twice (lines {first} and {number})")
            defined_at[ssa] = number
    for number, line in enumerate(lines[1:], 2):
        definition = _DEF.match(line)
        body = line[definition.end():] if definition else line
        if "%" not in body:
            continue
        phi = body.lstrip().startswith("phi ")
        for is_label, ssa in _USE.findall(body):
            if is_label:
                if ssa[1:] not in labels:
                    raise IRError(f"@{name}: branch to undefined label {ssa} (line {number})")
                continue
            at = defined_at.get(ssa)
            if at is None:
                if ssa in params or ssa in types or (phi and ssa[1:] in labels):
                    continue
                raise IRError(f"@{name}: {ssa} used but never defined (line {number})")
            if at >= number and not phi:
                raise IRError(f"@{name}: {ssa} used on line {number} before its definition on line {at}")


def check_module(ir: str) -> None:
    """`check_function` on every function defined in module text `ir`."""
    types = frozenset(_TYPE_DEF.findall(ir))
    for chunk in ir.split("\ndefine ")[1:]:
        end = chunk.find("\n}")
        check_function("define " + chunk[: end + 2], types)
