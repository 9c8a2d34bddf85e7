"""benchmarks/process_cpu.py: a command's CPU time by kind of process, from the kernel's process
accounting, counting the command's own processes only."""

import os
import re
import subprocess
import sys

import pytest

from benchmarks import process_cpu
from fastddp.testing import slack


def _record(pid, ppid, ticks, comm, forked=False):
    # ac_flag, ac_version 3, tty, exitcode, uid, gid, pid, ppid, btime, etime, utime, stime,
    # mem, io, rw, minflt, majflt, swaps, comm (ticks < 8192 need no exponent in a comp_t)
    return process_cpu._RECORD.pack(
        int(forked), 3, 0, 0, 0, 0, pid, ppid, 0, 0.0, ticks, 10, 0, 0, 0, 0, 0, 0, comm.encode()
    )


def test_records_are_read_and_the_commands_processes_sorted_by_kind():
    py = sys.executable
    cmdlines = {
        10: (1, f"{py} -m pytest -m ranks"),
        11: (10, f"{py} -m fastddp.launch --standalone --nproc-per-node 2 train.py"),
        12: (11, f"{py} -u train.py --steps 3"),
        13: (11, f"{py} -u train.py --steps 3"),
        14: (10, f"{py} -B -c from multiprocessing.spawn import spawn_main; spawn_main()"),
        20: (1, f"{py} -m fastddp.launch train.py"),  # another command's: not counted
    }
    # 15 and 18 forked by the pooled rank 14 (18 named by its last thread); 16 cc1plus under
    # g++ 17 (no command lines logged); 19 a Python without a logged command line, not forked;
    # 21 the other command's worker.
    records = [(12, 11, 190, "python"), (13, 11, 210, "python"), (11, 10, 140, "python")]
    records += [(15, 14, 30, "python", True), (18, 14, 10, "pt_gloo_runloop", True)]
    records += [(14, 10, 290, "python"), (16, 17, 90, "cc1plus"), (19, 10, 20, "python3")]
    records += [(17, 10, 0, "g++"), (10, 1, 490, "pt_main_thread"), (21, 20, 500, "python")]
    records += [(20, 1, 500, "python")]
    data = b"".join(_record(*r) for r in records)
    read = process_cpu.read_accounting(data)
    assert read[0] == (12, 11, 2.0, "python", False) and len(read) == len(records)
    assert read[3] == (15, 14, 0.4, "python", True)
    got = process_cpu.tally(read, cmdlines, root=10)
    assert {k: (r["cpu_s"], r["processes"]) for k, r in got.items()} == {
        "pytest session": (5.0, 1),
        "launched worker": (4.2, 2),
        "pooled rank or fork server": (3.0, 1),
        "launcher": (1.5, 1),
        "compiler": (1.0, 1),
        "pooled rank or fork server, forked": (0.6, 2),
        "other: python3": (0.3, 1),
        "other: g++": (0.1, 1),
    }
    assert list(got)[0] == "pytest session"  # most CPU first
    # Each kind's command forms, most CPU first: the two workers' one form adds up; a forked
    # or non-Python process goes by its command name.
    assert got["launched worker"]["commands"] == [["train.py", 4.2]]
    assert got["launcher"]["commands"] == [["-m fastddp.launch", 1.5]]
    assert got["compiler"]["commands"] == [["cc1plus", 1.0]]
    forked = got["pooled rank or fork server, forked"]["commands"]
    assert forked == [["python", 0.4], ["pt_gloo_runloop", 0.2]]
    assert process_cpu.command_form(f"{py} -B -c import x; run()") == "-c import x; run()"
    with pytest.raises(ValueError, match="accounting version 2, not 3"):
        process_cpu.read_accounting(data[:1] + b"\x02" + data[2:])


_BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


@pytest.mark.multiproc
@pytest.mark.skipif(os.geteuid() != 0, reason="process accounting needs root")
@pytest.mark.skipif(bool(os.environ.get(process_cpu._NESTED)), reason="measured from outside")
def test_a_command_is_measured_without_the_machines_other_processes():
    # A process outside the command burns CPU and ends while it runs (the command waits until
    # it is a zombie, its record written): it must not be counted. Twice the command's burn,
    # so that the bounds below tell the two apart with room for the records' truncation.
    outside = subprocess.Popen([sys.executable, "-c", _BURN.format(s=0.6)])
    wait = (
        f"while open('/proc/{outside.pid}/stat').read().split()[2] != 'Z':\n    time.sleep(0.01)\n"
    )
    burn = _BURN.format(s=0.3)
    root = f"import subprocess, sys, time\n{wait}subprocess.run([sys.executable, '-c', {burn!r}])"
    try:
        code, rows = process_cpu.measure([sys.executable, "-c", root])
    except SystemExit as e:
        if "another process_cpu measurement" not in str(e):
            raise
        pytest.skip(str(e))  # one measured from outside this suite: leave its records alone
    finally:
        outside.wait(timeout=slack.guard(60))
    assert code == 0
    assert list(rows) == ["other Python"] and rows["other Python"]["processes"] == 2, rows
    # A program of several lines is logged whole, on one line: its form reads past the first.
    forms = [form for form, _ in rows["other Python"]["commands"]]
    assert any(form.startswith("-c import time t = time.process_time()") for form in forms), forms
    # A record's user and system times are each truncated to the 10 ms ticks of acct(2).
    assert 0.27 <= rows["other Python"]["cpu_s"] < 0.6, rows
    with pytest.raises(SystemExit, match="already on"):
        os.environ[process_cpu._NESTED] = "1"
        try:
            process_cpu.measure([sys.executable, "-c", "pass"])
        finally:
            del os.environ[process_cpu._NESTED]


def test_a_second_measurement_is_refused_while_one_runs(tmp_path, monkeypatch):
    # acct(2) has one file for the machine: a second measurement would take the first one's
    # records and switch accounting off under it. Refused before it touches the accounting.
    monkeypatch.delenv(process_cpu._NESTED, raising=False)  # this suite itself measured or not
    lock = tmp_path / "lock"
    refused = pytest.raises(
        SystemExit, match=f"another process_cpu measurement.*{re.escape(str(lock))}"
    )
    with process_cpu._only_measurement(lock), refused:
        process_cpu.measure([sys.executable, "-c", "pass"], lock=lock)
    with process_cpu._only_measurement(lock):  # free again once the first has ended
        pass


def test_a_filesystem_too_full_for_accounting_is_refused(tmp_path, monkeypatch):
    # The kernel suspends accounting below the first figure of /proc/sys/kernel/acct (% free):
    # the tally would be empty. A filesystem 3 % free against a 4 % limit is refused.
    limits = tmp_path / "acct"
    limits.write_text("4\t2\t30\n")
    full = os.statvfs_result((4096, 4096, 1000, 30, 30, 100, 50, 50, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    with pytest.raises(SystemExit, match=r"has 3\.0 % free.*only above 4 %"):
        process_cpu.check_room(str(tmp_path), str(limits))
    roomy = os.statvfs_result((4096, 4096, 1000, 500, 500, 100, 50, 50, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: roomy)
    process_cpu.check_room(str(tmp_path), str(limits))  # 50 % free: measured
