"""Check in the sm_90 SASS that fastddp's CUDA kernels move memory 16 bytes at a time.

An op reaches memory speed on an H100 only if its loop moves memory in 128-bit accesses; 1-,
2- or 4-byte accesses keep the load/store units busy long before the memory is. This reads
the machine code nvcc made for sm_90 (``cuobjdump -sass``, which needs ``nvdisasm``; PyPI's
``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` provide both) and finds each kernel's
loops: the code between a backward branch and its target. Every kernel of ``VECTOR`` must
have a loop that holds a 128-bit global load (``LDG.E.128``) and a loop that holds a 128-bit
global store (``STG.E.128``), in every instance; those of ``STORES_ONLY`` the store alone,
with the reason their loads are narrower. The kernels of ``EXEMPT`` are named with the
reason they do without. No kernel, exempt or not, may touch local memory (``LDL``, ``STL``): an
array that nvcc cannot keep in registers (one indexed by the counter of a loop left rolled)
costs a round trip to L1 for each of its values, which Nsight Compute found in three kernels.
A kernel in neither table fails the check, as does one of the tables that is missing from
the SASS (renamed? update the table), so no kernel escapes it. Narrower accesses are listed
for each kernel, for a reader to judge (scalar heads and tails, one fp32 scale per block).

    python benchmarks/sass_check.py --build-dir build-cmake    # the sm_90 cubin of _C.so
    python benchmarks/sass_check.py kernels.cubin listing.sass  # cubins or SASS listings

It lives beside ``ptx_check.py``, which ``make cuda-check`` runs before it; it needs the
cuobjdump and nvdisasm tools (from PATH, or the running Python's ``nvidia/cu*/bin``) but no
GPU and no torch. Exits 1 when a kernel fails.
"""

import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import check_cli

# The vector kernels of csrc/cuda: each must load and store 128 bits in a loop.
VECTOR = (
    "compress_kernel",
    "compress_feedback_kernel",
    "decompress_kernel",
    "sum_chunks_kernel",
    "widen_sum_kernel",
    "quantize_vec_kernel",
    "quantize_wide_kernel",
    "dequantize_vec_kernel",
    "unpack_vec_kernel",
)

# Kernels of VECTOR that need only the 128-bit store in a loop, and why their loads are narrower;
# `name (requantize)` for a kernel's instances that sum rows of codes (values.cuh SummedRows).
STORES_ONLY = {
    "quantize_vec_kernel (requantize)": "it reads rows of codes as dequantize_vec_kernel does, "
    "each lane its own piece of each row; with error feedback the residual is loaded 16 bytes "
    "a lane",
    "dequantize_vec_kernel": "each lane loads its own piece of codes (4, 2 or 1 bytes), so that "
    "a warp's load is 32 consecutive pieces, every byte used; the group's shared 16 bytes cost "
    "4 registers a load, which left 2 of int8's 8 loads in flight. Its codes are a fifth of "
    "its bytes or less; its fp32 output, the rest, is stored 16 bytes a lane",
}

# Kernels of VECTOR whose instances for int4 and int2 codes move a lane's 16 codes in one access
# of 16 * bits bits (64 or 32), and why that is enough: their loops must hold an access of
# exactly that width for the codes and 128-bit accesses of the fp32 values: for each kernel,
# what it loads and what it stores ("codes" or "fp32"; requantize's instances, over
# SummedRows, load codes). int4's 64-bit accesses are the codes' alone; int2's 32-bit ones look
# like the scales' to this check, and the emulator's bit-for-bit checks cover them.
_LANE = (
    "a lane's 16 codes are one access of 8 (int4) or 4 (int2) bytes, a warp's 256 or 128 bytes "
    "in a row; its fp32 values, the rest of its bytes, move 16 bytes at a time"
)
LANE_CODES = {
    "quantize_wide_kernel": ("fp32", "codes", _LANE + " (with error feedback the residual too)"),
}
# Kernels without 128-bit accesses, and why they need none.
EXEMPT = {
    "quantize_int8_kernel": "the scalar fallback of quantize_vec_kernel, for blocks that are "
    "not 4 * 2^k <= 128 or a multiple of 128 elements, and fp32 pointers not 16-byte aligned",
    "quantize_packed_kernel": "the scalar fallback of quantize_vec_kernel for int4/int2 "
    "(as quantize_int8_kernel)",
    "dequantize_kernel": "the scalar fallback of dequantize_vec_kernel, for blocks that are "
    "not a multiple of 4 elements, dst not 16-byte aligned, or code rows not aligned to a "
    "chunk's 4 codes",
    "unpack_kernel": "the scalar fallback of unpack_vec_kernel (as dequantize_kernel)",
}

ARCH = "sm_90"

_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(.*?)\s*;")
_PREDICATE = re.compile(r"^@!?U?P[T\d]+\s+")
_HEX = re.compile(r"\b0x([0-9a-fA-F]+)\b")


@dataclass
class Kernel:
    """One function of a SASS listing: its instructions as (address, opcode, operands)."""

    name: str
    instructions: list = field(default_factory=list)

    def loops(self) -> list[tuple[int, int]]:
        """(first, last) address of each loop: a branch back to an address at or before it."""
        found = []
        for address, opcode, operands in self.instructions:
            if opcode.split(".")[0] == "BRA":
                targets = _HEX.findall(operands)
                if targets and int(targets[-1], 16) <= address:
                    found.append((int(targets[-1], 16), address))
        return found

    def loop_sizes(self) -> list[int]:
        """The instructions of each loop, its branch back included: a loop's cost per pass (the
        branch to itself that ends a kernel's code left out)."""
        return [
            sum(lo <= address <= hi for address, _, _ in self.instructions)
            for lo, hi in self.loops()
            if lo < hi
        ]

    def local(self) -> dict[str, int]:
        """How many of each local-memory load and store (``LDL``, ``STL``) the kernel has."""
        counts: dict[str, int] = {}
        for _, opcode, _ in self.instructions:
            if opcode.startswith(("LDL", "STL")):
                counts[opcode] = counts.get(opcode, 0) + 1
        return counts

    def accesses(self) -> list[tuple[int, str, bool]]:
        """(address, opcode, inside a loop) of each global load and store."""
        loops = self.loops()
        return [
            (address, opcode, any(lo <= address <= hi for lo, hi in loops))
            for address, opcode, _ in self.instructions
            if opcode.startswith(("LDG", "STG"))
        ]


def parse(sass: str) -> list[Kernel]:
    """The functions of a ``cuobjdump -sass`` / ``nvdisasm`` listing."""
    kernels: list[Kernel] = []
    for line in sass.splitlines():
        m = _FUNCTION.match(line)
        if m:
            kernels.append(Kernel(m.group(1)))
            continue
        m = _INSTRUCTION.match(line)
        if m and kernels:
            text = _PREDICATE.sub("", m.group(2).strip())
            opcode, _, operands = text.partition(" ")
            kernels[-1].instructions.append((int(m.group(1), 16), opcode, operands))
    return kernels


def width(opcode: str) -> int:
    """Bits a global load or store moves per thread, from its opcode."""
    parts = opcode.split(".")
    for bits in ("128", "64"):
        if bits in parts:
            return int(bits)
    if {"U16", "S16"} & set(parts):
        return 16
    if {"U8", "S8"} & set(parts):
        return 8
    return 32


def short_name(mangled: str) -> str:
    """``_ZN7fastddp7kernels15compress_kernelIL...`` -> ``compress_kernel``."""
    m = re.match(r"_ZN7fastddp7kernels(\d+)", mangled)
    if not m:
        m = re.match(r"_Z\d*?N?(\d+)", mangled)  # a kernel outside the namespace (tests)
        if not m:
            return mangled
    start = m.end()
    return mangled[start : start + int(m.group(1))]


def template_args(mangled: str, name: str) -> str:
    """The template arguments of an instance, enough to tell instances apart."""
    rest = mangled.split(name, 1)[-1]
    # An int, then any bools, then what quantize_vec_kernel rounds (values.cuh).
    ints = re.match(r"ILi(\d+)E((?:Lb[01]E)*)(?:NS0_\d+(FlatValues|SummedRows))?", rest)
    if ints:
        flags = "".join(
            ", true" if b == "1" else ", false" for b in re.findall(r"Lb([01])E", ints.group(2))
        )
        values = f", {ints.group(3)}" if ints.group(3) else ""
        return f"<{ints.group(1)}{flags}{values}>"
    kind = re.match(r"ILNS_4math8WireKindE(\d)E", rest)
    if kind:
        return "<kBf16>" if kind.group(1) == "1" else "<kFp16>"
    codes = re.match(r"INS0_(\d+)(\w+)", rest)  # a type of fastddp::kernels
    if codes:
        length = int(codes.group(1))
        inner = re.match(r"ILi(\d+)E", codes.group(2)[length:])
        return f"<{codes.group(2)[:length]}{f'<{inner.group(1)}>' if inner else ''}>"
    return ""


@dataclass
class Verdict:
    kernel: str  # the instance, e.g. quantize_vec_kernel<4>
    ok: bool
    lines: list


def judge(kernel: Kernel, vector=VECTOR, exempt=None) -> Verdict:
    """Whether one kernel meets its requirement, and the accesses that say so."""
    exempt = EXEMPT if exempt is None else exempt
    name = short_name(kernel.name)
    label = name + template_args(kernel.name, name)
    counts: dict[tuple[str, bool], int] = {}
    for _, opcode, in_loop in kernel.accesses():
        counts[(opcode, in_loop)] = counts.get((opcode, in_loop), 0) + 1

    def listed(in_loop: bool, wide: bool) -> str:
        items = [
            f"{op} x{n}"
            for (op, loop), n in sorted(counts.items())
            if loop == in_loop and (width(op) == 128) == wide
        ]
        return ", ".join(items) or "none"

    lines = [
        f"128-bit in loops: {listed(True, True)}",
        f"narrower in loops: {listed(True, False)}",
        # For a reader comparing builds: a kernel short of memory speed with few bytes a
        # pass may be short of issue slots (dequantize's rows loop: benchmarks/results/gpu.md).
        "instructions a loop: " + (", ".join(map(str, kernel.loop_sizes())) or "no loop"),
    ]
    wide_in_loop = {op.split(".")[0] for (op, loop) in counts if loop and width(op) == 128}
    local = kernel.local()
    spilled = (
        [
            "FAILED: local memory: "
            + ", ".join(f"{op} x{n}" for op, n in sorted(local.items()))
            + " (an array indexed by a rolled loop's counter? unroll the loop)"
        ]
        if local
        else []
    )
    if name in exempt:
        return Verdict(label, not local, [f"exempt: {exempt[name]}", *spilled])
    if name not in vector:
        return Verdict(label, False, ["not in VECTOR or EXEMPT: say what it must do"])
    summed = "10SummedRows" in kernel.name
    bits = re.search(r"<(\d+)", label)
    if name in LANE_CODES and bits and int(bits.group(1)) < 8:
        lane = 16 * int(bits.group(1))
        loads, stores, why = LANE_CODES[name]
        loads = "codes" if summed else loads
        pairs = (("LDG", loads), ("STG", stores))
        floor = {op: lane if what == "codes" else 128 for op, what in pairs}
        lines.append(f"codes {lane} bits a lane: {why}")
        found = {op.split(".")[0] for (op, loop) in counts if loop and width(op) == floor[op[:3]]}
        missing = [f"{floor[op]}-bit {op}" for op in floor if op not in found]
        if missing:
            lines.append(f"FAILED: no {' or '.join(missing)} in any loop")
        return Verdict(label, not missing and not local, lines + spilled)
    needed = ("LDG", "STG")
    key = f"{name} (requantize)" if summed else name
    if key in STORES_ONLY:
        needed = ("STG",)
        lines.append(f"loads narrower: {STORES_ONLY[key]}")
    missing = [op for op in needed if op not in wide_in_loop]
    if missing:
        lines.append(f"FAILED: no 128-bit {' or '.join(missing)} in any loop")
    return Verdict(label, not missing and not local, lines + spilled)


def check(sass: str, vector=VECTOR, exempt=None) -> tuple[list[Verdict], list[str]]:
    """Each kernel's verdict, and the kernels of the tables that the listing lacks."""
    exempt = EXEMPT if exempt is None else exempt
    kernels = parse(sass)
    verdicts = [judge(k, vector, exempt) for k in kernels]
    present = {short_name(k.name) for k in kernels}
    missing = [k for k in (*vector, *exempt) if k not in present]
    return verdicts, missing


def tool(name: str) -> str:
    """cuobjdump or nvdisasm: from PATH, else from the nvidia-cuda-* wheels of this Python."""
    roots = [Path(sysconfig.get_paths()["purelib"]), *map(Path, sys.path)]
    for root in roots:
        for found in sorted(root.glob(f"nvidia/cu*/bin/{name}")):
            return str(found)
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if directory and (Path(directory) / name).exists():
            return str(Path(directory) / name)
    raise SystemExit(
        f"sass_check: {name} not found; `pip install nvidia-cuda-cuobjdump "
        "nvidia-cuda-nvdisasm` (make setup installs them)"
    )


def _run(cmd: list[str], cwd=None) -> str:
    env = dict(os.environ)
    env["PATH"] = str(Path(tool("nvdisasm")).parent) + os.pathsep + env.get("PATH", "")
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"sass_check: {' '.join(cmd)} failed:\n{res.stderr}")
    return res.stdout


def sass_of_cubin(cubin: Path) -> str:
    return _run([tool("cuobjdump"), "-sass", str(cubin)])


def sass_of_library(library: Path, work: Path, arch: str = ARCH) -> str:
    """The SASS of the ``arch`` cubin embedded in a shared library."""
    listing = _run([tool("cuobjdump"), "--list-elf", str(library)])
    names = re.findall(rf"(\S+\.{arch}\.cubin)", listing)
    if not names:
        raise SystemExit(f"sass_check: no {arch} cubin in {library}:\n{listing}")
    _run([tool("cuobjdump"), "-xelf", names[0], str(library.resolve())], cwd=work)
    return sass_of_cubin(work / names[0])


def main(argv=None) -> int:
    args = check_cli.parse(
        argv, __doc__, "cubins or SASS listings", "a CMake build: check its _C.so"
    )
    bad = False
    with tempfile.TemporaryDirectory() as tmp:
        sources = []
        if args.build_dir is not None:
            library = args.build_dir / "_C.so"
            sources.append((f"{library} ({ARCH})", sass_of_library(library, Path(tmp))))
        for path in args.files:
            text = sass_of_cubin(path) if path.suffix == ".cubin" else path.read_text()
            sources.append((str(path), text))
        for label, sass in sources:
            verdicts, missing = check(sass)
            kernels = [(v.kernel, not v.ok, "ok" if v.ok else "FAILED", v.lines) for v in verdicts]
            note = "not in the SASS (renamed? update VECTOR or EXEMPT)"
            bad |= check_cli.report(label, kernels, missing, note)
    return check_cli.verdict(
        "sass_check",
        bad,
        "every vector kernel loads and stores 128 bits (the packed wide ones a lane's codes in "
        "one access); no kernel uses local memory",
    )


if __name__ == "__main__":
    sys.exit(main())
