"""Check the PTX of fastddp's CUDA kernels for math that would break bit parity with the CPU.

Every kernel in ``csrc/cuda`` promises the CPU's results bit for bit (README,
"Ops"): each fp32 multiply and add is rounded on its own, as the CPU loops built with
``-ffp-contract=off`` do. nvcc contracts ``a * b + c`` into one FMA unless the code says
otherwise (the kernels call ``__fmul_rn``/``__fadd_rn`` through ``fastddp/rounding.h``), so a
plain ``*`` or ``+`` slipped into a kernel silently changes the last bit on the GPU. Per
``.entry`` this reports:

- ``fma``/``mad`` on floating-point values (contracted, or written as an FMA);
- an unrounded ``mul.f32`` whose result feeds an unrounded ``add``/``sub``: ptxas may still
  fuse such a pair into an FMA (a rounding modifier such as ``.rn`` forbids it);
- ``.approx`` math and ``div.full`` (approximate), and ``.ftz`` (the CPU keeps subnormals).

The PTX is the build's own: the CMake build embeds each architecture's PTX in ``_C.so``
beside its cubin (``code=[compute_XX,sm_XX]``; a newer GPU compiles it at load), and
``cuobjdump`` takes it out, so nothing is compiled again (``make cuda-check`` runs this after
the CMake build). PTX files can also be given directly. Exits 1 on any finding, when a kernel
of the header is missing from the PTX (renamed without updating ``KERNELS``), or when the
library holds no PTX.

    python benchmarks/ptx_check.py --build-dir build-cmake
    python benchmarks/ptx_check.py kernels.ptx [more.ptx ...]

It lives beside ``gpu_check.py`` because it is a check run from the Makefile, linted and
tested with the other scripts; it needs cuobjdump (as ``sass_check.py`` finds it) but no GPU
and no torch.
"""

import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import check_cli
import sass_check

# The kernels of csrc/cuda (kernels.cuh, codes_kernels.cuh, packed_kernels.cuh,
# wide_kernels.cuh), all of which promise parity with the CPU.
KERNELS = (
    "compress_kernel",
    "decompress_kernel",
    "compress_feedback_kernel",
    "sum_chunks_kernel",
    "widen_sum_kernel",
    "quantize_vec_kernel",
    "quantize_wide_kernel",
    "dequantize_vec_kernel",
    "unpack_vec_kernel",
    "quantize_int8_kernel",
    "quantize_packed_kernel",
    "dequantize_kernel",
    "unpack_kernel",
)
FLOAT_TYPES = (".f16", ".f16x2", ".bf16", ".bf16x2", ".f32", ".f64")
ROUNDING = (".rn", ".rz", ".rm", ".rp")

_FUNC = re.compile(r"^\s*(?:\.\w+\s+)*\.(entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)")
_CALL = re.compile(r"^call(?:\.uni)?\b.*?,?\s*([\w$]+)\s*,?\s*\(")


@dataclass
class Function:
    """One ``.entry`` or ``.func`` of a PTX module: its instructions and whom it calls."""

    name: str
    entry: bool
    instructions: list = field(default_factory=list)  # (line number, text)
    calls: set = field(default_factory=set)


def parse(ptx: str) -> dict[str, Function]:
    """Split PTX text into its functions, each with its statements (comments removed)."""
    funcs: dict[str, Function] = {}
    current, in_body, depth = None, False, 0
    pending, start = "", 0

    def flush():
        nonlocal pending
        stmt = " ".join(pending.split())
        pending = ""
        # Directives (.reg, .loc, .pragma) and labels are not instructions.
        if stmt and not stmt.startswith(".") and not stmt.endswith(":"):
            stmt = re.sub(r"^@!?%\w+\s+", "", stmt)  # the guard predicate
            current.instructions.append((start, stmt))
            call = _CALL.match(stmt)
            if call:
                current.calls.add(call.group(1))

    for number, raw in enumerate(ptx.splitlines(), 1):
        line = raw.split("//", 1)[0].strip()
        if not line:
            continue
        if current is None:
            m = _FUNC.match(line)
            if m is None:
                continue
            current = funcs[m.group(2)] = Function(m.group(2), m.group(1) == "entry")
            in_body, depth, pending = False, 0, ""
        if not in_body:
            if "{" in line:
                in_body, line = True, line[line.index("{") :]
            elif line.endswith(";"):  # a declaration (.extern .func ...;): no body
                if not current.instructions:
                    del funcs[current.name]
                current = None
                continue
            else:
                continue
        if not pending.strip() and (line.endswith(":") or line.startswith(".")):
            continue  # a label, or a directive such as .loc (which has no ";")
        # Statements may span lines (calls do) and inline asm wraps them in braces on one
        # line: split on ";" and braces, counting the braces to find the body's end.
        for ch in line:
            if ch in "{};":
                flush()
                depth += {"{": 1, "}": -1}.get(ch, 0)
                if depth == 0:
                    current = None
                    break
            else:
                if not pending.strip() and not ch.isspace():
                    start = number
                pending += ch
        else:
            pending += " "
    return funcs


def _opcode(stmt: str) -> str:
    return stmt.split(None, 1)[0]


def _operands(stmt: str) -> list[str]:
    parts = stmt.split(None, 1)
    return [o.strip() for o in parts[1].split(",")] if len(parts) > 1 else []


def _is_float(op: str) -> bool:
    return any(op.endswith(t) or f"{t}." in op for t in FLOAT_TYPES)


def _unrounded(op: str, base: str) -> bool:
    return op.startswith(base + ".") and _is_float(op) and not any(r in op for r in ROUNDING)


def findings(func: Function) -> list[str]:
    """What in one function's own instructions may break parity, one line each."""
    found = []
    products: dict[str, int] = {}  # register -> line of the unrounded mul that wrote it
    for number, stmt in func.instructions:
        op = _opcode(stmt)
        args = _operands(stmt)
        if op.split(".")[0] in ("fma", "mad") and _is_float(op):
            found.append(f"line {number}: {stmt}  (fused multiply-add)")
        elif ".approx" in op or op.startswith("div.full"):
            found.append(f"line {number}: {stmt}  (approximate math)")
        elif ".ftz" in op and _is_float(op):
            found.append(f"line {number}: {stmt}  (flushes subnormals to zero)")
        if _unrounded(op, "mul") and args:
            products[args[0]] = number
        elif op.split(".")[0] in ("mov", "neg") and len(args) == 2 and args[1] in products:
            products[args[0]] = products[args[1]]
        elif _unrounded(op, "add") or _unrounded(op, "sub"):
            fed = [a for a in args[1:] if a in products]
            if fed:
                found.append(
                    f"line {number}: {stmt}  (adds the unrounded product of line "
                    f"{products[fed[0]]}: ptxas may fuse the pair into an FMA)"
                )
    return found


# The values of fastddp::math::WireKind, a template argument of the compress/decompress kernels.
_WIRE_KINDS = {"0": "kFp16", "1": "kBf16"}


def demangle(name: str) -> str:
    """A kernel's short name with its template argument, from the mangled one.

    ``_ZN7fastddp7kernels15compress_kernelILNS_4math8WireKindE1EEEv...`` -> compress_kernel<kBf16>,
    ``_ZN7fastddp7kernels15compress_kernelINS0_8WireBf16EEE...`` -> compress_kernel<WireBf16>,
    ``_ZN7fastddp7kernels19quantize_vec_kernelILi4EEEv...`` -> quantize_vec_kernel<4>.
    """
    m = re.match(r"_ZN7fastddp7kernels(\d+)", name)
    if not m:
        return name
    start = m.end()
    short = name[start : start + int(m.group(1))]
    rest = name[start + len(short) :]
    arg = re.match(r"INS0_(\d+)", rest)  # a type of fastddp::kernels
    if arg:
        name = rest[arg.end() : arg.end() + int(arg.group(1))]
        inner = re.match(r"ILi(\d+)E", rest[arg.end() + len(name) :])  # its int argument
        short += f"<{name}<{inner.group(1)}>>" if inner else f"<{name}>"
    bits = re.match(r"ILi(\d+)E((?:Lb[01]E)*)", rest)  # an int template argument, then bools
    if bits:
        flags = re.findall(r"Lb([01])E", bits.group(2))
        short += f"<{bits.group(1)}{''.join(', true' if b == '1' else ', false' for b in flags)}>"
    kind = re.match(r"ILNS_4math8WireKindE(\d+)E", rest)  # a math::WireKind value
    if kind:
        short += f"<{_WIRE_KINDS.get(kind.group(1), kind.group(1))}>"
    return short


def check(ptx: str) -> dict[str, list[str]]:
    """Findings per kernel entry (demangled name), a called ``.func``'s included."""
    funcs = parse(ptx)
    report = {}
    for func in funcs.values():
        if not func.entry:
            continue
        seen, todo, found = set(), [func.name], []
        while todo:
            name = todo.pop()
            if name in seen or name not in funcs:
                continue
            seen.add(name)
            prefix = "" if name == func.name else f"in {demangle(name)}, "
            found += [prefix + f for f in findings(funcs[name])]
            todo += sorted(funcs[name].calls)
        name = demangle(func.name)
        report[func.name if name in report else name] = found  # two instances never merge
    return report


def missing_kernels(report: dict[str, list[str]]) -> list[str]:
    """Kernels of the header with no entry in the PTX."""
    names = {k.split("<", 1)[0] for k in report}
    return [k for k in KERNELS if k not in names]


def ptx_from_build(build_dir: Path, work: Path) -> list[Path]:
    """Take the PTX of every architecture out of the CMake build's ``_C.so``."""
    library = (build_dir / "_C.so").resolve()
    cuobjdump = sass_check.tool("cuobjdump")
    res = subprocess.run([cuobjdump, "--list-ptx", str(library)], capture_output=True, text=True)
    names = re.findall(r"(\S+\.ptx)$", res.stdout, re.MULTILINE)
    if res.returncode != 0 or not names:
        raise SystemExit(
            f"ptx_check: no PTX in {library} (built with code=sm_XX only? the check needs "
            f"code=[compute_XX,sm_XX]):\n{res.stdout}{res.stderr}"
        )
    for name in names:
        cmd = [cuobjdump, "-xptx", name, str(library)]
        out = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"ptx_check: {shlex.join(cmd)} failed:\n{out.stderr}")
    return [work / name for name in names]


def main(argv=None) -> int:
    args = check_cli.parse(argv, __doc__, "PTX files", "a CMake build: the PTX its _C.so holds")
    bad = False
    with tempfile.TemporaryDirectory() as tmp:
        files = list(args.files)
        if args.build_dir is not None:
            files += ptx_from_build(args.build_dir.resolve(), Path(tmp))
        for path in files:
            report = check(path.read_text())
            kernels = [
                (kernel, bool(found), f"{len(found)} findings" if found else "clean", found)
                for kernel, found in report.items()
            ]
            missing = missing_kernels(report) if args.build_dir is not None else []
            note = "not in the PTX (renamed? update KERNELS)"
            bad |= check_cli.report(path.name, kernels, missing, note)
    return check_cli.verdict("ptx_check", bad, "no contracted FMA or approximate math")


if __name__ == "__main__":
    sys.exit(main())
