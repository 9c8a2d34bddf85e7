"""Where compression pays: DDP step time per method against plain fp32, per link rate.

Runs ``python -m fastddp.bench ddp`` once per rate, two nodes (network namespaces, as root) of
``--nproc-per-node`` ranks joined by links of that rate, plus once on loopback (as many ranks on
one machine, no rate limit), and
tabulates each method's step time relative to fp32 at the same rate. Every ratio comes from
one run, so the methods at a rate share the machine's state. With ``--rounds N`` each mode runs
in jobs of its own instead, N per mode, the modes taking turns (the order reversed every other
round), and each mode's median job is kept: a drift of the machine then lands on every mode
rather than on the one that ran during it.

    python benchmarks/link_sweep.py --json benchmarks/results/link_sweep.json \\
        --plot benchmarks/results/link_sweep.png

It also prints, per rate, fastddp's fastest mode against PowerSGD's fastest: the crossover is
the fastest measured rate at which PowerSGD's step is the shorter.
"""

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from fastddp.bench import convergence, ddp, options, report
from fastddp.bench.common import AUTO
from fastddp.testing import netns

RATES = ["loopback", "10gbit", "1gbit", "100mbit"]
# Every method of the time-to-target run, and the no-communication floor.
MODES = [*convergence.MODES, "noop"]


# Each rate's first job's record (its command's options, date, host, versions), for --json.
_JOBS: dict = {}


def _one(rate, modes, args, tmp) -> dict:
    out = Path(tmp) / f"{rate}.json"
    cmd = [sys.executable, "-m", "fastddp.bench", "ddp", "--model", "transformer"]
    cmd += ["--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--modes", *modes]
    cmd += ["--bucket-cap-mb", str(args.bucket_cap_mb), "--json", str(out)]
    if rate != "loopback":
        cmd += ["--link", rate, "--nproc-per-node", str(args.nproc_per_node)]
    else:  # the same ranks on one machine
        cmd += ["--nproc", str(2 * args.nproc_per_node)]
    res = _run(cmd, args.timeout, rate)
    if res.returncode != 0:
        raise SystemExit(f"link_sweep: {rate} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    data = json.loads(out.read_text())
    _JOBS.setdefault(rate, {k: v for k, v in data.items() if k != "rows"})
    for row in data["rows"]:  # the shape it ran in
        row["world_size"], row["nodes"] = data["world_size"], data["nodes"]
    return data


def _run(cmd, timeout: float, rate: str) -> subprocess.CompletedProcess:
    """``cmd`` in a process group of its own: past ``timeout`` the whole group (its ranks,
    their fork server) is stopped, not the first process alone, which left the others behind."""
    job = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(job)
        raise SystemExit(
            f"link_sweep: the job at {rate} ran past --timeout {timeout:g} s and was stopped"
        ) from None
    except BaseException:  # Ctrl-C: the job, in a session of its own, was not sent it
        _stop(job)
        raise
    return subprocess.CompletedProcess(cmd, job.returncode, out, err)


def _stop(job: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        job.communicate(timeout=10)
    with contextlib.suppress(ProcessLookupError):  # what did not stop (a rank starting up)
        os.killpg(job.pid, signal.SIGKILL)
    job.communicate()


def _rate(rate, args, tmp) -> dict:
    """Each mode's row at ``rate``: from one job of every mode, or with ``--rounds`` from the
    median of the mode's own jobs, the modes taking turns, the order reversed every round."""
    if not args.rounds:
        return {r["mode"]: r for r in _one(rate, args.modes, args, tmp)["rows"]}
    jobs = {mode: [] for mode in args.modes}
    for r in range(args.rounds):
        for mode in args.modes if r % 2 == 0 else args.modes[::-1]:
            jobs[mode] += _one(rate, [mode], args, tmp)["rows"]
    rows = {}
    for mode, runs in jobs.items():
        # The median job (the lower middle one of an even number) speaks for the mode.
        row = dict(sorted(runs, key=lambda j: j["p50_ms"])[(len(runs) - 1) // 2])
        row["jobs_p50_ms"] = [j["p50_ms"] for j in runs]
        if row.get("chose"):
            row["jobs_chose"] = [j["chose"] for j in runs]
        rows[mode] = row
    floor = rows["noop"]["p50_ms"] if "noop" in rows else None
    for row in rows.values():
        row["vs_fp32"] = row["p50_ms"] / rows["fp32"]["p50_ms"]
        row["exposed_comm"] = None if floor is None else (row["p50_ms"] - floor) / row["p50_ms"]
    return rows


def _against_best(table, rates, modes) -> dict:
    """Per rate, auto's step over the best of fp32 and fastddp's fixed modes; print them."""
    fixed = [m for m in modes if m == "fp32" or (m.startswith("fastddp-") and m != AUTO)]
    if AUTO not in modes or not fixed:
        return {}
    out = {}
    for rate in rates:
        best = min(fixed, key=lambda m: table[rate][m]["p50_ms"])
        out[rate] = {
            "best": best,
            "ratio": table[rate][AUTO]["p50_ms"] / table[rate][best]["p50_ms"],
        }
    print(f"{'auto / best fixed':<20}" + "".join(f"{out[r]['ratio']:>11.2f}x" for r in rates))
    print(
        f"{'  (best fixed)':<20}"
        + "".join(f"{out[r]['best'].removeprefix('fastddp-'):>12}" for r in rates)
    )
    return out


def _crossover(table, rates) -> dict:
    """Per rate, fastddp's and PowerSGD's fastest modes and their step ratio; print them."""
    out = {}
    for rate in rates:
        rows = table[rate]
        ours = [m for m in rows if m.startswith("fastddp-")]
        theirs = [m for m in rows if m.startswith("powersgd-")]
        if not ours or not theirs:
            continue
        best = min(ours, key=lambda m: rows[m]["p50_ms"])
        peer = min(theirs, key=lambda m: rows[m]["p50_ms"])
        ratio = rows[best]["p50_ms"] / rows[peer]["p50_ms"]
        out[rate] = {"fastddp": best, "powersgd": peer, "ratio": ratio}
        print(f"{rate}: fastddp's fastest {best} is {ratio:.2f}x PowerSGD's fastest {peer}")
    slower = [r for r in rates if r in out and out[r]["ratio"] > 1]
    if slower:
        print(f"PowerSGD's step is the shorter at: {', '.join(slower)}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", nargs="+", default=RATES)
    p.add_argument("--modes", nargs="+", default=MODES, choices=ddp.CHOICES, metavar="MODE")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per job")
    p.add_argument(
        "--nproc-per-node", type=int, default=1, help="ranks on each of the two nodes (default 1)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="a job per mode and round, the modes taking turns, each mode's median job kept "
        "(default 0: every mode in one job)",
    )
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    if "fp32" not in args.modes:
        p.error("the ratios are against fp32: keep fp32 in --modes")
    if args.rounds < 0 or args.nproc_per_node < 1:
        p.error(
            f"--rounds {args.rounds} / --nproc-per-node {args.nproc_per_node}: give --rounds 0 "
            "(every mode in one job) or more, and at least one rank per node"
        )
    # What would fail after minutes of runs, refused first.
    options.check_outputs(p, args)
    links = [r for r in args.rates if r != "loopback"]
    bad = [r for r in links if not re.fullmatch(r"\d+(\.\d+)?[kmgt]?(bit|bps)", r, re.I)]
    if bad:
        p.error(f"--rates {' '.join(bad)}: give tc rates (1gbit, 100mbit, 500kbit) or loopback")
    why = netns.unavailable_reason() if links else None
    if why:
        p.error(f"--rates {' '.join(links)} need network namespaces: {why}")
    table = {}
    _JOBS.clear()  # (a caller's earlier sweep in this process)
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates:
            table[rate] = _rate(rate, args, tmp)
            print(f"{rate}: done", flush=True)
    params = next(iter(next(iter(table.values())).values()))["params"]
    n = args.nproc_per_node
    shape = f"{2 * n} ranks" + (f", 2 nodes x {n} over links" if args.rates != ["loopback"] else "")
    print(f"\nDDP step vs fp32, transformer of {params / 1e6:.1f}M parameters, {shape}")
    print(f"{'mode':<20}" + "".join(f"{r:>12}" for r in args.rates))
    for mode in args.modes:
        cells = [table[r][mode]["vs_fp32"] for r in args.rates]
        print(f"{mode:<20}" + "".join(f"{c:>11.2f}x" for c in cells))
        chose = [table[r][mode].get("chose") for r in args.rates]
        if any(chose):  # auto: what it planned at each rate
            print(f"{'  (chose)':<20}" + "".join(f"{c or '-':>12}" for c in chose))
    print(
        f"{'fp32 p50 (ms)':<20}"
        + "".join(f"{table[r]['fp32']['p50_ms']:>12.0f}" for r in args.rates)
    )
    against_best = _against_best(table, args.rates, args.modes)
    crossover = _crossover(table, args.rates)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": [
                        "benchmarks/link_sweep.py",
                        *(sys.argv[1:] if argv is None else argv),
                    ],
                    "options": vars(args),
                    "jobs": _JOBS,  # each rate's first ddp job: its options, when, where, on what
                    "params": params,
                    "rates": args.rates,
                    "rounds": args.rounds,
                    "nproc_per_node": args.nproc_per_node,
                    "rows": table,
                    "auto_vs_best_fixed": against_best,
                    "crossover": crossover,
                },
                f,
                indent=1,
            )
    if args.plot:
        title = f"Where compression pays (transformer, {params / 1e6:.1f}M, {shape})"
        x, y = "link between the two nodes", "step time / fp32 step time"
        with report.figure(args.plot, title, x, y, legend_size=7) as ax:
            xs = range(len(args.rates))
            for mode in args.modes:
                if mode == "fp32":
                    continue
                ratios = [table[r][mode]["vs_fp32"] for r in args.rates]
                ax.plot(xs, ratios, marker="o", label=mode)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks(list(xs), args.rates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
