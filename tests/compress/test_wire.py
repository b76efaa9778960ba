"""The wire format: every malformed, truncated, corrupted or oversized message raises
WireFormatError (and nothing else); the streaming decoder and read_header agree with decode."""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ravnest_jax.compress as C
from ravnest_jax.compress._wire import PREFIX_NBYTES

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _tree():
    rng = np.random.default_rng(0)
    return {
        "layer0": {"w": rng.standard_normal((8, 9)).astype(np.float32), "b": rng.standard_normal(9).astype(np.float32)},
        "head": [rng.standard_normal(70).astype(np.float32)],
    }


def _craft(header_obj, payload: bytes, *, version=1, magic=b"RJPG", flags=0, payload_len=None) -> bytes:
    """A message with an arbitrary header and correct checksums (to reach the deep validation)."""
    header = msgpack.packb(header_obj, use_bin_type=True)
    plen = len(payload) if payload_len is None else payload_len
    head = struct.pack("<4sBBHIQI", magic, version, flags, 0, len(header), plen, zlib.crc32(payload))
    crc = zlib.crc32(header, zlib.crc32(head))
    return head + struct.pack("<I", crc) + header + payload


def _raises_wire(data, **kw):
    with pytest.raises(C.WireFormatError) as info:
        C.decode(data, **kw)
    return str(info.value)


@pytest.mark.parametrize("codec", C.CODECS)
def test_payload_starts_8_byte_aligned(codec):
    for k in range(12):
        data = C.encode({"w" * (k + 1): np.ones(10, np.float32), "b": [np.ones(3, np.float32)] * k}, codec)
        assert C.read_header(data).header_nbytes % 8 == 0
    # a header without padding (another encoder) is accepted too
    hdr = {"codec": "fp32", "leaves": [["w", [1], "float32", 0, 0]], "tree": {"d": {"w": 0}}}
    np.testing.assert_array_equal(C.decode(_craft(hdr, np.float32([2.5]).tobytes()))["w"], [2.5])


def test_prefix_size_and_magic():
    data = C.encode(_tree(), "int4")
    assert data[:4] == C.MAGIC and PREFIX_NBYTES == 28 and data[4] == C.FORMAT_VERSION
    assert issubclass(C.WireFormatError, ValueError)


@pytest.mark.parametrize("codec", C.CODECS)
def test_every_truncation_and_extension_raises(codec):
    data = C.encode(_tree(), codec)
    for cut in range(len(data)):
        msg = _raises_wire(data[:cut])
        assert "truncated" in msg
    assert "trailing" in _raises_wire(data + b"\x00")


def test_every_single_bit_flip_raises():
    data = bytearray(C.encode(_tree(), "int4"))
    for i in range(len(data)):
        for bit in (0, 3, 7):
            bad = bytearray(data)
            bad[i] ^= 1 << bit
            with pytest.raises(C.WireFormatError):
                C.decode(bytes(bad))


def test_clear_messages_for_prefix_errors():
    data = C.encode(_tree(), "int8")
    assert "bad magic" in _raises_wire(b"XXXX" + data[4:])
    assert "version" in _raises_wire(data[:4] + b"\x02" + data[5:])
    assert "reserved" in _raises_wire(data[:5] + b"\x01" + data[6:])
    assert "checksum" in _raises_wire(data[:-1] + bytes([data[-1] ^ 0xFF]))
    assert "max_bytes" in _raises_wire(data, max_bytes=len(data) - 1)
    assert C.decode(data, max_bytes=len(data))["head"][0].shape == (70,)


def test_limits_are_checked_before_allocation():
    # a tiny message that claims a 2**40-element leaf: refused from the header alone
    hdr = {"codec": "topk", "leaves": [["w", [2**40], "float32", 0, 1]], "tree": {"d": {"w": 0}}}
    data = _craft(hdr, b"\x00" * 8)
    assert "max_decoded_bytes" in _raises_wire(data)
    with pytest.raises(C.WireFormatError, match="max_decoded_bytes"):
        C.read_header(data)
    # a claimed payload of 2**60 bytes: refused from the prefix alone
    big = _craft({"codec": "fp32", "leaves": [], "tree": {"d": {}}}, b"", payload_len=2**60)
    assert "max_bytes" in _raises_wire(big)
    dec = C.StreamDecoder(max_bytes=1000)
    with pytest.raises(C.WireFormatError, match="max_bytes"):
        dec.feed(big[:PREFIX_NBYTES])
    with pytest.raises(C.WireFormatError, match="max_bytes"):  # sticky
        dec.feed(b"")


GOOD_TREE = {"d": {"w": 0}}


@pytest.mark.parametrize(
    "header, payload, match",
    [
        ({"codec": "int5", "leaves": [], "tree": {"d": {}}}, b"", "unknown codec"),
        # fp16 was dropped (bf16 is the half-precision codec): its messages are refused as any unknown codec
        (
            {"codec": "fp16", "leaves": [["w", [2], "float32", 0, 0]], "tree": GOOD_TREE},
            np.array([1, 2], "<f2").tobytes(),
            "unknown codec 'fp16'",
        ),
        ({"codec": "fp32"}, b"", "keys"),
        ({"codec": "fp32", "leaves": [], "tree": {"d": {}}, "pad": b"x" * 65}, b"", "pad"),
        ({"codec": "fp32", "leaves": [], "tree": {"d": {}}, "pad": 3}, b"", "pad"),
        ({"codec": "fp32", "leaves": [], "tree": {"d": {}}, "extra": 3}, b"", "keys"),
        ([1, 2, 3], b"", "map"),
        ({"codec": "fp32", "leaves": [["w", [3], "float32", 0, 0]], "tree": GOOD_TREE}, b"\x00" * 8, "imply a payload"),
        (
            {"codec": "fp32", "leaves": [["w", [3], "float32", 0, 0]], "tree": GOOD_TREE},
            b"\x00" * 16,
            "imply a payload",
        ),
        ({"codec": "fp32", "leaves": [["w", [-3], "float32", 0, 0]], "tree": GOOD_TREE}, b"", "shape"),
        ({"codec": "fp32", "leaves": [["w", [2.5], "float32", 0, 0]], "tree": GOOD_TREE}, b"", "shape"),
        ({"codec": "fp32", "leaves": [["w", [1] * 40, "float32", 0, 0]], "tree": GOOD_TREE}, b"\x00" * 4, "shape"),
        ({"codec": "fp32", "leaves": [["w", [1], "int32", 0, 0]], "tree": GOOD_TREE}, b"\x00" * 4, "dtype"),
        ({"codec": "fp32", "leaves": [["w", [1], "float32", 64, 0]], "tree": GOOD_TREE}, b"\x00" * 4, "block_size"),
        ({"codec": "int4", "leaves": [["w", [1], "float32", 63, 0]], "tree": GOOD_TREE}, b"\x00" * 40, "block_size"),
        ({"codec": "int4", "leaves": [["w", [1], "float32", 0, 0]], "tree": GOOD_TREE}, b"", "block_size"),
        ({"codec": "topk", "leaves": [["w", [3], "float32", 0, 4]], "tree": GOOD_TREE}, b"\x00" * 32, "topk count"),
        ({"codec": "fp32", "leaves": [["w", [1], "float32", 0, 1]], "tree": GOOD_TREE}, b"\x00" * 4, "k must be 0"),
        ({"codec": "fp32", "leaves": [["w", [1], "float32", 0]], "tree": GOOD_TREE}, b"\x00" * 4, "leaf entry"),
        ({"codec": "fp32", "leaves": [[7, [1], "float32", 0, 0]], "tree": GOOD_TREE}, b"\x00" * 4, "name"),
        (
            {"codec": "fp32", "leaves": [["w", [1], "float32", 0, 0]], "tree": {"d": {"v": 0}}},
            b"\x00" * 4,
            "does not match its tree path",
        ),
        (
            {"codec": "fp32", "leaves": [["w", [1], "float32", 0, 0]], "tree": {"d": {"w": 1}}},
            b"\x00" * 4,
            "tree structure",
        ),
        ({"codec": "fp32", "leaves": [["w", [1], "float32", 0, 0]], "tree": {"x": [0]}}, b"\x00" * 4, "tree structure"),
        (
            {"codec": "fp32", "leaves": [["w", [1], "float32", 0, 0]], "tree": {"l": [0, 0]}},
            b"\x00" * 4,
            "tree structure",
        ),
        ({"codec": "fp32", "leaves": [["w", [1], "float32", 0, 0]], "tree": "w"}, b"\x00" * 4, "tree structure"),
        # payload contents
        (
            {"codec": "fp32", "leaves": [["w", [2], "float32", 0, 0]], "tree": GOOD_TREE},
            np.array([1, np.nan], "<f4").tobytes(),
            "non-finite",
        ),
        ({"codec": "bf16", "leaves": [["w", [1], "float32", 0, 0]], "tree": GOOD_TREE}, b"\xc0\x7f", "non-finite"),
        (
            {"codec": "topk", "leaves": [["w", [4], "float32", 0, 2]], "tree": GOOD_TREE},
            np.array([3, 1], "<u4").tobytes() + b"\x00" * 8,
            "indices",
        ),
        (
            {"codec": "topk", "leaves": [["w", [4], "float32", 0, 2]], "tree": GOOD_TREE},
            np.array([1, 1], "<u4").tobytes() + b"\x00" * 8,
            "indices",
        ),
        (
            {"codec": "topk", "leaves": [["w", [4], "float32", 0, 1]], "tree": GOOD_TREE},
            np.array([4], "<u4").tobytes() + b"\x00" * 4,
            "indices",
        ),
        (
            {"codec": "topk", "leaves": [["w", [4], "float32", 0, 1]], "tree": GOOD_TREE},
            np.array([0], "<u4").tobytes() + np.array([np.inf], "<f4").tobytes(),
            "non-finite",
        ),
        ({"codec": "int8", "leaves": [["w", [2], "float32", 2, 0]], "tree": GOOD_TREE}, b"\x80\x7f\x01\x01", "scales"),
        ({"codec": "int8", "leaves": [["w", [2], "float32", 2, 0]], "tree": GOOD_TREE}, b"\x80\xbf\x01\x01", "scales"),
        ({"codec": "int4", "leaves": [["w", [2], "float32", 2, 0]], "tree": GOOD_TREE}, b"\x7f\x7f\x01", "scales"),
        ({"codec": "fp4", "leaves": [["w", [2], "float32", 2, 0]], "tree": GOOD_TREE}, b"\xff\x01", "E8M0"),
    ],
)
def test_inconsistent_headers_and_payloads(header, payload, match):
    data = _craft(header, payload)
    msg = _raises_wire(data)
    assert match in msg, msg


def test_undecodable_header_and_bad_utf8():
    payload = b""
    header = b"\xc1\xc1\xc1"  # reserved msgpack bytes
    head = struct.pack("<4sBBHIQI", b"RJPG", 1, 0, 0, len(header), 0, zlib.crc32(payload))
    data = head + struct.pack("<I", zlib.crc32(header, zlib.crc32(head))) + header
    assert "undecodable header" in _raises_wire(data)


@SETTINGS
@given(st.binary(max_size=400))
def test_random_bytes_only_raise_wire_format_error(data):
    with pytest.raises(C.WireFormatError):
        C.decode(data)
    with pytest.raises(C.WireFormatError):
        C.decode(b"RJPG\x01\x00\x00\x00" + data)


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=6), children, max_size=5),
    max_leaves=20,
)


@st.composite
def _headers(draw):
    """Header-shaped objects, mostly almost valid, with correct checksums."""
    codec = draw(st.sampled_from(list(C.CODECS) + ["bad"]))
    n_leaves = draw(st.integers(0, 3))
    leaves = []
    for i in range(n_leaves):
        shape = draw(st.lists(st.integers(-1, 70), max_size=3))
        leaves.append(
            [
                draw(st.sampled_from([f"l{i}", "x"])),
                shape,
                draw(st.sampled_from(["float32", "bfloat16", "int8"])),
                draw(st.sampled_from([0, 2, 3, 64])),
                draw(st.integers(-1, 5)),
            ]
        )
    tree = draw(st.one_of(st.just({"d": {f"l{i}": i for i in range(n_leaves)}}), _msgpack_values))
    obj = draw(st.sampled_from(["valid", "random"]))
    return {"codec": codec, "leaves": leaves, "tree": tree} if obj == "valid" else draw(_msgpack_values)


@SETTINGS
@given(_headers(), st.binary(max_size=300))
def test_fuzzed_headers_with_valid_checksums_only_raise_wire_format_error(header, payload):
    data = _craft(header, payload)
    try:
        out = C.decode(data)
    except C.WireFormatError:
        return
    # when it does decode, the result is consistent with the manifest
    m = C.read_header(data)
    assert m.total_nbytes == len(data)
    assert out is not None


@SETTINGS
@given(
    codec=st.sampled_from(C.CODECS),
    chunks=st.lists(st.integers(1, 97), min_size=1, max_size=30),
)
def test_stream_decoder_equals_decode(codec, chunks):
    data = C.encode(_tree(), codec)
    ref = C.decode(data)
    dec = C.StreamDecoder()
    pos = 0
    i = 0
    while pos < len(data):
        step = chunks[i % len(chunks)]
        dec.feed(data[pos : pos + step])
        pos += step
        i += 1
        if pos >= C.read_header(data).header_nbytes:
            assert dec.header is not None and dec.header.names == ("head/0", "layer0/b", "layer0/w")
        elif pos < PREFIX_NBYTES:
            assert dec.header is None
    out = dec.finish()
    np.testing.assert_array_equal(out["layer0"]["w"], ref["layer0"]["w"])
    np.testing.assert_array_equal(out["head"][0], ref["head"][0])
    assert dec.nbytes == len(data)


def test_stream_decoder_errors():
    data = C.encode(_tree(), "int4")
    dec = C.StreamDecoder()
    dec.feed(data[:-3])
    with pytest.raises(C.WireFormatError, match="truncated"):
        dec.finish()
    dec = C.StreamDecoder()
    with pytest.raises(C.WireFormatError, match="past the declared end"):
        dec.feed(data + b"x")
    dec = C.StreamDecoder()
    dec.feed(data[:10])
    with pytest.raises(C.WireFormatError, match="header is incomplete"):
        dec.finish()
    bad = bytearray(data)
    bad[-1] ^= 1
    dec = C.StreamDecoder()
    dec.feed(bytes(bad))
    with pytest.raises(C.WireFormatError, match="checksum"):
        dec.finish()
    with pytest.raises(C.WireFormatError, match="checksum"):  # sticky
        dec.finish()
    dec = C.StreamDecoder()
    with pytest.raises(C.WireFormatError, match="bad magic"):
        dec.feed(b"HTTP/1.1 200 OK\r\n\r\n" + b"\x00" * 20)
    with pytest.raises(ValueError, match="max_bytes"):
        C.StreamDecoder(max_bytes=0)


def test_read_header_needs_only_the_header():
    data = C.encode(_tree(), "fp4")
    m = C.read_header(data)
    assert C.read_header(data[: m.header_nbytes]) == m
    with pytest.raises(C.WireFormatError, match="prefix alone needs 28"):
        C.read_header(data[:27])
    with pytest.raises(C.WireFormatError, match="header needs"):
        C.read_header(data[: m.header_nbytes - 1])
    assert m.codec == "fp4" and m.total_nbytes == len(data)
    assert m.leaves[0].name == "head/0" and m.leaves[0].block_size == 32
    assert m.decoded_nbytes >= 4 * (70 + 9 + 72)
    with pytest.raises(TypeError):
        C.decode("not bytes")  # type: ignore[arg-type]


def test_host_api_does_not_import_jax():
    code = (
        "import sys, numpy as np\n"
        "import ravnest_jax.compress as C\n"
        "d = C.decode(C.encode({'w': np.ones(100, np.float32)}, 'int4'))\n"
        "C.weighted_mean([d, d], [1, 2]); C.StreamDecoder(); C.read_header\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("codec, bad", [("fp32", np.float32(np.inf)), ("bf16", None)])
def test_non_finite_past_the_first_decode_chunk_is_found(codec, bad):
    # the decoder converts and checks in chunks of _wire._CHUNK elements: the check covers all
    from ravnest_jax.compress._decode import _CHUNK

    n = 2 * _CHUNK + 3
    if codec == "fp32":
        vals = np.ones(n, "<f4")
    else:
        vals = np.full(n, 0x3F80, "<u2")  # bf16 bits of 1.0
    vals[-1] = bad if bad is not None else 0xFF80  # bf16 -inf
    header = {"codec": codec, "leaves": [["w", [n], "float32", 0, 0]], "tree": GOOD_TREE}
    assert "non-finite" in _raises_wire(_craft(header, vals.tobytes()))


def test_dense_decoders_agree_with_numpy_on_every_bit_pattern():
    # all finite bfloat16 bit patterns
    bits = np.arange(1 << 16, dtype=np.uint16)
    bf = bits[(bits & 0x7F80) != 0x7F80]
    header = {"codec": "bf16", "leaves": [["w", [bf.size], "float32", 0, 0]], "tree": GOOD_TREE}
    dec = C.decode(_craft(header, bf.astype("<u2").tobytes()))["w"]
    np.testing.assert_array_equal(dec.view(np.uint32), bf.astype(np.uint32) << 16)


@pytest.mark.parametrize("codec", ["int8", "int4", "fp4"])
def test_block_decoder_agrees_with_the_generic_dequantize_on_every_byte(codec):
    # the host decoder's tables and chunked passes give the values of _formats.dequantize
    from ravnest_jax.compress import _formats as F

    B = 4
    codes = np.arange(256, dtype=np.uint8)
    nb = codes.size // (B if codec == "int8" else B // 2)
    n = nb * B - 1  # a padded last block
    rng = np.random.default_rng(0)
    if codec == "fp4":
        scales = rng.integers(1, 200, nb).astype(np.uint8)
    else:
        scales = (rng.integers(0x3000, 0x4000, nb)).astype("<u2")
    scales[0] = 0  # a zero block
    header = {"codec": codec, "leaves": [["w", [n], "float32", B, 0]], "tree": GOOD_TREE}
    dec = C.decode(_craft(header, scales.tobytes() + codes.tobytes()))["w"]
    want = F.dequantize(np, F.CodecConfig(codec, B), (scales, codes), n)
    np.testing.assert_array_equal(dec, want)


@pytest.mark.parametrize("codec", C.CODECS)
def test_chunks_are_the_message_and_stream_into_the_decoder(codec):
    packed = C.host_pack(_tree(), codec)
    chunks = C.packed_to_chunks(packed)
    data = C.packed_to_bytes(packed)
    assert b"".join(chunks) == data == C.encode(_tree(), codec)
    assert all(isinstance(c, bytes) or c.readonly for c in chunks)
    dec = C.StreamDecoder()
    for c in chunks:
        dec.feed(c)
    out = dec.finish()
    assert dec.finish() is out  # a second call: the same tree
    ref = C.decode(data)
    for a, b in [(out["layer0"]["w"], ref["layer0"]["w"]), (out["head"][0], ref["head"][0])]:
        np.testing.assert_array_equal(a, b)
        assert a.dtype == np.float32 and a.flags.writeable
    # the fp32 leaves view the decoder's buffer: writing one leaves the others intact
    out["layer0"]["w"][...] = 7.0
    np.testing.assert_array_equal(out["layer0"]["b"], ref["layer0"]["b"])
    np.testing.assert_array_equal(out["head"][0], ref["head"][0])


def test_packed_to_chunks_refuses_non_finite_and_oversized():
    packed = C.host_pack({"w": np.ones(100, np.float32)}, "fp32")
    bad = C.Packed(packed.codec, packed.specs, packed.structure, packed.parts, (False,))
    with pytest.raises(C.NonFiniteError):
        C.packed_to_chunks(bad)
    with pytest.raises(ValueError, match="max_bytes"):
        C.packed_to_chunks(packed, max_bytes=100)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int4"])
def test_decoded_and_encoded_arrays_are_freed_without_the_garbage_collector(codec):
    # no reference cycle (a self-recursive closure in the tree helpers was one) keeps a decoded
    # leaf, or an encoded input, alive after its last user: big buffers return to the allocator
    import gc
    import weakref

    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    data = C.encode({"w": x.copy()}, codec)
    gc.disable()
    try:
        out = C.decode(data)["w"]
        ref = weakref.ref(out)
        del out
        assert ref() is None
        dec = C.StreamDecoder()
        dec.feed(data)
        out = dec.finish()["w"]
        ref = weakref.ref(out)
        del out, dec
        assert ref() is None
        y = x.copy()
        ref = weakref.ref(y)
        C.encode({"w": y}, codec)
        del y
        assert ref() is None
    finally:
        gc.enable()


def test_bf16_inf_and_nan_bit_patterns_are_refused():
    # every bf16 Inf/NaN pattern (exponent all ones), mixed in among finite values, is refused
    bits = np.arange(1 << 16, dtype=np.uint16)
    bad_bits = bits[(bits & 0x7F80) == 0x7F80]
    assert bad_bits.size == 256
    for bad in bad_bits[::7].tolist() + [0x7F80, 0xFF80, 0x7FFF, 0xFFFF, 0x7F81]:
        vals = np.full(300, 0x3F80, "<u2")  # 1.0
        vals[123] = bad
        header = {"codec": "bf16", "leaves": [["w", [300], "float32", 0, 0]], "tree": GOOD_TREE}
        assert "non-finite" in _raises_wire(_craft(header, vals.tobytes()))


@SETTINGS
@given(st.lists(st.floats(-(2.0**127), 2.0**127, width=32), min_size=1, max_size=300))
def test_bf16_roundtrip_is_the_bfloat16_cast(values):
    # round half to even, as ml_dtypes' float32 -> bfloat16 cast (subnormals included)
    x = np.asarray(values, np.float32)
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(C.decode(C.encode({"w": x}, "bf16"))["w"].view(np.uint32), want.view(np.uint32))
