"""How well ``auto``'s trial ranks two close candidates: the GPT trainer over a slow link.

Runs examples/gpt_train.py over two network-namespace nodes (as root): ``--jobs`` auto jobs
whose trial measures every candidate of ``--allow`` for ``--rounds`` steps, dropping none, and
``--fixed`` jobs of each candidate alone. For each auto job it prints each candidate's trial
steps and which candidate each estimator (median or minimum of the first 3 or of all steps,
with auto's 2 % preference for the earlier candidate and 5 % edge for "none") would take,
against the fixed jobs' median steps; the JSON keeps every trial step.

    python benchmarks/trial_noise.py --rate 1gbit --allow bf16 int8-ef --jobs 8 --fixed 2 \\
        --json benchmarks/results/trial_noise_1gbit.json
"""

import argparse
import json
import runpy
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fastddp.bench import options, report
from fastddp.hooks.auto import NONE, PLAIN_EDGE, PREFER

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt_train.py"
ESTIMATORS = {
    "median of 3": lambda v: statistics.median(v[:3]),
    "min of 3": lambda v: min(v[:3]),
    "median of all": statistics.median,
    "min of all": min,
}


def _as_worker(rounds: int) -> None:
    # Inside each rank: more measured rounds, and no candidate dropped, then the example.
    from fastddp.hooks import auto

    auto.TRIAL_ROUNDS, auto.ELIMINATE, auto.RUNOFF_ROUNDS = rounds + 1, (float("inf"),) * 2, 0
    sys.argv = [str(GPT), *sys.argv[3:]]
    runpy.run_path(str(GPT), run_name="__main__")


def _job(args, argv: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "fastddp.netns", "--nodes", "2", "--rate", args.rate]
    cmd += ["--timeout", "900", *argv, "--steps", str(args.steps), "--json", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"trial_noise: {' '.join(argv)} failed:\n{res.stdout[-2000:]}{res.stderr}")
    return json.loads(out.read_text())


def _pick(estimate, trial: dict, allow: list[str]) -> str:
    # As auto ranks them: "none" PLAIN_EDGE faster than measured.
    figures = {n: estimate(trial[n]) / (1 + PLAIN_EDGE * (n == NONE)) for n in allow}
    fastest = min(figures.values())
    return next(n for n in allow if figures[n] <= fastest * (1 + PREFER))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--allow", nargs="+", default=["bf16", "int8-ef"])
    p.add_argument("--rounds", type=int, default=6, help="measured trial steps per candidate")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--fixed", type=int, default=2, help="jobs of each candidate alone")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--json")
    args = p.parse_args(argv)
    options.check_outputs(p, args)  # before the runs, not after
    fixed: dict[str, list[float]] = {n: [] for n in args.allow}
    trials = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(max(args.jobs, args.fixed)):
            if i < args.jobs:
                worker = [
                    str(Path(__file__).resolve()),
                    "--as-worker",
                    str(args.rounds),
                    "--preset",
                    "auto",
                ]
                got = _job(args, [*worker, "--allow", *args.allow], Path(tmp) / f"a{i}.json")
                trials.append({k: got[k] for k in ("chose", "median_step_ms", "plan")})
            for name in args.allow if i < args.fixed else ():
                got = _job(args, [str(GPT), "--preset", name], Path(tmp) / f"{name}{i}.json")
                fixed[name].append(got["median_step_ms"])
    steady = {n: statistics.median(v) for n, v in fixed.items() if v}
    best = min(steady, key=steady.get) if steady else None
    rows = []
    for t in trials:
        trial = t["plan"]["trial_ms"]
        picks = [_pick(e, trial, args.allow) for e in ESTIMATORS.values()]
        cells = [f"{statistics.median(trial[n]):.0f} / {min(trial[n]):.0f}" for n in args.allow]
        rows.append([*cells, *picks, t["chose"], f"{t['median_step_ms']:.1f}"])
    title = f"auto's trial over {args.rate}; fixed medians: " + ", ".join(
        f"{n} {ms:.1f} ms" for n, ms in steady.items()
    )
    report.table(
        title,
        [*(f"{n}: median / min" for n in args.allow), *ESTIMATORS, "auto chose", "auto ms"],
        rows,
    )
    if best is not None:
        for name, estimate in ESTIMATORS.items():
            right = sum(_pick(estimate, t["plan"]["trial_ms"], args.allow) == best for t in trials)
            print(f"{name}: {right} of {len(trials)} jobs would take {best}")
    if args.json:
        result = {"args": vars(args), "fixed_ms": fixed, "best_fixed": best, "jobs": trials}
        report.write_json(args.json, result)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--as-worker"]:
        _as_worker(int(sys.argv[2]))
    else:
        main()
