"""The GPU proof in one command: build, CUDA tests, sanitizers, hooks, bandwidth; one folder.

``make gpu-check OUT=dir`` (or ``python benchmarks/gpu_check.py dir``) on a machine with a GPU:

1. builds the extension against the installed torch (``pip install --no-build-isolation
   --no-deps -e .``, ``FORCE_CUDA=1``, ``TORCH_CUDA_ARCH_LIST`` of the GPU present);
2. runs the CUDA tests (``pytest -m cuda``: every op against the reference and the CPU, bit for
   bit, at awkward lengths and offsets, ``opcheck``, the non-finite flag, the GPU error paths,
   and the hook for every mode on NCCL with world size 1 and on Gloo with CUDA tensors);
3. runs ``benchmarks/gpu_ops_all.py`` under ``compute-sanitizer`` (memcheck, racecheck,
   synccheck);
4. measures each op's bandwidth against a device-to-device copy (``gpu_bandwidth.py``);
5. writes ``summary.md`` / ``summary.json`` (each step's verdict and time, GPU, driver,
   torch/CUDA/NCCL versions) and every step's log into the folder, and exits non-zero if
   any step failed.

Without a GPU (``nvidia-smi`` finds none) it says so in one line and exits 0, building
nothing, so it is safe to run anywhere.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Seconds per step; together well under the 8 minutes the whole check may take on an H100.
LIMITS = {"build": 240, "tests": 300, "sanitizer": 120, "bandwidth": 120}


def gpu_names() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (empty without a driver or a GPU)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in res.stdout.splitlines() if line.startswith("GPU ")]


class Step:
    """One step's command, verdict, time and log."""

    def __init__(self, name: str, ok: bool, seconds: float, detail: str, log: str) -> None:
        self.name, self.ok, self.seconds, self.detail, self.log = name, ok, seconds, detail, log

    def as_dict(self) -> dict:
        return {"step": self.name, "ok": self.ok, "seconds": round(self.seconds, 1),
                "detail": self.detail, "log": self.log}  # fmt: skip


def run_step(name, cmd, out: Path, limit: float, env=None, verdict=None) -> Step:
    """Run ``cmd``, log to ``out/<name>.log``; ``verdict(rc, text)`` -> (ok, detail)."""
    log = out / f"{name}.log"
    start = time.monotonic()
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        rc, text = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = None, f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {limit:.0f} s"
    log.write_text(f"$ {' '.join(map(str, cmd))}\n{text}")
    if rc is None:
        ok, detail = False, f"timed out after {limit:.0f} s"
    elif verdict is not None:
        ok, detail = verdict(rc, text)
    else:
        ok, detail = rc == 0, f"exit {rc}"
    return Step(name, ok, time.monotonic() - start, detail, log.name)


def pytest_verdict(rc, text):
    tail = [line for line in text.splitlines() if " passed" in line or " failed" in line]
    return rc == 0, tail[-1].strip("= ") if tail else f"exit {rc}"


def sanitizer_verdict(rc, text):
    summary = [line for line in text.splitlines() if "ERROR SUMMARY" in line]
    detail = summary[-1].strip("= ") if summary else f"exit {rc}"
    return rc == 0 and (not summary or " 0 errors" in summary[-1]), detail


def versions(python: str) -> dict:
    probe = (
        "import json, torch; p = torch.cuda.get_device_properties(0); "
        "print(json.dumps({'gpu': p.name, 'capability': f'{p.major}.{p.minor}', "
        "'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'nccl': '.'.join(map(str, torch.cuda.nccl.version())), "
        "'python': __import__('platform').python_version()}))"
    )
    res = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    info = json.loads(res.stdout) if res.returncode == 0 else {"probe_error": res.stderr[-500:]}
    driver = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    info["driver"] = driver.stdout.strip().splitlines()[0] if driver.returncode == 0 else "?"
    return info


def write_summary(out: Path, info: dict, steps: list[Step]) -> bool:
    """Write ``summary.md`` and ``summary.json``; return whether every step passed."""
    ok = all(s.ok for s in steps)
    lines = [
        f"# gpu-check: {'PASSED' if ok else 'FAILED'}",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
        "| step | verdict | seconds | detail | log |",
        "| --- | --- | ---: | --- | --- |",
        *(
            f"| {s.name} | {'pass' if s.ok else 'FAIL'} | {s.seconds:.1f} | {s.detail} | {s.log} |"
            for s in steps
        ),
    ]
    bandwidth = out / "bandwidth.md"
    if bandwidth.exists():
        lines += ["", "## Bandwidth", "", bandwidth.read_text()]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    summary = {"passed": ok, **info, "steps": [s.as_dict() for s in steps]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return ok


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    gpus = gpu_names()
    if not gpus:
        print("gpu-check: no GPU here (nvidia-smi lists none); nothing built or run")
        return 0
    out = Path(argv[0] if argv else "gpu-check-out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    info = {"gpus": "; ".join(gpus), **versions(python)}
    env = dict(os.environ, FORCE_CUDA="1", TORCH_CUDA_ARCH_LIST=info.get("capability", "9.0"))
    steps = []
    pip = [python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", "."]
    steps.append(run_step("build", pip, out, LIMITS["build"], env))
    if steps[-1].ok:
        tests = [python, "-m", "pytest", "-m", "cuda", "tests", "-q", "-p", "no:cacheprovider"]
        tests += ["--junitxml", str(out / "cuda-tests.xml")]
        steps.append(run_step("cuda-tests", tests, out, LIMITS["tests"], verdict=pytest_verdict))
        sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
        for tool in ("memcheck", "racecheck", "synccheck"):
            cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99"]
            cmd += [python, "benchmarks/gpu_ops_all.py"]
            steps.append(
                run_step(f"sanitizer-{tool}", cmd, out, LIMITS["sanitizer"],
                         verdict=sanitizer_verdict)
            )  # fmt: skip
        bandwidth = [python, "benchmarks/gpu_bandwidth.py", "--json", str(out / "bandwidth.json")]
        bandwidth += ["--markdown", str(out / "bandwidth.md")]
        steps.append(run_step("bandwidth", bandwidth, out, LIMITS["bandwidth"]))
    ok = write_summary(out, info, steps)
    print((out / "summary.md").read_text())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
