"""Every op's writes are visible to autograd, as an in-place aten op's are.

The ops have no derivative and write into their ``!`` arguments (csrc/fastddp.cpp). Autograd
must see those writes: a backward that saved a tensor an op then overwrote raises rather than
using the new values, a tensor that requires grad is refused while grad mode is on, and one
that carries a forward-mode derivative (a dual tensor) always.
"""

import pytest
import torch

from fastddp import ops

N, BLOCK = 64, 16


def _args(name, device):
    """``(args, written)`` of a valid call of op ``name``: written are the indices of the
    arguments the op writes."""
    f32 = torch.randn(N, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    residual = torch.zeros(N, device=device)
    scales = torch.ones(N // BLOCK, device=device)
    if name in ("compress", "sum_chunks"):
        rows = 1 if name == "compress" else 2
        src = f32 if name == "compress" else f32.to(torch.bfloat16).expand(rows, N).contiguous()
        return (src, torch.empty(N, dtype=torch.bfloat16, device=device), 0.5, flag, residual), (
            1,
            3,
            4,
        )
    if name in ("decompress", "widen_sum"):
        src = f32.to(torch.bfloat16)
        src = src if name == "decompress" else src.expand(2, N).contiguous()
        return (src, torch.empty(N, device=device), 1.0), (1,)
    if name == "quantize_int8":
        codes = torch.empty(N, dtype=torch.int8, device=device)
        return (f32, codes, torch.empty_like(scales), BLOCK, 1.0, flag, residual), (1, 2, 5, 6)
    if name in ("dequantize_int8", "unpack_int8"):
        codes = torch.ones(N, dtype=torch.int8, device=device)
        shape = (1, N) if name == "dequantize_int8" else (N,)
        return (codes.view(shape), scales.view(shape[:-1] + (-1,)), f32, BLOCK, 1.0), (2,)
    if name == "requantize":
        codes = torch.ones(2, N, dtype=torch.int8, device=device)
        out = torch.empty(N, dtype=torch.int8, device=device)
        src_scales = scales.expand(2, -1).contiguous()
        args = (codes, src_scales, out, torch.empty_like(scales), 8, BLOCK, 0.5, flag, residual)
        return args, (2, 3, 7, 8)
    if name == "quantize_packed":
        packed = torch.empty(N // 2, dtype=torch.uint8, device=device)
        return (f32, packed, torch.empty_like(scales), 4, BLOCK, 1.0, flag, residual), (1, 2, 6, 7)
    packed = torch.zeros(N // 2, dtype=torch.uint8, device=device)
    shape = (1, N // 2) if name == "dequantize_packed" else (N // 2,)
    return (packed.view(shape), scales.view(shape[:-1] + (-1,)), f32, 4, BLOCK, 1.0), (2,)


def _is_float32(a):
    return isinstance(a, torch.Tensor) and a.dtype == torch.float32


OPS = [
    "compress",
    "decompress",
    "sum_chunks",
    "widen_sum",
    "quantize_int8",
    "dequantize_int8",
    "unpack_int8",
    "quantize_packed",
    "dequantize_packed",
    "unpack_packed",
    "requantize",
]


def test_every_op_is_covered():
    assert sorted(OPS) == sorted(ops.__all__)


@pytest.mark.parametrize("name", OPS)
def test_each_write_moves_the_version_counter(device, name):
    args, written = _args(name, device)
    before = [a._version if isinstance(a, torch.Tensor) else None for a in args]
    getattr(ops, name)(*args)
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            # One bump for each tensor written, none for those only read.
            assert a._version == before[i] + (i in written), (name, i)


@pytest.mark.parametrize("name", OPS)
def test_a_tensor_that_requires_grad_is_refused_in_grad_mode(device, name):
    floats = [i for i, a in enumerate(_args(name, device)[0]) if _is_float32(a)]
    assert floats
    for i in floats:
        args = list(_args(name, device)[0])
        args[i] = args[i].requires_grad_()
        message = rf"fastddp\.{name}: argument '\w+' requires grad.*torch\.no_grad\(\)"
        with pytest.raises(RuntimeError, match=message):
            getattr(ops, name)(*args)
        with torch.no_grad():
            getattr(ops, name)(*args)  # as an optimizer writes parameters


@pytest.mark.parametrize("name", OPS)
def test_a_forward_mode_derivative_is_refused(device, name):
    # A dual tensor's tangent would pass through untouched, a silently wrong derivative.
    import torch.autograd.forward_ad as fw

    floats = [i for i, a in enumerate(_args(name, device)[0]) if _is_float32(a)]
    message = rf"fastddp\.{name}: argument '\w+' carries a forward-mode derivative.*primal"
    for i in floats:
        args = list(_args(name, device)[0])
        with fw.dual_level():
            args[i] = fw.make_dual(args[i], torch.ones_like(args[i]))
            with pytest.raises(RuntimeError, match=message):
                getattr(ops, name)(*args)
            args[i] = fw.unpack_dual(args[i]).primal
            getattr(ops, name)(*args)


def test_torch_func_jvp_through_an_op_is_refused():
    def f(x):
        out = torch.empty(N, dtype=torch.bfloat16)
        ops.compress(x, out, 2.0)
        return out.float()

    with pytest.raises(RuntimeError, match="argument 'src' carries a forward-mode derivative"):
        torch.func.jvp(f, (torch.ones(N),), (torch.ones(N),))


def test_backward_that_saved_an_overwritten_tensor_raises(device):
    a = torch.randn(N, device=device, requires_grad=True)
    saved = (a * 2).exp()  # exp's backward reads its result
    with torch.no_grad():
        ops.decompress(torch.zeros(N, dtype=torch.bfloat16, device=device), saved, 1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_inference_mode_as_for_in_place_aten_ops():
    # Inference tensors are written inside inference mode (they have no version counter).
    with torch.inference_mode():
        src, dst = torch.randn(N), torch.empty(N, dtype=torch.bfloat16)
        ops.compress(src, dst, 1.0)
    torch.testing.assert_close(dst, src.to(torch.bfloat16), rtol=0, atol=0)
    # A normal tensor written inside inference mode still has its version moved on.
    normal = torch.empty(N, dtype=torch.bfloat16)
    with torch.inference_mode():
        ops.compress(torch.randn(N), normal, 1.0)
    assert normal._version == 1
    # An inference tensor written outside inference mode is refused, before it is written.
    before = dst.clone()
    with pytest.raises(RuntimeError, match="argument 'dst' is an inference tensor"):
        ops.compress(torch.randn(N), dst, 1.0)
    assert torch.equal(dst, before)
