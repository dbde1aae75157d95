"""The paged KV cache (core/forward.c, core/kvcache.c) on muse-tiny: block size and batching
change no logit, prefix caching reuses blocks exactly, sliding layers give blocks back, and the
bf16/fp8/int8 cache dtypes compute what the float64 reference computes on rounded K and V."""
import numpy as np
import pytest

from test_model import PROMPTS, encode, make_model, max_rel_err, muse_ref
from tmx_engine import Engine, TmxError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory, "muse-tiny-kv")


@pytest.fixture(scope="module")
def ids(tiny):
    return [encode(tiny, t) for t in PROMPTS]


def all_logits(tiny, ids, overrides):
    with Engine(tiny, ["threads=2"] + overrides) as eng:
        seq = eng.seq(n_ctx=256)
        out = seq.forward(ids)
        seq.close()
        return out


def test_block_size_changes_nothing(tiny, ids):
    # Blocks of 1 and 5 positions (a window of 16 spans block edges unevenly), 7-token steps.
    want = all_logits(tiny, ids[2], ["kv_block_size=16"])
    for bs in ("1", "5"):
        got = all_logits(tiny, ids[2], [f"kv_block_size={bs}", "batch=7"])
        assert np.array_equal(got, want), f"block size {bs}"


def test_batched_step_matches_each_sequence_alone(tiny, ids):
    with Engine(tiny, ["threads=2", "kv_block_size=4"]) as eng:
        alone = []
        for p in ids:
            s = eng.seq(n_ctx=256)
            alone.append(s.forward(p, all_rows=False))
            s.close()
        # prompts together in one step, then one decode token each in the next
        seqs = [eng.seq(n_ctx=256) for _ in ids]
        got = eng.step(seqs, [p[:-1] for p in ids])
        got = eng.step(seqs, [p[-1:] for p in ids])
        for s in seqs:
            s.close()
    for g, w in zip(got, alone):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * np.abs(w).max())


def test_prefix_cache_reuses_blocks_exactly(tiny, ids):
    first, second = ids[0], ids[0][:40] + ids[1]
    with Engine(tiny, ["threads=2", "prefix_cache=false"]) as eng:
        fresh = eng.seq(n_ctx=256)
        want = fresh.forward(second, all_rows=False)
        fresh.close()
    with Engine(tiny, ["threads=2", "kv_block_size=8"]) as eng:
        a = eng.seq(n_ctx=256)
        a.forward(first, all_rows=False)
        b = eng.seq(n_ctx=256)
        hit = b.prefix(second)
        # the full blocks of the shared 40 tokens; the sliding window (16) of position 40 is
        # within them too
        assert hit == 40
        got = b.forward(second[hit:], all_rows=False)
        np.testing.assert_array_equal(got, want)
        # an identical prompt hits all but the last token's block
        c = eng.seq(n_ctx=256)
        assert c.prefix(first) == (len(first) - 1) // 8 * 8
        for s in (a, b, c):
            s.close()
    with Engine(tiny, ["threads=2", "prefix_cache=false"]) as eng:  # off: nothing is found
        a, b = eng.seq(n_ctx=256), eng.seq(n_ctx=256)
        a.forward(first, all_rows=False)
        assert b.prefix(first) == 0


def test_sliding_layers_give_blocks_back(tiny, ids):
    with Engine(tiny, ["threads=1", "kv_block_size=4", "batch=8"]) as eng:
        seq = eng.seq(n_ctx=256)
        seq.forward(ids[2] + ids[1], all_rows=False)
        u = eng.kv_usage()
        n = seq.n_past
        assert u.full_used == (n + 3) // 4
        # window 16: positions n-16..n-1 span at most 5 blocks of 4 (+ one for the next step)
        assert 0 < u.sliding_used <= 6 < u.full_used
        seq.close()
        u = eng.kv_usage()
        assert u.full_used == 0 and u.sliding_used == 0


def test_kv_cache_full_is_busy_not_a_crash(tiny, ids):
    with Engine(tiny, ["threads=1", "context=64", "kv_tokens=64", "kv_block_size=8"]) as eng:
        a, b = eng.seq(), eng.seq()
        a.forward(list(range(100, 160)), all_rows=False)
        with pytest.raises(TmxError, match="KV cache full"):
            b.forward(list(range(200, 230)), all_rows=False)
        a.close()
        b.forward(list(range(200, 230)), all_rows=False)  # room again
        b.close()


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "int8"])
def test_quantized_cache_matches_its_reference(tiny, ids, dtype):
    # The reference rounds K and V as the cache does (muse_ref.kv_round), in float64; a value
    # that lands on a rounding boundary in F32 may round the other way, hence 1e-3, not 1e-4.
    # On this random tiny model int8 and fp8 move the logits far from the f32 ones (up to ~40%
    # of their range): the per-row amax scale of V is what costs, not a kernel error.
    ref, exact = muse_ref.load(tiny, dtype), muse_ref.load(tiny)
    for p in ids:
        got = all_logits(tiny, p, [f"kv_dtype={dtype}"])
        err = max_rel_err(got, ref.forward(p))
        assert err <= 1e-3, f"{dtype}: max relative error {err:.2e} against its reference"
        assert max_rel_err(got, exact.forward(p)) > 1e-4, "the cache should round"


def test_bad_kv_config_is_named(tiny):
    with pytest.raises(TmxError, match="kv_dtype: 'f16' is not one of"):
        Engine(tiny, ["kv_dtype=f16"])
    with pytest.raises(TmxError, match="kv_tokens"):
        Engine(tiny, ["context=256", "kv_tokens=100"])
