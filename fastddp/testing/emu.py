"""fastddp's CUDA kernels on the CPU, through the CUDA grid emulator (``csrc/emu``).

:func:`load` builds ``csrc/emu`` with g++ (seconds; no torch headers) into a library cached by
the hash of its sources (:mod:`fastddp.testing.emu_build`), and returns an :class:`Emu` whose
methods take the same arguments as :mod:`fastddp.ops` (CPU tensors) and run the CUDA backend's
launch code and kernels. The tensor checks are not repeated here: give only arguments that the
real op accepts (the tests run the CPU op on the same layout first).

Sanitizers: the library is always built with UBSan (a misaligned vector access is undefined
behaviour), and with AddressSanitizer when the process runs under it
(``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``, as ``make test`` runs the ``emu`` tests), so
that an access past a buffer fails. The device has a settable number of SMs (default 2), so
grid-stride loops take several passes at small sizes; every launch's thread and block order is
drawn from ``seed``.
"""

import ctypes
import re
from pathlib import Path
from typing import Optional

import torch

from fastddp.testing.emu_build import CSRC, OPS, EmuError, asan_active, build, objects

__all__ = ["CSRC", "OPS", "Emu", "EmuError", "asan_active", "build", "load", "objects"]


def load(path: Optional[Path] = None, *, sms: int = 2, seed: int = 0) -> "Emu":
    """The emulator library at ``path`` (default: :func:`build`), configured."""
    emu = Emu(ctypes.CDLL(str(path or build())))
    emu.configure(sms, seed)
    return emu


def _kernel_name(symbol: str) -> str:
    """A kernel's name and its bits (and the bools after them), if it has some, from its symbol:
    ``_ZN7fastddp7kernels19unpack_vec_kernelILi4EEEv...`` -> ``unpack_vec_kernel<4>``,
    ``..._kernelILi8ELb1ELb0EEEv...`` -> ``..._kernel<8, true, false>``,
    ``..._kernelINS0_11PackedCodesILi2EEEEEv...`` -> ``..._kernel<2>``; requantize's
    instances (over ``SummedRows``) end in ``, summed``: ``quantize_int8_kernel<8, summed>``."""
    m = re.match(r"_ZN7fastddp7kernels(\d+)", symbol)
    if not m:
        return symbol
    name = symbol[m.end() : m.end() + int(m.group(1))]
    rest = symbol[m.end() + len(name) :]
    bits = re.match(r"I(?:NS0_\d+\w+?)?ILi(\d)E|ILi(\d)E((?:Lb[01]E)*)", rest)
    if not bits:
        return name
    flags = "".join(
        ", true" if b == "1" else ", false" for b in re.findall(r"Lb([01])E", bits.group(3) or "")
    )
    summed = ", summed" if "10SummedRows" in rest else ""
    return f"{name}<{bits.group(1) or bits.group(2)}{flags}{summed}>"


def _kind(t: torch.Tensor) -> int:
    return 1 if t.dtype == torch.bfloat16 else 0


def _rows(q: torch.Tensor, scales: torch.Tensor, block: int):
    """The int8 layout the C++ checks compute (``int8_rows`` in checks.h), as 4 int64."""
    return _packed_rows(q, scales, block, q.numel() if q.dim() == 1 else q.size(1))


def _packed_rows(q: torch.Tensor, scales: torch.Tensor, block: int, row_len: int):
    """The layout of ``row_len`` codes a row that the C++ checks compute (``packed_rows`` in
    checks.h; for int8, one byte a code), as 4 int64."""
    rows = 1 if q.dim() == 1 else q.size(0)
    nbytes = q.numel() if q.dim() == 1 else q.size(1)
    nb = -(-row_len // block)
    q_stride = nbytes if q.dim() == 1 or q.is_contiguous() else q.stride(0)
    s_stride = nb if scales.is_contiguous() else scales.stride(0)
    return (ctypes.c_int64 * 4)(rows, row_len, q_stride, s_stride)


def _packed_row_len(q: torch.Tensor, n: int, bits: int) -> int:
    return n if q.dim() == 1 else q.size(1) * (8 // bits)


class Emu:
    """The ops of :mod:`fastddp.ops`, run by the CUDA backend's code on the emulator."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        for name in OPS:
            if hasattr(lib, f"fastddp_emu_{name}"):  # a library built for one op has that one
                getattr(lib, f"fastddp_emu_{name}").restype = ctypes.c_char_p
        lib.fastddp_emu_configure.argtypes = [ctypes.c_int, ctypes.c_uint64]
        lib.fastddp_emu_launched.restype = ctypes.c_char_p

    def has(self, op: str) -> bool:
        """Whether the library holds ``op`` (one built for another op alone does not)."""
        return hasattr(self._lib, f"fastddp_emu_{op}")

    def configure(self, sms: int, seed: int) -> None:
        """The device's SM count and the seed of the next launches' order."""
        self._lib.fastddp_emu_configure(sms, seed)

    def launched(self) -> set[str]:
        """The kernels launched since the last call, by name (``quantize_vec_kernel``)."""
        names = self._lib.fastddp_emu_launched().decode().split()
        return {_kernel_name(n) for n in names}

    def _call(self, name: str, *args) -> None:
        conv = [ctypes.c_float(a) if isinstance(a, float) else
                ctypes.c_int64(a) if isinstance(a, int) and not isinstance(a, bool) else
                ctypes.c_void_p(a) if a is None else a for a in args]  # fmt: skip
        fn = getattr(self._lib, f"fastddp_emu_{name}", None)
        if fn is None:
            raise EmuError(f"this emulator library has no {name}: it was built for another op")
        err = fn(*conv)
        if err:
            raise EmuError(f"fastddp emulator, {name}: {err.decode()}")

    @staticmethod
    def _ptr(t: Optional[torch.Tensor]) -> ctypes.c_void_p:
        return ctypes.c_void_p(None if t is None else t.data_ptr())

    def compress(self, src, dst, scale=1.0, found_nonfinite=None, residual=None, seed=-1):
        self._call("compress", ctypes.c_int(_kind(dst)), self._ptr(src), self._ptr(dst),
                   src.numel(), float(scale), self._ptr(residual), int(seed),
                   self._ptr(found_nonfinite))  # fmt: skip

    def decompress(self, src, dst, scale=1.0):
        self._call("decompress", ctypes.c_int(_kind(src)), self._ptr(src), self._ptr(dst),
                   src.numel(), float(scale))  # fmt: skip

    def sum_chunks(self, src, dst, scale=1.0, found_nonfinite=None, residual=None, seed=-1):
        self._call("sum_chunks", ctypes.c_int(_kind(src)), self._ptr(src), src.size(0),
                   src.size(1), self._ptr(dst), self._ptr(residual), float(scale), int(seed),
                   self._ptr(found_nonfinite))  # fmt: skip

    def widen_sum(self, src, dst, scale=1.0):
        self._call("widen_sum", ctypes.c_int(_kind(src)), self._ptr(src), src.size(0),
                   src.size(1), self._ptr(dst), float(scale))  # fmt: skip

    def quantize_int8(self, src, dst, scales, block_size, scale=1.0, found_nonfinite=None,
                      residual=None, seed=-1):  # fmt: skip
        self._call("quantize_int8", self._ptr(src), self._ptr(dst), self._ptr(scales),
                   self._ptr(residual), src.numel(), int(block_size),
                   _rows(dst, scales, block_size), float(scale), int(seed),
                   self._ptr(found_nonfinite))  # fmt: skip

    def dequantize_int8(self, src, scales, dst, block_size, scale=1.0):
        self._call("dequantize_int8", self._ptr(src), self._ptr(scales), src.size(0),
                   src.size(1), int(block_size), _rows(src, scales, block_size), self._ptr(dst),
                   float(scale))  # fmt: skip

    def unpack_int8(self, src, scales, dst, block_size, scale=1.0):
        self._call("unpack_int8", self._ptr(src), self._ptr(scales), dst.numel(),
                   int(block_size), _rows(src, scales, block_size), self._ptr(dst),
                   float(scale))  # fmt: skip

    def quantize_packed(self, src, dst, scales, bits, block_size, scale=1.0,
                        found_nonfinite=None, residual=None, seed=-1):  # fmt: skip
        rows = _packed_rows(dst, scales, block_size, _packed_row_len(dst, src.numel(), bits))
        self._call("quantize_packed", ctypes.c_int(bits), self._ptr(src), self._ptr(dst),
                   self._ptr(scales), self._ptr(residual), src.numel(), int(block_size), rows,
                   float(scale), int(seed), self._ptr(found_nonfinite))  # fmt: skip

    def dequantize_packed(self, src, scales, dst, bits, block_size, scale=1.0):
        rows = _packed_rows(src, scales, block_size, dst.numel())
        self._call("dequantize_packed", ctypes.c_int(bits), self._ptr(src), self._ptr(scales),
                   int(block_size), rows, self._ptr(dst), float(scale))  # fmt: skip

    def requantize(self, src, src_scales, dst, dst_scales, bits, block_size, scale=1.0,
                   found_nonfinite=None, residual=None, seed=-1):  # fmt: skip
        n = src.size(1) * (8 // bits if bits < 8 else 1)
        self._call("requantize", ctypes.c_int(bits), self._ptr(src), self._ptr(src_scales),
                   _packed_rows(src, src_scales, block_size, n), self._ptr(dst),
                   self._ptr(dst_scales), _packed_rows(dst, dst_scales, block_size, n),
                   self._ptr(residual), n, int(block_size), float(scale), int(seed),
                   self._ptr(found_nonfinite))  # fmt: skip

    def unpack_packed(self, src, scales, dst, bits, block_size, scale=1.0):
        rows = _packed_rows(src, scales, block_size, _packed_row_len(src, dst.numel(), bits))
        self._call("unpack_packed", ctypes.c_int(bits), self._ptr(src), self._ptr(scales),
                   dst.numel(), int(block_size), rows, self._ptr(dst), float(scale))  # fmt: skip
