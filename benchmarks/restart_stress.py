"""Run every restart case many times under fastddp.launch and plain torchrun; count outcomes.

    python benchmarks/restart_stress.py --runs 50 --multi-node-runs 20 \\
        --launchers fastddp torchrun --torchrun-runs 5 --json benchmarks/results/restart_stress.json

Cases are :data:`fastddp.testing.restarts.CASES` (``--cases`` keeps those whose name contains
one of the given strings). Launchers alternate run by run, so that both see the same machine;
``--torchrun-runs`` keeps torchrun to the first rounds, since its hung runs cost the whole
``--timeout`` each.
Prints a table of finished / failed / wrong / hung and the median seconds per case and
launcher; the JSON is rewritten after every run, so an interrupted sweep keeps what it did.
The two-node cases need root (network namespaces) and are left out without it.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from fastddp.bench import options
from fastddp.testing import netns
from fastddp.testing.restarts import CASES, LAUNCHERS, reference, run_case

STATUSES = ("finished", "failed", "wrong", "hung")


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=50, help="runs per one-node case")
    p.add_argument("--multi-node-runs", type=int, default=20, help="runs per two-node case")
    p.add_argument("--launchers", nargs="+", choices=list(LAUNCHERS), default=["fastddp"])
    p.add_argument("--torchrun-runs", type=int, help="torchrun only in the first N rounds")
    p.add_argument("--cases", nargs="*", default=[], help="substrings of case names to keep")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds before a run is hung")
    p.add_argument("--json", type=Path, help="write the counts and every failure here")
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                   help="run nothing: add up the counts of earlier sweeps' JSON files")  # fmt: skip
    args = p.parse_args(argv)
    options.check_outputs(p, args)  # before the runs, not after
    if args.runs < 0 or args.multi_node_runs < 0 or (args.torchrun_runs or 0) < 0:
        p.error("--runs, --multi-node-runs and --torchrun-runs must be 0 or more")
    return args


def _table(counts: dict, seconds: dict) -> str:
    head = f"{'case':36s} {'launcher':9s} " + " ".join(f"{s:>8s}" for s in STATUSES)
    lines = [head + f" {'median s':>9s}", "-" * (len(head) + 10)]
    for (name, launcher), row in counts.items():
        cells = " ".join(f"{row[s]:8d}" for s in STATUSES)
        median = statistics.median(seconds[name, launcher])
        lines.append(f"{name:36s} {launcher:9s} {cells} {median:9.1f}")
    return "\n".join(lines)


def _merged(paths: list[Path]) -> tuple[dict, dict]:
    """Counts and seconds per (case, launcher) over sweeps' JSON files (a report, or a dict of
    reports). A file without per-run seconds counts each of its runs at its median."""
    counts: dict = {}
    seconds: dict = defaultdict(list)
    for path in paths:
        data = json.loads(path.read_text())
        reports = [data] if "rows" in data else [v for v in data.values() if "rows" in v]
        for row in (r for report in reports for r in report["rows"]):
            key = (row["case"], row["launcher"])
            total = counts.setdefault(key, dict.fromkeys(STATUSES, 0))
            for status in STATUSES:
                total[status] += row[status]
            runs = sum(row[status] for status in STATUSES)
            seconds[key] += row.get("seconds") or [row["median_s"]] * runs
    return dict(sorted(counts.items())), seconds


def main(argv=None) -> int:
    args = _args(argv)
    if args.merge:
        print(_table(*_merged(args.merge)))
        return 0
    cases = [c for c in CASES if not args.cases or any(s in c.name for s in args.cases)]
    if netns.unavailable_reason():
        print(f"two-node cases left out: {netns.unavailable_reason()}", file=sys.stderr)
        cases = [c for c in cases if c.nodes == 1]
    work = Path(tempfile.mkdtemp(prefix="restart-stress-"))
    counts: dict = {}
    seconds: dict = defaultdict(list)
    failures: list = []
    refs = {}
    torchrun_runs = args.torchrun_runs if args.torchrun_runs is not None else float("inf")
    started = time.time()
    for run in range(max(args.runs, args.multi_node_runs)):
        for case in cases:
            if run >= (args.runs if case.nodes == 1 else args.multi_node_runs):
                continue
            if case.nodes not in refs:
                refs[case.nodes] = reference(case, work)
            for launcher in args.launchers:
                if launcher == "torchrun" and run >= torchrun_runs:
                    continue
                out = run_case(case, launcher, refs[case.nodes], work, timeout=args.timeout)
                row = counts.setdefault((case.name, launcher), dict.fromkeys(STATUSES, 0))
                row[out.status] += 1
                seconds[case.name, launcher].append(out.seconds)
                mark = "." if out.status == "finished" else out.status[0].upper()
                print(mark, end="", flush=True)
                if out.status != "finished":
                    tail = [ln for ln in out.output.splitlines() if "Error" in ln][-2:]
                    failures.append({"case": case.name, "launcher": launcher, "run": run,
                                     "status": out.status, "detail": out.detail,
                                     "errors": tail})  # fmt: skip
        if args.json:
            rows = [{"case": n, "launcher": la, **row,
                     "median_s": statistics.median(seconds[n, la]),
                     "seconds": [round(t, 2) for t in seconds[n, la]]}
                    for (n, la), row in counts.items()]  # fmt: skip
            report = {"started": started, "runs_done": run + 1, "rows": rows,
                      "failures": failures}  # fmt: skip
            args.json.write_text(json.dumps(report, indent=1) + "\n")
    print()
    print(_table(counts, seconds))
    bad = sum(row[s] for row in counts.values() for s in STATUSES[1:])
    print(f"{bad} runs did not finish correctly; failures kept in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
