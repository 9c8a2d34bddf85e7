"""The GPU proof: build, CUDA tests, sanitizers, bandwidth, into one folder, in short commands.

A borrowed GPU machine runs one command for at most 600 s, so the check is a plan of parts,
each one command that fits in 540 s (the rest is for starting up and copying results back)::

    make gpu-check OUT=$OUT PART=1   # build; CUDA tests
    make gpu-check OUT=$OUT PART=2   # build; sanitizer memcheck, racecheck
    make gpu-check OUT=$OUT PART=3   # build; sanitizer synccheck, initcheck
    make gpu-check OUT=$OUT PART=4   # build; bandwidth

(``python benchmarks/gpu_check.py OUT --part N`` is the same; ``--steps build,cuda-tests``
runs chosen steps.) ``python benchmarks/gpu_check.py --dry-run`` prints the plan, each
command's steps and their time limits, and fails if a command could run past 540 s; it needs
no GPU. Without ``PART`` every step runs in one command, for a machine with no such limit.

The steps:

- ``build``: the extension against the installed torch (``pip install --no-build-isolation
  --no-deps -e .``, ``FORCE_CUDA=1``, ``TORCH_CUDA_ARCH_LIST`` of the GPU present). Every part
  starts with it, so that a part also runs on a fresh machine; where an earlier part's build
  is still there it is an incremental no-op.
- ``cuda-tests``: ``pytest -m cuda``: every op against the reference and the CPU, bit for bit,
  at awkward lengths and offsets and at lengths that take each grid-stride loop through three
  passes, ``opcheck``, the non-finite flag, the GPU error paths, and the hook for every mode on
  NCCL with world size 1 and on Gloo with CUDA tensors.
- ``sanitizer-<tool>``: ``benchmarks/gpu_ops_all.py`` under ``compute-sanitizer --tool
  <tool>`` for memcheck, racecheck, synccheck and initcheck, with
  ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that every tensor is its own allocation and an
  overrun past its end is seen, not hidden inside a cached block.
- ``bandwidth``: each op against a device-to-device copy (``gpu_bandwidth.py``).

Each step's verdict is written to ``summary.md`` / ``summary.json`` as soon as the step ends,
and a step is marked ``running`` before it starts, so a command killed at its limit loses only
that step; parts run into the same folder add to one summary. A verdict is ``pass``,
``FAIL``, ``skipped: <tool> not found`` (a program the machine lacks) or ``refused:
<reason>`` (a sanitizer that could not instrument the program, which is not an error found in
it). Every step's log lies beside the summary, with the GPU, driver and torch/CUDA/NCCL
versions. Exits 1 if a step of this command failed.

Without a GPU (``nvidia-smi`` finds none) it says so in one line and exits 0, building nothing.
"""

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND_LIMIT = 540  # seconds a command may take: the borrowed machine's 600, less its overhead
PROBES = 60  # seconds for nvidia-smi (10 + 10) and the torch version probe (40)
SANITIZERS = ("memcheck", "racecheck", "synccheck", "initcheck")
# Each step's time limit in seconds.
STEPS = {
    "build": 200,
    "cuda-tests": 280,
    **{f"sanitizer-{tool}": 120 for tool in SANITIZERS},
    "bandwidth": 120,
}
PARTS = (
    ("build", "cuda-tests"),
    ("build", "sanitizer-memcheck", "sanitizer-racecheck"),
    ("build", "sanitizer-synccheck", "sanitizer-initcheck"),
    ("build", "bandwidth"),
)
STATUSES = ("pass", "FAIL", "skipped", "refused", "running")


def gpu_names() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (empty without a driver or a GPU)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in res.stdout.splitlines() if line.startswith("GPU ")]


def find_tool(name: str) -> str:
    """``name`` on PATH or in the CUDA toolkit's bin; the bare name if neither has it."""
    found = shutil.which(name)
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / name).is_file():
            return str(Path(home) / "bin" / name)
    return name


class Step:
    """One step's verdict (one of ``STATUSES``), time, detail and log file name."""

    def __init__(self, name: str, status: str, seconds: float, detail: str, log: str) -> None:
        assert status in STATUSES, status
        self.name, self.status, self.seconds = name, status, seconds
        self.detail, self.log = detail, log

    @property
    def ok(self) -> bool:
        """Finished without a failure (a skip or a refusal is no error found in fastddp)."""
        return self.status in ("pass", "skipped", "refused")

    def as_dict(self) -> dict:
        return {
            "step": self.name,
            "status": self.status,
            "ok": self.ok,
            "seconds": round(self.seconds, 1),
            "detail": self.detail,
            "log": self.log,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Step":
        return cls(d["step"], d["status"], d["seconds"], d["detail"], d["log"])


def _run(cmd, log_path: Path, limit: float, env) -> "int | None":
    """Run ``cmd`` with its output streamed into ``log_path``; None if it ran past ``limit``.

    The command gets its own process group, killed whole at the limit (pytest's rank processes,
    pip's compilers) and when this script is terminated, so nothing outlives its step.
    """
    with log_path.open("w") as log:
        log.write(f"$ {shlex.join(map(str, cmd))}\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            log.write(f"\ntimed out after {limit:.0f} s\n")
            return None
        finally:
            # Also after a normal exit: whatever the command left running goes with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_step(name, cmd, out: Path, limit: float, env=None, verdict=None) -> Step:
    """Run ``cmd``, log to ``out/<name>.log``; ``verdict(rc, text)`` -> (status, detail).

    A program that is not there gives ``skipped: <program> not found``, not a failure.
    """
    program = str(cmd[0])
    if shutil.which(program) is None and not Path(program).is_file():
        return Step(name, "skipped", 0.0, f"skipped: {Path(program).name} not found", "")
    log = out / f"{name}.log"
    start = time.monotonic()
    rc = _run(cmd, log, limit, env)
    text = log.read_text(errors="replace")
    if rc is None:
        status, detail = "FAIL", f"timed out after {limit:.0f} s"
    elif verdict is not None:
        status, detail = verdict(rc, text)
    else:
        status, detail = ("pass" if rc == 0 else "FAIL"), f"exit {rc}"
    return Step(name, status, time.monotonic() - start, detail, log.name)


def pytest_verdict(rc, text):
    tail = [line for line in text.splitlines() if " passed" in line or " failed" in line]
    return ("pass" if rc == 0 else "FAIL"), tail[-1].strip("= ") if tail else f"exit {rc}"


# compute-sanitizer's own complaints that it could not check the program at all (it prints
# them after its "=========" prefix, as "Error: ..." or "Internal Sanitizer Error: ..."):
# the target ended before the first CUDA call it could hook, no process to attach to, a GPU or
# driver it does not support, no permission for, or no access to the debugger interface.
_REFUSAL = re.compile(
    r"terminated before first instrumented API call|no attachable process|not supported"
    r"|permission|privilege|debugger|driver|injection library|unable to (?:load|initiali[sz]e)",
    re.IGNORECASE,
)


def sanitizer_refusal(text: str) -> "str | None":
    """The first line of compute-sanitizer's reason for not running, if it gave one."""
    for line in text.splitlines():
        message = line.strip().lstrip("=").strip()
        if not line.lstrip().startswith("========="):
            continue
        if message.startswith("Internal Sanitizer Error") or (
            message.startswith("Error:") and _REFUSAL.search(message)
        ):
            return message
    return None


def sanitizer_verdict(rc, text):
    """``pass`` on a clean summary, ``FAIL`` on any error or hazard, or ``refused``."""
    errors = re.findall(r"ERROR SUMMARY: (\d+) errors?", text)
    hazards = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed", text)
    summaries = [
        line.strip("= ")
        for line in text.splitlines()
        if re.search(r"(ERROR|RACECHECK) SUMMARY", line)
    ]
    detail = summaries[-1] if summaries else f"exit {rc}"
    if sum(map(int, errors + hazards)):
        return "FAIL", detail
    reason = sanitizer_refusal(text)
    if reason is not None:
        return "refused", f"refused: {reason}"
    if not summaries:
        return "FAIL", f"exit {rc}, no sanitizer summary"
    if rc != 0:  # clean for the tool, but the program itself failed (a wrong result)
        return "FAIL", f"exit {rc}; {detail}"
    return "pass", detail


def versions(python: str) -> dict:
    probe = (
        "import json, torch; p = torch.cuda.get_device_properties(0); "
        "print(json.dumps({'gpu': p.name, 'capability': f'{p.major}.{p.minor}', "
        "'sms': p.multi_processor_count, "
        "'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'nccl': '.'.join(map(str, torch.cuda.nccl.version())), "
        "'python': __import__('platform').python_version()}))"
    )
    try:
        res = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=40)
        info = json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        info = {"probe_error": f"{type(e).__name__}: {e}"[-500:]}
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        info["driver"] = driver.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        info["driver"] = "?"
    return info


def write_summary(out: Path, info: dict, steps: list, planned=()) -> bool:
    """Write ``summary.md`` and ``summary.json``; return whether no step failed.

    ``planned`` names every step of the plan: while one has not run, or one is still marked
    running (its command was killed), the verdict is INCOMPLETE, unless a step FAILED.
    """
    failed = [s for s in steps if s.status == "FAIL"]
    missing = [name for name in planned if name not in {s.name for s in steps}]
    unfinished = missing or any(s.status == "running" for s in steps)
    verdict = "FAILED" if failed else "INCOMPLETE" if unfinished else "PASSED"
    notes = [f"{sum(s.status == k for s in steps)} {k}" for k in ("skipped", "refused")]
    notes = [n for n in notes if not n.startswith("0 ")]
    lines = [
        f"# gpu-check: {verdict}" + (f" ({', '.join(notes)})" if notes else ""),
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
        "| step | verdict | seconds | detail | log |",
        "| --- | --- | ---: | --- | --- |",
        *(f"| {s.name} | {s.status} | {s.seconds:.1f} | {s.detail} | {s.log} |" for s in steps),
        *(f"| {name} | not run | | | |" for name in missing),
    ]
    bandwidth = out / "bandwidth.md"
    if bandwidth.exists():
        lines += ["", "## Bandwidth", "", bandwidth.read_text()]
    summary = {"passed": verdict == "PASSED", "verdict": verdict, **info,
               "steps": [s.as_dict() for s in steps], "not_run": missing}  # fmt: skip
    # Written whole to a temporary name and renamed: a kill mid-write leaves the last summary.
    for name, text in (
        ("summary.md", "\n".join(lines) + "\n"),
        ("summary.json", json.dumps(summary, indent=1)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)
    return not failed


def load_steps(out: Path) -> list:
    """The steps an earlier command recorded in ``out/summary.json`` (none if unreadable)."""
    try:
        return [Step.from_dict(d) for d in json.loads((out / "summary.json").read_text())["steps"]]
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return []


def plan(part=None, steps=None) -> list:
    """The commands to run: ``(label, step names)`` for one part, chosen steps, or all."""
    if steps:
        unknown = [s for s in steps if s not in STEPS]
        if unknown:
            raise SystemExit(f"gpu-check: unknown steps {unknown}; known: {', '.join(STEPS)}")
        return [(f"--steps {','.join(steps)}", tuple(steps))]
    if part is not None:
        if not 1 <= part <= len(PARTS):
            raise SystemExit(f"gpu-check: PART must be 1 to {len(PARTS)}, not {part}")
        return [(f"PART={part}", PARTS[part - 1])]
    return [(f"PART={i}", p) for i, p in enumerate(PARTS, 1)]


def command_seconds(steps) -> int:
    """The most one command running ``steps`` can take."""
    return PROBES + sum(STEPS[s] for s in steps)


def print_plan(commands, out: str) -> int:
    """Print each command with its steps' limits; 1 if one could run past ``COMMAND_LIMIT``."""
    print(f"gpu-check plan: {len(commands)} command(s), each within {COMMAND_LIMIT} s "
          f"(its steps' limits plus {PROBES} s of probes)")  # fmt: skip
    over = []
    for label, steps in commands:
        total = command_seconds(steps)
        if label.startswith("PART="):
            command = f"make gpu-check OUT={out} {label}"
        else:
            command = f"python benchmarks/gpu_check.py {out} {label}"
        print(f"{command}   # at most {total} s")
        for s in steps:
            print(f"  {s:<22} {STEPS[s]:>4} s")
        if total > COMMAND_LIMIT:
            over.append(f"{label} may take {total} s, over {COMMAND_LIMIT} s")
    for line in over:
        print(f"gpu-check plan: {line}")
    return 1 if over else 0


def step_commands(python: str, out: Path, info: dict) -> dict:
    """Each step's ``(command, env, verdict)``."""
    build_env = dict(os.environ, FORCE_CUDA="1", TORCH_CUDA_ARCH_LIST=info.get("capability", "9.0"))
    pip = [python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", "."]
    tests = [python, "-m", "pytest", "-m", "cuda", "tests", "-q", "-p", "no:cacheprovider"]
    tests += ["--junitxml", str(out / "cuda-tests.xml")]
    # The caching allocator would hide an overrun inside one of its blocks.
    sanitizer_env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    sanitizer = find_tool("compute-sanitizer")
    bandwidth = [python, "benchmarks/gpu_bandwidth.py", "--json", str(out / "bandwidth.json")]
    bandwidth += ["--markdown", str(out / "bandwidth.md")]
    commands = {
        "build": (pip, build_env, None),
        "cuda-tests": (tests, None, pytest_verdict),
        "bandwidth": (bandwidth, None, None),
    }
    for tool in SANITIZERS:
        cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99"]
        cmd += [python, "benchmarks/gpu_ops_all.py"]
        commands[f"sanitizer-{tool}"] = (cmd, sanitizer_env, sanitizer_verdict)
    return commands


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through _run, which kills the running step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="gpu-check-out", help="folder for the results")
    p.add_argument("--part", type=int, help=f"run part 1..{len(PARTS)} of the plan")
    p.add_argument("--steps", help=f"comma-separated steps to run, of: {', '.join(STEPS)}")
    p.add_argument("--dry-run", action="store_true", help="print the plan and check its times")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    steps = [s for s in (args.steps or "").split(",") if s]
    commands = plan(args.part, steps)
    if args.dry_run:
        return print_plan(commands, args.out)
    gpus = gpu_names()
    if not gpus:
        print("gpu-check: no GPU here (nvidia-smi lists none); nothing built or run")
        return 0
    started = time.monotonic()
    # A part must end within its command's limit; all parts in one command have no such limit.
    deadline = started + COMMAND_LIMIT if (args.part or steps) else float("inf")
    signal.signal(signal.SIGTERM, _terminate)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    info = {"gpus": "; ".join(gpus), **versions(python)}
    wanted = list(dict.fromkeys(s for _, part in commands for s in part))
    planned = [s for part in PARTS for s in part]
    recorded = {s.name: s for s in load_steps(out)}
    order = list(dict.fromkeys([*planned, *recorded, *wanted]))

    def record(step: Step) -> None:
        recorded[step.name] = step
        write_summary(out, info, [recorded[n] for n in order if n in recorded], planned)

    failed = build_failed = False
    todo = step_commands(python, out, info)
    for name in wanted:
        if build_failed:
            record(Step(name, "skipped", 0.0, "skipped: the build failed", ""))
            continue
        limit = min(STEPS[name], deadline - time.monotonic())
        if limit <= 0:
            record(Step(name, "skipped", 0.0, "skipped: no time left in this command", ""))
            continue
        record(Step(name, "running", 0.0, f"started, limit {limit:.0f} s", f"{name}.log"))
        cmd, env, verdict = todo[name]
        step = run_step(name, cmd, out, limit, env, verdict)
        failed |= step.status == "FAIL"
        build_failed = name == "build" and step.status == "FAIL"
        record(step)
    print((out / "summary.md").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
