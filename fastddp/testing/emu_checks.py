"""Every op on the CUDA grid emulator against the CPU op, bit for bit: one case at a time.

Each ``check_*`` function runs one op on the CPU backend and on the emulator
(:mod:`fastddp.testing.emu`) with the same inputs and layout, and raises ``AssertionError``
naming the first difference. Outputs lie between canaries, so a write past either end is
caught even without AddressSanitizer; ``offset`` places every tensor one element into its
buffer, which breaks the 16-byte alignment the vectorised path needs. The sizes and the table
of cases that sweep every kernel are in :mod:`fastddp.testing.emu_cases`.
"""

import torch

from fastddp import ops
from fastddp.testing.emu import Emu

__all__ = [
    "check_compress",
    "check_decode_packed",
    "check_decompress",
    "check_dequantize_int8",
    "check_quantize_int8",
    "check_quantize_packed",
    "check_requantize",
    "check_sum_chunks",
    "check_unpack_int8",
    "check_widen_sum",
]

_CANARY = 64  # elements on each side of an output


def _buffer(n: int, dtype, offset: bool, fill=93) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor, its whole buffer): ``n`` elements between canaries, shifted by ``offset``.

    The canaries of an output (93) differ from what any op writes from an input's canaries
    (NaN, or 1 for codes, see :func:`_twin`), so an access one past the end shows as a
    difference.
    """
    whole = torch.full((n + 2 * _CANARY + 1,), fill, dtype=dtype)
    start = _CANARY + int(offset)
    return whole[start : start + n], whole


def _twin(t: torch.Tensor, offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # An input's canaries are NaN: a value read past the end then spoils a block's absmax, a
    # flag or a sum, where a small number would hide among the data.
    fill = float("nan") if t.is_floating_point() else 1
    copy, whole = _buffer(t.numel(), t.dtype, offset, fill=fill)
    copy.copy_(t.reshape(-1))
    return copy.view(t.shape), whole


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(what: str, cpu: torch.Tensor, emu: torch.Tensor, nan_equal: bool = False) -> None:
    a, b = _bits(cpu), _bits(emu)
    diff = a != b
    if nan_equal and cpu.is_floating_point():
        diff &= ~(cpu.isnan() & emu.isnan())
    if bool(diff.any()):
        i = int(diff.nonzero()[0, 0]) if diff.dim() == 1 else diff.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: cpu and emu differ at {i} of {tuple(cpu.shape)} ({int(diff.sum())} "
            f"elements): {a.reshape(-1)[diff.reshape(-1)][:4].tolist()} vs "
            f"{b.reshape(-1)[diff.reshape(-1)][:4].tolist()}"
        )


def _same_codes(what: str, cpu: tuple, emu: tuple) -> None:
    """A quantize's (values, scales, residual, flag), each compared where given."""
    for part, a, b in zip(("values", "scales", "residual", "flag"), cpu, emu):
        if a is not None:
            _same(f"{what} {part}", a, b)


# Runs of 128 elements, so that every block of up to 128 lies in one: all zeros; so small
# that qmax / absmax overflows (its inverse is 0); FLT_MAX, whose absmax / qmax times qmax
# rounds past it (the scale is taken one step down); one inf; one NaN; ordinary values; and
# all of magnitude 1.0008252859 (then 1.0008854866), whose own code before rounding is an ulp
# past 127 (then 7): rounded to nearest, 127 (7) again.
_EXTREMES = (0.0, 1e-38, torch.finfo(torch.float32).max, float("inf"), float("nan"), None,
             "edge")  # fmt: skip


def _data(n: int, seed: int, special: bool = False, extreme: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 4)
    if extreme:
        for run, start in enumerate(range(0, n, 128)):
            kind = _EXTREMES[run % len(_EXTREMES)]
            part = x[start : start + 128]
            if kind in (0.0, 1e-38):
                part.copy_(torch.randn(part.shape, generator=gen) * kind)
            elif kind == "edge":
                sign = torch.randint(0, 2, part.shape, generator=gen) * 2.0 - 1.0
                half = len(part) // 2
                part[:half] = sign[:half] * 1.0008252859115601
                part[half:] = sign[half:] * 1.0008854866027832
            elif kind is not None:
                # mid-run, or 16 on in odd runs: with blocks of 16, each kind lies in an even
                # lane's block and in an odd lane's (the wide quantize's lanes work in pairs)
                part[min(len(part) - 1, len(part) // 2 + 16 * (run % 2))] = kind
    if special and n > 10:
        # Past fp16's range, tiny (subnormal in fp16), and one non-finite value in a thread
        # other than thread 0 of its block.
        x[n // 3] = 7.0e4
        x[n // 5] = 3.0e-7
        x[n - 2 if n > 2 else 0] = float("inf")
    return x


def check_compress(emu: Emu, n: int, dtype, variant: str, offset: bool, special=False) -> None:
    """``variant``: plain, flag, ef (error feedback), sr (stochastic rounding), ef-sr."""
    src = _data(n, n, special)
    flag = torch.zeros(1, dtype=torch.int32) if variant != "plain" else None
    residual = _data(n, n + 1) * 1e-3 if "ef" in variant else None
    seed = 1234 + n if "sr" in variant else -1
    outs = []
    for backend in ("cpu", "emu"):
        s, _ = _twin(src, offset)
        d, whole = _buffer(n, dtype, offset)
        r = _twin(residual, offset)[0] if residual is not None else None
        f = flag.clone() if flag is not None else None
        run = ops.compress if backend == "cpu" else emu.compress
        run(s, d, 0.37, f, r, seed)
        outs.append((whole, r, f))
    what = f"compress n={n} {dtype} {variant} offset={offset}"
    # CUDA's fp32 -> fp16/bf16 instructions give the canonical NaN 0x7fff (sign dropped); the
    # CPU keeps a quiet copy. The inputs here hold no NaN: where one is met, the GPU's fp32
    # multiply and add (the software rounding of error feedback and stochastic rounding) make
    # it positive too, which the emulator, multiplying on the host, would not show.
    _same(what, outs[0][0], outs[1][0], nan_equal=variant in ("plain", "flag"))
    if residual is not None:
        _same(what + " residual", outs[0][1], outs[1][1])
    if flag is not None:
        _same(what + " flag", outs[0][2], outs[1][2])


def check_decompress(emu: Emu, n: int, dtype, offset: bool) -> None:
    src = _data(n, n).to(dtype)
    outs = []
    for run in (ops.decompress, emu.decompress):
        s, _ = _twin(src, offset)
        d, whole = _buffer(n, torch.float32, offset)
        run(s, d, 1.5)
        outs.append(whole)
    _same(f"decompress n={n} {dtype} offset={offset}", *outs)


def check_sum_chunks(emu: Emu, m: int, dtype, chunks: int, variant: str, offset=False) -> None:
    """``variant``: plain, ef, sr or ef-sr; the wire rows summed in fp32 and rounded again."""
    src = _data(chunks * m, m).to(dtype).view(chunks, m)
    flag = torch.zeros(1, dtype=torch.int32)
    residual = _data(m, m + 2) * 1e-3 if "ef" in variant else None
    seed = 77 + m if "sr" in variant else -1
    outs = []
    for run in (ops.sum_chunks, emu.sum_chunks):
        d, whole = _buffer(m, dtype, offset)
        r = _twin(residual, offset)[0] if residual is not None else None
        f = flag.clone()
        run(_twin(src, offset)[0], d, 0.25, f, r, seed)
        outs.append((whole, r, f))
    what = f"sum_chunks m={m} {dtype} chunks={chunks} {variant} offset={offset}"
    _same(what, outs[0][0], outs[1][0])
    if residual is not None:
        _same(what + " residual", outs[0][1], outs[1][1])
    _same(what + " flag", outs[0][2], outs[1][2])


def check_widen_sum(emu: Emu, m: int, dtype, chunks: int, offset=False) -> None:
    src = _data(chunks * m, m).to(dtype).view(chunks, m)
    outs = []
    for run in (ops.widen_sum, emu.widen_sum):
        d, whole = _buffer(m, torch.float32, offset)
        run(_twin(src, offset)[0], d, 0.5)
        outs.append(whole)
    _same(f"widen_sum m={m} {dtype} chunks={chunks} offset={offset}", *outs)


def _int8_layout(n: int, block: int, rows: int, spaced: bool, pad: int = 16):
    """int8 and scales buffers for ``n`` values in ``rows`` rows (rows spaced apart by ``pad``
    bytes or not: 16 keeps rows of whole 16-byte units aligned, 4 does not)."""
    m = -(-n // rows)
    if rows > 1:
        m = -(-m // block) * block  # whole blocks per row
    nb = -(-m // block)
    if rows == 1:
        q, qw = _buffer(m, torch.int8, False)
        s, sw = _buffer(nb, torch.float32, False)
        return q, s, qw, sw
    pad = pad if spaced else 0
    qw = torch.full((rows * (m + pad) + 2 * _CANARY,), 93, dtype=torch.int8)
    sw = torch.full((rows * (nb + pad) + 2 * _CANARY,), 93.0)
    q = qw[_CANARY : _CANARY + rows * (m + pad)].view(rows, m + pad)[:, :m]
    s = sw[_CANARY : _CANARY + rows * (nb + pad)].view(rows, nb + pad)[:, :nb]
    return q, s, qw, sw


def check_quantize_int8(
    emu: Emu, n: int, block: int, variant: str, rows: int = 1, pad=16, offset=False, special=False,
    extreme=False,
) -> None:  # fmt: skip
    """``variant``: plain, ef, sr or ef-sr; ``rows`` > 1 writes rows ``pad`` bytes apart;
    ``offset`` shifts the fp32 tensors one element; ``special`` puts inf in a block;
    ``extreme`` gives runs of 128 elements the extreme blocks of ``_EXTREMES`` (scale 1)."""
    src = _data(n, n, special=special, extreme=extreme)
    scale = 1.0 if extreme else 0.5
    residual = _data(n, n + 3) * 1e-3 if "ef" in variant else None
    seed = 99 + n if "sr" in variant else -1
    outs = []
    for run in (ops.quantize_int8, emu.quantize_int8):
        q, s, qw, sw = _int8_layout(n, block, rows, spaced=True, pad=pad)
        r = _twin(residual, offset)[0] if residual is not None else None
        f = torch.zeros(1, dtype=torch.int32)
        run(_twin(src, offset)[0], q, s, block, scale, f, r, seed)
        outs.append((qw, sw, r, f))
    what = (f"quantize_int8 n={n} block={block} {variant} rows={rows} pad={pad} offset={offset} "
            f"extreme={extreme}")  # fmt: skip
    _same_codes(what, *outs)


def check_dequantize_int8(emu: Emu, m: int, block: int, chunks: int, pad=16, offset=False) -> None:
    q, s, _, _ = _int8_layout(chunks * m, block, chunks, spaced=True, pad=pad)
    gen = torch.Generator().manual_seed(m)
    q.copy_(torch.randint(-127, 128, q.shape, generator=gen, dtype=torch.int8))
    s.copy_(torch.rand(s.shape, generator=gen))
    outs = []
    for run in (ops.dequantize_int8, emu.dequantize_int8):
        d, whole = _buffer(q.size(1), torch.float32, offset)
        run(q, s, d, block, 0.5)
        outs.append(whole)
    _same(f"dequantize_int8 m={m} block={block} chunks={chunks} pad={pad} offset={offset}", *outs)


def check_unpack_int8(emu: Emu, n: int, block: int, rows: int, pad=16, offset=False) -> None:
    q, s, _, _ = _int8_layout(n, block, rows, spaced=True, pad=pad)
    gen = torch.Generator().manual_seed(n)
    q.copy_(torch.randint(-127, 128, q.shape, generator=gen, dtype=torch.int8))
    s.copy_(torch.rand(s.shape, generator=gen))
    n = min(n, q.numel())
    outs = []
    for run in (ops.unpack_int8, emu.unpack_int8):
        d, whole = _buffer(n, torch.float32, offset)
        run(q, s, d, block, 2.0)
        outs.append(whole)
    _same(f"unpack_int8 n={n} block={block} rows={rows} pad={pad} offset={offset}", *outs)


def _packed_layout(n: int, bits: int, block: int, rows: int, pad: int = 16):
    """uint8 and scales buffers for ``n`` packed codes in ``rows`` rows ``pad`` bytes apart."""
    per = 8 // bits
    per_row = -(-n // rows)
    m = n if rows == 1 else -(-per_row // block) * block  # whole blocks per row
    nbytes, nb = -(-m // per), -(-m // block)
    qw = torch.full((rows * (nbytes + pad) + 2 * _CANARY,), 93, dtype=torch.uint8)
    sw = torch.full((rows * (nb + 16) + 2 * _CANARY,), 93.0)
    q = qw[_CANARY : _CANARY + rows * (nbytes + pad)].view(rows, nbytes + pad)[:, :nbytes]
    s = sw[_CANARY : _CANARY + rows * (nb + 16)].view(rows, nb + 16)[:, :nb]
    return (q[0], s[0], qw, sw) if rows == 1 else (q, s, qw, sw)


def check_quantize_packed(
    emu: Emu, bits: int, n: int, block: int, variant: str, rows=1, pad=16, offset=False,
    special=False, extreme=False,
) -> None:  # fmt: skip
    """quantize_packed as :func:`check_quantize_int8`, for ``bits`` 4 or 2."""
    src = _data(n, n, special=special, extreme=extreme)
    scale = 1.0 if extreme else 0.5
    residual = _data(n, n + 3) * 1e-3 if "ef" in variant else None
    seed = 99 + n if "sr" in variant else -1
    outs = []
    for run in (ops.quantize_packed, emu.quantize_packed):
        q, s, qw, sw = _packed_layout(n, bits, block, rows, pad)
        r = _twin(residual, offset)[0] if residual is not None else None
        f = torch.zeros(1, dtype=torch.int32)
        run(_twin(src, offset)[0], q, s, bits, block, scale, f, r, seed)
        outs.append((qw, sw, r, f))
    what = (f"quantize_packed bits={bits} n={n} block={block} {variant} rows={rows} pad={pad} "
            f"offset={offset} extreme={extreme}")  # fmt: skip
    _same_codes(what, *outs)


def _random_codes(q: torch.Tensor, s: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    q.copy_(torch.randint(0, 256, q.shape, generator=gen, dtype=torch.uint8))
    s.copy_(torch.rand(s.shape, generator=gen))


def check_decode_packed(
    emu: Emu, op: str, bits: int, n: int, block: int, rows: int, pad=16, offset=False
) -> None:
    """``op``: ``dequantize`` sums ``rows`` rows of ``n`` codes each; ``unpack`` reads ``n``
    codes laid out in ``rows`` rows."""
    summing = op == "dequantize"
    q, s, _, _ = _packed_layout(rows * n if summing else n, bits, block, rows, pad)
    _random_codes(q, s, n)
    outs = []
    for run in (getattr(ops, f"{op}_packed"), getattr(emu, f"{op}_packed")):
        d, whole = _buffer(n, torch.float32, offset)
        run(q, s, d, bits, block, 0.5 if summing else 2.0)
        outs.append(whole)
    what = f"{op}_packed bits={bits} n={n} block={block} rows={rows} pad={pad} offset={offset}"
    _same(what, *outs)


def _code_rows(rows: int, nbytes: int, nb: int, dtype, pad: int, gen, special: bool):
    """Input rows of random codes (``nbytes`` a row) and scales (``nb``), each row ``pad``
    elements past the last, between canaries (codes 1, scales NaN); ``special`` gives a few
    blocks an inf or NaN scale."""
    qw = torch.ones(rows * (nbytes + pad) + 2 * _CANARY, dtype=dtype)
    sw = torch.full((rows * (nb + pad) + 2 * _CANARY,), float("nan"))
    q = qw[_CANARY : _CANARY + rows * (nbytes + pad)].view(rows, nbytes + pad)[:, :nbytes]
    s = sw[_CANARY : _CANARY + rows * (nb + pad)].view(rows, nb + pad)[:, :nb]
    low = -127 if dtype == torch.int8 else 0
    q.copy_(torch.randint(low, 128 if low else 256, q.shape, generator=gen, dtype=dtype))
    s.copy_(torch.rand(s.shape, generator=gen) * 2.0 ** torch.randint(-20, 20, s.shape))
    if special:
        s[0, nb // 3] = float("inf")
        s[-1, nb // 2] = float("nan")
    return q, s


def check_requantize(
    emu: Emu, bits: int, n: int, block: int, variant: str, rows=3, pad=16, offset=False,
    special=False,
) -> None:  # fmt: skip
    """requantize of ``rows`` rows of ``n`` codes of ``bits`` bits (rounded up to whole bytes),
    ``pad`` bytes apart, into one row; ``variant`` as for quantize; ``offset`` shifts the
    residual and the row written (codes and scales) one element into their buffers;
    ``special`` gives a few blocks an inf or NaN scale."""
    per = 8 // bits if bits < 8 else 1
    nbytes, dtype = -(-n // per), torch.int8 if bits == 8 else torch.uint8
    n, nb = nbytes * per, -(-nbytes * per // block)
    q, s = _code_rows(rows, nbytes, nb, dtype, pad, torch.Generator().manual_seed(n), special)
    residual = _data(n, n + 3) * 1e-3 if "ef" in variant else None
    seed = 99 + n if "sr" in variant else -1
    outs = []
    for run in (ops.requantize, emu.requantize):
        d, dw = _buffer(nbytes, dtype, offset)
        ds, dsw = _buffer(nb, torch.float32, offset)
        r = _twin(residual, offset)[0] if residual is not None else None
        f = torch.zeros(1, dtype=torch.int32)
        run(q, s, d, ds, bits, block, 0.75, f, r, seed)
        outs.append((dw, dsw, r, f))
    what = (f"requantize bits={bits} n={n} block={block} {variant} rows={rows} pad={pad} "
            f"offset={offset} special={special}")  # fmt: skip
    _same_codes(what, *outs)
