"""Tables (rich when installed), JSON and plots for the benchmarks."""

import contextlib
import json
import math
import os
import sys

# A --link run's options, as its caller was given them, for its nodes' --json
OPTIONS_ENV = "FASTDDP_BENCH_OPTIONS"


def table(title, columns, rows):
    """Print ``rows`` (lists of strings) under ``columns``, with rich when it is installed."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        print(title)
        for row in [columns, *rows]:
            print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
        return
    t = Table(title=title)
    for c in columns:
        # Names (modes) are never cut short; numbers wrap their headers instead.
        longest = max([len(c), *(len(r[len(t.columns)]) for r in rows)])
        t.add_column(c, justify="right", min_width=longest if c in ("mode", "size") else None)
    for r in rows:
        t.add_row(*r)
    # Wide enough for every column, also into a file or a pipe (rich drops what does not fit).
    need = sum(max([len(c), *(len(r[i]) for r in rows)]) + 3 for i, c in enumerate(columns)) + 1
    Console(width=max(120, Console().width, need)).print(t)


def record(args, env, nodes) -> dict:
    """What a result file needs beside its rows to be read later: the command, every option
    (defaults included), when, where, on what, and the ranks."""
    import datetime
    import platform

    import torch

    from fastddp._version import __version__

    given = os.environ.get(OPTIONS_ENV)  # a --link run's node: its caller's options
    options = (
        json.loads(given) if given else {k: v for k, v in vars(args).items() if k != "command"}
    )
    if not given and env.launcher != "spawn":  # under a launcher: its ranks, none spawned
        options.update(nproc=None, nproc_per_node=env.local_world_size)
    if options.get("link") and options.get("nodes") is None:
        options["nodes"] = 2  # --link's default
    return {
        "command": args.command,
        "options": options,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fastddp": __version__,
        "world_size": env.world_size,
        "backend": env.backend,
        "device": str(env.device),
        "nodes": nodes,
        # What changes the figures from outside the options (FASTDDP_NATIVE=0 the runner).
        "environment": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith("FASTDDP_") or k == "OMP_NUM_THREADS"
        },
    }


def write_json(path, payload):
    """Write ``payload`` as strict JSON: a figure that is NaN or infinite (a run that
    diverged) is written as null, with a warning naming it."""
    bad: list[str] = []

    def finite(value, where):
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(f"{where} = {value}")
            return None
        if isinstance(value, dict):
            return {k: finite(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    payload = finite(payload, "")
    if bad:
        shown = ", ".join(b.lstrip(".") for b in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        print(f"warning: {path}: not finite (a run diverged?), written as null: {shown}{more}",
              file=sys.stderr, flush=True)  # fmt: skip
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, allow_nan=False)


def pyplot():
    """matplotlib's ``pyplot`` drawing to files (the Agg backend); exits if it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    return plt


@contextlib.contextmanager
def figure(path, title, xlabel, ylabel, legend_size=8):
    """``with figure(...) as ax:`` draw on one set of axes; on leaving, label them, add a
    legend and a grid, and save the figure to ``path`` (PNG)."""
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    yield ax
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=legend_size)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_allreduce(path, rows, title):
    """busbw and speed-up over fp32 against message size, one line per mode."""
    plt = pyplot()
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    base = {r["size"]: r["time_us"] for r in rows if r["mode"] == "fp32"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        xs = [r["size"] for r in mine]
        if mode != "noop":
            ax1.plot(xs, [r["busbw_gbs"] for r in mine], marker="o", label=mode)
        if base:
            ax2.plot(xs, [base[r["size"]] / r["time_us"] for r in mine], marker="o", label=mode)
    for ax, label in ((ax1, "wire busbw (GB/s)"), (ax2, "speed-up over fp32 (x)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (fp32 bytes)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax2.set_yscale("log", base=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
