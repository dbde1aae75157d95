#!/usr/bin/env python3
"""Writes the seed corpus of the safetensors fuzz target (core/fuzz/fuzz_safetensors.c).

    python3 tools/make_fuzz_corpus.py [OUT_DIR]      (default: tests/fuzz/seeds)

A handful of tiny files: valid ones of every dtype tmx reads, with metadata, gaps, empty and
scalar tensors, and invalid ones that stop at each kind of check, so that the fuzzer starts from
inputs that reach deep into the parser. tools/fuzz.sh runs the target on these.
"""
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402


def raw(header, data_len):
    """A file from a header (dict or JSON text) and data_len bytes of 0..255."""
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
    return struct.pack("<Q", len(text)) + text.encode() + bytes(i % 256 for i in range(data_len))


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests", "fuzz", "seeds")
    os.makedirs(out, exist_ok=True)
    f = np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)
    safetensors_io.save_file(os.path.join(out, "valid-dtypes.safetensors"), {
        "f32": f, "bf16": safetensors_io.Bf16(f), "f16": f.astype(np.float16),
        "u8": np.arange(3, dtype=np.uint8), "i32": np.array([[-1], [7]], dtype=np.int32),
        "scalar": np.array(1.5, dtype=np.float32), "empty": np.zeros((0, 4), dtype=np.float16),
    }, {"format": "pt"})
    files = {
        "valid-fp8-gap.safetensors": raw({"__metadata__": {"k": "v"},
                                          "b": entry("F8_E4M3", [2, 2], 6, 10),
                                          "a": entry("U8", [1, 1, 1, 3], 0, 3)}, 12),
        "bad-overlap.safetensors": raw({"a": entry("F32", [2], 0, 8),
                                        "b": entry("F32", [2], 4, 12)}, 12),
        "bad-dtype.safetensors": raw({"a": entry("F64", [1], 0, 8)}, 8),
        "bad-size.safetensors": raw({"a": entry("I32", [3], 0, 8)}, 8),
        "bad-past-end.safetensors": raw({"a": entry("BF16", [4], 0, 8)}, 6),
        "bad-duplicate.safetensors": raw('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                         '"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', 2),
        "bad-shape-overflow.safetensors": raw({"a": entry("F32", [1 << 32, 1 << 32], 0, 0)}, 0),
        "bad-not-object.safetensors": raw("[1,2]", 0),
        "bad-json.safetensors": raw('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]', 1),
        "bad-header-length.safetensors": struct.pack("<Q", 1 << 40) + b"{}",
    }
    for name, blob in files.items():
        with open(os.path.join(out, name), "wb") as fh:
            fh.write(blob)


if __name__ == "__main__":
    main()
