"""Count unclean exits of a trainer that keeps its DDP model alive past the process group.

Runs ``tests/launch/_keep_model_trainer.py`` under ``python -m fastddp.launch`` (2 ranks, Gloo) N
times per mode and reports how many runs ended with a non-zero exit code or an abort message.

    .venv/bin/python benchmarks/exit_check.py --runs 50 --modes none bf16 bf16-acc int8-ef
"""

import argparse
import json
import os
import subprocess
import sys
import time

import fastddp
from fastddp.bench import options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "tests", "launch", "_keep_model_trainer.py")


def run_once(mode: str, port: int, timeout: float = 120.0) -> tuple[int, str]:
    """Return the launcher's exit code and its stderr."""
    cmd = [
        sys.executable, "-m", "fastddp.launch", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
        TRAINER, mode,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return res.returncode, res.stderr


def unclean(code: int, stderr: str) -> bool:
    return code != 0 or "terminate called" in stderr or "Aborted" in stderr


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["none", "bf16", "bf16-acc", "int8-ef"],
        choices=["none", *fastddp.PRESETS],
    )
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args(argv)
    options.check_outputs(parser, args)  # before the runs, not after
    counts = {}
    for mode in args.modes:
        bad = 0
        start = time.perf_counter()
        for i in range(args.runs):
            code, stderr = run_once(mode, args.port + i % 50)
            if unclean(code, stderr):
                bad += 1
                tail = stderr.strip().splitlines()[-3:]
                print(f"  {mode} run {i}: exit {code}: {' | '.join(tail)}", flush=True)
        counts[mode] = {"runs": args.runs, "unclean": bad}
        seconds = time.perf_counter() - start
        print(f"{mode}: {bad} unclean of {args.runs} ({seconds:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(counts, f, indent=2)
    return 1 if any(c["unclean"] for c in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
