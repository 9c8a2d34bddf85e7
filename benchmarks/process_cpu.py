"""Where a command's CPU time goes, by kind of process: launchers, their workers, pooled ranks,
pytest sessions, compilers.

    python benchmarks/process_cpu.py [--json F] [--top N] [--commands N] -- COMMAND [ARGS ...]

Runs COMMAND with the kernel's process accounting on (``acct(2)``; needs root) and a
``sitecustomize`` that records each Python process's command line, then adds up the CPU time
of COMMAND's processes (it and its descendants) by their kind. A process counts whole: a
pytest session includes the tests it ran in-process, a pooled rank every call it served. The
accounting is the machine's: one run at a time (it refuses to start beside another, by a lock
in the temporary folder), and a process still running when COMMAND ends is not counted.
``--commands N`` names, under each kind, its costliest command forms (a script, ``-m module``).

    python benchmarks/process_cpu.py -- .venv/bin/python tests/streams.py
"""

import argparse
import collections
import contextlib
import ctypes
import fcntl
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from fastddp.bench import options

# Appended to the log by every Python process that starts: its pid, its parent's, its command
# line (NUL-separated in /proc, joined with spaces here, and the newlines of a `-c` program's
# lines too: the log has one line a process).
_SITE = """import os
try:
    with open("/proc/self/cmdline", "rb") as f:
        line = f.read().replace(b"\\0", b" ").replace(b"\\n", b" ").decode(errors="replace").strip()
    with open({log!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\t{{os.getppid()}}\\t{{line[:300]}}\\n")
except OSError:
    pass
"""
# struct acct_v3 (linux/acct.h): 64 bytes; times in comp_t (13-bit mantissa, base-8 exponent)
# of AHZ = 100 ticks a second.
_RECORD = struct.Struct("<BBH6If8H16s")
# Set for the command: the accounting is the machine's, one measurement at a time.
_NESTED = "FASTDDP_PROCESS_CPU"
LOCK = Path(tempfile.gettempdir(), "fastddp-process-cpu.lock")
_AFORK = 0x01  # ac_flag: forked, never exec'd
_FORMS_KEPT = 8  # command forms kept for each kind, most CPU first
_COMPILERS = {"cc1plus", "cc1", "cicc", "cudafe++", "ptxas", "nvlink", "fatbinary", "as", "ld"}


def _comp_t(value: int) -> float:
    return ((value & 0x1FFF) << (3 * (value >> 13))) / 100.0


def read_accounting(data: bytes) -> list[tuple[int, int, float, str, bool]]:
    """``(pid, ppid, CPU s, command name, forked)`` of each record in an ``acct_v3`` file;
    ``forked``: the process never called exec, so it is a copy of its parent."""
    out = []
    for off in range(0, len(data) - _RECORD.size + 1, _RECORD.size):
        f = _RECORD.unpack_from(data, off)
        if f[1] != 3:  # ac_version: anything else is not acct_v3
            raise ValueError(f"record {off // _RECORD.size}: accounting version {f[1]}, not 3")
        comm = f[-1].split(b"\0")[0].decode(errors="replace")
        out.append((f[6], f[7], _comp_t(f[10]) + _comp_t(f[11]), comm, bool(f[0] & _AFORK)))
    return out


def kind(cmd: str, parent_cmd: str, comm: str, forked: bool = False) -> str:
    """The kind of a process, from its command line (empty when not Python) and its parent's."""
    if not cmd and forked and parent_cmd:
        # No interpreter start-up of its own (a fork server's child, a rank forked by pytest).
        # Its command name may be that of the thread that ended last (`pt_gloo_runloop`).
        return kind(parent_cmd, "", comm) + ", forked"
    if not cmd:
        return "compiler" if comm in _COMPILERS else f"other: {comm}"
    if " -m pytest" in cmd:
        return "pytest session"
    if "multiprocessing.spawn" in cmd or "multiprocessing.forkserver" in cmd:
        return "pooled rank or fork server"
    if " -m fastddp.launch" in cmd or " -m torch.distributed.run" in cmd:
        return "launcher"
    if " -m fastddp.launch" in parent_cmd or " -m torch.distributed.run" in parent_cmd:
        return "launched worker"
    for module in ("fastddp.netns", "fastddp.bench", "fastddp.demo"):
        if f" -m {module}" in cmd:
            return f"{module} command"
    return "other Python"


def tally(records, cmdlines: dict[int, tuple[int, str]], root: int) -> dict[str, dict]:
    """CPU s and processes per kind of ``root`` and its descendants, most CPU first.

    A Python process's parent is the one it started under (``cmdlines``); another's, the one it
    ended under (the record's), so that a worker whose launcher died first still counts.
    """
    parent = {pid: ppid for pid, ppid, *_ in records}
    parent.update((pid, ppid) for pid, (ppid, _) in cmdlines.items())

    def under_root(pid: int) -> bool:
        for _ in range(64):  # deeper than any process tree here; a cycle (pid reuse) ends
            if pid == root:
                return True
            if pid not in parent:
                return False
            pid = parent[pid]
        return False

    cpu, count = collections.Counter(), collections.Counter()
    forms = collections.defaultdict(collections.Counter)  # kind -> command form -> CPU s
    for pid, _, seconds, comm, forked in records:
        if not under_root(pid):
            continue
        cmd = cmdlines.get(pid, (0, ""))[1]
        k = kind(cmd, cmdlines.get(parent.get(pid, 0), (0, ""))[1], comm, forked)
        cpu[k] += seconds
        count[k] += 1
        forms[k][command_form(cmd) or comm] += seconds
    return {
        k: {
            "cpu_s": round(v, 2),
            "processes": count[k],
            "commands": [[f, round(c, 2)] for f, c in forms[k].most_common(_FORMS_KEPT)],
        }
        for k, v in cpu.most_common()
    }


def command_form(cmd: str) -> str:
    """A Python command line without its interpreter's path or the arguments that vary from
    run to run: ``-m module``, a script's path, or ``-c`` and the code's start."""
    words = cmd.split()[1:]
    for i, w in enumerate(words):
        if w == "-m" and i + 1 < len(words):
            return f"-m {words[i + 1]}"
        if w == "-c":
            return "-c " + " ".join(words[i + 1 :])[:60]
        if not w.startswith("-"):
            return w
    return " ".join(words)[:60]


def _cmdlines(log: Path) -> dict[int, tuple[int, str]]:
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        pid, ppid, cmd = (line.split("\t", 2) + ["", ""])[:3]
        if pid.isdigit() and ppid.isdigit():
            out[int(pid)] = (int(ppid), cmd)
    return out


def check_room(folder: str, limits: str = "/proc/sys/kernel/acct") -> None:
    """Refuse to measure where the kernel would write no records: it suspends accounting while
    the file's filesystem has less free space than the first figure of ``limits`` (4 %), and
    the tally would then be empty without a word."""
    try:
        with open(limits) as f:
            resume = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return  # no such setting: nothing known to check
    fs = os.statvfs(folder)
    free = 100 * fs.f_bavail / fs.f_blocks if fs.f_blocks else 100.0
    if free < resume:
        raise SystemExit(
            f"process accounting would record nothing: {folder} has {free:.1f} % free, and the "
            f"kernel writes records only above {resume} % ({limits}); free some space there, "
            "or point TMPDIR at a filesystem with more"
        )


@contextlib.contextmanager
def _only_measurement(lock: Path):
    """Hold the machine's one measurement: ``acct(2)`` has a single file for the whole machine,
    so a second measurement would take the first one's records and then switch them off."""
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(
                f"another process_cpu measurement is running on this machine (it holds {lock}); "
                "process accounting is the machine's, so wait for it to end"
            ) from None
        yield


def measure(command: list[str], lock: Path = LOCK) -> tuple[int, dict[str, dict]]:
    """Run ``command`` under process accounting; its exit status and :func:`tally`."""
    if os.environ.get(_NESTED):
        raise SystemExit("process accounting is already on for a command around this one")
    libc = ctypes.CDLL(None, use_errno=True)
    with _only_measurement(lock), tempfile.TemporaryDirectory(prefix="process-cpu-") as tmp:
        check_room(tmp)
        site, log, acct = Path(tmp, "site"), Path(tmp, "cmdlines"), Path(tmp, "acct")
        site.mkdir()
        log.touch()
        acct.touch()
        (site / "sitecustomize.py").write_text(_SITE.format(log=str(log)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
        env[_NESTED] = "1"
        if libc.acct(str(acct).encode()) != 0:
            err = os.strerror(ctypes.get_errno())
            raise SystemExit(f"process accounting could not start ({err}): it needs root")
        try:
            proc = subprocess.Popen(command, env=env)
            code = proc.wait()
        finally:
            libc.acct(None)
        return code, tally(read_accounting(acct.read_bytes()), _cmdlines(log), proc.pid)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the table here too")
    p.add_argument("--top", type=int, default=12, help="kinds shown (default 12)")
    p.add_argument(
        "--commands",
        type=int,
        default=0,
        help=f"under each kind, its N costliest command forms (at most {_FORMS_KEPT})",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS ...]")
    args = p.parse_args(argv)
    options.check_outputs(p, args)  # before the runs, not after
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to measure after --")
    code, rows = measure(command)
    total = sum(r["cpu_s"] for r in rows.values()) or 1.0
    print(f"\n{'kind':32s} {'processes':>9s} {'CPU s':>8s} {'per process':>11s} {'share':>6s}")
    for k, r in list(rows.items())[: args.top]:
        per = r["cpu_s"] / r["processes"]
        print(
            f"{k:32s} {r['processes']:9d} {r['cpu_s']:8.1f} {per:11.2f} {r['cpu_s'] / total:6.1%}"
        )
        for form, cpu in r["commands"][: args.commands]:
            print(f"    {cpu:8.1f}  {form}")
    print(f"{'all':32s} {sum(r['processes'] for r in rows.values()):9d} {total:8.1f}")
    if args.json:
        args.json.write_text(
            json.dumps({"command": command, "exit": code, "kinds": rows}, indent=1)
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
