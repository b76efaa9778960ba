"""Parts of an encoded contribution (compress/_parts.py): cut on block boundaries, sent as views of
the encoded payload, decoded chunk by chunk as they stream in."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ravnest_jax import compress
from ravnest_jax.compress import WireFormatError
from ravnest_jax.compress._parts import GRID, PartLayout, RangeDecoder, part_chunks
from ravnest_jax.swarm.peer._allreduce import part_bounds
from ravnest_jax.swarm.wire._codec import encode_part

CODECS = ["fp32", "bf16", "int8", "int4", "fp4", "int2", "sign", "topk"]


def _tree(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "a": rng.standard_normal((37, 5)).astype(np.float32),
        "b": rng.standard_normal(1000).astype(np.float32),
        "c": np.zeros(0, np.float32),
        "d": rng.standard_normal(300).astype(np.float32) * 1e-3,
    }


def _flat(packed: compress.Packed) -> np.ndarray:
    full = compress.decode(compress.packed_to_bytes(packed))
    return np.concatenate([full[k].ravel() for k in sorted(full)])


def _stream(layout: PartLayout, lo: int, hi: int, msg: bytes, rng: np.random.Generator) -> list[np.ndarray]:
    out: list[tuple[int, np.ndarray]] = []
    dec = RangeDecoder(layout, lo, hi, lambda j, v: out.append((j, v)))
    pos = 0
    while pos < len(msg):  # the socket's chunking: any sizes
        k = int(rng.integers(1, 900))
        dec.feed(msg[pos : pos + k])
        pos += k
    dec.finish()
    assert [j for j, _ in out] == list(range(len(layout.chunk_grid(lo, hi))))
    return [v for _, v in out]


@pytest.mark.parametrize("codec", CODECS)
def test_a_part_decodes_into_an_out_array_as_through_a_sink(codec):
    """``out=``: the part's values land in the caller's array (fp32: collected there, no copy),
    equal to what the sink form hands over; a wrong array or neither form is refused."""
    rng = np.random.default_rng(3)
    packed = compress.host_pack(_tree(rng), codec)
    layout = PartLayout.of(packed)
    for lo, hi in layout.bounds(3):
        msg = b"".join(bytes(c) for c in part_chunks(packed, layout, lo, hi))
        want = np.concatenate(_stream(layout, lo, hi, msg, rng) or [np.zeros(0, np.float32)])
        out = np.full(hi - lo, np.nan, np.float32)
        dec = RangeDecoder(layout, lo, hi, out=out)
        dec.feed(msg)
        dec.finish()
        np.testing.assert_array_equal(out, want)
    with pytest.raises(ValueError, match="contiguous float32 array of"):
        RangeDecoder(layout, 0, 10, out=np.zeros(11, np.float32))
    with pytest.raises(ValueError, match="needs a sink or an out array"):
        RangeDecoder(layout, 0, 10)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n_parts", [1, 2, 3, 7, 50])
def test_parts_decode_to_the_contribution_whatever_the_chunking(codec, n_parts):
    rng = np.random.default_rng(n_parts)
    packed = compress.host_pack(_tree(rng), codec)
    flat, layout = _flat(packed), PartLayout.of(packed)
    bounds = layout.bounds(n_parts)
    assert bounds[0][0] == 0 and bounds[-1][1] == layout.n == flat.size
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(n_parts - 1)), bounds
    for lo, hi in bounds:
        msg = b"".join(bytes(c) for c in part_chunks(packed, layout, lo, hi))
        whole = compress.decode(msg)  # a complete message of the wire format
        got = np.concatenate([whole[i] for i in range(len(whole))]) if whole else np.zeros(0, np.float32)
        np.testing.assert_array_equal(got, flat[lo:hi])
        chunks = _stream(layout, lo, hi, msg, rng)
        grid = layout.chunk_grid(lo, hi)
        for v, (a, b) in zip(chunks, grid):
            assert v.dtype == np.float32 and v.shape == (b - a,) and b - a <= GRID
            np.testing.assert_array_equal(v, flat[lo + a : lo + b])


@pytest.mark.parametrize("codec", ["int8", "int4", "fp4", "int2", "sign"])
def test_block_codec_parts_are_whole_blocks_of_their_leaves(codec):
    packed = compress.host_pack(_tree(np.random.default_rng(0)), codec)
    layout = PartLayout.of(packed)
    B = layout.block_size
    starts = set(int(o) for o in layout.offsets)
    for lo, _ in layout.bounds(5):
        i = int(np.searchsorted(layout.offsets, lo, side="right")) - 1
        assert lo in starts or (lo - int(layout.offsets[i])) % B == 0, (lo, B)
    with pytest.raises(ValueError, match="not a part"):
        part_chunks(packed, layout, 1, layout.n)  # not on a block boundary


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_dense_parts_are_the_bytes_the_swarm_sent_before(codec):
    """One flat leaf (``Swarm.all_reduce`` of float32 arrays): the same cut and the same payload
    bytes as encoding each part on its own (what the butterfly did before it sent views)."""
    x = np.random.default_rng(1).standard_normal(10_001).astype(np.float32)
    packed = compress.host_pack({"pg": x}, codec)
    layout = PartLayout.of(packed)
    assert layout.bounds(4) == part_bounds(x.size, 4)
    for lo, hi in layout.bounds(4):
        new = b"".join(bytes(c) for c in part_chunks(packed, layout, lo, hi))
        old = encode_part("p", x[lo:hi], codec)
        hn, ho = compress.read_header(new), compress.read_header(old)
        assert new[hn.header_nbytes :] == old[ho.header_nbytes :]


@pytest.mark.parametrize("codec", ["int8", "int4", "fp4"])
def test_block_codec_parts_send_no_more_bytes_than_encoding_each_part(codec):
    x = np.random.default_rng(2).standard_normal(100_003).astype(np.float32)
    packed = compress.host_pack({"pg": x}, codec)
    layout = PartLayout.of(packed)
    for n in (2, 3, 4, 8):
        new = sum(
            compress.read_header(b"".join(map(bytes, part_chunks(packed, layout, lo, hi)))).payload_nbytes
            for lo, hi in layout.bounds(n)
        )
        old = sum(
            compress.read_header(encode_part("p", x[lo:hi], codec)).payload_nbytes for lo, hi in part_bounds(x.size, n)
        )
        assert new == packed.nbytes <= old, (n, new, packed.nbytes, old)


def test_parts_of_device_style_segmented_payloads():
    """A device encode above its segment size gives a part as consecutive slices: parts cut
    across slice boundaries are the same bytes."""
    x = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    packed = compress.host_pack({"pg": x}, "int4")
    ((s, codes),) = packed.parts
    seg = compress.Packed(
        packed.codec, packed.specs, packed.structure, (((s[:10], s[10:]), (codes[:777], codes[777:])),), packed.ok
    )
    layout = PartLayout.of(packed)
    for lo, hi in layout.bounds(3):
        assert b"".join(map(bytes, part_chunks(seg, layout, lo, hi))) == b"".join(
            map(bytes, part_chunks(packed, layout, lo, hi))
        )


def _message(codec="fp32", n=1000):
    x = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    packed = compress.host_pack({"pg": x}, codec)
    layout = PartLayout.of(packed)
    lo, hi = layout.bounds(2)[1]
    return layout, lo, hi, b"".join(map(bytes, part_chunks(packed, layout, lo, hi)))


def test_range_decoder_refuses_what_is_not_the_part():
    layout, lo, hi, msg = _message()
    sink = lambda j, v: None  # noqa: E731
    with pytest.raises(WireFormatError, match="codec"):
        RangeDecoder(layout, lo, hi, sink).feed(encode_part("p", np.ones(hi - lo, np.float32), "bf16"))
    with pytest.raises(WireFormatError, match="do not match"):
        RangeDecoder(layout, lo, hi, sink).feed(encode_part("p", np.ones(hi - lo + 1, np.float32), "fp32"))
    with pytest.raises(WireFormatError, match="past the declared end"):
        RangeDecoder(layout, lo, hi, sink).feed(msg + b"\0")
    dec = RangeDecoder(layout, lo, hi, sink)
    dec.feed(msg[:-5])
    with pytest.raises(WireFormatError, match="truncated"):
        dec.finish()
    corrupt = bytearray(msg)
    corrupt[-3] ^= 0xFF
    dec = RangeDecoder(layout, lo, hi, sink)
    dec.feed(bytes(corrupt))
    with pytest.raises(WireFormatError, match="checksum"):
        dec.finish()
    with pytest.raises(WireFormatError, match="magic"):
        RangeDecoder(layout, lo, hi, sink).feed(b"\0garbage" * 10)
    nan = np.full(hi - lo, np.nan, np.float32)
    raw = bytearray(encode_part("p", np.ones(hi - lo, np.float32), "fp32"))
    head = compress.read_header(bytes(raw)).header_nbytes
    raw[head:] = nan.tobytes()
    with pytest.raises(WireFormatError, match="non-finite"):
        RangeDecoder(layout, lo, hi, sink).feed(bytes(raw))
    dec = RangeDecoder(layout, lo, hi, sink)
    with pytest.raises(WireFormatError):
        dec.feed(b"\0garbage" * 10)
    with pytest.raises(WireFormatError):  # errors are sticky
        dec.feed(msg)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=6),
    n_parts=st.integers(1, 9),
    codec=st.sampled_from(CODECS),
    seed=st.integers(0, 2**16),
)
def test_any_layout_round_trips(sizes, n_parts, codec, seed):
    rng = np.random.default_rng(seed)
    tree = [rng.standard_normal(s).astype(np.float32) for s in sizes]
    packed = compress.host_pack(tree, codec)
    layout = PartLayout.of(packed)
    flat = np.concatenate([a.ravel() for a in compress.decode(compress.packed_to_bytes(packed))])
    got = np.empty_like(flat)
    for lo, hi in layout.bounds(n_parts):
        msg = b"".join(map(bytes, part_chunks(packed, layout, lo, hi)))
        grid = layout.chunk_grid(lo, hi)
        for v, (a, b) in zip(_stream(layout, lo, hi, msg, rng), grid):
            got[lo + a : lo + b] = v
    np.testing.assert_array_equal(got, flat)
