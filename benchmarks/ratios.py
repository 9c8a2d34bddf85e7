"""Print the ratios RESULTS.md records, from a pytest-benchmark JSON file.

python benchmarks/ratios.py bench.json [min]

Ratios use each benchmark's median time, or its fastest with ``min`` (steadier on a busy
machine, where the median takes in other processes' bursts).
"""

import json
import sys


def main(path, stat="median"):
    with open(path) as f:
        data = json.load(f)
    groups = {}
    for b in data["benchmarks"]:
        groups.setdefault(b["group"], {})[b["name"]] = b
    for group, rows in groups.items():
        copy = rows["copy fp32"]
        copy_bw = copy["extra_info"]["bytes_moved"] / copy["stats"][stat]
        print(f"\n{group}: copy fp32 {copy['stats'][stat] * 1e3:.3f} ms, {copy_bw / 1e9:.1f} GB/s")
        print(f"  {'what':42s} {stat + ' ms':>10s} {'GB/s':>7s} {'vs copy GB/s':>13s}")
        for name, b in sorted(rows.items()):
            t = b["stats"][stat]
            bw = b["extra_info"]["bytes_moved"] / t
            print(f"  {name:42s} {t * 1e3:10.3f} {bw / 1e9:7.1f} {bw / copy_bw:13.2f}")
        ours = rows.get("fastddp hook fp16 (CPU work)")
        theirs = rows.get("torch fp16_compress_hook (CPU work)")
        if ours and theirs:
            ratio = ours["stats"][stat] / theirs["stats"][stat]
            print(f"  hook CPU time, fastddp / torch fp16 hook: {ratio:.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        sys.exit(print(__doc__))
    if not 2 <= len(sys.argv) <= 3 or sys.argv[1].startswith("-"):
        sys.exit(__doc__.split("\n\n")[1].strip())
    main(*sys.argv[1:3])
