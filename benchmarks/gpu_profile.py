"""Nsight Compute over every op's kernels, in one table: ``make gpu-profile OUT=dir``.

Runs ``ncu --set full`` over ``gpu_kernel_profile.py`` (one launch of each op's kernels at
``--size``, clocks left as the GPU sets them), reads the report's details page back, and writes
into ``OUT``: ``kernels.ncu-rep`` (the report), ``kernels.txt`` (its whole details page), and
``profile.md`` and ``profile.json``, a row per kernel with what says where its time goes:

- time, and DRAM throughput (% of the peak): a kernel at memory speed is near 90%;
- issue slots busy (%): near 100%, the kernel is bound by its instructions, not memory;
- executed warp instructions, per 256 fp32 elements of the bucket (``--size`` / 4);
- registers per thread, the theoretical and achieved occupancy and the waves per SM;
- local memory spills (requests; none expected: ``sass_check.py`` fails kernels with any);
- SM busy (%), the busiest pipeline and its share (``ALU 52.0%``), and the stall that holds
  warps longest with its share of the cycles between two instructions, from ncu's rule
  texts: which unit an instruction-bound kernel waits on, and what a latency-bound one waits
  for.

Without a GPU it says so in one line and exits 0. Without ``ncu`` (searched on ``PATH``, under
``/opt/nvidia/nsight-compute`` and in the CUDA toolkit) it exits 2 and says where it looked.
The command takes about 60 s on an H100 at the default 100 MB; ``--limit`` bounds it.

    make gpu-profile OUT=$OUT                         # python3 benchmarks/gpu_profile.py $OUT
    python3 benchmarks/gpu_profile.py out --parse kernels.txt   # the table of a details page
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gpu_check

HERE = Path(__file__).resolve().parent
# A kernel's line: its name (and template arguments, one of them a template's instance at
# most: quantize_vec_kernel<8, 1, 0, SummedRows<8>>), parameters, grid and block.
_KERNEL = re.compile(
    r"^  (?:void )?(?P<name>[A-Za-z_][\w:]*(?:<(?:[^<>]|<[^<>]*>)*>)?)\(.*\) "
    r"\((?P<grid>\d+), \d+, \d+\)x\((?P<block>\d+), \d+, \d+\), Context"
)
# A metric's line: its name, its unit (if any) and a number, columns two spaces apart or more.
_METRIC = re.compile(
    r"^    (?P<name>\S(?:.*?\S)?)\s{2,}(?:(?P<unit>\S+)\s{2,})?(?P<value>-?[\d,]*\.?\d+)$"
)
_TO_US = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6}
# column -> (metric, unit) as ncu names them
COLUMNS = {
    "dram_pct": ("DRAM Throughput", "%"),
    "issue_busy_pct": ("Issue Slots Busy", "%"),
    "instructions": ("Executed Instructions", "inst"),
    "registers": ("Registers Per Thread", "register/thread"),
    "theoretical_occupancy_pct": ("Theoretical Occupancy", "%"),
    "achieved_occupancy_pct": ("Achieved Occupancy", "%"),
    "waves_per_sm": ("Waves Per SM", None),
    "local_spills": ("Local Memory Spilling Requests", None),
    "sm_busy_pct": ("SM Busy", "%"),
}
# ncu's rule texts, wrapped over lines; read with the lines of a kernel joined.
_PIPE = re.compile(r"(?P<pipe>[\w-]+) is the highest-utilized pipeline \((?P<pct>[\d.]+)%\)")
_STALL = re.compile(
    r"spends [\d.]+ cycles being stalled (?P<why>.+?)\. .*?This stall type represents about "
    r"(?P<pct>[\d.]+)% of the total"
)


def _rules(text: str) -> dict:
    """The busiest pipeline and the longest stall named in one kernel's rule texts."""
    text = " ".join(text.split())
    pipe = _PIPE.search(text)
    stalls = [(float(m["pct"]), re.sub(r" \([^)]*\)", "", m["why"])) for m in _STALL.finditer(text)]
    stall = max(stalls, default=None)
    return {
        "top_pipe": f"{pipe['pipe']} {float(pipe['pct']):.1f}%" if pipe else None,
        "top_stall": stall[1] if stall else None,
        "top_stall_pct": stall[0] if stall else None,
    }


def parse_details(text: str, elements: "int | None" = None) -> list:
    """The rows of ``ncu --page details`` text, one per kernel launch, in order.

    ``elements``: the fp32 elements of the bucket, for instructions per 256 of them.
    A metric named twice in a kernel's sections (with one unit) keeps its first value.
    """
    kernels = []
    for line in text.splitlines():
        line = line.rstrip()
        found = _KERNEL.match(line)
        if found:
            kernels.append({"kernel": found["name"], "grid": int(found["grid"]),
                            "block": int(found["block"]), "_metrics": {}, "_text": []})  # fmt: skip
            continue
        if kernels:
            kernels[-1]["_text"].append(line)
        metric = _METRIC.match(line)
        if metric and kernels:
            key = (metric["name"], metric["unit"])
            value = float(metric["value"].replace(",", ""))
            kernels[-1]["_metrics"].setdefault(key, value)
    rows = []
    for k in kernels:
        metrics = k.pop("_metrics")
        text = "\n".join(k.pop("_text"))
        row = dict(k)
        duration = [(u, v) for (n, u), v in metrics.items() if n == "Duration" and u in _TO_US]
        row["duration_us"] = duration[0][1] * _TO_US[duration[0][0]] if duration else None
        for column, key in COLUMNS.items():
            row[column] = metrics.get(key)
        per = row["instructions"]
        row["instructions_per_256"] = per * 256 / elements if per and elements else None
        row.update(_rules(text))
        rows.append(row)
    return rows


def _stall_cell(row) -> str:
    if not row.get("top_stall"):
        return ""
    return f"{row['top_stall']} ({row['top_stall_pct']:.1f}%)"


def markdown(rows, size: str) -> str:
    def cell(value, fmt):
        return "" if value is None else format(value, fmt)

    lines = [
        "| kernel | grid | us | DRAM % | issue busy % | warp instr / 256 elements | registers "
        "| occupancy % (theory / achieved) | waves | spills | busiest pipe | longest stall |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        occupancy = (
            f"{cell(r['theoretical_occupancy_pct'], '.0f')} / "
            f"{cell(r['achieved_occupancy_pct'], '.1f')}"
        )
        lines.append(
            f"| {r['kernel']} | {r['grid']} | {cell(r['duration_us'], '.1f')} | "
            f"{cell(r['dram_pct'], '.1f')} | {cell(r['issue_busy_pct'], '.1f')} | "
            f"{cell(r['instructions_per_256'], '.0f')} | {cell(r['registers'], '.0f')} | "
            f"{occupancy} | {cell(r['waves_per_sm'], 'g')} | {cell(r['local_spills'], '.0f')} | "
            f"{r.get('top_pipe') or ''} | {_stall_cell(r)} |"
        )
    lines += ["", f"One launch of each op at {size}, Nsight Compute's full set, clocks unlocked."]
    return "\n".join(lines) + "\n"


# Where ncu is looked for, after PATH and the CUDA toolkit's bin (gpu_check.find_tool).
NSIGHT = "/opt/nvidia/nsight-compute/*/ncu"


def find_ncu() -> "str | None":
    """``ncu``'s path: on PATH, in the CUDA toolkit, or the newest under ``NSIGHT``."""
    tool = gpu_check.find_tool("ncu")
    if os.path.isabs(tool):
        return tool
    found = sorted(glob.glob(NSIGHT))
    return found[-1] if found and os.access(found[-1], os.X_OK) else None


def _elements(size: str) -> int:
    """fp32 elements in a bucket of ``size`` (``gpu_bandwidth.py``'s names: ``100MB``, ``1GB``)."""
    number, unit = re.fullmatch(r"(\d+)([MG]B)", size).groups()
    return int(number) * {"MB": 1 << 20, "GB": 1 << 30}[unit] // 4


def _write(out: Path, rows, size: str) -> str:
    table = markdown(rows, size)
    (out / "profile.md").write_text(table)
    (out / "profile.json").write_text(json.dumps({"size": size, "rows": rows}, indent=1))
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder for the report and the table")
    p.add_argument("--size", default="100MB", choices=["1MB", "25MB", "100MB", "1GB"])
    p.add_argument("--limit", type=float, default=240, help="seconds ncu may take")
    p.add_argument("--parse", metavar="DETAILS", help="only tabulate this details page")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.parse:
        rows = parse_details(Path(args.parse).read_text(errors="replace"), _elements(args.size))
        print(_write(out, rows, args.size))
        return 0 if rows else 1
    if not gpu_check.gpu_names():
        print("gpu-profile: no GPU here (nvidia-smi lists none); nothing profiled")
        return 0
    try:  # what the profiled program runs: fastddp's ops, which need the build
        import gpu_bandwidth  # noqa: F401
    except ImportError as e:
        print(f"gpu-profile: {e}; build fastddp first (make gpu-check builds it, or "
              "pip install --no-build-isolation -e .)")  # fmt: skip
        return 2
    ncu = find_ncu()
    if ncu is None:
        print(f"gpu-profile: ncu (Nsight Compute) not found on PATH, in $CUDA_HOME/bin, "
              f"/usr/local/cuda/bin or {NSIGHT}")  # fmt: skip
        return 2
    report = out / "kernels"
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--set", "full"]
    cmd += ["--import-source", "no", "-f", "-o", str(report), sys.executable]
    cmd += [str(HERE / "gpu_kernel_profile.py"), "--size", args.size]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit)
    except subprocess.TimeoutExpired:
        print(f"gpu-profile: ncu ran past --limit {args.limit:g} s")
        return 1
    if res.returncode != 0:
        print(f"gpu-profile: ncu exit {res.returncode}:\n{(res.stdout + res.stderr)[-3000:]}")
        return 1
    details = subprocess.run(
        [ncu, "--import", f"{report}.ncu-rep", "--page", "details"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    (out / "kernels.txt").write_text(details.stdout)
    rows = parse_details(details.stdout, _elements(args.size))
    print(_write(out, rows, args.size))
    if not rows:
        print(f"gpu-profile: no kernel in ncu's details page (exit {details.returncode})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
