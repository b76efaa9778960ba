"""Causal grouped-query attention with per-token segment ids (packed documents), three ways:
XLA's reference (materialises the scores), cuDNN's flash attention on NVIDIA GPUs, and a pure-JAX
memory-efficient kernel (query chunks x key chunks with an online softmax and FlashAttention's
recomputing backward pass) that never holds a ``(seq x seq)`` score matrix.

References: Rabe & Staats, Self-attention does not need O(n^2) memory, arXiv 2112.05682; Dao et
al., FlashAttention, arXiv 2205.14135; Dao, FlashAttention-2, arXiv 2307.08691; Ainslie et al.,
GQA, arXiv 2305.13245.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("auto", "cudnn", "chunked", "xla")
DEFAULT_CHUNK = 256  # tokens per query / key chunk of the chunked kernel (docs/attention.md: why 256)
_NEG = float(np.finfo(np.float32).min)  # the score of a masked pair (finite: no inf - inf)


def check_implementation(implementation: str) -> None:
    """Raises a one-line ``ValueError`` unless ``implementation`` is one of
    :data:`IMPLEMENTATIONS`."""
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation={implementation!r}: choose one of {', '.join(IMPLEMENTATIONS)}")


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    implementation: str = "auto",
    chunk_size: int = DEFAULT_CHUNK,
) -> jax.Array:
    """Causal scaled dot-product attention, ``softmax(q k^T / sqrt(head_dim) + mask) v``, where a
    token attends to the earlier-or-equal tokens of its own segment. The softmax runs in float32.

    Args:
      q: queries ``(batch, seq, heads, head_dim)``, float32, bfloat16 or float16.
      k: keys ``(batch, seq, kv_heads, head_dim)``, q's dtype; ``heads`` a multiple of
        ``kv_heads`` (grouped-query attention: each key/value head serves ``heads / kv_heads``
        consecutive query heads, as ``jax.nn.dot_product_attention``).
      v: values, the shape and dtype of ``k``.
      segment_ids: int32 ``(batch, seq)``: token ``i`` attends to token ``j <= i`` only where
        ``segment_ids[:, i] == segment_ids[:, j]`` (packed documents never see each other; any
        integer labels, documents need not be contiguous). None: one segment per row.
      implementation: ``"xla"``: ``jax.nn.dot_product_attention(implementation="xla")`` with the
        causal and segment masks: holds the float32 scores ``batch x heads x seq^2`` (the
        reference). ``"cudnn"``: cuDNN's flash attention through
        ``jax.nn.dot_product_attention(implementation="cudnn")``: NVIDIA GPUs (compute capability
        8.0 or more), bfloat16 / float16, head_dim a multiple of 8 up to 128 (256 from Hopper);
        GQA natively and the causal mask generated in the kernel; with ``segment_ids`` the only
        form the public API takes is a boolean mask ``(batch, 1, seq, seq)``, which jax turns
        into an additive bias in q's dtype: ``2 * batch * seq^2`` bytes held from the forward
        to the backward pass, plus as much again for the bias gradient cuDNN writes in the
        backward (``4 * batch * seq^2`` bytes a layer: 64 MiB at 4096 tokens, 1 GiB at 16384;
        independent of the number of heads, unlike XLA's scores); with segment ids cuDNN also
        needs an even ``seq``. ``"chunked"``: :func:`chunked_attention`, pure JAX, any backend
        and dtype. ``"auto"``: ``"cudnn"`` on an NVIDIA GPU where cuDNN takes the dtype and the
        shapes, else ``"xla"`` when ``seq <= chunk_size`` (one chunk: chunking saves nothing),
        else ``"chunked"``.
      chunk_size: tokens per chunk of ``"chunked"`` (and the ``"auto"`` threshold), >= 1.

    Returns:
      ``(batch, seq, heads, head_dim)`` in q's dtype.

    Raises:
      ValueError: an unknown ``implementation``; shapes, dtypes or ``chunk_size`` that do not
        fit; ``"cudnn"`` where there is no NVIDIA GPU with cuDNN, or with float32 inputs.
    """
    check_implementation(implementation)
    _check_inputs(q, k, v, segment_ids, chunk_size)
    if implementation == "auto":
        if _cudnn_takes(q, segment_ids):
            implementation = "cudnn"
        else:
            implementation = "xla" if q.shape[1] <= chunk_size else "chunked"
    if implementation == "chunked":
        return chunked_attention(q, k, v, segment_ids=segment_ids, chunk_size=chunk_size)
    if implementation == "cudnn":
        why = _no_cudnn_reason(q.dtype)
        if why:
            raise ValueError(f"attention implementation='cudnn': {why}; use 'chunked' or 'xla'")
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # (batch, 1, seq, seq)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)


def _check_inputs(q, k, v, segment_ids, chunk_size) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"attention: q {q.shape}, k {k.shape}, v {v.shape}: want (batch, seq, heads, head_dim)")
    b, t, h, d = q.shape
    if k.shape[:2] != (b, t) or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"attention: q {q.shape} and k/v {k.shape} differ in batch, seq or head_dim, or heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if segment_ids is not None and (segment_ids.shape != (b, t) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(f"attention: segment_ids {segment_ids.shape} {segment_ids.dtype}: want int32 {(b, t)}")
    if not isinstance(chunk_size, int | np.integer) or chunk_size < 1:
        raise ValueError(f"attention: chunk_size={chunk_size!r}: want an int >= 1")


def _gpu():
    """The first CUDA device, or None."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    d = devices[0] if devices else None
    if d is None or "cuda" not in str(getattr(d.client, "platform_version", "")).lower():
        return None
    return d


def _no_cudnn_reason(dtype) -> str:
    """Why cuDNN's flash attention cannot run here ('' when it can)."""
    d = _gpu()
    if d is None:
        return f"cuDNN flash attention needs an NVIDIA GPU, and the backend is {jax.default_backend()}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN flash attention takes bfloat16 or float16, not {jnp.dtype(dtype)}"
    return ""


def _cudnn_takes(q: jax.Array, segment_ids: jax.Array | None) -> bool:
    """Whether ``"auto"`` picks cuDNN: a CUDA GPU of compute capability >= 8.0, bf16/fp16, and
    the shapes jax's cuDNN wrapper accepts (head_dim a multiple of 8, <= 128 before Hopper and
    <= 256 from it; an even seq with a segment mask, which cuDNN takes as a bias)."""
    if _no_cudnn_reason(q.dtype):
        return False
    try:
        capability = tuple(int(x) for x in str(_gpu().compute_capability).split("."))
    except (AttributeError, ValueError):
        return False
    head_dim = q.shape[-1]
    max_head_dim = 256 if capability >= (9, 0) else 128
    if capability < (8, 0) or head_dim % 8 or head_dim > max_head_dim:
        return False
    return segment_ids is None or q.shape[1] % 2 == 0


# ------------------------------------------------------------------------ the chunked kernel
def chunked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> jax.Array:
    """Memory-efficient causal attention in pure JAX: the arguments, result and masking of
    :func:`attention`.

    The sequence is cut into ``n = ceil(seq / chunk_size)`` chunks (padded at the end; padded
    keys come after every real query, so the causal mask hides them, and padded query rows are
    dropped). Forward (Rabe & Staats, arXiv 2112.05682; FlashAttention, arXiv 2205.14135): for
    each query chunk ``i``, the key chunks ``j = 0 .. i`` one at a time, with a running row
    maximum ``m``, sum ``l`` and float32 accumulator (online softmax); it keeps the output and
    the row log-sum-exp ``m + log l`` (float32 ``batch x heads x seq``) for the backward pass.
    Backward (a ``jax.custom_vjp``, FlashAttention-2's, arXiv 2307.08691): for each key chunk
    ``j``, the query chunks ``i = j .. n - 1``, recomputing ``P = exp(s - lse)`` from q and k,
    with ``dV_j += P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ_i += dS K_j / sqrt(d)``,
    ``dK_j += dS^T Q_i / sqrt(d)``.

    Key chunks above the causal diagonal are never computed, forward or backward: the loops
    run to the diagonal (``lax.fori_loop`` with a traced bound, a ``while`` loop, which the
    custom backward rule never has to differentiate): ``n (n + 1) / 2`` block products of
    ``chunk_size^2`` per pass instead of ``n^2``. Grouped-query attention without repeating k
    and v: q is viewed as ``(batch, seq, kv_heads, group, head_dim)``.

    Memory beyond the inputs and output: one block's float32 scores and probabilities
    (``batch x heads x chunk_size^2`` each), the float32 accumulators of one query chunk, the
    log-sum-exp, and in the backward a float32 ``dQ`` (``batch x seq x heads x head_dim``);
    no ``seq x seq`` array. Forward-mode differentiation (``jax.jvp``) is not defined (a
    custom VJP); reverse mode, ``jit`` and ``vmap`` are.
    """
    b, t, _, _ = q.shape
    if segment_ids is None:
        segment_ids = jnp.zeros((b, t), jnp.int32)
    return _chunked(q, k, v, segment_ids.astype(jnp.int32), int(chunk_size))


def _blocks(q, k, v, seg, c):
    """Pads seq to ``n * c`` and views the arrays by chunk: q ``(b, n, c, kv, g, d)``, k and v
    ``(b, n, c, kv, d)``, segment ids ``(b, n, c)`` (padding: segment -1)."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    n = -(-t // c)
    pad = n * c - t
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, widths), jnp.pad(k, widths), jnp.pad(v, widths)
        seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)
    return (
        q.reshape(b, n, c, kvh, h // kvh, d),
        k.reshape(b, n, c, kvh, d),
        v.reshape(b, n, c, kvh, d),
        seg.reshape(b, n, c),
        n,
    )


def _block_mask(i, j, seg_i, seg_j, c):
    """``(b, 1, 1, c, c)``: query ``i * c + a`` may see key ``j * c + e`` (causal, same
    segment)."""
    pos = jnp.arange(c, dtype=jnp.int32)
    causal = (j * c + pos)[None, :] <= (i * c + pos)[:, None]
    same = seg_i[:, :, None] == seg_j[:, None, :]
    return (causal[None] & same)[:, None, None]


def _scores(q_i, k_j, scale):
    """``(b, kv, g, c, c)`` float32 scores of a query chunk against a key chunk."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q_i, k_j, preferred_element_type=jnp.float32)
    return s * jnp.float32(scale)


def _take(x, i, axis=1):
    return jax.lax.dynamic_index_in_dim(x, i, axis, keepdims=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked(q, k, v, seg, c):
    return _chunked_fwd(q, k, v, seg, c)[0]


def _chunked_fwd(q, k, v, seg, c):
    b, t, h, d = q.shape
    scale = 1.0 / math.sqrt(d)
    qb, kb, vb, sb, n = _blocks(q, k, v, seg, c)
    kvh, g = qb.shape[3], qb.shape[4]

    def query_chunk(_, xs):
        i, q_i, seg_i = xs  # q_i (b, c, kv, g, d)

        def key_chunk(j, carry):
            m, total, acc = carry
            k_j, v_j, seg_j = _take(kb, j), _take(vb, j), _take(sb, j)
            mask = _block_mask(i, j, seg_i, seg_j, c)
            s = jnp.where(mask, _scores(q_i, k_j, scale), _NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            total = total * corr + p.sum(-1)
            pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v_j.dtype), v_j, preferred_element_type=jnp.float32)
            return m_new, total, acc * corr[..., None] + pv

        init = (
            jnp.full((b, kvh, g, c), _NEG, jnp.float32),
            jnp.zeros((b, kvh, g, c), jnp.float32),
            jnp.zeros((b, kvh, g, c, d), jnp.float32),
        )
        m, total, acc = jax.lax.fori_loop(0, i + 1, key_chunk, init)  # up to the diagonal only
        out = (acc / total[..., None]).astype(q.dtype)  # every row sees itself: total > 0
        return None, (jnp.einsum("bhgqd->bqhgd", out), m + jnp.log(total))

    xs = (jnp.arange(n, dtype=jnp.int32), jnp.moveaxis(qb, 1, 0), jnp.moveaxis(sb, 1, 0))
    _, (out, lse) = jax.lax.scan(query_chunk, None, xs)  # (n, b, c, kv, g, d), (n, b, kv, g, c)
    out = jnp.moveaxis(out, 0, 1).reshape(b, n * c, h, d)[:, :t]
    return out, (q, k, v, seg, out, jnp.moveaxis(lse, 0, 1))


def _chunked_bwd(c, res, do):
    q, k, v, seg, out, lse = res  # lse (b, n, kv, g, c)
    b, t, h, d = q.shape
    scale = 1.0 / math.sqrt(d)
    qb, kb, vb, sb, n = _blocks(q, k, v, seg, c)
    kvh, g = qb.shape[3], qb.shape[4]
    # rowsum(dO * O) (FlashAttention-2's D), float32 (b, n, kv, g, c)
    dsum = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1)
    dob = _blocks(do, k, v, seg, c)[0]
    dsum = jnp.pad(dsum, ((0, 0), (0, n * c - t), (0, 0))).reshape(b, n, c, kvh, g)
    dsum = jnp.einsum("bnqhg->bnhgq", dsum)

    def key_chunk(dq, xs):
        j, k_j, v_j, seg_j = xs

        def query_chunk(i, carry):
            dq, dk, dv = carry
            q_i, do_i, seg_i = _take(qb, i), _take(dob, i), _take(sb, i)
            mask = _block_mask(i, j, seg_i, seg_j, c)
            s = _scores(q_i, k_j, scale)
            p = jnp.where(mask, jnp.exp(s - _take(lse, i)[..., None]), 0.0)  # (b, kv, g, c, c)
            dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - _take(dsum, i)[..., None]) * jnp.float32(scale)
            dq_i = jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(k_j.dtype), k_j, preferred_element_type=jnp.float32)
            dq = jax.lax.dynamic_update_index_in_dim(dq, _take(dq, i) + dq_i, i, 1)
            dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q_i.dtype), q_i, preferred_element_type=jnp.float32)
            return dq, dk, dv

        zeros = jnp.zeros((b, c, kvh, d), jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(j, n, query_chunk, (dq, zeros, zeros))  # from the diagonal down
        return dq, (dk, dv)

    xs = (jnp.arange(n, dtype=jnp.int32), jnp.moveaxis(kb, 1, 0), jnp.moveaxis(vb, 1, 0), jnp.moveaxis(sb, 1, 0))
    dq, (dk, dv) = jax.lax.scan(key_chunk, jnp.zeros(qb.shape, jnp.float32), xs)
    dq = dq.reshape(b, n * c, h, d)[:, :t].astype(q.dtype)
    dk = jnp.moveaxis(dk, 0, 1).reshape(b, n * c, kvh, d)[:, :t].astype(k.dtype)
    dv = jnp.moveaxis(dv, 0, 1).reshape(b, n * c, kvh, d)[:, :t].astype(v.dtype)
    return dq, dk, dv, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
