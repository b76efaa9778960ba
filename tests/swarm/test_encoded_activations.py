"""Activations received undecoded (``EncodedActivation``): the wire parts, checked as the host
decoder checks them, a quarter of the host bytes with int8; numpy only (no jax)."""

from __future__ import annotations

import numpy as np
import pytest

from ravnest_jax.compress import Packed, encode, host_pack, packed_to_bytes
from ravnest_jax.compress import _formats as F
from ravnest_jax.compress._wire import read_header
from ravnest_jax.swarm.peer._activations import encoded_activation
from ravnest_jax.swarm.wire._codec import WireFormatError, decode_activation

SHAPE = (2, 8, 96)  # (rows, seq, hidden): one int8 scale per token at block 96


def _x(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32) * 3


@pytest.mark.parametrize(
    ("codec", "opts"),
    [("fp32", {}), ("bf16", {}), ("int8", {"block_size": 96}), ("int8", {}), ("int4", {}), ("fp4", {})],
)
def test_the_parts_decode_to_what_the_host_decoder_gives(codec, opts):
    data = encode({"x": _x()}, codec=codec, **opts)
    host = decode_activation(data, name="x", shape=SHAPE, codec=codec)
    enc = encoded_activation(data, name="x", shape=SHAPE, codec=codec)
    cfg = F.resolve(codec, **opts)
    assert (enc.codec, enc.shape, enc.block_size) == (codec, SHAPE, cfg.block_size)
    n = host.size
    assert [p.dtype for p in enc.parts] == list(F.part_dtypes(codec))
    assert [p.size for p in enc.parts] == list(F.part_lengths(codec, n, cfg.block_size, 0))
    got = F.dequantize(np, cfg, enc.parts, n).reshape(SHAPE)
    np.testing.assert_array_equal(got.view(np.uint32), host.view(np.uint32))  # bit for bit


@pytest.mark.parametrize(("codec", "opts", "ratio"), [("int8", {"block_size": 96}, 4 * 96 / 98), ("bf16", {}, 2.0)])
def test_host_bytes_per_activation_drop_by_the_codec_ratio(codec, opts, ratio):
    data = encode({"x": _x()}, codec=codec, **opts)
    enc = encoded_activation(data, name="x", shape=SHAPE, codec=codec)
    host = decode_activation(data, name="x", shape=SHAPE, codec=codec)
    assert host.nbytes / enc.nbytes == pytest.approx(ratio, rel=1e-9)  # int8: 3.92x, bf16: 2x
    assert enc.nbytes == read_header(data).payload_nbytes


def _with_bits(codec: str, bits: int) -> bytes:
    """A valid message (checksum included) whose 18th value has the bfloat16 ``bits``."""
    packed = host_pack({"x": _x()}, codec)
    vals = packed.parts[0][0].copy()
    vals[17] = bits
    return packed_to_bytes(Packed(packed.codec, packed.specs, packed.structure, ((vals,),), packed.ok))


@pytest.mark.parametrize(("codec", "bits"), [("bf16", 0x7F80), ("bf16", 0xFF80), ("bf16", 0xFFC1), ("bf16", 0x7FC0)])
def test_inf_and_nan_bits_are_refused_as_the_host_decoder_refuses_them(codec, bits):
    data = _with_bits(codec, bits)
    for dec in (decode_activation, encoded_activation):
        with pytest.raises(WireFormatError, match="non-finite"):
            dec(data, name="x", shape=SHAPE, codec=codec)
    # the largest finite values pass both
    data = _with_bits(codec, 0x7F7F)
    want = decode_activation(data, name="x", shape=SHAPE, codec=codec)
    enc = encoded_activation(data, name="x", shape=SHAPE, codec=codec)
    got = F.dequantize(np, F.resolve(codec), enc.parts, want.size).reshape(SHAPE)
    np.testing.assert_array_equal(got, want)


def test_int8_scales_out_of_range_are_refused():
    packed = host_pack({"x": _x()}, "int8", block_size=96)
    scales, codes = packed.parts[0]
    scales = scales.copy()
    scales[3] = 0xFF80  # -inf as bf16
    data = packed_to_bytes(Packed(packed.codec, packed.specs, packed.structure, ((scales, codes),), packed.ok))
    for dec in (decode_activation, encoded_activation):
        with pytest.raises(WireFormatError, match="scales"):
            dec(data, name="x", shape=SHAPE, codec="int8")


def test_a_message_of_another_shape_or_codec_is_refused():
    data = encode({"x": _x()}, codec="int8")
    with pytest.raises(WireFormatError, match="codec"):
        encoded_activation(data, name="x", shape=SHAPE, codec="bf16")
    with pytest.raises(WireFormatError, match="leaves"):
        encoded_activation(data, name="x", shape=(2, 8, 95), codec="int8")
