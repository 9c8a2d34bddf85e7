"""``dtype="auto"`` in a real training loop: examples/gpt_train.py per preset, and auto.

Runs the GPT-style example once per preset (``none``, ``bf16``, ``bf16-acc``, ``int8-ef``) and
with ``auto``, each a job of its own launched with ``python -m fastddp.launch`` on this machine
(``local``), or on two network-namespace nodes joined by a rate-limited link
(``python -m fastddp.netns``, as root). Each job reports its median step over the last half of
its steps (after auto's plan); the table holds auto's against the fastest fixed preset's.
Jobs run one after another, alternating the presets' order between repeats, and each preset's
figure is the median of its repeats.

    python benchmarks/gpt_auto.py --where local 1gbit --json benchmarks/results/gpt_auto.json
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fastddp.bench import options, report

ROOT = Path(__file__).resolve().parents[1]
FIXED = ["none", "bf16", "bf16-acc", "int8-ef"]


def _job(where, preset, args, out) -> dict:
    train = [str(ROOT / "examples" / "gpt_train.py"), "--preset", preset, "--json", str(out)]
    train += ["--steps", str(args.steps), "--width", str(args.width)]
    train += ["--layers", str(args.layers), "--batch", str(args.batch)]
    if where == "local":
        cmd = [sys.executable, "-m", "fastddp.launch", "--standalone"]
        cmd += ["--nproc-per-node", str(args.nproc_per_node)]
    else:
        cmd = [sys.executable, "-m", "fastddp.netns", "--nodes", "2", "--rate", where]
        cmd += ["--nproc-per-node", str(args.nproc_per_node), "--timeout", str(args.timeout)]
    res = subprocess.run([*cmd, *train], cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"gpt_auto: {where} {preset} failed:\n{res.stdout[-2000:]}{res.stderr}")
    return json.loads(out.read_text())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--where", nargs="+", default=["local", "1gbit"], help="local, or a rate")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--nproc-per-node", type=int, default=1, help="local: 2 when left at 1")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--json")
    args = p.parse_args(argv)
    options.check_outputs(p, args)  # before the runs, not after
    result = {"args": vars(args), "where": {}}
    rows = []
    for where in args.where:
        local = argparse.Namespace(**vars(args))
        if where == "local" and args.nproc_per_node == 1:
            local.nproc_per_node = 2  # the same two ranks as two nodes of one
        runs: dict[str, list[dict]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for repeat in range(args.repeats):
                order = [*FIXED, "auto"]
                for preset in order if repeat % 2 == 0 else order[::-1]:
                    out = Path(tmp) / f"{preset}-{repeat}.json"
                    runs.setdefault(preset, []).append(_job(where, preset, local, out))
        ms = {k: statistics.median(r["median_step_ms"] for r in v) for k, v in runs.items()}
        best = min(FIXED, key=ms.get)
        chose = [r["chose"] for r in runs["auto"]]
        entry = {"step_ms": ms, "best_fixed": best, "auto_vs_best": ms["auto"] / ms[best]}
        entry.update(chose=chose, runs=runs)
        result["where"][where] = entry
        cells = [f"{ms[k]:.1f}" for k in FIXED]
        rows.append([where, *cells, f"{ms['auto']:.1f}", ", ".join(chose), best])
        rows[-1].append(f"{entry['auto_vs_best']:.2f}x")
    report.table(
        f"examples/gpt_train.py, median step (ms) over the last half of {args.steps} steps",
        ["where", *FIXED, "auto", "auto chose", "best fixed", "auto / best"],
        rows,
    )
    if args.json:
        report.write_json(args.json, result)


if __name__ == "__main__":
    main()
