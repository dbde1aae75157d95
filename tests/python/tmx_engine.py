"""ctypes binding of the engine API (core/include/tmx/tmx.h, model.h) for the Python tests.

Only what the tests need: open a model directory, run a sequence, read logits.
"""
import ctypes as C
import json
import os

import numpy as np

BIN_DIR = os.environ.get("TMX_BIN_DIR", os.path.join(os.path.dirname(__file__), "../../build/bin"))

_lib = None


def lib():
    global _lib
    if _lib is None:
        _lib = C.CDLL(os.path.join(BIN_DIR, "libtmx.so"))
        P, I, S = C.c_void_p, C.c_int, C.c_char_p
        _lib.tmx_engine_open.argtypes = [S, S, I, C.POINTER(S), C.POINTER(P), C.POINTER(P)]
        _lib.tmx_engine_free.argtypes = [P]
        _lib.tmx_engine_model.argtypes = [P]
        _lib.tmx_engine_model.restype = P
        _lib.tmx_engine_n_vocab.argtypes = [P]
        _lib.tmx_engine_n_ctx.argtypes = [P]
        _lib.tmx_seq_new.argtypes = [P, I, C.POINTER(P), C.POINTER(P)]
        _lib.tmx_seq_prefix.argtypes = [P, C.POINTER(C.c_int32), I]
        _lib.tmx_seq_n_past.argtypes = [P]
        _lib.tmx_seq_reserve.argtypes = [P, I, C.POINTER(P)]
        _lib.tmx_model_step.argtypes = [P, C.POINTER(P), C.POINTER(C.POINTER(C.c_int32)),
                                        C.POINTER(I), I, C.POINTER(C.c_float), C.POINTER(P)]
        _lib.tmx_model_step_greedy.argtypes = [P, C.POINTER(P), C.POINTER(C.POINTER(C.c_int32)),
                                               C.POINTER(I), I, I, C.POINTER(C.c_int32),
                                               C.POINTER(P)]
        _lib.tmx_model_can_top.argtypes = [P]
        _lib.tmx_model_can_edit.argtypes = [P]
        _lib.tmx_model_step_top.argtypes = [P, C.POINTER(P), C.POINTER(C.POINTER(C.c_int32)),
                                            C.POINTER(I), I, I, C.POINTER(C.c_float),
                                            C.POINTER(C.c_int32), P,
                                            C.POINTER(C.c_float), C.POINTER(C.c_int32),
                                            C.POINTER(C.c_double), C.POINTER(P)]
        _lib.tmx_model_read_logits.argtypes = [P, I, C.POINTER(C.c_float), C.POINTER(P)]
        _lib.tmx_seq_free.argtypes = [P]
        _lib.tmx_seq_forward.argtypes = [P, C.POINTER(C.c_int32), I, C.POINTER(C.c_float), I,
                                         C.POINTER(P)]
        _lib.tmx_model_kv_usage.argtypes = [P, C.POINTER(KvUsage)]
        _lib.tmx_free.argtypes = [P]
    return _lib


class KvUsage(C.Structure):
    _fields_ = [("full_used", C.c_int), ("full_total", C.c_int), ("sliding_used", C.c_int),
                ("sliding_total", C.c_int), ("block_size", C.c_int)]


class TmxError(RuntimeError):
    pass


def _check(status, err):
    if status != 0:
        msg = C.string_at(err.value).decode() if err.value else "status %d" % status
        lib().tmx_free(err)
        raise TmxError(msg)


class Engine:
    """An engine on a model directory, with `key=value` config overrides."""

    def __init__(self, model_dir, overrides=(), config=None):
        arr = (C.c_char_p * max(1, len(overrides)))(*[o.encode() for o in overrides])
        self.handle, err = C.c_void_p(), C.c_void_p()
        _check(lib().tmx_engine_open(model_dir.encode(), config.encode() if config else None,
                                     len(overrides), arr, C.byref(self.handle), C.byref(err)),
               err)
        with open(os.path.join(model_dir, "config.json")) as f:
            self.vocab_size = json.load(f)["vocab_size"]
        self.n_vocab = lib().tmx_engine_n_vocab(self.handle)

    def close(self):
        if self.handle:
            lib().tmx_engine_free(self.handle)
            self.handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def seq(self, n_ctx=None):
        """A sequence of at most n_ctx tokens (default: the engine's context)."""
        return Seq(self, n_ctx or lib().tmx_engine_n_ctx(self.handle))

    def kv_usage(self):
        u = KvUsage()
        lib().tmx_model_kv_usage(lib().tmx_engine_model(self.handle), C.byref(u))
        return u

    def _batch(self, seqs, token_lists):
        """Reserves the blocks of a step and returns its C arrays (the numpy ones kept)."""
        arrays = [np.ascontiguousarray(t, dtype=np.int32) for t in token_lists]
        for s, a in zip(seqs, arrays):
            err = C.c_void_p()
            _check(lib().tmx_seq_reserve(s.handle, len(a), C.byref(err)), err)
        n = len(seqs)
        handles = (C.c_void_p * n)(*[s.handle for s in seqs])
        ptrs = (C.POINTER(C.c_int32) * n)(*[a.ctypes.data_as(C.POINTER(C.c_int32))
                                            for a in arrays])
        counts = (C.c_int * n)(*[len(a) for a in arrays])
        return arrays, handles, ptrs, counts

    def step(self, seqs, token_lists):
        """One batched step: seqs[i] appends token_lists[i]; returns the last-token logits of
        each sequence, [len(seqs)][n_vocab]. Reserves the blocks first."""
        _, handles, ptrs, counts = self._batch(seqs, token_lists)
        out = np.zeros((len(seqs), self.vocab_size), dtype=np.float32)
        err = C.c_void_p()
        _check(lib().tmx_model_step(lib().tmx_engine_model(self.handle), handles, ptrs, counts,
                                    len(seqs), out.ctypes.data_as(C.POINTER(C.c_float)),
                                    C.byref(err)), err)
        return out[:, : self.n_vocab]

    def step_greedy(self, seqs, token_lists, n_vocab=None):
        """step(), returning each sequence's argmax over ids [0, n_vocab) (default: the
        engine's n_vocab) as the step computes it."""
        _, handles, ptrs, counts = self._batch(seqs, token_lists)
        out = np.zeros(len(seqs), dtype=np.int32)
        err = C.c_void_p()
        _check(lib().tmx_model_step_greedy(lib().tmx_engine_model(self.handle), handles, ptrs,
                                           counts, len(seqs), n_vocab or self.n_vocab,
                                           out.ctypes.data_as(C.POINTER(C.c_int32)),
                                           C.byref(err)), err)
        return out


    TOPK = 256  # TMX_TOPK_MAX
    EDIT = np.dtype([("id", "<i4"), ("bias", "<f4"), ("penalty", "<f4"), ("rep", "<f4")])

    def can_top(self):
        return bool(lib().tmx_model_can_top(lib().tmx_engine_model(self.handle)))

    def can_edit(self):
        return bool(lib().tmx_model_can_edit(lib().tmx_engine_model(self.handle)))

    def step_top(self, seqs, token_lists, temps, n_vocab=None, edits=None):
        """step(), returning each sequence's first TOPK candidates at temps[i] as the step
        finds them: their logits x [n][TOPK] float32, ids [n][TOPK] int32, stats [n][3]
        (softmax denominator at temps[i], number of candidates, denominator at 1); edits[i]
        (None: no edits) is sequence i's list of (id, bias, penalty, rep), struct
        tmx_logit_edit, applied to its logits first."""
        _, handles, ptrs, counts = self._batch(seqs, token_lists)
        n = len(seqs)
        t = np.asarray(temps, dtype=np.float32)
        starts, table = None, None
        if edits is not None:
            starts = np.cumsum([0] + [len(e) for e in edits]).astype(np.int32)
            table = np.array([tuple(e) for row in edits for e in row] or [(0, 0, 0, 1)],
                             dtype=self.EDIT)
        x = np.zeros((n, self.TOPK), dtype=np.float32)
        ids = np.zeros((n, self.TOPK), dtype=np.int32)
        stats = np.zeros((n, 3), dtype=np.float64)
        err = C.c_void_p()
        _check(lib().tmx_model_step_top(lib().tmx_engine_model(self.handle), handles, ptrs,
                                        counts, n, n_vocab or self.n_vocab,
                                        t.ctypes.data_as(C.POINTER(C.c_float)),
                                        None if starts is None else
                                        starts.ctypes.data_as(C.POINTER(C.c_int32)),
                                        None if table is None else table.ctypes.data,
                                        x.ctypes.data_as(C.POINTER(C.c_float)),
                                        ids.ctypes.data_as(C.POINTER(C.c_int32)),
                                        stats.ctypes.data_as(C.POINTER(C.c_double)),
                                        C.byref(err)), err)
        return x, ids, stats

    def read_logits(self, i):
        """Row i's logits of the last step (after step_top), [n_vocab]."""
        out = np.zeros(self.vocab_size, dtype=np.float32)
        err = C.c_void_p()
        _check(lib().tmx_model_read_logits(lib().tmx_engine_model(self.handle), i,
                                           out.ctypes.data_as(C.POINTER(C.c_float)),
                                           C.byref(err)), err)
        return out[: self.n_vocab]


class Seq:
    def __init__(self, engine, n_ctx):
        self.engine, self.handle, err = engine, C.c_void_p(), C.c_void_p()
        _check(lib().tmx_seq_new(lib().tmx_engine_model(engine.handle), n_ctx,
                                 C.byref(self.handle), C.byref(err)), err)

    @property
    def n_past(self):
        return lib().tmx_seq_n_past(self.handle)

    def prefix(self, ids):
        """Takes cached blocks for a prefix of ids; returns how many tokens they cover."""
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        return lib().tmx_seq_prefix(self.handle, ids.ctypes.data_as(C.POINTER(C.c_int32)),
                                    len(ids))

    def close(self):
        if self.handle:
            lib().tmx_seq_free(self.handle)
            self.handle = None

    def forward(self, ids, all_rows=True):
        """Appends ids; returns logits [n][n_vocab] (all rows) or [n_vocab] (last row)."""
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        rows = len(ids) if all_rows else 1
        out = np.zeros((rows, self.engine.vocab_size), dtype=np.float32)
        err = C.c_void_p()
        _check(lib().tmx_seq_forward(self.handle, ids.ctypes.data_as(C.POINTER(C.c_int32)),
                                     len(ids), out.ctypes.data_as(C.POINTER(C.c_float)),
                                     int(all_rows), C.byref(err)), err)
        out = out[:, : self.engine.n_vocab]
        return out if all_rows else out[0]

    def greedy(self, prompt_ids, n):
        logits = self.forward(prompt_ids, all_rows=False)
        out = []
        for i in range(n):
            nxt = int(np.argmax(logits))
            out.append(nxt)
            if i + 1 < n:
                logits = self.forward([nxt], all_rows=False)
        return out
