#!/usr/bin/env python3
"""ptx_check.py: compares what a GPU's conversions gave (tools/trellis/ptx_check.cu) with the
rules of docs/trellismx.md, computed here in numpy.

    python3 tools/trellis/ptx_check.py out.bin

Prints one line per claim and exits 1 if any disagrees.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import make_vectors as mv  # noqa: E402

E4M3 = np.array([float(mv.e4m3_value(c)) for c in range(0x7F)])  # magnitudes of codes 0..126


def rne_e4m3(x):
    """RNE_E4M3 of float64 values (exact differences: every input has at most 24 bits)."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(np.nan_to_num(x, nan=0.0, posinf=1e300, neginf=-1e300)), 448.0)
    hi = np.clip(np.searchsorted(E4M3, a), 0, 0x7E)
    lo = np.maximum(hi - 1, 0)
    dlo, dhi = a - E4M3[lo], E4M3[hi] - a
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a == E4M3[hi], hi, code)
    code = code | np.where(np.signbit(x), 0x80, 0)
    return np.where(np.isnan(x), 0x7F, code).astype(np.uint8)


def main():
    buf = open(sys.argv[1], "rb").read()
    off = 0
    v16 = np.frombuffer(buf, np.uint16, 1021, off)
    off += 2042
    law = np.frombuffer(buf, np.uint8, 1021, off)
    off += 1021
    f16 = np.frombuffer(buf, np.uint8, 65536, off)
    off += 65536
    n = int(np.frombuffer(buf, np.uint32, 1, off)[0])
    off += 4
    x = np.frombuffer(buf, np.float32, n, off)
    off += 4 * n
    f32 = np.frombuffer(buf, np.uint8, n, off)

    ok = True

    def claim(name, good, detail=""):
        nonlocal ok
        ok &= bool(good)
        print("%-62s %s %s" % (name, "yes" if good else "NO", detail))

    want_v = np.array([np.float16(float(mv.v(s))).view(np.uint16) for s in range(1021)])
    claim("hfma(1024 + sigma, 0x1EEE, 0xC931) is v(sigma)", np.array_equal(v16, want_v),
          "(%d differ)" % int(np.sum(v16 != want_v)))
    want_law = np.array(mv.lut_e4m3(), dtype=np.uint8)
    claim("mul1 + cvt.rn.satfinite.e4m3x2.f16x2 is LUT_E4M3", np.array_equal(law, want_law),
          "(%d differ)" % int(np.sum(law != want_law)))
    h = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float64)
    want16 = rne_e4m3(h)
    bad = np.nonzero(f16 != want16)[0]
    claim("cvt.rn.satfinite.e4m3x2.f16x2 is RNE_E4M3 on all 65536 fp16", len(bad) == 0,
          "(%d differ%s)" % (len(bad), ", e.g. %04x -> %02x, spec %02x" % (
              bad[0], f16[bad[0]], want16[bad[0]]) if len(bad) else ""))
    want32 = rne_e4m3(x.astype(np.float64))
    bad = np.nonzero(f32 != want32)[0]
    claim("cvt.rn.satfinite.e4m3x2.f32 is RNE_E4M3 on %d f32" % n, len(bad) == 0,
          "(%d differ%s)" % (len(bad), ", e.g. %r -> %02x, spec %02x" % (
              float(x[bad[0]]), f32[bad[0]], want32[bad[0]]) if len(bad) else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
