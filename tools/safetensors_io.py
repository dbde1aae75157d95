"""Minimal safetensors writer and reader on numpy alone, for tmx's Python tools and tests.

    save_file(path, {name: array}, metadata=None)     metadata: {str: str}, or None
    tensors, metadata = load_file(path)

A file is `u64 little-endian header length | JSON header | data`; the header maps each name to
{"dtype", "shape", "data_offsets": [begin, end)} within the data section, plus an optional
"__metadata__" of strings. Arrays map to dtypes by numpy type:

    float32 -> F32   float16 -> F16   uint16 -> BF16 (raw bits)   uint8 -> U8   int32 -> I32

numpy has no bfloat16: Bf16(a) (or f32_to_bf16_bits) turns floats into the uint16 bit patterns
that save_file stores as BF16, and bf16_bits_to_f32 widens them back. load_file returns BF16 as
uint16 and F8_E4M3 as uint8 bytes. The header is padded with spaces to a multiple of 8 and
tensors are laid out widest element first, so that every tensor is aligned to its element size.
"""
import json
import struct

import numpy as np

_TO_DTYPE = {"f4": "F32", "f2": "F16", "u2": "BF16", "u1": "U8", "i4": "I32"}
_TO_NUMPY = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "U8": "u1", "F8_E4M3": "u1",
             "I32": "<i4"}


def f32_to_bf16_bits(a):
    """float array -> uint16 bfloat16 bits, rounding float32 to nearest even; NaN stays NaN."""
    u = np.asarray(a, dtype=np.float32, order="C").view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def bf16_bits_to_f32(bits):
    """uint16 bfloat16 bits -> float32 array (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def Bf16(a):  # noqa: N802 - reads as a dtype tag where tensors are listed: {name: Bf16(w)}
    """A float array to be stored as BF16: the same as f32_to_bf16_bits."""
    return f32_to_bf16_bits(a)


def nbytes(a):
    """Bytes a tensor takes in the data section."""
    return np.asarray(a).nbytes


def save_file(path, tensors, metadata=None):
    arrays = {}
    for name, a in tensors.items():
        a = np.asarray(a, order="C")
        if a.dtype.str[1:] not in _TO_DTYPE:
            raise TypeError(f"{path}: tensor {name!r}: numpy dtype {a.dtype} has no tmx dtype")
        arrays[name] = a.astype(a.dtype.newbyteorder("<"), copy=False)
    header = {"__metadata__": dict(metadata)} if metadata else {}
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    offset = 0
    for name in order:
        a = arrays[name]
        header[name] = {"dtype": _TO_DTYPE[a.dtype.str[1:]], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in order:
            f.write(arrays[name].tobytes())


def load_file(path):
    """({name: read-only array}, {key: value}) of one file, in the file's header order."""
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack_from("<Q", buf)
    header = json.loads(buf[8:8 + n])
    metadata = header.pop("__metadata__", {})
    data = memoryview(buf)[8 + n:]
    tensors = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        a = np.frombuffer(data[begin:end], dtype=_TO_NUMPY[e["dtype"]])
        tensors[name] = a.reshape(e["shape"])
    return tensors, metadata
