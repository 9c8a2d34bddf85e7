"""Checks the ops against torch in a fresh process; the test picks the loops by environment
(FASTDDP_DISABLE_SIMD=1: portable loops; FASTDDP_STREAM_MIN_BYTES=0: streaming stores)."""

import torch

import fastddp

g = torch.Generator().manual_seed(0)
for n in (0, 1, 7, 17, 1000, 2**20 + 3):
    base = torch.randn(n + 5, generator=g) * torch.exp(torch.randn(n + 5, generator=g) * 4)
    base[::97] = float("inf")
    for offset in (0, 1, 3):  # unaligned starts exercise the scalar heads and tails
        x = base[offset : offset + n]
        for dt in (torch.float16, torch.bfloat16):
            w = torch.empty(n + 5, dtype=dt)[offset : offset + n]
            fastddp.ops.compress(x, w, 0.5)
            want = (x * 0.5).to(dt)
            assert torch.equal(w.view(torch.int16), want.view(torch.int16)), (n, offset, dt)
            y = torch.empty(n + 5)[offset : offset + n]
            fastddp.ops.decompress(w, y, 2.0)
            assert torch.equal(y, w.float() * 2.0), (n, offset, dt)
# Outputs at an odd byte address (torch.frombuffer with an offset): no element of them lies on
# a 32-byte boundary, where the streaming stores write; they crashed there.
x = torch.randn(1000, generator=g)
raw = bytearray(4 * 1000 + 64)
start = torch.frombuffer(raw, dtype=torch.uint8).data_ptr()
for dt, wide in ((torch.float16, torch.float32), (torch.bfloat16, torch.float32)):
    w = torch.frombuffer(raw, dtype=dt, count=1000, offset=(1 - start) % 32)
    fastddp.ops.compress(x, w, 1.0)
    assert torch.equal(w.view(torch.int16), x.to(dt).view(torch.int16)), dt
    y = torch.frombuffer(raw, dtype=wide, count=1000, offset=(2 - start) % 32)
    fastddp.ops.decompress(x.to(dt), y, 1.0)
    assert torch.equal(y, x.to(dt).float()), dt
# Error feedback: v = x * 0.5 + r is rounded; r becomes what the rounding dropped, or stays
# where the result is inf or NaN (fp16 overflows past 65504; inf and NaN inputs), inside the
# vector loops' bodies as well as their heads and tails.
for n in (17, 1000, 2**16 + 3):
    x = torch.randn(n + 3, generator=g) * 4e4
    x[::89], x[7::97] = float("inf"), float("nan")
    r = torch.randn(n + 3, generator=g)
    r[11::101] = float("nan")
    for offset in (0, 3):
        for dt in (torch.float16, torch.bfloat16):
            xs, before = x[offset : offset + n], r[offset : offset + n]
            after = before.clone()
            w = torch.empty(n + 3, dtype=dt)[offset : offset + n]
            fastddp.ops.compress(xs, w, 0.5, None, after)
            v = xs * 0.5 + before
            want = v.to(dt)
            nan = want.isnan()  # (torch's NaN bits vary with its loop: compared as NaN)
            assert torch.equal(w.isnan(), nan), (n, offset, dt)
            assert torch.equal(w[~nan].view(torch.int16), want[~nan].view(torch.int16)), (n, dt)
            want_r = torch.where(torch.isfinite(want.float()), v - want.float(), before)
            assert torch.equal(after.view(torch.int32), want_r.view(torch.int32)), (n, offset, dt)
# Rows summed in fp32, in row order (fp16 has a loop of its own with F16C), then rounded or
# widened: sum_chunks, with and without feedback, and widen_sum.
for chunks, m in ((1, 9), (3, 1000), (4, 2**12 + 5)):
    for dt in (torch.float16, torch.bfloat16):
        rows = (torch.randn(chunks, m, generator=g) * 2e4).to(dt)
        rows[0, ::53] = float("inf")
        total = rows[0].float()
        for p in range(1, chunks):
            total = total + rows[p].float()
        v = total * 0.5
        out = torch.empty(m, dtype=dt)
        fastddp.ops.sum_chunks(rows, out, 0.5)
        assert torch.equal(out.view(torch.int16), v.to(dt).view(torch.int16)), (chunks, m, dt)
        before = torch.randn(m, generator=g)
        after = before.clone()
        fastddp.ops.sum_chunks(rows, out, 0.5, None, after)
        want = (v + before).to(dt)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (chunks, m, dt)
        kept = torch.where(torch.isfinite(want.float()), v + before - want.float(), before)
        assert torch.equal(after.view(torch.int32), kept.view(torch.int32)), (chunks, m, dt)
        wide = torch.empty(m)
        fastddp.ops.widen_sum(rows, wide, 0.5)
        assert torch.equal(wide, v), (chunks, m, dt)
bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
for dt in (torch.float16, torch.bfloat16):
    y = torch.empty(2**16)
    fastddp.ops.decompress(bits.view(dt), y, 1.0)
    torch.testing.assert_close(y, bits.view(dt).float(), rtol=0, atol=0, equal_nan=True)
print("ok")
