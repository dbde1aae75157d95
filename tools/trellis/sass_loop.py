#!/usr/bin/env python3
"""sass_loop.py: the instructions of a kernel's main loop, by opcode, per tile
(docs/perf/h200-codec.md, "Integer ops per weight, from SASS").

Reads one function's SASS (cuobjdump -sass -fun NAME) on stdin; the main loop is the longest
backward branch's span (BRA, or BRA.U on a uniform predicate as sm_120a code has it), from its
target to the branch. Prints the loop's instruction count and the most frequent opcodes, each
divided by the tiles one trip of the loop covers.

    cuobjdump -sass -arch sm_120a -fun _Z9mm_kernelILi3ELb1ELi1ELb1EEv9mm_params BIN \\
        | python3 tools/trellis/sass_loop.py [--tiles 16] [--inner]
"""
import argparse
import collections
import re
import sys

INSTR = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
TARGET = re.compile(r"0x([0-9a-f]+)\s*$")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiles", type=float, default=16, help="tiles a trip of the loop (16)")
    ap.add_argument("--top", type=int, default=16, help="opcodes to list (16)")
    ap.add_argument("--inner", action="store_true",
                    help="the longest loop with no loop inside (a persistent kernel's chunk loop)")
    args = ap.parse_args()

    code = []  # (address, opcode, operands)
    for line in sys.stdin:
        m = INSTR.match(line)
        if m:
            code.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []  # (target, branch) of every backward branch
    for at, op, rest in code:
        t = TARGET.search(rest) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < at:
            loops.append((int(t.group(1), 16), at))
    if args.inner:
        loops = [(a, b) for a, b in loops
                 if not any(a <= c < d <= b and (c, d) != (a, b) for c, d in loops)]
    lo = hi = 0
    for a, b in loops:
        if b - a > hi - lo:
            lo, hi = a, b
    if hi == lo:
        sys.exit("sass_loop.py: no backward branch in the input (is it one function's SASS?)")
    ops = collections.Counter(op.split(".")[0] for at, op, _ in code if lo <= at <= hi)
    print("loop %x..%x: %.2f instructions a tile" % (lo, hi, sum(ops.values()) / args.tiles))
    for op, n in ops.most_common(args.top):
        print("  %-8s %7.2f" % (op, n / args.tiles))


if __name__ == "__main__":
    main()
