"""lowcomm.compress: round-trip error within each compressor's stated bound, packed sizes
equal to their formulas, the error-feedback identity, lossless top-k, DeMo's DCT blocks."""
from __future__ import annotations

import math

import pytest
import torch

from lowcomm.compress import (Compressor, DCTTopK, ErrorFeedback, IntQuantizer, PerTensor, SignQuantizer, TopK,
                              block_dims, dct_matrix, largest_divisor_at_most, make_compressor,
                              pack_bits, parse_spec, quantizer_for_bits, unpack_bits)


def data(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.logspace(-4, 0, shape[-1])[torch.randperm(shape[-1], generator=g)]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000])
def test_bit_packing_round_trips_at_its_size(bits, n):
    codes = torch.randint(0, 2 ** bits, (3, n), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, math.ceil(n * bits / 8))
    assert torch.equal(unpack_bits(packed, bits, n), codes)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("block", [1, 64, 100])
def test_int_quantizer_error_within_half_a_step(bits, block):
    x = data(4, 1003)
    q = IntQuantizer(bits, block)
    y = q.roundtrip(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert ((x - y).abs() <= q.bound(x) * (1 + 1e-5) + 1e-12).all()
    zero = torch.zeros(2, 50)
    assert torch.equal(q.roundtrip(zero), zero)  # a zero block has scale 0, not NaN


def test_sign_quantizer_error_is_the_stated_identity():
    x = data(3, 1000)
    q = SignQuantizer(block=64)
    y = q.roundtrip(x)
    for r in range(3):
        for b in range(0, 1000, 64):
            xb, yb = x[r, b:b + 64].double(), y[r, b:b + 64].double()
            s = xb.abs().mean()
            assert torch.allclose(yb.abs(), s.expand_as(yb), rtol=1e-6)
            assert torch.equal(yb >= 0, xb >= 0)
            err, bound = float((xb - yb).pow(2).sum()), float(xb.pow(2).sum() - xb.numel() * s ** 2)
            assert err == pytest.approx(bound, rel=1e-5, abs=1e-12) and err <= float(xb.pow(2).sum())


@pytest.mark.parametrize("n,block", [(1000, 64), (1024, 256), (1, 256), (513, 7)])
def test_packed_sizes_equal_the_formulas(n, block):
    x = data(2, n)
    nb = math.ceil(n / block)
    want = {"int8": n + 4 * nb, "int4": math.ceil(n / 2) + 4 * nb, "int2": math.ceil(n / 4) + 4 * nb,
            "sign": math.ceil(n / 8) + 4 * nb, "none": 4 * n}
    for kind, size in want.items():
        c = make_compressor(kind, block)
        assert c.nbytes(n) == size, kind
        buf = c.to_bytes(c.compress(x))
        assert buf.dtype == torch.uint8 and buf.shape == (2, size), kind
        assert torch.equal(c.decompress(c.from_bytes(buf, n)), c.roundtrip(x)), kind
    assert quantizer_for_bits(4, block).nbytes(n) == want["int4"]
    with pytest.raises(ValueError):
        quantizer_for_bits(3)


@pytest.mark.parametrize("chunk,idx_bytes", [(256, 1), (257, 2), (65536, 2), (70000, 4)])
def test_topk_indices_use_the_smallest_type(chunk, idx_bytes):
    t = TopK(chunk, k=3, value_bits=16)
    n = 2 * chunk + 1
    chunks = 3
    assert t.nbytes(n) == chunks * 3 * (idx_bytes + 2)
    x = data(1, n)
    assert t.to_bytes(t.compress(x)).shape == (1, t.nbytes(n))


@pytest.mark.parametrize("value_bits", [32, 16, 8, 4, 2])
def test_topk_keeps_the_largest_and_sizes_match(value_bits):
    chunk, k, n = 64, 8, 1000
    x = data(2, n)
    t = TopK(chunk, k=k, value_bits=value_bits)
    chunks = math.ceil(n / chunk)
    vals = {32: 4 * chunks * k, 16: 2 * chunks * k}.get(value_bits, math.ceil(chunks * k * value_bits / 8) + 4 * chunks)
    assert t.nbytes(n) == chunks * k * 1 + vals
    y = t.roundtrip(x)
    padded = torch.nn.functional.pad(x, (0, chunks * chunk - n)).view(2, chunks, chunk)
    kept = torch.nn.functional.pad(y, (0, chunks * chunk - n)).view(2, chunks, chunk) != 0
    top = padded.abs().topk(k, dim=-1).indices
    assert kept.sum() <= 2 * chunks * k
    if value_bits in (32, 16):  # every value is kept at its place (bf16 rounds it)
        assert torch.equal(kept.gather(-1, top), torch.ones_like(top, dtype=torch.bool))
        rel = 0 if value_bits == 32 else 2 ** -8
        sel = torch.zeros_like(padded).scatter(-1, top, padded.gather(-1, top)).view(2, -1)[:, :n]
        assert ((y - sel).abs() <= sel.abs() * rel).all()
    else:  # per-chunk absmax step over the kept values
        qmax = 2 ** (value_bits - 1) - 1
        step = padded.gather(-1, top).abs().amax(-1, keepdim=True) / qmax
        sel = torch.zeros_like(padded).scatter(-1, top, padded.gather(-1, top))
        err = (torch.nn.functional.pad(y, (0, chunks * chunk - n)).view(2, chunks, chunk) - sel).abs()
        assert (err <= step / 2 * (1 + 1e-5) + 1e-12).all()
    assert TopK(64, fraction=0.25).k == 16


def test_topk_with_k_equal_to_the_chunk_at_32_bits_is_lossless():
    x = data(3, 1001)
    for chunk in (1, 64, 1001, 2000):
        t = TopK(chunk, k=chunk, value_bits=32)
        assert torch.equal(t.decompress(t.from_bytes(t.to_bytes(t.compress(x)), 1001)), x)


@pytest.mark.parametrize("kind", ["int8", "int4", "int2", "topk"])
def test_error_feedback_identity_is_exact(kind):
    """sent + new residual = input, bit for bit, over several steps (the residual carries over)."""
    kw = {"k": 5} if kind == "topk" else {}
    ef = ErrorFeedback(make_compressor(kind, 64, **kw))
    residual = torch.zeros(4, 999)
    for step in range(5):
        g = data(4, 999, seed=step)
        inp = g + residual
        payload, sent = ef.compress("g", g)
        residual = ef.residuals["g"]
        assert torch.equal(sent, ef.compressor.decompress(payload))
        assert torch.equal(sent + residual, inp), f"step {step}"
    state = ef.state_dict()
    fresh = ErrorFeedback(make_compressor(kind, 64, **kw))
    fresh.load_state_dict(state)
    g = data(4, 999, seed=99)
    assert torch.equal(fresh.compress("g", g)[1], ef.compress("g", g)[1])


def test_error_feedback_with_sign_carries_exactly_what_was_not_sent():
    """1 bit: the residual is input - sent exactly as computed in fp32 (sent + residual can
    differ from the input by rounding when |x| is far below the block's scale)."""
    ef = ErrorFeedback(SignQuantizer(64))
    g = data(2, 500)
    _, sent = ef.compress("g", g)
    assert torch.equal(ef.residuals["g"], g - sent)
    assert torch.allclose(sent + ef.residuals["g"], g, rtol=0, atol=1e-6)
    off = ErrorFeedback(SignQuantizer(64), enabled=False)
    off.compress("g", g)
    assert off.residuals == {}


def test_identity_compressor_and_names():
    x = data(2, 10)
    assert torch.equal(Compressor().roundtrip(x), x)
    with pytest.raises(ValueError):
        make_compressor("int3")


# -- DeMo's DCT ------------------------------------------------------------------------------

def test_chunk_is_the_largest_divisor_not_above_the_target():
    assert largest_divisor_at_most(256, 64) == 64
    assert largest_divisor_at_most(48, 64) == 48
    assert largest_divisor_at_most(144, 64) == 48
    assert largest_divisor_at_most(432, 64) == 54
    assert largest_divisor_at_most(97, 64) == 1
    assert block_dims((576, 144), 64) == (64, 48)
    assert block_dims((144,), 64) == (48,)


def test_dct_matrix_is_orthonormal_dct_ii():
    for n in (1, 5, 16, 64):
        F = dct_matrix(n, dtype=torch.float64)
        assert torch.allclose(F.T @ F, torch.eye(n, dtype=torch.float64), atol=1e-12)
        x = torch.randn(n, dtype=torch.float64)
        k = torch.arange(n, dtype=torch.float64)
        i = torch.arange(n, dtype=torch.float64)
        ref = (x[:, None] * torch.cos(math.pi * (2 * i[:, None] + 1) * k[None, :] / (2 * n))).sum(0)
        ref = ref * torch.where(k == 0, math.sqrt(1 / n), math.sqrt(2 / n))
        assert torch.allclose(x @ F, ref, atol=1e-10)


@pytest.mark.parametrize("shape", [(256, 16), (48, 16), (16,), (144, 576), (7, 3)])
def test_dct_topk_with_every_coefficient_is_lossless(shape):
    x = torch.randn(shape)
    enc = DCTTopK(shape, chunk=64, k=10 ** 9)
    idx, val = enc.compress(x)
    assert idx.dtype == torch.int64 and val.dtype == torch.float32
    assert enc.nbytes() == 12 * x.numel()
    assert torch.allclose(enc.decompress([idx], [val]), x, atol=1e-5)


def test_dct_topk_sizes_and_index_types():
    enc = DCTTopK((256, 144), chunk=64, k=32)              # blocks 64 x 48: 4 x 3 blocks
    assert enc.dims == (64, 48) and enc.blocks == 12 and enc.block == 3072
    assert enc.nbytes() == 12 * 32 * 12
    compact = DCTTopK((256, 144), chunk=64, k=32, compact_index=True)
    assert compact.nbytes() == 12 * 32 * (2 + 4)
    assert DCTTopK((16, 16), chunk=64, k=32, compact_index=True).nbytes() == 32 * (1 + 4)   # 256 -> uint8
    assert DCTTopK((256, 144), chunk=64, k=32, values="bf16").nbytes() == 12 * 32 * (8 + 2)
    assert DCTTopK((256, 144), chunk=64, k=32, values="sign", compact_index=True).nbytes() == \
        12 * 32 * 2 + 12 * 32 // 8 + 4 * 12
    for values in ("fp32", "bf16", "sign"):
        e = DCTTopK((256, 144), chunk=64, k=32, values=values, compact_index=True)
        i, v = e.compress(torch.randn(256, 144))
        assert i.numel() * i.element_size() + v.numel() * v.element_size() == e.nbytes()


def test_dct_topk_keeps_the_largest_coefficients_and_averages_over_senders():
    shape = (128, 32)
    enc = DCTTopK(shape, chunk=64, k=4)
    a, b = torch.randn(shape), torch.randn(shape)
    ia, va = enc.compress(a)
    coeffs = enc.encode(a)
    assert torch.equal(coeffs.abs().gather(-1, ia).min(-1).values >= coeffs.abs().topk(4, dim=-1).values[:, -1],
                       torch.ones(enc.blocks, dtype=torch.bool))
    ib, vb = enc.compress(b)
    both = torch.zeros(enc.blocks, enc.block)
    count = torch.zeros(enc.blocks, enc.block)
    for i, v in ((ia, va), (ib, vb)):
        both.scatter_add_(-1, i, v)
        count.scatter_add_(-1, i, torch.ones_like(v))
    want = enc.decode(torch.where(count > 0, both / count.clamp(min=1), 0))
    assert torch.allclose(enc.decompress([ia, ib], [va, vb]), want, atol=1e-6)


# -- SPECs, SparseLoCo's value quantizer, combining workers' payloads, decaying residuals -------

def test_parse_spec_builds_the_named_compressor_and_rejects_the_rest():
    t = parse_spec("topk:0.02,bits:2")
    assert isinstance(t, TopK) and (t.chunk, t.k, t.values.bits, t.values.scheme) == (256, 5, 2, "absmax")
    t = parse_spec("topk:64,chunk:4096,bits:2,quant:stat")
    assert (t.chunk, t.k, t.values.scheme) == (4096, 64, "stat") and t.idx_dtype == torch.int16
    q = parse_spec("int4,block:64")
    assert isinstance(q, IntQuantizer) and (q.bits, q.block) == (4, 64)
    assert type(parse_spec("none")) is Compressor and isinstance(parse_spec("sign"), SignQuantizer)
    for bad in ("", "topk", "gzip", "topk:0.02,bits:3", "topk:0.02,block:64", "int8,bits:2",
                "topk:0.02,topk:0.1", "topk:0.02,quant:fp8", "topk:5000,chunk:4096"):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_statistical_values_are_sparselocos_quantizer_at_its_size():
    """2 bits: shift = mean, step = 6σ/4, codes round(c/step) + 2 clamped to 0..3, each code
    decoded to the mean of the centred values it holds; 2^b + 1 fp32 per row."""
    t = TopK(chunk=64, k=16, value_bits=2, values="stat")
    x = data(3, 640)
    payload = t.compress(x)
    assert t.to_bytes(payload).shape == (3, t.nbytes(640)) == (3, 10 * 16 + 10 * 16 * 2 // 8 + 5 * 4)
    chunks = x.view(3, 10, 64)
    idx = payload.parts[0].long().view(3, 10, 16)  # uint8 indices: a chunk of 64
    v = chunks.gather(-1, idx).reshape(3, -1)
    c = v - v.mean(-1, keepdim=True)
    step = 6 * (c.norm(dim=-1, keepdim=True) / math.sqrt(v.shape[-1] - 1)) / 4
    codes = torch.round(c / step + 2).clamp(0, 3)
    want = torch.zeros_like(v)
    for b in range(4):
        sel = codes == b
        means = torch.where(sel, c, 0).sum(-1, keepdim=True) / sel.sum(-1, keepdim=True).clamp(min=1)
        want = torch.where(sel, means, want)
    got = t.decompress(payload).view(3, 10, 64).gather(-1, idx).reshape(3, -1)
    assert torch.allclose(got, want + v.mean(-1, keepdim=True), atol=1e-6)


def _authors_stat_quantize(val, n_bins=4, range_in_sigmas=6):
    """The authors' TopKCompressor._quantize and _dequantize (tplr-ai/SparseLoCo, first published
    as CCLoco: src/tplr/ccloco.py), on the values their top-k selected: decoded values."""
    offset, shift = n_bins // 2, val.mean()
    centered = val - shift
    std = centered.norm() / math.sqrt(centered.numel() - 1) if centered.numel() > 1 else torch.tensor(0.0)
    scale = range_in_sigmas * std / n_bins
    if scale == 0 or torch.isnan(scale) or torch.isinf(scale):
        scale = torch.tensor(1.0)
    q = (centered / scale + offset).round().clamp(0, n_bins - 1).long()
    sums = torch.zeros(n_bins).scatter_add_(0, q, centered)
    counts = torch.zeros(n_bins).scatter_add_(0, q, torch.ones_like(centered))
    return torch.where(counts > 0, sums / counts, 0.0)[q] + shift


@pytest.mark.parametrize("n", [10, 64 + 10, 40])
def test_statistical_values_of_a_short_row_are_over_its_own_values_only(n):
    """A row shorter than its chunks is zero-padded, and where a chunk holds fewer than k of
    the row's values top-k picks padding too: the quantizer's mean, σ and table are over the
    row's own selected values, as the authors' (whose k is clamped to a short tensor)."""
    t = TopK(chunk=64, k=16, value_bits=2, values="stat")
    x = data(n, seed=n)
    payload = t.compress(x)
    chunks = -(-n // 64)
    idx = (payload.parts[0].long().view(chunks, 16) + torch.arange(0, 64 * chunks, 64).unsqueeze(-1)).reshape(-1)
    own = idx[idx < n]
    assert own.numel() == min(n, 16) + max(0, min(n - 64, 16))
    assert torch.allclose(t.decompress(payload)[own], _authors_stat_quantize(x[own]), atol=1e-6)


def test_combine_averages_each_value_over_the_workers_that_sent_it():
    t = TopK(chunk=32, k=4)
    xs = [data(320, seed=s) for s in range(3)]
    ps = [t.compress(x) for x in xs]
    sums = sum(t.decompress(p) for p in ps)
    counts = sum(t.support(p) for p in ps)
    want = torch.where(counts > 0, sums / counts.clamp(min=1), 0)
    assert torch.allclose(t.combine(ps, [1 / 3] * 3), want, atol=1e-7)
    dense = IntQuantizer(8, 64)
    qs = [dense.compress(x) for x in xs]
    assert torch.equal(dense.combine(qs, [0.5, 0.25, 0.0]),
                       dense.decompress(qs[0]) * 0.5 + dense.decompress(qs[1]) * 0.25)
    lossless = TopK(chunk=32, k=32)  # every value sent: the plain weighted sum, bit for bit
    assert torch.equal(lossless.combine([lossless.compress(x) for x in xs[:2]], [0.5, 0.5]),
                       xs[0] * 0.5 + xs[1] * 0.5)


def test_error_feedback_decay_scales_the_carried_residual():
    ef = ErrorFeedback(TopK(chunk=64, k=4), decay=0.5)
    g1, g2 = data(640, seed=1), data(640, seed=2)
    _, sent1 = ef.compress("g", g1)
    r1 = ef.residuals["g"].clone()
    assert torch.equal(r1, g1 - sent1)
    _, sent2 = ef.compress("g", g2)
    assert torch.equal(ef.residuals["g"], (g2 + 0.5 * r1) - sent2)


@pytest.mark.parametrize("spec", ["topk:64,chunk:4096,bits:2,quant:stat", "int8,block:64"])
def test_per_tensor_compression_is_each_tensors_own(spec):
    """Each tensor's chunks and statistics are its own: the payload, its bytes and the combined
    mean of three senders equal the compressor run on every tensor alone."""
    inner, sizes = parse_spec(spec), [5000, 64, 144, 9000]
    per = PerTensor(inner, sizes)
    rows = [data(sum(sizes), seed=s) for s in range(3)]
    payloads = [per.compress(x) for x in rows]
    assert per.nbytes(sum(sizes)) == sum(inner.nbytes(n) for n in sizes)
    for x, p in zip(rows, payloads):
        buf = per.to_bytes(p)
        assert buf.numel() == per.nbytes(sum(sizes))
        alone = torch.cat([inner.decompress(inner.compress(t)) for t in x.split(sizes)])
        assert torch.equal(per.decompress(per.from_bytes(buf, sum(sizes))), alone)
    combined = per.combine(payloads, [1 / 3] * 3)
    each = [inner.combine([inner.compress(x.split(sizes)[j]) for x in rows], [1 / 3] * 3) for j in range(len(sizes))]
    assert torch.equal(combined, torch.cat(each))
    with pytest.raises(ValueError, match="expected 14208"):
        per.compress(torch.zeros(10))


@pytest.mark.parametrize("spec", ["int8,block:7", "int4,block:7", "sign,block:5", "topk:3,chunk:7,bits:2,quant:stat",
                                  "topk:3,chunk:7,bits:16"])
@pytest.mark.parametrize("world", [1, 2])
def test_every_workers_row_of_received_bytes_decodes_as_it_was_sent(spec, world):
    """Received bytes are a (world, nbytes) buffer; each payload part is read back from its column
    range. With odd sizes a part starts off its dtype's alignment, and on one worker the slice is
    a single row whose stride is the row's length: both once failed to view."""
    c, n = parse_spec(spec), 101
    at, misaligned = 0, False
    for dtype, count in c.layout(n):
        size = torch.empty((), dtype=dtype).element_size()
        misaligned, at = misaligned or at % size != 0, at + count * size
    assert misaligned or spec.endswith("bits:16")  # (16-bit values after 8-bit indices: aligned at 2)
    xs = [data(n, seed=s) for s in range(world)]
    rows = torch.stack([c.to_bytes(c.compress(x)) for x in xs])
    assert rows.shape == (world, c.nbytes(n))
    received = torch.cat([torch.zeros(world, 3, dtype=torch.uint8), rows], dim=1)[:, 3:]  # off a boundary
    got = c.decompress(c.from_bytes(received, n))
    assert torch.equal(got, torch.stack([c.decompress(c.compress(x)) for x in xs]))
