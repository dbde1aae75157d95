#!/usr/bin/env python3
"""make_vectors.py: the TrellisMX v1 test vectors (docs/trellismx.md), computed from the spec.

Everything here is derived from the spec's rules with exact arithmetic (Python integers and
fractions; numpy float32 only where the spec fixes f32 rounding, the Hadamard), by methods
chosen to differ from plugins/trellis: rounding searches the list of representable values
instead of splitting exponent and mantissa, the tile position comes from the fragment table,
states are read bit by bit from the ring. The C tests (tests/unit/test_trellis.c) check the
library against these files.

    python3 tools/trellis/make_vectors.py [--out tests/fixtures/trellismx] [--markdown]

--markdown prints the decode-law tables (and law e4m3-pair's Q, §14) in the form
docs/trellismx.md quotes them.
"""
import argparse
import hashlib
import json
import math
import os
import random
import statistics
import sys
from fractions import Fraction

import numpy as np

MUL = 0x83DCD12D
ALPHA = 0.5625  # e2m1 law divisor (9/16), docs/trellismx.md section 4
SIGMAS = 1021

# --- number formats ----------------------------------------------------------------------------


def e4m3_value(code):
    """Exact value of an E4M3 byte (None for NaN)."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return None
    if e == 0:
        v = Fraction(m, 8) * Fraction(1, 64)
    else:
        v = (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7)
    return -v if s else v


E2M1_MAGS = [Fraction(0), Fraction(1, 2), Fraction(1), Fraction(3, 2), Fraction(2), Fraction(3),
             Fraction(4), Fraction(6)]


def e2m1_value(nib):
    v = E2M1_MAGS[nib & 7]
    return -v if nib & 8 else v


def nearest_even(a, mags, max_code):
    """Code of the magnitude nearest to a >= 0 (ties to the even code), saturating."""
    if a > mags[max_code]:
        return max_code
    return min(range(max_code + 1), key=lambda c: (abs(mags[c] - a), c & 1))


E4M3_MAGS = [e4m3_value(c) for c in range(0x7F)]


def rne_e4m3(x, negative=None):
    """x: a Fraction or float (float NaN allowed); negative: sign for zero inputs."""
    if isinstance(x, float) and math.isnan(x):
        return 0x7F
    neg = (math.copysign(1.0, x) < 0) if isinstance(x, float) else x < 0
    if negative is not None:
        neg = negative
    if isinstance(x, float) and math.isinf(x):
        return (0x80 if neg else 0) | 0x7E
    a = abs(Fraction(x))
    return (0x80 if neg else 0) | nearest_even(a, E4M3_MAGS, 0x7E)


def rne_e2m1(x, negative=None):
    if isinstance(x, float) and math.isnan(x):
        return 0x7
    neg = (math.copysign(1.0, x) < 0) if isinstance(x, float) else x < 0
    if negative is not None:
        neg = negative
    if isinstance(x, float) and math.isinf(x):
        return (8 if neg else 0) | 7
    a = abs(Fraction(x))
    return (8 if neg else 0) | nearest_even(a, E2M1_MAGS, 7)


def f32(x):
    return np.float32(x)


def f32_bits(x):
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


# --- decode laws -------------------------------------------------------------------------------


def sigma(state):
    x = (state * MUL) & 0xFFFFFFFF
    return sum((x >> (8 * i)) & 0xFF for i in range(4))


def fp16_value(bits):
    return Fraction(float(np.array([bits], dtype=np.uint16).view(np.float16)[0]))


C1, C0 = fp16_value(0x1EEE), fp16_value(0xC931)


def v(sig):
    """fp16(fma(1024 + sig, 0x1EEE, 0xC931)): the exact product and sum, rounded once to 11
    significant bits, ties to even (Python's round() on a Fraction)."""
    exact = (1024 + sig) * C1 + C0
    e = 0
    while Fraction(2) ** (e + 1) <= abs(exact):
        e += 1
    while Fraction(2) ** e > abs(exact):
        e -= 1
    step = Fraction(2) ** (e - 10)
    r = round(exact / step) * step
    assert float(r) == float(np.float16(float(exact)))  # numpy's float16 agrees
    return r


def lut_e4m3():
    return [rne_e4m3(v(s)) for s in range(SIGMAS)]


def lut_e2m1(alpha):
    a = Fraction(float(f32(alpha)))
    return [rne_e2m1(v(s) / a) for s in range(SIGMAS)]


# --- tiles -------------------------------------------------------------------------------------

# The mma m16n8k16 B fragment: lane l holds (k row, n column) pairs, j = 0..7.
FRAGMENT = [(0, 0), (1, 0), (8, 0), (9, 0), (0, 8), (1, 8), (8, 8), (9, 8)]


def position(t):
    lane, j = divmod(t, 8)
    r0, c0 = 2 * (lane % 4), lane // 4
    dk, dn = FRAGMENT[j]
    k, n = r0 + dk, c0 + dn
    return 16 * n + k


def ring_bits(words, K):
    return [(words[b // 32] >> (31 - b % 32)) & 1 for b in range(256 * K)]


def states_of(words, K):
    bits = ring_bits(words, K)
    ring = 256 * K
    out = []
    for t in range(256):
        end = (t + 1) * K
        s = 0
        for b in range(end - 16, end):
            s = (s << 1) | bits[b % ring]
        out.append(s)
    return out


def symbols_of(words, K):
    bits = ring_bits(words, K)
    return [int("".join(str(b) for b in bits[t * K:(t + 1) * K]), 2) for t in range(256)]


def tile_vector(name, words, K, l4, l2):
    states = states_of(words, K)
    codes4 = [l4[sigma(s)] for s in states]
    nib = [l2[sigma(s)] for s in states]
    packed = [nib[2 * i] | nib[2 * i + 1] << 4 for i in range(128)]
    values = [0.0] * 256
    for t in range(256):
        values[position(t)] = float(e4m3_value(codes4[t]))
    return {
        "name": name, "K": K, "words": ["%08x" % w for w in words],
        "symbols": symbols_of(words, K), "states": states,
        "e4m3": bytes(codes4).hex(), "e2m1": bytes(packed).hex(), "e4m3_values": values,
    }


# --- Hadamard (f32, as the spec orders it) -----------------------------------------------------

NORM = f32(1.0 / math.sqrt(128.0))


def hadamard_f32(x):
    y = np.array(x, dtype=np.float32).reshape(-1, 128).copy()
    h = 1
    while h < 128:
        z = y.reshape(y.shape[0], 128 // (2 * h), 2, h)
        a, b = z[:, :, 0, :].copy(), z[:, :, 1, :].copy()
        z[:, :, 0, :] = a + b
        z[:, :, 1, :] = a - b
        y = z.reshape(-1, 128)
        h *= 2
    return (y * NORM).reshape(-1)


def sylvester(n):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def sign_bits(signs):
    out = bytearray(len(signs) // 8)
    for i, s in enumerate(signs):
        if s < 0:
            out[i // 8] |= 1 << (i % 8)
    return bytes(out)


# --- activations -------------------------------------------------------------------------------


def pow2_exp(amax, mx):
    if amax == 0:
        return 0
    e = -127
    while e < 127 and amax > Fraction(mx) * Fraction(2) ** e:
        e += 1
    return e


def act_e4m3(x):
    e = pow2_exp(max(abs(Fraction(float(a))) for a in x), 448)
    return e, [rne_e4m3(Fraction(float(a)) / Fraction(2) ** e,
                        negative=math.copysign(1.0, float(a)) < 0) for a in x]


def act_nvfp4(x):
    e = pow2_exp(max(abs(Fraction(float(a))) for a in x), 2688)
    scales, nibs = [], []
    for b in range(len(x) // 16):
        xb = x[16 * b:16 * b + 16]
        s = rne_e4m3(max(abs(Fraction(float(a))) for a in xb) / (6 * Fraction(2) ** e))
        scales.append(s)
        d = e4m3_value(s) * Fraction(2) ** e
        for a in xb:
            nibs.append(rne_e2m1(Fraction(float(a)) / d, negative=math.copysign(1.0, float(a)) < 0)
                        if s else 0)
    packed = [nibs[2 * i] | nibs[2 * i + 1] << 4 for i in range(len(nibs) // 2)]
    return e, scales, packed


def mxfp8(x):
    scales, q = [], []
    for b in range(len(x) // 32):
        xb = x[32 * b:32 * b + 32]
        e = pow2_exp(max(abs(Fraction(float(a))) for a in xb), 448)
        scales.append(e + 127)
        q += [rne_e4m3(Fraction(float(a)) / Fraction(2) ** e,
                       negative=math.copysign(1.0, float(a)) < 0) for a in xb]
    return scales, q


# --- CSF ---------------------------------------------------------------------------------------


def csf_encode(plane, rows, cols):
    fixed = bytearray()
    exceptions = []
    for slab in range(rows // 16):
        bases = []
        for r in range(16):
            row = plane[(16 * slab + r) * cols:(16 * slab + r + 1) * cols]
            counts = [sum(1 for x in row if b <= x <= b + 15) for b in range(112)]
            bases.append(counts.index(max(counts)))
        fixed += bytes(bases)
        for r in range(16):
            row_i = 16 * slab + r
            base = bases[r]
            nibs = []
            for c in range(cols):
                x = plane[row_i * cols + c]
                if base <= x <= base + 15:
                    nibs.append(x - base)
                else:
                    nibs.append(0)
                    exceptions.append((row_i * cols + c) | x << 24)
            fixed += bytes(nibs[2 * i] | nibs[2 * i + 1] << 4 for i in range(cols // 2))
    return bytes(fixed), exceptions


# --- matrices ----------------------------------------------------------------------------------


def matrix_vector(rng, law, K, rows, cols, lut, value_of, block):
    nw = 8 * K
    words = [rng.getrandbits(32) for _ in range(rows // 16 * cols // 16 * nw)]
    # Row norms spread over two octaves, so that scales vary as real ones do.
    scales = []
    for r in range(rows):
        centre = 0x30 + rng.randrange(0, 16)
        scales += [max(0, min(0x7E, centre + rng.randrange(-3, 4))) for _ in range(cols // block)]
    g = float(f32(0.0123))
    s_in = [rng.choice((1, -1)) for _ in range(cols)]
    s_out = [rng.choice((1, -1)) for _ in range(rows)]
    q = np.zeros((rows, cols))
    for tr in range(rows // 16):
        for tc in range(cols // 16):
            tw = words[(tr * (cols // 16) + tc) * nw:(tr * (cols // 16) + tc + 1) * nw]
            for t, s in enumerate(states_of(tw, K)):
                n, k = divmod(position(t), 16)
                row, col = 16 * tr + n, 16 * tc + k
                b = e4m3_value(scales[row * (cols // block) + col // block])
                q[row, col] = g * float(b) * float(value_of(lut[sigma(s)]))
    h = sylvester(128) / math.sqrt(128)
    hr, hc = np.kron(np.eye(rows // 128), h), np.kron(np.eye(cols // 128), h)
    w = np.diag(s_out) @ hr @ q @ hc @ np.diag(s_in)
    picks = sorted(rng.sample(range(rows * cols), 256))
    return {
        "law": law, "K": K, "block": block, "rows": rows, "cols": cols,
        "words": "".join("%08x" % x for x in words), "scales": bytes(scales).hex(),
        "scale": g, "sign_in": sign_bits(s_in).hex(), "sign_out": sign_bits(s_out).hex(),
        "max_abs": float(np.abs(w).max()),
        "samples": [[p, float(w.flat[p])] for p in picks],
        "q_samples": [[p, float(q.flat[p])] for p in picks],
    }


# --- files -------------------------------------------------------------------------------------


def numbers():
    e4m3_cases = [0.0, -0.0, 1.0, -1.0, 448.0, -448.0, 464.0, 479.0, 480.0, 1e6, float("inf"),
                  -float("inf"), float("nan"), 2.0 ** -9, 2.0 ** -10, 2.0 ** -10 * 1.0001,
                  -2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -6, 15 * 2.0 ** -10, 1.0625, 1.1875,
                  1.0625 * (1 + 2 ** -20), 240.0, 248.0, 0.1, -0.3, 3.14159, 17.0, 18.0, 19.0,
                  2.0 ** -126, 1e-40, 432.0, 447.0]
    e2m1_cases = [0.0, -0.0, 0.25, -0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 6.0, 7.0,
                  100.0, float("inf"), -float("inf"), float("nan"), 0.5, 1.0, 1.5, -2.75, 4.5,
                  0.2499, -5.5]
    return {
        "e4m3_round": [["%08x" % f32_bits(x), rne_e4m3(float(f32(x)))] for x in e4m3_cases],
        "e2m1_round": [["%08x" % f32_bits(x), rne_e2m1(float(f32(x)))] for x in e2m1_cases],
        "e4m3_values": [None if e4m3_value(c) is None else float(e4m3_value(c))
                        for c in range(256)],
        "e2m1_values": [float(e2m1_value(n)) for n in range(16)],
    }


def laws():
    l4, l2 = lut_e4m3(), lut_e2m1(ALPHA)
    states = [0, 1, 2, 0x8000, 0xFFFF, 0x1234, 0xBEEF, 0x7FFF, 0x00FF, 0xA5A5]
    return {
        "multiplier": "0x%08X" % MUL,
        "alpha": ALPHA,
        "sigma": [[s, sigma(s)] for s in states],
        # fp16 rounding decides the code at 224, 471, 568, 598 and 935: the exact value would
        # round to the neighbouring E4M3 code.
        "v": [[s, float(v(s))] for s in (0, 1, 224, 471, 510, 511, 568, 598, 935, 1020)],
        "lut_e4m3": bytes(l4).hex(),
        "lut_e2m1": "".join("%x" % n for n in l2),
        "sha256_e4m3": hashlib.sha256(bytes(l4)).hexdigest(),
        "sha256_e2m1": hashlib.sha256(bytes(l2)).hexdigest(),
    }


def tiles(rng):
    l4, l2 = lut_e4m3(), lut_e2m1(ALPHA)
    out = {"positions": [position(t) for t in range(256)], "tiles": []}
    for K in range(2, 7):
        nw = 8 * K
        out["tiles"].append(tile_vector("zeros-K%d" % K, [0] * nw, K, l4, l2))
        out["tiles"].append(tile_vector("ones-K%d" % K, [0xFFFFFFFF] * nw, K, l4, l2))
        out["tiles"].append(tile_vector("random-K%d" % K, [rng.getrandbits(32) for _ in range(nw)],
                                        K, l4, l2))
    # One bit set: every state that sees it differs from zero, around the ring's seam too.
    out["tiles"].append(tile_vector("first-bit-K3", [0x80000000] + [0] * 23, 3, l4, l2))
    out["tiles"].append(tile_vector("last-bit-K3", [0] * 23 + [1], 3, l4, l2))
    return out


PAIR_MUL = (0x5D9DC9F9, 0x9531985D)


def pair_table():
    """Law e4m3-pair (§14): code i of state s is Q[(s * PAIR_MUL[i] mod 2^32) >> 22]."""
    nd = statistics.NormalDist()
    q = [rne_e4m3(nd.inv_cdf((j + 0.5) / 1024)) for j in range(1024)]
    code = [[q[(s * m & 0xFFFFFFFF) >> 22] for s in range(65536)] for m in PAIR_MUL]
    return q, [code[0][s] | code[1][s] << 8 for s in range(65536)]


def pair_fnv(table):
    """FNV-1a 64 of the pair table's bytes, each pair low byte first."""
    fnv = 0xCBF29CE484222325
    for p in table:
        for b in (p & 0xFF, p >> 8):
            fnv = ((fnv ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % fnv


def pair(rng):
    q, table = pair_table()
    out = {"quantiles": bytes(q).hex(), "fnv1a64": pair_fnv(table),
           "pairs": [[s, table[s]] for s in (0, 1, 2, 0x8000, 0xFFFF, 0x1234, 0xBEEF, 0x7FFF)],
           "tiles": []}
    for K in range(2, 5):
        words = [rng.getrandbits(32) for _ in range(8 * K)]
        states = states_of(words, K)
        codes = []
        for t in range(0, 256, 2):  # positions 2t, 2t + 1 by the state of 2t + 1
            p = table[states[t + 1]]
            codes += [p & 0xFF, p >> 8]
        values = [0.0] * 256
        for t in range(256):
            values[position(t)] = float(e4m3_value(codes[t]))
        out["tiles"].append({"K": K, "words": ["%08x" % w for w in words],
                             "codes": bytes(codes).hex(), "values": values})
    return out


def hadamard(rng):
    x = np.array([rng.gauss(0, 1) * 3 for _ in range(256)], dtype=np.float32)
    x[5], x[130] = np.float32(1e-30), np.float32(-65504.0)
    signs = [rng.choice((1, -1)) for _ in range(256)]
    h = hadamard_f32(x)
    rot = hadamard_f32(x * np.array(signs, dtype=np.float32))
    exact = np.kron(np.eye(2), sylvester(128) / math.sqrt(128)) @ x.astype(np.float64)
    assert np.max(np.abs(h - exact)) < 1e-4 * np.max(np.abs(exact))
    assert f32_bits(NORM) == 0x3DB504F3
    return {
        "x": ["%08x" % f32_bits(a) for a in x],
        "h": ["%08x" % f32_bits(a) for a in h],
        "signs": sign_bits(signs).hex(),
        "rotated": ["%08x" % f32_bits(a) for a in rot],
    }


def activations(rng):
    x = [rng.gauss(0, 1) for _ in range(64)]
    x[3], x[4], x[9] = 17.5, -0.0, 1e-3
    xe = [float(f32(a)) for a in x]
    # Ties with e = 0: 232 between 224 and 240, -216 between -208 and -224, 13.5 between 13
    # and 14; each goes to the even code.
    ties = [float(f32(a)) for a in [232.0, -216.0, 13.5, 0.0] + [1.0] * 28]
    # NVFP4: one zero block, one whose scale rounds down (saturating its max), one tiny block.
    nv = [float(f32(rng.gauss(0, 2))) for _ in range(64)]
    for i in range(16, 32):
        nv[i] = 0.0
    nv[32:48] = [float(f32(a)) for a in [6.5 * 4.25] + [1.3] * 15]
    nv[48:64] = [float(f32(a * 1e-4)) for a in nv[48:64]]
    mx = [float(f32(rng.gauss(0, 1) * 100)) for _ in range(64)]
    mx[32:64] = [0.0] * 32
    out = {"e4m3": [], "nvfp4": [], "mxfp8": []}
    for xs in (xe, ties):
        e, q = act_e4m3(xs)
        out["e4m3"].append({"x": ["%08x" % f32_bits(a) for a in xs], "exp": e, "q": bytes(q).hex()})
    e, s, q = act_nvfp4(nv)
    out["nvfp4"].append({"x": ["%08x" % f32_bits(a) for a in nv], "exp": e,
                         "scales": bytes(s).hex(), "q": bytes(q).hex()})
    s, q = mxfp8(mx)
    out["mxfp8"].append({"x": ["%08x" % f32_bits(a) for a in mx], "scales": bytes(s).hex(),
                         "q": bytes(q).hex()})
    return out


def csf(rng):
    out = []
    rows, cols = 32, 8
    plane = []
    for r in range(rows):
        centre = 0x28 + rng.randrange(0, 24)
        plane += [max(0, min(0x7E, centre + rng.randrange(-6, 7))) for _ in range(cols)]
    plane[3 * cols + 2] = 0x00      # far below its row: an exception
    plane[17 * cols + 7] = 0x7E     # far above
    plane[20 * cols:21 * cols] = [0x10, 0x60, 0x10, 0x60, 0x10, 0x60, 0x10, 0x61]  # a tie of bases
    plane[31 * cols:32 * cols] = [0x7E] * cols  # a base at its limit (111)
    fixed, ex = csf_encode(plane, rows, cols)
    out.append({"rows": rows, "cols": cols, "scales": bytes(plane).hex(), "fixed": fixed.hex(),
                "exceptions": ex})
    return out


def matrices(rng):
    l4, l2 = lut_e4m3(), lut_e2m1(ALPHA)
    return [matrix_vector(rng, "e4m3", 3, 128, 256, l4, e4m3_value, 32),
            matrix_vector(rng, "e2m1", 4, 256, 128, l2, e2m1_value, 16)]


def markdown():
    l4, l2 = lut_e4m3(), lut_e2m1(ALPHA)
    h4, h2 = bytes(l4).hex(), "".join("%x" % n for n in l2)
    print("LUT_E4M3, 1021 bytes, sigma 0.. in order, 32 bytes a line:\n\n```")
    for i in range(0, len(h4), 64):
        print(h4[i:i + 64])
    print("```\nSHA-256: `%s`\n" % hashlib.sha256(bytes(l4)).hexdigest())
    print("LUT_E2M1 (alpha = %s), 1021 nibbles, one hex digit each, 64 a line:\n\n```" % ALPHA)
    for i in range(0, len(h2), 64):
        print(h2[i:i + 64])
    print("```\nSHA-256 (one nibble per byte): `%s`\n" % hashlib.sha256(bytes(l2)).hexdigest())
    q, table = pair_table()
    print("Q of law e4m3-pair, 1024 bytes, 32 a line:\n\n```")
    hq = bytes(q).hex()
    for i in range(0, len(hq), 64):
        print(hq[i:i + 64])
    print("```\nFNV-1a 64 of the pair table: `%s`" % pair_fnv(table))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests",
                                                  "fixtures", "trellismx"))
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    if args.markdown:
        markdown()
        return 0
    rng = random.Random(20240601)
    os.makedirs(args.out, exist_ok=True)
    files = {"numbers.json": numbers(), "laws.json": laws(), "tiles.json": tiles(rng),
             "hadamard.json": hadamard(rng), "activations.json": activations(rng),
             "csf.json": csf(rng), "matrices.json": matrices(rng),
             "pair.json": pair(random.Random(20261205))}
    for name, data in files.items():
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(data, f, separators=(",", ":"))
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
