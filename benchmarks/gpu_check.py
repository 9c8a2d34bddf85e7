"""The GPU proof in one command: build, CUDA tests, sanitizers, bandwidth and step cost.

A borrowed GPU machine gives a few minutes in all and at most 600 s a command, so everything
runs in one command of at most 480 s (the rest is for starting the machine and copying the
results back)::

    make gpu-check OUT=$OUT          # python3 benchmarks/gpu_check.py $OUT
    make gpu-check-plan              # the plan, each phase's time limit; fails if over 480 s

The plan is a row of phases; the steps of a phase run at once, the phases one after another:

1. ``build``: the extension against the installed torch (``pip install --no-build-isolation
   --no-deps -e .``, ``FORCE_CUDA=1``, ``TORCH_CUDA_ARCH_LIST`` of the GPU present), once.
2. At once, since neither is timed: ``cuda-tests`` (``gpu_cuda_tests.py``: every ``cuda``
   test, one pytest process per file, files of spawned ranks split, all started together,
   each with its own time limit) and ``sanitizer-<tool>`` for memcheck, racecheck, synccheck
   and initcheck (``gpu_ops_all.py``, every op including the packed ones, under
   ``compute-sanitizer --tool <tool>``, with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that each
   tensor is its own allocation and an overrun past its end is seen).
3. ``bandwidth`` alone: each op against a device-to-device copy (``gpu_bandwidth.py``).
4. ``step-cost`` alone: a DDP step with each hook against plain DDP on NCCL at world size 1
   (``gpu_step_cost.py``).

``--part N`` (``make gpu-check PART=N``) runs one part of the plan, for when a command was cut
short; ``--steps a,b`` runs chosen steps. Each starts with the build, so that it also runs on a
fresh machine (where the build is still there it is an incremental no-op).

The output folder holds three files: ``summary.md`` and ``summary.json`` (every step's verdict,
time and detail, the machine's GPU, driver and torch/CUDA/NCCL versions, the bandwidth and
step-cost tables) and ``logs.tar.gz`` (every step's log and output). Logs are written to a
temporary folder and archived whenever a step ends, so a command killed at its limit loses only
what was running; a step is marked ``running`` before it starts. Parts run into the same folder
add to one summary and one archive. A verdict is ``pass``, ``FAIL``, ``skipped: <tool> not
found`` (a program the machine lacks) or ``refused: <reason>`` (a sanitizer that could not
instrument the program, which is not an error found in it). A missed bandwidth or step-cost
target is reported in its table, not as a failure. Exits 1 if a step of this command failed.

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
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND_LIMIT = 480  # seconds the whole command may take
PROBES = 35  # nvidia-smi -L (5) and its driver query (5), the torch version probe (25)
FINISH = 10  # the last summary and archive
GRACE = 3  # seconds between asking a step to stop (SIGTERM) and killing it
MAX_FILES = 8  # files the output folder may hold
ARCHIVE = "logs.tar.gz"
SANITIZERS = ("memcheck", "racecheck", "synccheck", "initcheck")
# Each step's time limit in seconds. Measured on an H100 (16 cores) on 2026-11-27: the build
# 55 s; the 616 CUDA tests 190 s on 12 processes (each two-rank hook test about 30 s there, its
# ranks' CUDA start-up sharing the cores); the sanitizers beside them 9-79 s (racecheck the
# longest); bandwidth 5 s; the step cost 45 s. The CUDA tests decide the command's length.
STEPS = {
    "build": 90,
    "cuda-tests": 260,
    **{f"sanitizer-{tool}": 260 for tool in SANITIZERS},
    "bandwidth": 20,
    "step-cost": 60,
}
# Steps in one phase run at once; the timed ones run alone.
PHASES = (
    ("build",),
    ("cuda-tests", *(f"sanitizer-{tool}" for tool in SANITIZERS)),
    ("bandwidth",),
    ("step-cost",),
)
PARTS = (
    ("build", "cuda-tests"),
    ("build", *(f"sanitizer-{tool}" for tool in SANITIZERS)),
    ("build", "bandwidth", "step-cost"),
)
TABLES = {"bandwidth": "Bandwidth", "step-cost": "Step cost"}  # step -> summary section
STATUSES = ("pass", "FAIL", "skipped", "refused", "running", "stopped")


def gpu_names() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (empty without a driver or a GPU)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=5)
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


class Running:
    """One step's command, started with its output streamed into ``logs/<name>.log``.

    The command gets its own process group: at its limit, or when this script is stopped, the
    group is asked to stop (SIGTERM, which lets gpu_cuda_tests.py stop its own pytest
    processes) and killed ``GRACE`` seconds later (pytest's rank processes, pip's compilers),
    so nothing outlives its step.
    """

    def __init__(self, name, cmd, logs: Path, limit: float, env=None) -> None:
        self.name, self.limit = name, limit
        self.log = logs / f"{name}.log"
        with self.log.open("w") as log:
            log.write(f"$ {shlex.join(map(str, cmd))}\n")
            log.flush()
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.started = time.monotonic()
        self.rc: int | None = None
        self.timed_out = False

    def done(self) -> bool:
        """Whether the command ended or ran past its limit (then it is stopped)."""
        self.rc = self.proc.poll()
        if self.rc is None and time.monotonic() - self.started < self.limit:
            return False
        if self.rc is None:
            self.timed_out = True
            with self.log.open("a") as log:
                log.write(f"\ntimed out after {self.limit:.0f} s\n")
        self.stop()
        return True

    def stop(self) -> None:
        """Stop the command and whatever it left running (also after a normal exit)."""
        stop_all([self])

    def step(self, verdict=None) -> "Step":
        text = self.log.read_text(errors="replace")
        if self.timed_out:
            status, detail = "FAIL", f"timed out after {self.limit:.0f} s"
        elif verdict is not None:
            status, detail = verdict(self.rc, text)
        else:
            status, detail = ("pass" if self.rc == 0 else "FAIL"), f"exit {self.rc}"
        return Step(self.name, status, time.monotonic() - self.started, detail, self.log.name)


def stop_all(commands) -> None:
    """Ask every command's group to stop, give them ``GRACE`` seconds together, then kill
    whatever is left of each group."""
    for c in commands:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c.proc.pid, signal.SIGTERM)
    until = time.monotonic() + GRACE
    for c in commands:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=max(0.0, until - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c.proc.pid, signal.SIGKILL)
        c.proc.wait()


def missing_program(cmd) -> "str | None":
    program = str(cmd[0])
    if shutil.which(program) is None and not Path(program).is_file():
        return Path(program).name
    return None


def run_step(name, cmd, logs: Path, limit: float, env=None, verdict=None) -> Step:
    """Run ``cmd`` to its end, log to ``logs/<name>.log``; ``verdict(rc, text)`` -> (status,
    detail). A program that is not there gives ``skipped: <program> not found``."""
    return run_phase({name: (cmd, env, verdict)}, logs, {name: limit}, lambda step: None)[0]


def run_phase(todo: dict, logs: Path, limits: dict, record) -> list:
    """Run the steps of ``todo`` (name -> (command, env, verdict)) at once, each within its
    limit; ``record(step)`` as each is marked running and as each ends. Returns the steps."""
    running, ended = [], []
    try:
        for name, (cmd, env, verdict) in todo.items():
            missing = missing_program(cmd)
            if missing is not None:
                ended.append(Step(name, "skipped", 0.0, f"skipped: {missing} not found", ""))
                record(ended[-1])
                continue
            limit = limits[name]
            record(Step(name, "running", 0.0, f"started, limit {limit:.0f} s", f"{name}.log"))
            running.append((Running(name, cmd, logs, limit, env), verdict))
        while running:
            time.sleep(0.2)
            for item in list(running):
                if item[0].done():
                    running.remove(item)
                    ended.append(item[0].step(item[1]))
                    record(ended[-1])
    finally:
        stop_all([proc for proc, _ in running])  # this script was stopped: so are its steps
        for proc, _ in running:  # what each had done when it was stopped, and for how long
            seconds = time.monotonic() - proc.started
            with contextlib.suppress(OSError), proc.log.open("a") as log:
                log.write(f"\nstopped after {seconds:.0f} s: the check itself was stopped\n")
            detail = f"stopped after {seconds:.0f} s of its {proc.limit:.0f}: the check was stopped"
            record(Step(proc.name, "stopped", seconds, detail, proc.log.name))
    return ended


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


def tests_verdict(rc, text):
    """gpu_cuda_tests.py's last ``cuda-tests:`` line, and pass on exit 0."""
    lines = [line for line in text.splitlines() if line.startswith("cuda-tests: ")]
    detail = lines[-1].removeprefix("cuda-tests: ") if lines else f"exit {rc}"
    return ("pass" if rc == 0 else "FAIL"), detail


def table_verdict(path: Path, what: str):
    """A verdict for a table step: pass on exit 0; the detail counts the targets met."""

    def verdict(rc, text):
        try:
            rows = json.loads(path.read_text())["rows"]
        except (OSError, ValueError, KeyError, TypeError):
            return "FAIL", f"exit {rc}, no table"
        judged = [r for r in rows if r.get("target") is not None]
        met = sum(r.get("meets_target") is True for r in judged)
        # The step cost leaves a verdict undecided where its interval straddles the target.
        open_ = sum(r.get("verdict") == "undecided" for r in judged)
        tail = f", {open_} undecided" if open_ else ""
        return ("pass" if rc == 0 else "FAIL"), f"exit {rc}; {met} of {len(judged)} {what}{tail}"

    return verdict


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
        res = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=25)
        info = json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        info = {"probe_error": f"{type(e).__name__}: {e}"[-500:]}
    info["cpus"] = os.cpu_count()
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=5,
        )  # fmt: skip
        info["driver"] = driver.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        info["driver"] = "?"
    return info


def _failed_tests(logs: Path) -> list:
    """The ``FAILED``/``ERROR``/``CRASHED`` lines gpu_cuda_tests.py printed, if it ran."""
    try:
        text = (logs / "cuda-tests.log").read_text(errors="replace")
    except OSError:
        return []
    return [
        line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR ", "CRASHED "))
    ]


def write_summary(out: Path, info: dict, steps: list, planned=(), logs: "Path | None" = None):
    """Write ``summary.md`` and ``summary.json`` into ``out``; return whether no step failed.

    ``planned`` names every step of the plan: while one has not run, or one is still marked
    running (its command was killed) or stopped (its command was stopped by a signal), the
    verdict is INCOMPLETE, unless a step FAILED. The
    tables and failed tests are read from ``logs`` (``out`` if not given).
    """
    logs = out if logs is None else logs
    failed = [s for s in steps if s.status == "FAIL"]
    missing = [name for name in planned if name not in {s.name for s in steps}]
    unfinished = missing or any(s.status in ("running", "stopped") for s in steps)
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
        "",
        f"Logs: {ARCHIVE}.",
    ]
    failures = _failed_tests(logs)
    if failures:
        lines += ["", "## Failed tests", "", *(f"- {f}" for f in failures)]
    tables = {}
    for step, title in TABLES.items():
        with contextlib.suppress(OSError, ValueError, KeyError):
            md = (logs / f"{step}.md").read_text()
            lines += ["", f"## {title}", "", md.rstrip("\n")]
            tables[step] = json.loads((logs / f"{step}.json").read_text())["rows"]
    summary = {"passed": verdict == "PASSED", "verdict": verdict, **info,
               "steps": [s.as_dict() for s in steps], "not_run": missing,
               "failed_tests": failures, "tables": tables}  # fmt: skip
    # Written whole to a temporary name and renamed: a kill mid-write leaves the last summary.
    for name, text in (
        ("summary.md", "\n".join(lines) + "\n"),
        ("summary.json", json.dumps(summary, indent=1)),
    ):
        _replace(out / name, lambda tmp, text=text: tmp.write_text(text))
    return not failed


def _replace(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    tmp.replace(path)


def write_archive(logs: Path, out: Path) -> None:
    """Every file under ``logs`` into ``out/logs.tar.gz``, under ``logs/``."""

    def write(tmp):
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(logs, arcname="logs")

    _replace(out / ARCHIVE, write)


def _extract_files(tar: tarfile.TarFile, dest: Path) -> None:
    """The archive's files and folders under ``dest``; links and paths leading out of it are
    left out. Python's ``data`` filter checks again where it has one: not before 3.11.4
    (Debian 12's python3 is 3.11.2)."""
    safe = [m for m in tar.getmembers() if (m.isfile() or m.isdir()) and
            not Path(m.name).is_absolute() and ".." not in Path(m.name).parts]  # fmt: skip
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=safe, filter="data")
    else:
        tar.extractall(dest, members=safe)


def open_logs(out: Path) -> Path:
    """A fresh folder for the logs, holding those of an earlier command into ``out``."""
    logs = Path(tempfile.mkdtemp(prefix="gpu-check-logs-"))
    with contextlib.suppress(OSError, tarfile.TarError):
        with tarfile.open(out / ARCHIVE) as tar:
            _extract_files(tar, logs.parent / (logs.name + "-old"))
        old = logs.parent / (logs.name + "-old") / "logs"
        if old.is_dir():
            shutil.rmtree(logs)
            old.rename(logs)
        shutil.rmtree(logs.parent / (logs.name + "-old"), ignore_errors=True)
    return logs


def load_steps(out: Path) -> list:
    """The steps an earlier command recorded in ``out/summary.json`` (none if unreadable)."""
    try:
        return [Step.from_dict(d) for d in json.loads((out / "summary.json").read_text())["steps"]]
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return []


def plan(part=None, steps=None) -> "tuple[str, list]":
    """The command to run: its label and its phases (tuples of steps run at once)."""
    if steps:
        unknown = [s for s in steps if s not in STEPS]
        if unknown:
            raise SystemExit(f"gpu-check: unknown steps {unknown}; known: {', '.join(STEPS)}")
        label, wanted = f"--steps {','.join(steps)}", set(steps)
    elif part is not None:
        if not 1 <= part <= len(PARTS):
            raise SystemExit(f"gpu-check: PART must be 1 to {len(PARTS)}, not {part}")
        label, wanted = f"PART={part}", set(PARTS[part - 1])
    else:
        label, wanted = "", set(STEPS)
    phases = [tuple(s for s in phase if s in wanted) for phase in PHASES]
    return label, [phase for phase in phases if phase]


def command_seconds(phases) -> int:
    """The most one command running ``phases`` can take."""
    return PROBES + sum(max(STEPS[s] for s in phase) for phase in phases) + FINISH


def _command(label: str, out: str) -> str:
    if label.startswith("--steps"):
        return f"python3 benchmarks/gpu_check.py {out} {label}"
    return f"make gpu-check OUT={out}" + (f" {label}" if label else "")


def print_plan(label: str, phases, out: str, parts: bool = False) -> int:
    """Print the command's phases with their limits (and, with ``parts``, each part's total);
    1 if a command could run past ``COMMAND_LIMIT``."""
    total = command_seconds(phases)
    print(f"gpu-check plan: {_command(label, out)}   # at most {total} s of {COMMAND_LIMIT} s")
    rows = [("probes (nvidia-smi, torch versions)", PROBES)]
    for i, phase in enumerate(phases, 1):
        if len(phase) == 1:
            rows.append((f"phase {i}: {phase[0]}" + (" (alone)" if i > 1 else ""), STEPS[phase[0]]))
            continue
        rows.append((f"phase {i}: {len(phase)} steps at once", max(STEPS[s] for s in phase)))
        rows += [(f"  {s}  ({STEPS[s]} s)", None) for s in phase]
    rows += [("summary and archive", FINISH), ("total", total)]
    for text, seconds in rows:
        print(f"  {text:<44} {'' if seconds is None else f'{seconds:>4} s'}".rstrip())
    over = [] if total <= COMMAND_LIMIT else [f"{label or 'the plan'} may take {total} s"]
    if parts:
        print("for a command cut short, one part at a time:")
        for i in range(1, len(PARTS) + 1):
            part_label, part_phases = plan(part=i)
            seconds = command_seconds(part_phases)
            steps = ", ".join(s for phase in part_phases for s in phase)
            print(f"  {_command(part_label, out)}   # {steps}: at most {seconds} s")
            if seconds > COMMAND_LIMIT:
                over.append(f"{part_label} may take {seconds} s")
    for line in over:
        print(f"gpu-check plan: {line}, over {COMMAND_LIMIT} s")
    return 1 if over else 0


def step_commands(python: str, logs: Path, info: dict) -> dict:
    """Each step's ``(command, env, verdict)``; outputs go into ``logs``."""
    build_env = dict(os.environ, FORCE_CUDA="1", TORCH_CUDA_ARCH_LIST=info.get("capability", "9.0"))
    pip = [python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", "."]
    tests = [python, "benchmarks/gpu_cuda_tests.py", "--logs", str(logs / "cuda-tests")]
    # Cores left for the sanitizers, which run beside the tests.
    jobs = max(4, (os.cpu_count() or 8) - len(SANITIZERS))
    tests += ["--limit", str(STEPS["cuda-tests"] - 10), "--jobs", str(jobs)]
    # "binary": the checks of the built library itself, which this build may fail apart from CI's.
    tests += ["--marker", "cuda or binary", "tests"]
    # The caching allocator would hide an overrun inside one of its blocks.
    sanitizer_env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    sanitizer = find_tool("compute-sanitizer")
    bandwidth = [python, "benchmarks/gpu_bandwidth.py", "--json", str(logs / "bandwidth.json")]
    bandwidth += ["--markdown", str(logs / "bandwidth.md")]
    step_cost = [python, "benchmarks/gpu_step_cost.py", "--json", str(logs / "step-cost.json")]
    # Its rounds stop in time for the process's start, NCCL's and the models' set-up.
    step_cost += ["--markdown", str(logs / "step-cost.md")]
    step_cost += ["--seconds", str(STEPS["step-cost"] - 25)]
    commands = {
        "build": (pip, build_env, None),
        "cuda-tests": (tests, None, tests_verdict),
        "bandwidth": (bandwidth, None, table_verdict(logs / "bandwidth.json", "targets met")),
        "step-cost": (
            step_cost,
            None,
            table_verdict(logs / "step-cost.json", "hooks within 1.03x of plain DDP"),
        ),
    }
    for tool in SANITIZERS:
        cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99"]
        cmd += [python, "benchmarks/gpu_ops_all.py"]
        commands[f"sanitizer-{tool}"] = (cmd, sanitizer_env, sanitizer_verdict)
    return commands


def _terminate(signum, frame):
    # From the first stop on, the clean-up runs to its end: a second SIGTERM would cut short
    # the stopping of the steps, which run in sessions of their own, and leave them running.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)  # unwinds through run_phase, which stops the running steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="gpu-check-out", help="folder for the results")
    p.add_argument("--part", type=int, help=f"run part 1..{len(PARTS)} of the plan")
    p.add_argument("--steps", help=f"comma-separated steps to run, of: {', '.join(STEPS)}")
    p.add_argument("--dry-run", action="store_true", help="print the plan and check its times")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    steps = [s for s in (args.steps or "").split(",") if s]
    label, phases = plan(args.part, steps)
    if args.dry_run:
        return print_plan(label, phases, args.out, parts=not label)
    gpus = gpu_names()
    if not gpus:
        print("gpu-check: no GPU here (nvidia-smi lists none); nothing built or run")
        return 0
    deadline = time.monotonic() + COMMAND_LIMIT - FINISH
    signal.signal(signal.SIGTERM, _terminate)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    logs = open_logs(out)
    python = sys.executable
    info = {"gpus": "; ".join(gpus)}
    planned = list(STEPS)
    recorded = {s.name: s for s in load_steps(out)}
    order = list(dict.fromkeys([*planned, *recorded]))

    def summarise() -> None:
        write_summary(out, info, [recorded[n] for n in order if n in recorded], planned, logs)

    def record(step: Step) -> None:
        recorded[step.name] = step
        summarise()
        write_archive(logs, out)

    failed = build_failed = False
    try:  # from here on, a stop (SIGTERM) still leaves a summary, the logs and no folder behind
        info.update(versions(python))  # probes the GPU, the driver and the tools: seconds
        todo = step_commands(python, logs, info)
        for phase in phases:
            if build_failed:
                for name in phase:
                    record(Step(name, "skipped", 0.0, "skipped: the build failed", ""))
                continue
            left = deadline - time.monotonic()
            for name in [n for n in phase if min(STEPS[n], left) <= 0]:
                record(Step(name, "skipped", 0.0, "skipped: no time left in this command", ""))
            limits = {n: min(STEPS[n], left) for n in phase if min(STEPS[n], left) > 0}
            ended = run_phase({n: todo[n] for n in limits}, logs, limits, record)
            failed |= any(s.status == "FAIL" for s in ended)
            build_failed = any(s.name == "build" and s.status == "FAIL" for s in ended)
    finally:
        with contextlib.suppress(OSError):
            summarise()
            write_archive(logs, out)
        shutil.rmtree(logs, ignore_errors=True)
    print((out / "summary.md").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
