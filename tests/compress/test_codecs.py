"""Round-trip error bounds, byte counts and options of every codec (host numpy path).

The bounds asserted here are the documented ones (docs/compression.md and the docstring of
``ravnest_jax.compress``), for an element ``x`` (its float32 value) in a block of absmax ``A``:

- fp32: exact.
- bf16: ``|err| <= max(|x| 2**-8, 2**-134)`` (stochastic: ``2 * that``).
- int8 / int4 (``q = 127 / 7``): ``|err| <= A / (2 q) * (1 + 2**-6)`` (stochastic: ``A / q * (1 + 2**-6)``);
  blocks with ``A < 2**-100`` decode to 0.
- fp4: ``|err| <= max(|x|, A / 3) / 4`` (stochastic: ``/ 2``); blocks with ``A < 2**-100`` decode to 0.
- topk: the ``k`` kept elements exact, the others 0, every kept magnitude >= every dropped one.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ravnest_jax.compress as C
from ravnest_jax.compress import _formats as F

SETTINGS = settings(max_examples=40, deadline=None)
TINY = 2.0**-100
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
SIZES = [0, 1, 2, 31, 63, 64, 65, 100, 129, 1000, 4097]


@st.composite
def arrays(draw, dtype_names=tuple(DTYPES)):
    """A float array: random normal values at a random scale, with zero blocks and edge values."""
    dtype = draw(st.sampled_from(dtype_names))
    n = draw(st.one_of(st.sampled_from(SIZES), st.integers(0, 3000)))
    two_d = draw(st.booleans()) and n % 5 == 0 and n > 0
    seed = draw(st.integers(0, 2**32 - 1))
    max_exp = {"float32": 125, "bfloat16": 125, "float16": 14}[dtype]
    min_exp = {"float32": -120, "bfloat16": -120, "float16": -20}[dtype]
    log_scale = draw(st.integers(min_exp, max_exp))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 2.0**log_scale
    if n and draw(st.booleans()):  # zero out a stretch (all-zero blocks)
        a, b = sorted(rng.integers(0, n + 1, 2))
        x[a:b] = 0.0
    limit = {"float32": 2.0**127, "bfloat16": 2.0**127, "float16": 65504.0}[dtype]
    specials = draw(
        st.lists(
            st.floats(-limit, limit, allow_nan=False, allow_infinity=False, width=16 if dtype == "float16" else 32),
            max_size=8,
        )
    )
    for v in specials:
        if n:
            x[rng.integers(0, n)] = v
    x = np.clip(x, -limit, limit)
    arr = x.astype(np.float32).astype(DTYPES[dtype])
    arr = np.clip(arr.astype(np.float32), -limit, limit).astype(DTYPES[dtype])
    return arr.reshape((5, n // 5) if two_d else (n,))


def _blocks_absmax(x32: np.ndarray, block: int) -> np.ndarray:
    """Per-element absmax of its block."""
    n = x32.size
    nb = -(-n // block)
    pad = np.zeros(nb * block, np.float64)
    pad[:n] = np.abs(x32.reshape(-1))
    return np.repeat(pad.reshape(nb, block).max(1), block)[:n]


def check_bound(codec: str, x, dec: np.ndarray, *, block: int | None = None, stochastic: bool = False) -> None:
    x32 = np.asarray(x).astype(np.float32).reshape(-1).astype(np.float64)
    d = dec.reshape(-1).astype(np.float64)
    err = np.abs(d - x32)
    ax = np.abs(x32)
    f = 2.0 if stochastic else 1.0
    if codec == "fp32":
        np.testing.assert_array_equal(d, x32)
        return
    if codec == "bf16":
        assert np.all(err <= f * np.maximum(ax * 2.0**-8, 2.0**-134))
        return
    if codec == "topk":
        kept = d != 0
        np.testing.assert_array_equal(d[kept], x32[kept])
        if kept.any() and (~kept).any():
            assert ax[kept].min() >= ax[~kept & (x32 != 0)].max(initial=0.0)
        return
    if codec in ("sign", "int2"):  # scaled by the block's mean |x| over its real elements
        n = x32.size
        if n == 0:
            return
        nb = -(-n // block)
        pad = np.zeros(nb * block, np.float64)
        pad[:n] = ax
        counts = np.full(nb, block, np.float64)
        counts[-1] = n - (nb - 1) * block
        s = np.repeat(pad.reshape(nb, block).sum(1) / counts, block)[:n]
        if codec == "int2":  # a midrise grid of step 1.25 mean |x| (bf16, rounded up), clipped at +-1.5 steps
            step = 1.25 * s
            small = step < TINY * 0.99
            assert np.all(d[small] == 0)
            big = step > TINY * 1.01
            st_ = step[big] * (1 + 2.0**-7)
            bound = np.maximum(st_ / 2, ax[big] - 1.5 * step[big]) * (1 + 1e-5)
            worst = np.max(err[big] - bound, initial=-1.0)
            assert worst <= 0, f"int2: error above bound by {worst}"
            return
        signs = np.where(x32 >= 0, 1.0, -1.0)
        small = s < TINY * 0.99
        assert np.all(d[small] == 0)
        big = s > TINY * 1.01
        rel = np.abs(d[big] * signs[big] - s[big]) / s[big]
        assert np.all(rel <= 2.0**-8 + 1e-6), f"sign: scale off by {rel.max()} (relative)"
        return
    A = _blocks_absmax(x32.astype(np.float32), block)
    tiny = A < TINY
    assert np.all(d[tiny] == 0)
    A, err, ax = A[~tiny], err[~tiny], ax[~tiny]
    if codec in ("int8", "int4"):
        q = 127 if codec == "int8" else 7
        bound = f * A / (2 * q) * (1 + 2.0**-6)
    else:
        bound = f * np.maximum(ax, A / 3) / 4
    worst = np.max(err - bound, initial=-1.0)
    assert worst <= 0, f"{codec}: error above bound by {worst}"


@pytest.mark.parametrize("codec", C.CODECS)
@SETTINGS
@given(x=arrays(), block=st.sampled_from([2, 8, 32, 64, 256]))
def test_roundtrip_within_documented_bound(codec, x, block):
    if codec in ("sign", "int2"):
        block = max(block, 8)  # a power of two >= 8
    opts = {"block_size": block} if codec in F.BLOCK_CODECS else {}
    data = C.encode({"g": x}, codec, **opts)
    dec = C.decode(data)["g"]
    assert dec.dtype == np.float32 and dec.shape == x.shape
    assert C.read_header(data).leaves[0].dtype == x.dtype.name
    check_bound(codec, x, dec, block=block)


@pytest.mark.parametrize("codec", F.STOCHASTIC_CODECS)
@SETTINGS
@given(x=arrays(dtype_names=("float32",)), seed=st.integers(0, 2**31))
def test_stochastic_roundtrip_within_bound(codec, x, seed):
    opts = {"block_size": 64} if codec in F.BLOCK_CODECS else {}
    dec = C.decode(C.encode([x], codec, stochastic=True, seed=seed, **opts))[0]
    check_bound(codec, x, dec, block=64, stochastic=True)


@pytest.mark.parametrize("codec", F.STOCHASTIC_CODECS)
def test_stochastic_rounding_is_unbiased(codec):
    # many blocks holding the same values, each with its own noise: the mean estimates E[decoded]
    vals = np.array([1.0, 0.3, -0.77, 0.051, 0.49, -0.999, 0.6543, 0.1234], np.float32)
    block = np.tile(vals, 8)  # 64 values, absmax 1.0 (exactly representable, same scale)
    reps = 4000
    x = np.tile(block, reps)
    opts = {"block_size": 64} if codec in F.BLOCK_CODECS else {}
    dec = C.decode(C.encode(x, codec, stochastic=True, seed=1, **opts)).reshape(reps * 8, 8)
    det = C.decode(C.encode(x, codec, **opts)).reshape(reps * 8, 8)
    mean = dec.astype(np.float64).mean(0)
    spread = dec.std(0) + 1e-12
    z = np.abs(mean - vals) / (spread / math.sqrt(reps * 8))
    assert np.all(z < 5), (mean, vals, z)
    # and deterministic rounding is biased for at least some values (otherwise the test is void)
    assert np.abs(det.mean(0) - vals).max() > 5 * (spread / math.sqrt(reps * 8)).max()


@pytest.mark.parametrize("codec", C.CODECS)
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000, 100_000])
def test_exact_payload_bytes(codec, n):
    block = {"int8": 64, "int4": 64, "fp4": 32, "int2": 64, "sign": 64}.get(codec)
    data = C.encode({"w": np.ones(n, np.float32)}, codec)
    m = C.read_header(data)
    nb = -(-n // block) if block else 0
    k = min(n, max(1, math.ceil(0.01 * n))) if n else 0
    expected = {
        "fp32": 4 * n,
        "bf16": 2 * n,
        "int8": 2 * nb + nb * block if block else 0,
        "int4": 2 * nb + nb * block // 2 if block else 0,
        "fp4": nb + nb * block // 2 if block else 0,
        "int2": 2 * nb + nb * block // 4 if block else 0,
        "sign": 2 * nb + nb * block // 8 if block else 0,
        "topk": 8 * k,
    }[codec]
    assert m.payload_nbytes == expected == m.leaves[0].nbytes
    assert len(data) == m.total_nbytes == m.header_nbytes + expected


def test_byte_ratios_for_large_leaves():
    n = 1 << 20
    assert C.payload_ratio("int4", n, block_size=64) <= 0.14
    assert C.payload_ratio("fp4", n, block_size=32) <= 0.14
    assert C.payload_ratio("int8", n, block_size=64) <= 0.27
    assert C.payload_ratio("bf16", n) == 0.5
    assert C.payload_ratio("topk", n, fraction=0.01) <= 0.0201
    data = C.encode({"w": np.ones(n, np.float32)}, "int4", block_size=64)
    assert len(data) / (4 * n) <= 0.14


@pytest.mark.parametrize("codec", ["int8", "int4", "fp4"])
def test_all_zero_and_tiny_blocks_decode_to_zero(codec):
    x = np.zeros(256, np.float32)
    x[64:128] = 1e-35  # below 2**-100: sent as zeros
    x[200] = 5.0
    dec = C.decode(C.encode(x, codec, block_size=64))
    assert np.all(dec[:192] == 0)
    assert np.abs(dec[200] - 5.0) <= 5.0 / 4


@pytest.mark.parametrize("codec", C.CODECS)
def test_huge_magnitudes(codec):
    x = np.array([2.0**127, -(2.0**127), 1e38, -3e37, 1.0, 0.0], np.float32)
    block = 8 if codec in ("sign", "int2") else 2
    dec = C.decode(C.encode(x, codec, block_size=block) if codec in F.BLOCK_CODECS else C.encode(x, codec))
    assert np.all(np.isfinite(dec))
    check_bound(codec, x, dec, block=block)


@pytest.mark.parametrize("codec", C.CODECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 3e38])
def test_non_finite_input_raises_naming_the_leaf(codec, bad):
    x = np.ones(100, np.float32)
    x[37] = bad
    with pytest.raises(C.NonFiniteError, match="layer0/w"):
        C.encode({"layer0": {"w": x, "b": np.ones(3, np.float32)}}, codec)
    assert issubclass(C.NonFiniteError, ValueError)


def test_option_validation():
    x = {"w": np.ones(10, np.float32)}
    with pytest.raises(ValueError, match="unknown codec 'int3'"):
        C.encode(x, "int3")
    with pytest.raises(ValueError, match="unknown codec 'fp16'; expected one of fp32, bf16, int8,"):
        C.encode(x, "fp16")  # dropped: bf16 is the half-precision codec
    with pytest.raises(ValueError, match="block_size"):
        C.encode(x, "int4", block_size=63)
    with pytest.raises(ValueError, match="block_size"):
        C.encode(x, "int4", block_size=0)
    with pytest.raises(ValueError, match="'block_size' does not apply"):
        C.encode(x, "bf16", block_size=64)
    with pytest.raises(ValueError, match="'fraction' does not apply"):
        C.encode(x, "int8", fraction=0.1)
    with pytest.raises(ValueError, match="fraction"):
        C.encode(x, "topk", fraction=0.0)
    with pytest.raises(ValueError, match="fraction"):
        C.encode(x, "topk", fraction=1.5)
    with pytest.raises(ValueError, match="'stochastic' does not apply"):
        C.encode(x, "fp32", stochastic=True)
    with pytest.raises(ValueError, match="unknown codec option 'blocksize'"):
        C.encode(x, "int8", blocksize=64)
    with pytest.raises(ValueError, match="dtype int64"):
        C.encode({"w": np.ones(3, np.int64)}, "fp32")
    with pytest.raises(ValueError, match="dict keys must be str"):
        C.encode({1: np.ones(3, np.float32)}, "fp32")
    with pytest.raises(ValueError, match="share the path name"):
        C.encode({"a/b": np.ones(3, np.float32), "a": {"b": np.ones(3, np.float32)}}, "fp32")
    with pytest.raises(ValueError, match="max_bytes"):
        C.encode({"w": np.ones(1000, np.float32)}, "fp32", max_bytes=1000)


def test_tree_structure_and_names_round_trip():
    tree = {
        "layer0": {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)},
        "blocks": [np.full((4,), 2.0, np.float32), (np.float32(1.5), np.ones((1, 1), np.float16))],
        "empty": [],
    }
    data = C.encode(tree, "fp32")
    out = C.decode(data)
    assert set(out) == {"layer0", "blocks", "empty"}
    assert isinstance(out["blocks"], list) and isinstance(out["blocks"][1], tuple)
    assert out["empty"] == []
    assert out["layer0"]["w"].shape == (2, 3) and out["blocks"][1][0].shape == ()
    np.testing.assert_array_equal(out["blocks"][0], 2.0)
    m = C.read_header(data)
    assert m.names == ("blocks/0", "blocks/1/0", "blocks/1/1", "layer0/b", "layer0/w")
    assert m.shapes["layer0/w"] == (2, 3)
    assert m.codec == "fp32" and m.version == C.FORMAT_VERSION
    for leaf in jax_free_leaves(out):
        assert leaf.flags.writeable and leaf.dtype == np.float32


def jax_free_leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from jax_free_leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from jax_free_leaves(v)
    else:
        yield tree


def test_topk_ties_break_toward_lower_indices():
    x = np.array([1.0, -3.0, 3.0, 2.0, 3.0, 0.5], np.float32)
    dec = C.decode(C.encode(x, "topk", fraction=0.34))  # k = 3
    np.testing.assert_array_equal(dec, [0, -3, 3, 0, 3, 0])
    dec = C.decode(C.encode(x, "topk", fraction=0.3))  # k = 2: the two lowest-index 3s
    np.testing.assert_array_equal(dec, [0, -3, 3, 0, 0, 0])


def test_weighted_mean():
    rng = np.random.default_rng(0)
    trees = [
        {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": [rng.standard_normal(5).astype(np.float32)]}
        for _ in range(3)
    ]
    w = [1.0, 2.0, 5.0]
    out = C.weighted_mean(trees, w)
    ref = sum(wi * t["a"].astype(np.float64) for wi, t in zip(w, trees)) / sum(w)
    np.testing.assert_allclose(out["a"], ref, rtol=1e-6, atol=1e-6)
    assert out["a"].dtype == np.float32 and isinstance(out["b"], list)
    # the documented float32 order: acc = w0 x0, then acc += w_i x_i, bit for bit
    wn = (np.asarray(w) / sum(w)).astype(np.float32)
    acc = trees[0]["a"] * wn[0]
    for wi, t in zip(wn[1:], trees[1:]):
        acc += t["a"] * wi
    assert out["a"].tobytes() == acc.tobytes()
    # deterministic: same inputs, same bits
    again = C.weighted_mean(trees, w)
    assert out["a"].tobytes() == again["a"].tobytes()
    # flat arrays and equal weights
    flat = C.weighted_mean([np.ones(4, np.float32), np.zeros(4, np.float32)])
    np.testing.assert_array_equal(flat, 0.5)
    for bad in ([1.0], [1.0, -1.0, 1.0], [0.0, 0.0, 0.0], [np.nan, 1.0, 1.0]):
        with pytest.raises(ValueError, match="weight"):
            C.weighted_mean(trees, bad)
    with pytest.raises(ValueError, match="structure"):
        C.weighted_mean([trees[0], {"a": trees[1]["a"]}])
    with pytest.raises(ValueError, match="shape"):
        C.weighted_mean([np.ones(3), np.ones(4)])
    with pytest.raises(ValueError, match="at least one"):
        C.weighted_mean([])


@pytest.mark.parametrize("codec", C.CODECS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_large_leaf_within_bound(codec, stochastic):
    if stochastic and codec not in F.STOCHASTIC_CODECS:
        pytest.skip("no stochastic rounding for this codec")
    rng = np.random.default_rng(7)
    n = (1 << 20) + 3  # not a multiple of any block size
    x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)  # heavy tails
    x[1000:5000] = 0.0
    opts = {"block_size": 64} if codec in F.BLOCK_CODECS else {}
    dec = C.decode(C.encode({"w": x}, codec, stochastic=stochastic, seed=0, **opts))["w"]
    check_bound(codec, x, dec, block=64, stochastic=stochastic)


def _e2m1_codes_by_rounding(a):
    """The codes of the rounding formulation (the device encoder's and the stochastic path's)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return F._e2m1_round(np, np.asarray(a, np.float32), None)


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_e2m1_comparison_count_is_round_half_to_even():
    # every float32 in [2**-3, 8) (all 6 * 2**23 of them) and the neighbourhoods of 0 and of the
    # decision points: the comparison count equals rounding half to even on the E2M1 grid
    lo, hi = np.float32(0.125).view(np.uint32), np.float32(8.0).view(np.uint32)
    a = np.arange(lo, hi, dtype=np.uint32).view(np.float32)
    np.testing.assert_array_equal(F._e2m1_round_nearest_even(np, a), _e2m1_codes_by_rounding(a))
    b = np.concatenate(
        [np.arange(0, 1 << 16, dtype=np.uint32).view(np.float32), np.float32([0.0, 6.0, 6.5, 7.0, 8.0, 100.0])]
    )
    for t, _ in F._E2M1_DECISIONS + ((2.0, True), (4.0, True), (6.0, True)):
        tb = int(np.float32(t).view(np.uint32))
        b = np.concatenate([b, np.arange(tb - 64, tb + 65, dtype=np.uint32).view(np.float32)])
    np.testing.assert_array_equal(F._e2m1_round_nearest_even(np, b), _e2m1_codes_by_rounding(b))


@pytest.mark.parametrize("B", [2, 32, 64])
def test_block_absmax_from_bits_is_max_of_abs(B):
    rng = np.random.default_rng(B)
    x = (rng.standard_normal(64 * B) * 10.0 ** rng.integers(-40, 38, 64 * B)).astype(np.float32)
    x[:B] = -0.0
    x[B : 2 * B] = np.float32(-3.0)
    xb = x.reshape(-1, B)
    got = F._block_absmax(np, xb)
    np.testing.assert_array_equal(got, np.abs(xb).max(axis=1))
    assert got.dtype == np.float32 and got[0].view(np.uint32) == 0
    for bad in (np.nan, -np.nan, np.inf, -np.inf):
        y = xb.copy()
        y[5, 1] = bad
        r = F._block_absmax(np, y)
        assert (np.isnan(r[5]) if np.isnan(bad) else r[5] == np.inf) and not r[5] <= F.MAX_ABS
