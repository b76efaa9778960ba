"""Jitted device encode (same bytes as the host), error feedback, and the simulated codec in
rj.diloco."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ravnest_jax as rj
import ravnest_jax.compress as C
from ravnest_jax.compress import _formats as F

DETERMINISTIC = C.CODECS  # stochastic rounding is opt-in; every codec is deterministic by default


def _encoder(codec, **opts):
    return jax.jit(functools.partial(C.device_encode, codec=codec, **opts))


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
@pytest.mark.parametrize("codec", DETERMINISTIC)
@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.sampled_from([0, 1, 63, 64, 65, 1000]),
    log_scale=st.integers(-60, 100),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
)
def test_device_bytes_equal_host_bytes(codec, seed, n, log_scale, dtype):
    rng = np.random.default_rng(seed)
    scale = 2.0**log_scale if dtype != "float16" else 2.0 ** min(log_scale, 10)
    w = (rng.standard_normal(n) * scale).astype(np.float32)
    w[: n // 4] = 0.0  # an all-zero block when n >= 64
    w = w.astype({"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype])
    tree = {"w": w, "b": [rng.standard_normal(3).astype(np.float32)]}
    packed, res = _encoder(codec)(tree)
    assert res is None
    assert C.packed_to_bytes(packed) == C.encode(tree, codec)


@pytest.mark.parametrize("codec", DETERMINISTIC)
def test_large_parts_leave_the_device_as_slices_with_the_same_bytes(codec, monkeypatch):
    """Parts above SEGMENT_BYTES come out of the jitted encode as consecutive slices (each its
    own buffer, reused by the host allocator); the message is byte for byte the same, with and
    without error feedback, and a wrong slice length is refused."""
    from ravnest_jax.compress import _device

    monkeypatch.setattr(_device, "SEGMENT_BYTES", 96)  # bytes: every part of 1000 values is cut
    rng = np.random.default_rng(7)
    tree = {"w": (rng.standard_normal(1000) * 1e-3).astype(np.float32), "b": np.ones(5, np.float32)}
    opts = {"fraction": 0.1} if codec == "topk" else {}
    packed, _ = _encoder(codec, **opts)(tree)
    big = [f for f in packed.parts[1] if isinstance(f, tuple)]  # the leaves are sorted: "w" second
    assert big and all(len(f) > 1 and all(q.nbytes <= 96 for q in f) for f in big), packed.parts[1]
    host = C.encode(tree, codec, **opts)
    assert C.packed_to_bytes(packed) == host
    assert b"".join(C.packed_to_chunks(packed)) == host
    packed_ef, res = jax.jit(functools.partial(C.device_encode, codec=codec, **opts))(
        tree, residual=C.init_error_feedback(tree)
    )
    assert C.packed_to_bytes(packed_ef) == C.packed_to_bytes(packed) and res is not None
    first = next(i for i, f in enumerate(packed.parts[1]) if isinstance(f, tuple))
    cut = list(packed.parts[1])
    cut[first] = cut[first][:-1]
    bad = C.Packed(packed.codec, packed.specs, packed.structure, (packed.parts[0], tuple(cut)), packed.ok)
    with pytest.raises(ValueError, match="does not match"):
        C.packed_to_bytes(bad)


@pytest.mark.parametrize("codec", ["int8", "int4", "fp4", "bf16"])
def test_device_stochastic_rounding(codec):
    # jittable with a key; decodable; unbiased over many blocks
    vals = np.array([1.0, 0.3, -0.77, 0.051, 0.49, -0.999, 0.6543, 0.1234], np.float32)
    reps = 2000
    x = np.tile(vals, 8 * reps)
    opts = {"block_size": 64} if codec in F.BLOCK_CODECS else {}
    packed, _ = _encoder(codec, stochastic=True, **opts)(x, key=jax.random.key(3))
    dec = C.decode(C.packed_to_bytes(packed)).reshape(-1, 8).astype(np.float64)
    z = np.abs(dec.mean(0) - vals) / (dec.std(0) / np.sqrt(dec.shape[0]) + 1e-12)
    assert np.all(z < 5), z
    with pytest.raises(ValueError, match="key"):
        C.device_encode(x, codec, stochastic=True, **opts)


def test_device_non_finite_flags_the_leaf():
    x = {"a": jnp.ones(10), "b": jnp.ones(10).at[3].set(jnp.nan)}
    packed, _ = _encoder("int4")(x)
    with pytest.raises(C.NonFiniteError, match="'b'") as info:
        C.packed_to_bytes(packed)
    assert info.value.leaf == "b"


@pytest.mark.parametrize("codec", ["int4", "fp4", "topk", "int8"])
def test_error_feedback_tracks_the_sum_and_plain_quantisation_does_not(codec):
    """sum_t decoded_t = sum_t g_t - residual_T: the drift stays bounded by one round's error."""
    rng = np.random.default_rng(0)
    n, rounds = 512, 200
    bias = rng.standard_normal(n).astype(np.float32)  # a consistent direction, as pseudo-gradients have
    # a few large entries per block so that small ones round to 0 without error feedback
    bias[::32] *= 20
    opts = {"fraction": 0.05} if codec == "topk" else {}
    enc = _encoder(codec, **opts)
    res = C.init_error_feedback({"g": jnp.zeros(n)})
    sum_in = np.zeros(n, np.float64)
    sum_ef = np.zeros(n, np.float64)
    sum_plain = np.zeros(n, np.float64)
    drift_ef = []
    max_err = 0.0
    for _ in range(rounds):
        g = {"g": bias + 0.1 * rng.standard_normal(n).astype(np.float32)}
        packed, res = enc(g, residual=res)
        dec = C.decode(C.packed_to_bytes(packed))["g"]
        plain = C.decode(C.encode(g, codec, **opts))["g"]
        sum_in += g["g"]
        sum_ef += dec
        sum_plain += plain
        drift_ef.append(np.abs(sum_ef - sum_in).max())
        max_err = max(max_err, float(np.abs(plain - g["g"]).max()))
    drift_plain = np.abs(sum_plain - sum_in).max()
    # the drift is exactly the last residual ...
    np.testing.assert_allclose(sum_in - sum_ef, np.asarray(res["g"], np.float64), atol=1e-2)
    # ... and it stays bounded: no growth over the second half of the rounds
    assert max(drift_ef[rounds // 2 :]) <= 1.5 * max(drift_ef[: rounds // 2]) + 1e-3
    if codec != "topk":  # quantisers: within a few rounds' worth of quantisation error
        assert drift_ef[-1] <= 3 * max_err + 1e-3, (drift_ef[-1], max_err)
    # plain quantisation drifts away (it drops the same small values every round)
    assert drift_plain > 5 * drift_ef[-1], (drift_plain, drift_ef[-1])


def test_error_feedback_residual_matches_definition():
    x = {"w": jnp.linspace(-1, 1, 100)}
    r0 = {"w": jnp.full((100,), 0.01)}
    packed, r1 = _encoder("int4")(x, residual=r0)
    dec = C.decode(C.packed_to_bytes(packed))["w"]
    np.testing.assert_allclose(np.asarray(r1["w"]), np.asarray(x["w"] + r0["w"]) - dec, atol=1e-7)
    with pytest.raises(ValueError, match="structure"):
        C.device_encode(x, "int4", residual={"v": r0["w"]})


def _problem():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k1, (8, 2)) * 0.1, "b": jnp.zeros((2,))}
    xs = jax.random.normal(k2, (4, 16, 8))
    ys = xs @ jax.random.normal(k3, (8, 2))
    return params, xs, ys


def _loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def _train(codec, steps=60):
    params, xs, ys = _problem()
    tx = rj.diloco(optax.adam(0.02), sync_every=5, axis_name="replica", codec=codec)

    def step(p, s, x, y):
        g = jax.grad(_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    vstep = jax.jit(jax.vmap(step, axis_name="replica"))
    P = rj.replicate(params, 4)
    S = jax.vmap(tx.init)(P)
    loss0 = float(jnp.mean(jax.vmap(_loss)(P, xs, ys)))
    for _ in range(steps):
        P, S = vstep(P, S, xs, ys)
    return P, S, loss0, float(jnp.mean(jax.vmap(_loss)(P, xs, ys)))


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_diloco_fp32_codec_equals_no_codec_exactly():
    p_none, _, _, _ = _train(None)
    p_fp32, s_fp32, _, _ = _train("fp32")
    for a, b in zip(jax.tree.leaves(p_none), jax.tree.leaves(p_fp32)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(s_fp32.codec_state, optax.EmptyState)


@pytest.mark.integration  # 5 s of compiling on 2 cores: the full suite, not the unit tier
def test_diloco_int4_trains_with_error_feedback_state():
    _, _, loss0, loss_none = _train(None)
    _, s, _, loss_int4 = _train("int4")
    assert loss_int4 < 0.4 * loss0
    assert loss_int4 < 1.05 * loss_none
    assert isinstance(s.codec_state, C.ErrorFeedbackState)
    assert float(jnp.abs(s.codec_state.residual["w"]).sum()) > 0


@pytest.mark.parametrize(
    "codec",
    [
        pytest.param(C.simulated(C.Codec("fp4", stochastic=True)), marks=pytest.mark.integration),  # 3 s of compiles
        C.simulated(C.Codec("topk", fraction=0.25)),
        C.simulated(C.Codec("int8", error_feedback=False)),
        C.simulated(C.Codec("bf16", block_size=None)),
    ],
    ids=["fp4-stochastic", "topk", "int8-noef", "bf16"],
)
def test_simulated_codecs_train(codec):
    assert isinstance(codec, rj.SimulatedCodec)
    _, _, loss0, loss = _train(codec)
    assert np.isfinite(loss) and loss < 0.6 * loss0


def test_simulated_validates_eagerly():
    with pytest.raises(ValueError, match="unknown codec"):
        C.simulated("int3")
    with pytest.raises(ValueError, match="fraction"):
        C.simulated(C.Codec("int4", fraction=0.1))
    with pytest.raises(ValueError, match="unknown codec"):
        rj.diloco(optax.sgd(0.1), sync_every=2, axis_name="r", codec="int3")


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4", "fp4", "int2", "sign"])
def test_chunked_host_encode_equals_device_for_long_leaves(codec):
    # the host encoder works in chunks of 2**17 elements for long leaves: same bytes as one pass
    rng = np.random.default_rng(5)
    x = {"w": (rng.standard_normal(300_001) * np.exp(rng.standard_normal(300_001))).astype(np.float32)}
    packed, _ = _encoder(codec)(x)
    assert C.packed_to_bytes(packed) == C.encode(x, codec)


def _reference_topk(x: np.ndarray, k: int) -> np.ndarray:
    """The definition: the k largest |x|, ties toward lower indices, as ascending indices."""
    order = np.lexsort((np.arange(x.size), -np.abs(x.astype(np.float64))))
    return np.sort(order[:k])


def _topk_inputs():
    rng = np.random.default_rng(11)
    n = 300_001  # above 4 * 65536: np_topk_indices takes its sampled-threshold path
    normal = rng.standard_normal(n).astype(np.float32)
    ties = rng.integers(-2, 3, n).astype(np.float32)  # heavy ties at the k-th value
    zeros = np.zeros(n, np.float32)
    ramp = np.linspace(-1, 1, n, dtype=np.float32)
    # the strided sample sees only large values: at fraction 0.3 fewer than k elements pass its
    # threshold, so the exact full-array path takes over (as it does for "zeros": threshold 0)
    fooled = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    fooled[:: n // (1 << 16)] = 100.0
    clustered = normal * np.where(np.arange(n) < 3000, 1e3, 1e-3).astype(np.float32)
    return {"normal": normal, "ties": ties, "zeros": zeros, "ramp": ramp, "fooled": fooled, "clustered": clustered}


@pytest.mark.parametrize("name", ["normal", "ties", "zeros", "ramp", "fooled", "clustered"])
@pytest.mark.parametrize("fraction", [1e-4, 0.01, 0.3])
def test_topk_selection_is_exact_on_every_path(name, fraction):
    # numpy (host encode and the CPU backend of device_encode) and lax.top_k (the accelerator
    # path) pick exactly the definition's elements
    from ravnest_jax.compress import _device as D

    x = _topk_inputs()[name]
    k = F.topk_count(x.size, fraction)
    want = _reference_topk(x, k)
    np.testing.assert_array_equal(F.np_topk_indices(x, k), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: D._lax_topk_indices(v, k))(x)), want)
    packed, _ = _encoder("topk", fraction=fraction)({"w": x})
    assert C.packed_to_bytes(packed) == C.encode({"w": x}, "topk", fraction=fraction)
    np.testing.assert_array_equal(np.asarray(packed.parts[0][0]), want)


def test_simulated_topk_under_shard_map_equals_vmap():
    # the CPU backend selects through a host callback: its indices must carry the shard_map
    # types of lax.top_k's (platform_dependent needs one type), and give the same result
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    assert jax.device_count() >= 2, "conftest forces 4 CPU devices"
    mesh = Mesh(np.array(jax.devices()[:2]), ("r",))
    codec = C.simulated(C.Codec("topk", fraction=0.1))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 1000)).astype(np.float32))

    def one(v):
        return codec.compress({"w": v}, codec.init({"w": v}), jax.random.key(0))[0]["w"]

    sharded = jax.jit(jax.shard_map(lambda v: one(v[0])[None], mesh=mesh, in_specs=P("r"), out_specs=P("r")))(x)
    mapped = jax.jit(jax.vmap(one))(x)
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(mapped))
    for i in range(2):
        xi = np.asarray(x[i])
        idx = _reference_topk(xi, F.topk_count(xi.size, 0.1))
        want = np.zeros_like(xi)
        want[idx] = xi[idx]
        np.testing.assert_array_equal(np.asarray(mapped[i]), want)


@pytest.mark.parametrize("where", ["one-device", "vmap", "explicit-mesh", "auto-mesh"])
def test_topk_host_callback_on_every_layout(where):
    # the CPU backend selects the top k in a zero-copy host callback (buffer_callback): the same
    # indices and bytes as the host encoder for plain, vmapped and mesh-sharded leaves
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(7)
    tree = {"a": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.standard_normal(300_001).astype(np.float32)}
    want = C.encode(tree, "topk", fraction=0.03)
    enc = _encoder("topk", fraction=0.03)
    if where == "vmap":
        both = jax.tree.map(lambda x: jnp.stack([x, -x]), tree)
        packed, _ = jax.jit(jax.vmap(functools.partial(C.device_encode, codec="topk", fraction=0.03)))(both)
        first = jax.tree.map(lambda p: p[0], packed)
        second = jax.tree.map(lambda p: p[1], packed)
        assert C.packed_to_bytes(jax.device_get(first)) == want
        assert C.packed_to_bytes(jax.device_get(second)) == C.encode(
            jax.tree.map(np.negative, tree), "topk", fraction=0.03
        )
        return
    if where.endswith("mesh"):
        axis = AxisType.Explicit if where == "explicit-mesh" else AxisType.Auto
        m = jax.make_mesh((4,), ("data",), axis_types=(axis,), devices=jax.devices()[:4])
        tree = {
            "a": jax.device_put(tree["a"], NamedSharding(m, P("data", None))),
            "b": jax.device_put(tree["b"][:300_000], NamedSharding(m, P("data"))),
        }
        want = C.encode(jax.device_get(tree), "topk", fraction=0.03)
    packed, _ = enc(tree)
    assert C.packed_to_bytes(jax.device_get(packed)) == want


def test_error_feedback_decay_carries_beta_times_the_residual():
    """SparseLoCo's accumulator (arXiv 2508.15706): encoded = delta + beta * residual."""
    rng = np.random.default_rng(3)
    delta = {"w": jnp.asarray(rng.standard_normal(256), jnp.float32)}
    res = C.ErrorFeedbackState({"w": jnp.asarray(rng.standard_normal(256), jnp.float32)})
    key = jax.random.key(0)
    for beta in (0.0, 0.5, 0.95, 1.0):
        codec = C.simulated(C.Codec("topk", fraction=0.1, error_feedback_decay=beta))
        dec, new = codec.compress(delta, res, key)
        x = np.asarray(delta["w"]) + beta * np.asarray(res.residual["w"])
        keep = np.argsort(-np.abs(x))[:26]  # ceil(0.1 * 256) = 26 largest of delta + beta r
        want = np.zeros_like(x)
        want[keep] = x[keep]
        np.testing.assert_allclose(np.asarray(dec["w"]), want, rtol=1e-6, err_msg=f"beta={beta}")
        np.testing.assert_allclose(np.asarray(new.residual["w"]), x - want, rtol=1e-6, atol=1e-7)
    for bad in (-0.1, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match="error_feedback_decay"):
            C.simulated(C.Codec("topk", error_feedback_decay=bad))


def test_the_swarm_round_start_decays_the_residual_as_the_simulation_does():
    from ravnest_jax.sync._pipeline import RoundFunctions

    params = {"w": jnp.asarray(np.random.default_rng(4).standard_normal(300), jnp.float32)}
    tx = rj.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2)
    state = tx.init(params)
    state = state._replace(global_params={"w": params["w"] + 1.0})  # pseudo-gradient ~1 everywhere
    residual = [jnp.asarray(np.random.default_rng(5).standard_normal(300), jnp.float32)]
    key = jax.random.key(1)
    for beta in (0.0, 0.9):
        fns = RoundFunctions(tx, "topk", {"fraction": 0.05}, True, error_feedback_decay=beta)
        snap, packed, new_res = fns.start(0, None)(params, state, residual, key)
        pg = jax.tree.leaves(snap.pseudo_gradient)
        want, want_res = C.device_encode(pg, "topk", key=key, residual=[beta * residual[0]], fraction=0.05)
        got, exp = C.decode(C.packed_to_bytes(packed)), C.decode(C.packed_to_bytes(want))
        g, e = jax.tree.leaves(got)[0], jax.tree.leaves(exp)[0]
        np.testing.assert_array_equal(g != 0, e != 0, err_msg=f"beta={beta}: the kept indices")
        np.testing.assert_allclose(g, e, rtol=1e-6, err_msg=f"beta={beta}")  # up to a fused multiply-add
        np.testing.assert_allclose(np.asarray(new_res[0]), np.asarray(want_res[0]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="error_feedback_decay"):
        rj.OuterSync(tx, None, codec=rj.Codec("topk", error_feedback_decay=2.0))


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_sign_mean_error_feedback_in_the_simulation():
    """The owners' error feedback as the simulation applies it: the mean's encode residual goes
    into the next round's mean (off by default), and the values are the scaled signs of the host
    encoder."""
    rng = np.random.default_rng(5)
    mean = {"w": jnp.asarray(rng.standard_normal(1000), jnp.float32)}
    key = jax.random.key(0)

    def q(x):
        return C.decode(C.encode({"w": np.asarray(x, np.float32)}, "sign"))["w"]

    codec = C.simulated(C.Codec("sign", mean_ef=True))
    assert not C.simulated("sign").mean_error_feedback
    state = codec.init(mean)
    m = np.asarray(mean["w"])
    first, state = codec.requantize_with_state(mean, state, key)
    np.testing.assert_array_equal(np.asarray(first["w"]), q(m))
    np.testing.assert_allclose(np.asarray(state.mean_residual["w"]), m - q(m), rtol=1e-6, atol=1e-7)
    second, state = codec.requantize_with_state(mean, state, key)
    np.testing.assert_array_equal(np.asarray(second["w"]), q(m + (m - q(m))))
    # without it, every round sends the same
    plain = C.simulated("sign")
    s = plain.init(mean)
    again, _ = plain.requantize_with_state(mean, s, key)
    np.testing.assert_array_equal(np.asarray(again["w"]), q(m))


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_a_mean_codec_of_its_own_in_the_simulation():
    """``simulated(Codec("sign", mean="int2"))``: the contributions as ``sign`` encodes them, the
    mean as ``int2`` does (the contribution's block size), its error feedback in ``int2`` too;
    a mean codec that cannot pair with the codec is a ``ValueError``."""
    rng = np.random.default_rng(6)
    x = {"w": jnp.asarray(rng.standard_normal(2048), jnp.float32)}
    key = jax.random.key(0)

    def q(codec, v):
        return C.decode(C.encode({"w": np.asarray(v, np.float32)}, codec, block_size=256))["w"]

    codec = C.simulated(C.Codec("sign", mean="int2", mean_ef=True, block_size=256))
    state = codec.init(x)
    up, _ = codec.compress(x, state, key)
    np.testing.assert_array_equal(np.asarray(up["w"]), q("sign", x["w"]))
    down, state = codec.requantize_with_state(x, state, key)
    np.testing.assert_array_equal(np.asarray(down["w"]), q("int2", x["w"]))
    m = np.asarray(x["w"])
    np.testing.assert_allclose(np.asarray(state.mean_residual["w"]), m - q("int2", m), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(codec.requantize(x, key)["w"]), q("int2", m))
    assert "mean_codec='int2'" in repr(codec)
    same = C.simulated(C.Codec("sign", mean="sign"))
    np.testing.assert_array_equal(
        np.asarray(same.requantize(x, key)["w"]), np.asarray(C.simulated("sign").requantize(x, key)["w"])
    )
    for codec_, mean, match in [
        ("fp32", "int2", "block codecs"),
        ("sign", "topk", "block codecs"),
        ("sign", "x", "unknown"),
    ]:
        with pytest.raises(ValueError, match=match):
            C.simulated(C.Codec(codec_, mean=mean))
    # the mean takes the contribution's block size, the default one included (fp4's own is 32)
    assert C.simulated(C.Codec("sign", mean="fp4")).mean_cfg.block_size == 64
