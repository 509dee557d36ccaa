"""Facts about compiled kernels read from their PTX text (loops, instruction counts, load widths, waits) and from
their SASS (the machine code ``cuobjdump -sass`` prints: what the GPU issues, e.g. ``I2F`` vs ``I2FP``).

The kernels' speed claims are checked ahead of time on a CPU (``scripts/ptx_stats.py``,
``tests/kernels/test_ptx_stats.py``): Triton compiles them for sm_90 / sm_80 without a GPU and these pure functions
read the result. A *loop* is a PTX label with a later branch back to it; its *body* is the instructions from the
label to that branch (labels, directives, comments and braces are not instructions; an inline-assembly block counts
its instructions). Counts are per thread: PTX is the program of one thread.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_VECTOR = re.compile(r"\.v(\d)\.(?:b|u|s|f)(\d+)")
_SCALAR = re.compile(r"\.(?:b|u|s|f)(\d+)\s")


@dataclass(frozen=True)
class Loop:
    """One PTX loop: its label and the instructions of its body (opcode first)."""

    label: str
    body: tuple[str, ...]

    def opcodes(self) -> Counter[str]:
        return Counter(opcode(line) for line in self.body)

    def count(self, fragment: str) -> int:
        """Instructions whose text contains ``fragment`` (e.g. ``"shfl"``, ``"bar.sync"``)."""
        return sum(fragment in line for line in self.body)

    def load_bytes(self, marker: str) -> list[int]:
        """Bytes per thread of each ``ld.global`` whose text contains ``marker`` (a cache hint or modifier)."""
        return [load_width(line) for line in self.body if "ld.global" in line and marker in line]


def instructions(lines: list[str]) -> list[str]:
    """The instruction lines among PTX ``lines`` (stripped): not labels, directives, comments or braces."""
    out = []
    for raw in lines:
        line = raw.strip()
        if line and line[0] not in "$./{}" and not line.startswith("//"):
            out.append(line)
    return out


def opcode(line: str) -> str:
    """The opcode of an instruction line, without its guard predicate (``@%p1 ld.global.v4.b32 ...``)."""
    parts = line.split()
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def load_width(line: str) -> int:
    """Bytes one thread moves with a load instruction (``.v4.b32`` = 16)."""
    vec = _VECTOR.search(line)
    if vec:
        return int(vec.group(1)) * int(vec.group(2)) // 8
    scalar = _SCALAR.search(line)
    if scalar is None:
        raise ValueError(f"no operand width in {line!r}")
    return int(scalar.group(1)) // 8


def loops(ptx: str) -> list[Loop]:
    """Every loop of a PTX text (outermost extent: from the label to the last branch back to it)."""
    lines = ptx.splitlines()
    found = []
    for start, line in enumerate(lines):
        match = _LABEL.match(line)
        if not match:
            continue
        back = re.compile(r"\bbra(?:\.uni)?\s+" + re.escape(match.group(1)) + r";")
        ends = [i for i in range(start + 1, len(lines)) if back.search(lines[i])]
        if ends:
            found.append(Loop(match.group(1), tuple(instructions(lines[start + 1 : ends[-1] + 1]))))
    return found


def main_loop(ptx: str, marker: str) -> Loop:
    """The loop that moves the most bytes through loads containing ``marker`` (the weight's cache hint)."""
    candidates = [(sum(loop.load_bytes(marker)), loop) for loop in loops(ptx)]
    candidates = [c for c in candidates if c[0] > 0]
    if not candidates:
        raise ValueError(f"no loop with a load marked {marker!r}")
    return max(candidates, key=lambda c: c[0])[1]


def waits_in_loops(ptx: str, instruction: str = "cp.async.wait_group") -> list[int]:
    """The depths of every ``cp.async.wait_group N`` (or ``wgmma.wait_group.sync.aligned N``) inside a loop."""
    depths = []
    for loop in loops(ptx):
        for line in loop.body:
            match = re.search(re.escape(instruction) + r"(?:\.[a-z]+)*\s+(\d+)", line)
            if match:
                depths.append(int(match.group(1)))
    return depths


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_SASS_BRANCH = re.compile(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)")


def sass_loops(sass: str) -> list[tuple[int, int, Counter[str]]]:
    """Every loop of a ``cuobjdump -sass`` listing (one kernel): ``(first line, last line, opcodes)`` from the
    target of a backward ``BRA`` to that branch (predicated instructions count once), longest first."""
    lines = sass.splitlines()
    at = {}
    for i, line in enumerate(lines):
        match = _SASS_LINE.search(line)
        if match:
            at[int(match.group(1), 16)] = i
    found = []
    for i, line in enumerate(lines):
        branch, here = _SASS_BRANCH.search(line), _SASS_LINE.search(line)
        if branch and here and int(branch.group(1), 16) < int(here.group(1), 16):
            start = at.get(int(branch.group(1), 16))
            if start is not None:
                body = Counter(m.group(2) for m in map(_SASS_LINE.search, lines[start : i + 1]) if m)
                found.append((start, i, body))
    return sorted(found, key=lambda loop: -sum(loop[2].values()))


def sass_loop(sass: str) -> Counter[str]:
    """Opcodes (``FFMA``, ``I2F``, ...) of the longest loop of a ``cuobjdump -sass`` listing (:func:`sass_loops`)."""
    found = sass_loops(sass)
    return found[0][2] if found else Counter()


def sass_executed(sass: str, inner_trips: int) -> int:
    """Instructions one iteration of the longest loop executes when each loop inside it runs ``inner_trips``
    times (its body is counted once in the outer loop's listing, ``inner_trips - 1`` more times here)."""
    found = sass_loops(sass)
    if not found:
        return 0
    start, end, body = found[0]
    inner = [b for s, e, b in found[1:] if start <= s and e <= end]
    return sum(body.values()) + (inner_trips - 1) * sum(sum(b.values()) for b in inner)
