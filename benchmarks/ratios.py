"""Print the ratios RESULTS.md records, from a pytest-benchmark JSON file.

python benchmarks/ratios.py bench.json
"""

import json
import sys


def main(path):
    with open(path) as f:
        data = json.load(f)
    groups = {}
    for b in data["benchmarks"]:
        groups.setdefault(b["group"], {})[b["name"]] = b
    for group, rows in groups.items():
        copy = rows["copy fp32"]
        copy_bw = copy["extra_info"]["bytes_moved"] / copy["stats"]["median"]
        print(
            f"\n{group}: copy fp32 {copy['stats']['median'] * 1e3:.3f} ms, {copy_bw / 1e9:.1f} GB/s"
        )
        print(f"  {'what':42s} {'median ms':>10s} {'GB/s':>7s} {'vs copy GB/s':>13s}")
        for name, b in sorted(rows.items()):
            t = b["stats"]["median"]
            bw = b["extra_info"]["bytes_moved"] / t
            print(f"  {name:42s} {t * 1e3:10.3f} {bw / 1e9:7.1f} {bw / copy_bw:13.2f}")
        ours = rows.get("fastddp hook fp16 (CPU work)")
        theirs = rows.get("torch fp16_compress_hook (CPU work)")
        if ours and theirs:
            ratio = ours["stats"]["median"] / theirs["stats"]["median"]
            print(f"  hook CPU time, fastddp / torch fp16 hook: {ratio:.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
