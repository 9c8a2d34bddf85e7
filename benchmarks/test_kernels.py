"""Per-bucket CPU work of fastddp against PyTorch's equivalents and a plain copy.

``make bench`` times them (pytest-benchmark); the plain test run executes each once, checking
the results, so the suite cannot rot. ``python benchmarks/ratios.py out.json`` turns a
``--benchmark-json`` file into the ratios recorded in RESULTS.md.
"""

import pytest
import torch

from fastddp import codecs, ops

WORLD = 2  # the division by world size that each hook folds in


def _bucket(nbytes):
    g = torch.Generator().manual_seed(0)
    return torch.randn(nbytes // 4, generator=g)


def _group(benchmark, label, what, moved):
    benchmark.group = label
    benchmark.extra_info["bytes_moved"] = moved
    benchmark.name = what


def test_copy(benchmark, bucket_bytes):
    label, nbytes = bucket_bytes
    src = _bucket(nbytes)
    dst = torch.empty_like(src)
    _group(benchmark, label, "copy fp32", 2 * nbytes)
    benchmark(dst.copy_, src)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fastddp_compress(benchmark, bucket_bytes, dtype):
    label, nbytes = bucket_bytes
    src = _bucket(nbytes)
    wire = torch.empty(src.numel(), dtype=dtype)
    flag = torch.zeros(1, dtype=torch.int32)
    _group(benchmark, label, f"fastddp compress {dtype}", nbytes + nbytes // 2)
    benchmark(ops.compress, src, wire, 1.0 / WORLD, flag)
    assert torch.equal(wire, (src / WORLD).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fastddp_compress_feedback(benchmark, bucket_bytes, dtype):
    # With error feedback (bf16-acc-ef's encode): the residual read and written too, each call
    # adding the one the last left, as a training step does.
    label, nbytes = bucket_bytes
    src = _bucket(nbytes)
    wire = torch.empty(src.numel(), dtype=dtype)
    residual = torch.zeros_like(src)
    _group(benchmark, label, f"fastddp compress {dtype} ef", nbytes + nbytes // 2 + 2 * nbytes)
    benchmark(ops.compress, src, wire, 1.0 / WORLD, None, residual)
    before = residual.clone()
    ops.compress(src, wire, 1.0 / WORLD, None, residual)
    v = src / WORLD + before
    assert torch.equal(wire, v.to(dtype))
    assert torch.equal(residual, v - wire.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fastddp_sum_chunks(benchmark, bucket_bytes, dtype):
    # The -acc presets' reduce step: the WORLD rows of a bucket's shard received, summed in fp32
    # and rounded to the wire dtype once.
    label, nbytes = bucket_bytes
    rows = _bucket(nbytes).view(WORLD, -1).to(dtype)
    out = torch.empty(rows.shape[1], dtype=dtype)
    moved = rows.numel() * rows.element_size() + out.numel() * out.element_size()
    _group(benchmark, label, f"fastddp sum_chunks {dtype}", moved)
    benchmark(ops.sum_chunks, rows, out, 1.0 / WORLD)
    assert torch.equal(out, ((rows[0].float() + rows[1].float()) / WORLD).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_torch_compress(benchmark, bucket_bytes, dtype):
    # What PyTorch's fp16/bf16 hooks do: cast into a new tensor, then divide in place.
    label, nbytes = bucket_bytes
    src = _bucket(nbytes)
    _group(benchmark, label, f"torch to().div_() {dtype}", nbytes + 3 * (nbytes // 2))
    out = benchmark(lambda: src.to(dtype).div_(WORLD))
    torch.testing.assert_close(out.float(), src / WORLD, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fastddp_decompress(benchmark, bucket_bytes, dtype):
    label, nbytes = bucket_bytes
    wire = _bucket(nbytes).to(dtype)
    dst = torch.empty(wire.numel())
    _group(benchmark, label, f"fastddp decompress {dtype}", nbytes + nbytes // 2)
    benchmark(ops.decompress, wire, dst, 1.0)
    assert torch.equal(dst, wire.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_torch_decompress(benchmark, bucket_bytes, dtype):
    label, nbytes = bucket_bytes
    wire = _bucket(nbytes).to(dtype)
    dst = torch.empty(wire.numel())
    _group(benchmark, label, f"torch copy_() {dtype}", nbytes + nbytes // 2)
    benchmark(dst.copy_, wire)
    assert torch.equal(dst, wire.float())


def test_fastddp_hook_cpu_work(benchmark, bucket_bytes):
    # Everything compress_hook does to a bucket on this rank, minus the collective.
    label, nbytes = bucket_bytes
    # The result goes to a second buffer so that every round sees the same input.
    bucket = _bucket(nbytes)
    result = torch.empty_like(bucket)
    wire = torch.empty(bucket.numel(), dtype=torch.float16)
    flag = torch.zeros(1, dtype=torch.int32)
    _group(benchmark, label, "fastddp hook fp16 (CPU work)", 2 * (nbytes + nbytes // 2))

    def work():
        ops.compress(bucket, wire, 1.0 / WORLD, flag)
        ops.decompress(wire, result, 1.0)

    benchmark(work)
    assert flag.item() == 0
    assert torch.equal(result, (bucket / WORLD).half().float())


def test_torch_fp16_hook_cpu_work(benchmark, bucket_bytes):
    # torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook, minus the
    # collective: to(fp16) into a new tensor, div_, then copy_ back into the bucket.
    label, nbytes = bucket_bytes
    # 16 bytes per element: to() 4+2, div_() 2+2, copy_() 2+4.
    bucket = _bucket(nbytes)
    result = torch.empty_like(bucket)
    _group(benchmark, label, "torch fp16_compress_hook (CPU work)", 4 * nbytes)

    def work():
        compressed = bucket.to(torch.float16).div_(WORLD)
        result.copy_(compressed)

    benchmark(work)
    # Dividing after the cast rounds twice: off by one fp16 ulp in a few places.
    torch.testing.assert_close(result, (bucket / WORLD).half().float(), rtol=1e-3, atol=6e-8)


_BLOCK = 128


def _block_codec(n, bits, residual=None):
    """(scales, quantize(src, scale), unpack(out)) over the codes of ``n`` elements; with error
    feedback into ``residual`` where one is given."""
    scales = torch.empty(-(-n // _BLOCK))
    if bits == 8:
        q = torch.empty(n, dtype=torch.int8)
        return (scales,
                lambda src, s=1.0: ops.quantize_int8(src, q, scales, _BLOCK, s, None, residual),
                lambda out: ops.unpack_int8(q, scales, out, _BLOCK))  # fmt: skip
    q = torch.empty(-(-n * bits // 8), dtype=torch.uint8)
    return (scales,
            lambda src, s=1.0: ops.quantize_packed(src, q, scales, bits, _BLOCK, s, None, residual),
            lambda out: ops.unpack_packed(q, scales, out, bits, _BLOCK))  # fmt: skip


def _codec_bytes(nbytes, bits):
    n = nbytes // 4
    return nbytes + n * bits // 8 + -(-n // _BLOCK) * 4


@pytest.mark.parametrize("bits", [8, 4, 2], ids=["int8", "int4", "int2"])
def test_fastddp_quantize(benchmark, bucket_bytes, bits):
    # Codes of `bits` bits and one fp32 scale per block of 128: what a block codec writes.
    label, nbytes = bucket_bytes
    src = _bucket(nbytes)
    scales, quantize, unpack = _block_codec(src.numel(), bits)
    _group(benchmark, label, f"fastddp quantize int{bits}", _codec_bytes(nbytes, bits))
    benchmark(quantize, src, 1.0 / WORLD)
    out = torch.empty_like(src)
    unpack(out)
    step = scales.repeat_interleave(_BLOCK)[: src.numel()]
    assert ((out - src / WORLD).abs() <= step * 0.5001).all()


@pytest.mark.parametrize("bits", [8, 4, 2], ids=["int8", "int4", "int2"])
def test_fastddp_quantize_feedback(benchmark, bucket_bytes, bits):
    # As above, with error feedback (the int8-ef preset's encode): the residual read and
    # written too. Each call adds the residual the last one left, as a training step does.
    label, nbytes = bucket_bytes
    src = _bucket(nbytes)
    residual = torch.zeros_like(src)
    scales, quantize, unpack = _block_codec(src.numel(), bits, residual)
    _group(benchmark, label, f"fastddp quantize int{bits} ef",
           _codec_bytes(nbytes, bits) + 2 * nbytes)  # fmt: skip
    benchmark(quantize, src, 1.0 / WORLD)
    residual.zero_()
    quantize(src, 1.0 / WORLD)
    out = torch.empty_like(src)
    unpack(out)
    # What was sent plus what was kept is the input, to a rounding.
    tol = 1e-6 * src.abs().max().item()
    torch.testing.assert_close(out + residual, src / WORLD, rtol=1e-6, atol=tol)


@pytest.mark.parametrize("bits", [8, 4, 2], ids=["int8", "int4", "int2"])
@pytest.mark.parametrize("way", ["requantize", "two-step"])
def test_fastddp_reduce_codes(benchmark, bucket_bytes, bits, way):
    # The reduce step of the codecs' reduce-scatter, with error feedback (int8-ef's): the
    # bucket's WORLD rows of codes received, summed in fp32, times 1 / WORLD, and quantised
    # again into one row. requantize does it in one pass; two-step dequantizes into an fp32
    # shard and quantizes that, as the codecs did before it. Both write the same bits.
    label, nbytes = bucket_bytes
    codec = codecs.codec_for({8: torch.int8, 4: torch.int4, 2: torch.int2}[bits])
    shard = nbytes // 4 // WORLD
    rows = torch.empty(WORLD, codec.row_elems(shard), dtype=codec.wire_dtype)
    codec.encode(_bucket(nbytes), rows, shard)
    outs, residuals = {}, {}
    for w in ("requantize", "two-step"):
        out = torch.zeros(codec.row_elems(shard), dtype=codec.wire_dtype)  # padding too
        residual = torch.zeros(shard)
        total = torch.empty(shard)

        def reduce(w=w, out=out, residual=residual, total=total):
            if w == "requantize":
                codec.reduce(rows, out, shard, 1.0 / WORLD, None, residual)
            else:
                codec.sum_into(rows, shard, total, 1.0 / WORLD)
                codec.encode(total, out.view(1, -1), shard, 1.0, None, residual)

        outs[w], residuals[w] = (out, reduce), residual
    moved = nbytes * bits // 32 + shard * bits // 8 + 8 * shard  # codes in and out, residual
    _group(benchmark, label, f"fastddp reduce int{bits} ef {way}", moved)
    benchmark(outs[way][1])
    for w in outs:
        residuals[w].zero_()
        outs[w][1]()
    assert torch.equal(outs["requantize"][0], outs["two-step"][0])
    assert torch.equal(residuals["requantize"], residuals["two-step"])


@pytest.mark.parametrize("bits", [8, 4, 2], ids=["int8", "int4", "int2"])
def test_fastddp_unpack(benchmark, bucket_bytes, bits):
    label, nbytes = bucket_bytes
    src = _bucket(nbytes)
    scales, quantize, unpack = _block_codec(src.numel(), bits)
    quantize(src)
    out = torch.empty_like(src)
    _group(benchmark, label, f"fastddp unpack int{bits}", _codec_bytes(nbytes, bits))
    benchmark(unpack, out)
    step = scales.repeat_interleave(_BLOCK)[: src.numel()]
    assert ((out - src).abs() <= step * 0.5001).all()


def test_diloco_fingerprint(benchmark, bucket_bytes):
    # What DiLoCo reads of each frozen parameter and buffer at construction, on every rank,
    # so that only those unlike the first node's cross the link (fastddp/diloco/start.py).
    from fastddp.diloco.start import _fingerprint

    label, nbytes = bucket_bytes
    src = _bucket(nbytes)
    _group(benchmark, label, "DiLoCo start fingerprint", nbytes)
    prints = benchmark(_fingerprint, src)
    other = src.clone()
    other[-1] = -other[-1]
    assert torch.equal(prints, _fingerprint(src.clone()))
    assert not torch.equal(prints, _fingerprint(other))
