"""tools/safetensors_io.py against itself and against the C parser (libtmx.so through ctypes):
files it writes must read back bit-exactly in both, with every tensor aligned to its element
size, and sharded checkpoints of its files must open with tmx_checkpoint_open."""
import ctypes as C
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import safetensors_io as sio  # noqa: E402

DTYPES = ["F32", "BF16", "F16", "F8_E4M3", "U8", "I32"]  # enum tmx_dtype order
ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1, "I32": 4}


class Tensor(C.Structure):
    _fields_ = [("dtype", C.c_int), ("ndim", C.c_int), ("shape", C.c_int64 * 4),
                ("data", C.c_void_p)]


@pytest.fixture(scope="module")
def lib(libtmx):
    """libtmx.so (conftest.py) with the signatures of the safetensors and checkpoint calls."""
    P, S, T = C.c_void_p, C.c_char_p, C.POINTER(Tensor)
    for fn, args, res in [
        ("tmx_safetensors_open", [S, C.POINTER(P), C.POINTER(P)], C.c_int),
        ("tmx_safetensors_free", [P], None),
        ("tmx_safetensors_count", [P], C.c_size_t),
        ("tmx_safetensors_at", [P, C.c_size_t, T], S),
        ("tmx_safetensors_find", [P, S, T], C.c_int),
        ("tmx_safetensors_meta", [P, S], S),
        ("tmx_checkpoint_open", [S, C.POINTER(P), C.POINTER(P)], C.c_int),
        ("tmx_checkpoint_free", [P], None),
        ("tmx_checkpoint_count", [P], C.c_size_t),
        ("tmx_checkpoint_at", [P, C.c_size_t, T, C.POINTER(S)], S),
        ("tmx_free", [P], None),
    ]:
        getattr(libtmx, fn).argtypes, getattr(libtmx, fn).restype = args, res
    return libtmx


def check(lib, status, err):
    """Raises with the C message on failure, freeing it."""
    if status != 0:
        msg = C.string_at(err.value).decode()
        lib.tmx_free(err)
        raise RuntimeError(msg)


def tensor_bytes(t):
    n = int(np.prod([t.shape[i] for i in range(t.ndim)]))
    return C.string_at(t.data, n * ITEMSIZE[DTYPES[t.dtype]]) if n else b""


def sample():
    rng = np.random.default_rng(0)
    f = rng.standard_normal((3, 5)).astype(np.float32)
    return {
        "f32": f,
        "bf16": sio.Bf16(f),
        "f16": f.astype(np.float16),
        "u8": np.arange(7, dtype=np.uint8),
        "i32": np.array([[-1, 2], [3, -4]], dtype=np.int32),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((4, 0), dtype=np.float16),
    }


def test_roundtrip_python(tmp_path):
    tensors = sample()
    sio.save_file(tmp_path / "a.safetensors", tensors, {"format": "pt"})
    back, meta = sio.load_file(tmp_path / "a.safetensors")
    assert meta == {"format": "pt"}
    assert set(back) == set(tensors)
    for name, a in tensors.items():
        assert back[name].dtype == a.dtype and back[name].shape == a.shape
        assert back[name].tobytes() == a.tobytes()


def test_c_parser_reads_writer_output(lib, tmp_path):
    tensors = sample()
    path = tmp_path / "a.safetensors"
    sio.save_file(path, tensors, {"format": "pt", "note": "ünïcode"})
    st, err = C.c_void_p(), C.c_void_p()
    check(lib, lib.tmx_safetensors_open(str(path).encode(), C.byref(st), C.byref(err)), err)
    try:
        assert lib.tmx_safetensors_count(st) == len(tensors)
        assert lib.tmx_safetensors_meta(st, b"note").decode() == "ünïcode"
        assert lib.tmx_safetensors_meta(st, b"absent") is None
        want_dtype = {"f32": "F32", "bf16": "BF16", "f16": "F16", "u8": "U8", "i32": "I32",
                      "scalar": "F32", "empty": "F16"}
        prev = -1
        for i in range(len(tensors)):
            t = Tensor()
            name = lib.tmx_safetensors_at(st, i, C.byref(t)).decode()
            a = tensors[name]
            assert DTYPES[t.dtype] == want_dtype[name]
            assert tuple(t.shape[:t.ndim]) == a.shape
            assert tensor_bytes(t) == a.tobytes()
            assert t.data % ITEMSIZE[DTYPES[t.dtype]] == 0, f"{name} misaligned"
            assert t.data >= prev  # file order: by data offset
            prev = t.data
            found = Tensor()
            assert lib.tmx_safetensors_find(st, name.encode(), C.byref(found)) == 0
            assert found.data == t.data
        assert lib.tmx_safetensors_find(st, b"missing", None) == -1
    finally:
        lib.tmx_safetensors_free(st)


def test_c_parser_rejects_f64(lib, tmp_path):
    header = json.dumps({"x": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "f64.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    st, err = C.c_void_p(), C.c_void_p()
    with pytest.raises(RuntimeError, match=r"f64\.safetensors: tensor 'x': dtype F64"):
        check(lib, lib.tmx_safetensors_open(str(path).encode(), C.byref(st), C.byref(err)), err)


def test_sharded_checkpoint(lib, tmp_path):
    tensors = sample()
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {n: files[i % 2] for i, n in enumerate(names)}
    for f in files:
        sio.save_file(tmp_path / f, {n: tensors[n] for n in names if weight_map[n] == f})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    ck, err = C.c_void_p(), C.c_void_p()
    check(lib, lib.tmx_checkpoint_open(str(tmp_path).encode(), C.byref(ck), C.byref(err)), err)
    try:
        assert lib.tmx_checkpoint_count(ck) == len(names)
        for i, name in enumerate(names):
            t, file = Tensor(), C.c_char_p()
            assert lib.tmx_checkpoint_at(ck, i, C.byref(t), C.byref(file)).decode() == name
            assert file.value.decode() == weight_map[name]
            assert tensor_bytes(t) == tensors[name].tobytes()
    finally:
        lib.tmx_checkpoint_free(ck)


def test_bf16_rounding():
    one = np.float32(1.0)
    cases = {
        1.0: 0x3F80,
        float(one + np.float32(2.0**-8)): 0x3F80,      # halfway: ties to the even 0x3F80
        float(one + np.float32(3 * 2.0**-8)): 0x3F82,  # halfway: ties to the even 0x3F82
        float(one + np.float32(2.0**-8 + 2.0**-20)): 0x3F81,  # above halfway rounds up
        -2.0: 0xC000,
        float("inf"): 0x7F80,
        float(np.float32(3.4028235e38)): 0x7F80,       # largest f32 rounds to infinity
    }
    got = sio.f32_to_bf16_bits(np.array(list(cases), dtype=np.float32))
    assert [int(g) for g in got] == list(cases.values())
    nan = sio.f32_to_bf16_bits(np.array([np.nan], dtype=np.float32))
    assert np.isnan(sio.bf16_bits_to_f32(nan))[0]
    x = np.array([0.5, -3.25, 1e-3], dtype=np.float32)
    assert np.allclose(sio.bf16_bits_to_f32(sio.f32_to_bf16_bits(x)), x, rtol=2.0**-8)


def test_writer_refuses_other_dtypes(tmp_path):
    with pytest.raises(TypeError, match="'x'.*float64"):
        sio.save_file(tmp_path / "a.safetensors", {"x": np.zeros(2)})
