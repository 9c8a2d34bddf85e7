"""Faults: a worker killed mid-run (restart and resume), a worker stopped (named, not a hang),
a restart with nothing left to run."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fastddp.testing import slack
from fastddp.testing.ports import free_port

from .._dist import run_ranks
from .._references import _resume_rank, resume_example, resume_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.launcher]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "resume.py"


def _launch(args, extra_env=None, launch_args=()):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    cmd = [sys.executable, "-m", "fastddp.launch", "--standalone", "--nproc-per-node", "2"]
    return subprocess.Popen(
        [*cmd, *launch_args, str(EXAMPLE), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_step(progress: Path, rank: int, step: int, proc, timeout=120.0):
    """Return rank's pid once it has finished `step` steps."""
    path = progress.with_suffix(f".rank{rank}")
    deadline = time.monotonic() + slack.guard(timeout)
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            pid, done = path.read_text().split()
            if int(done) >= step:
                return int(pid)
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"rank {rank} did not reach step {step}")


def _finish(proc, timeout):
    timeout = slack.guard(timeout)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the job did not end within {timeout} s:\n{out}") from None
    return proc.returncode, out


@pytest.mark.faults
def test_killed_worker_restarts_and_resumes_to_the_same_parameters(tmp_path):
    steps = ["--steps", "24", "--ckpt-every", "5"]
    # The uninterrupted run, on pooled ranks (tests/_references.py).
    resume_example([*steps, "--ckpt-dir", str(tmp_path / "a"), "--out", str(tmp_path / "a.pt")], 2)
    # The same run, with rank 1 killed (SIGKILL) between two checkpoints.
    progress = tmp_path / "progress"
    args = [*steps, "--ckpt-dir", str(tmp_path / "b"), "--out", str(tmp_path / "b.pt")]
    job = _launch(
        [*args, "--step-seconds", "0.15", "--progress", str(progress)],
        launch_args=["--max-restarts", "1"],
    )
    pid = _wait_for_step(progress, 1, 12, job)
    os.kill(pid, signal.SIGKILL)
    rc, out = _finish(job, 240)
    assert rc == 0, out
    assert "attempt 0, starting from scratch" in out
    # The restarted workers resumed from the last complete checkpoint, not from zero.
    # (Found in the text rather than per line: two ranks' lines may interleave.)
    resumed = re.findall(r"rank \d: attempt 1, starting from step (\d+) ", out)
    assert len(resumed) == 2, out
    assert set(resumed) <= {"10", "15"}, resumed
    assert "rank 0: done, 24 steps" in out
    want = torch.load(tmp_path / "a.pt")
    got = torch.load(tmp_path / "b.pt")
    for w, g in zip(want, got):
        assert torch.equal(w, g), "the resumed run ended with other parameters"


@pytest.mark.faults
def test_stopped_worker_is_named_instead_of_hanging(tmp_path):
    progress = tmp_path / "progress"
    job = _launch(
        ["--steps", "100000", "--ckpt-every", "1000000", "--ckpt-dir", str(tmp_path / "c"),
         "--step-seconds", "0.05", "--progress", str(progress)],
        # 10 s, as in the multi-node fault tests: a heartbeat thread starved by a busy 2-core
        # machine missed 6 s there, and a 5 s timeout named live ranks before the fault.
        extra_env={"FASTDDP_PEER_TIMEOUT": "10"},
    )  # fmt: skip
    pid = _wait_for_step(progress, 1, 3, job)
    stopped_at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    lines, named, named_at = [], threading.Event(), []

    def read() -> None:
        for line in job.stdout:
            lines.append(line)
            if "has not answered for" in line and not named.is_set():
                named_at.append(time.monotonic())
                named.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        named.wait(timeout=slack.guard(100))
    finally:
        # Once named, the stopped rank is killed: torchrun's SIGTERM would wait out its 30 s
        # shutdown timeout on it (that teardown is torchrun's, not what is tested here).
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        rc = job.wait(timeout=slack.guard(60))
    except subprocess.TimeoutExpired:
        job.kill()
        raise AssertionError("the job did not end after its stopped rank was named") from None
    reader.join(timeout=slack.guard(10))
    out = "".join(lines)
    assert named.is_set(), out
    assert rc != 0, out
    assert f"rank 1 (node 0, 127.0.0.1, pid {pid} on " in out, out
    assert "has not answered for" in out and "peer timeout 10 s" in out
    assert "exits with status 3" in out
    # Named within the timeout plus a couple of heartbeat intervals, not after minutes (the
    # job's teardown after it is torchrun's, and not counted).
    assert named_at[0] - stopped_at < slack.guard(60), named_at[0] - stopped_at


_FINISHING = """
import os, sys, time
import torch.distributed as dist
import fastddp
fastddp.init_distributed(peer_timeout=2)
case, rank = sys.argv[1], dist.get_rank()
working = 1 if case == "rank 0 exited" else 0
if case == "destroyed":  # both destroy the group; rank 1 then vanishes without a word
    dist.destroy_process_group()
    if rank == 1:
        os._exit(0)
elif rank != working:  # the other ends as a script does, its group still there
    sys.exit(0)
time.sleep(float(sys.argv[2]))  # still at work (a final checkpoint, an evaluation)
print(f"rank {rank} finished its work", flush=True)
fastddp.shutdown_distributed()
from fastddp.distributed import exit_after_shutdown
exit_after_shutdown()
"""


@pytest.mark.parametrize("case", ["destroyed", "exited", "rank 0 exited"])
def test_a_rank_at_work_after_the_others_ended_is_not_stopped(case):
    # Ranks that ended without shutdown_distributed(): after destroy_process_group() no
    # collective waits for anyone; one that exits says it finished. The rank at work for
    # three peer timeouts after must not be named lost and ended, also where rank 0 ended and
    # the store (here in its process) went with it.
    procs = _hand_started(["-c", _FINISHING, case, str(slack.guard(6))])
    (rc0, out0), (rc1, out1) = (_finish(p, 120) for p in procs)
    working, out = (1, out1) if case == "rank 0 exited" else (0, out0)
    assert rc0 == 0 and rc1 == 0, (out0, out1)
    assert f"rank {working} finished its work" in out, out
    assert "has not answered" not in out and "store" not in out, out


_RAISING = """
import sys, time
import torch.distributed as dist
import fastddp
if sys.argv[2] == "session":  # the exception leaves the session, which shuts the group down
    with fastddp.distributed_session(peer_timeout=60):
        if dist.get_rank() == 1:
            raise ValueError("a bad batch on rank 1")
        time.sleep(float(sys.argv[1]))
else:
    fastddp.init_distributed(peer_timeout=60)
    if dist.get_rank() == 1:
        raise ValueError("a bad batch on rank 1")
    time.sleep(float(sys.argv[1]))  # waiting in a collective rank 1 never joins (NCCL's wait)
print("rank 0 waited it out", flush=True)
"""


@pytest.mark.faults
@pytest.mark.parametrize("how", ["init", "session"])
def test_a_rank_that_ends_with_an_exception_is_named_at_once(how):
    # Its process exits, which Gloo's sockets tell at once but NCCL's collectives do not: the
    # others waited until their timeout, since the rank said at exit that it had finished
    # (in a session, at the shutdown the exception passed through).
    procs = _hand_started(["-c", _RAISING, str(slack.guard(60)), how])
    (rc1, out1), (rc0, out0) = (_finish(p, 120) for p in procs[::-1])
    assert rc1 == 1 and "ValueError: a bad batch on rank 1" in out1, out1
    assert rc0 == 3 and "rank 0 waited it out" not in out0, out0
    assert "fastddp: rank 1 (127.0.0.1, pid " in out0, out0
    assert "ended with an uncaught exception (ValueError: a bad batch on rank 1)" in out0, out0


_TOLD = """
import sys, time
import torch.distributed as dist
import fastddp
fastddp.init_distributed(peer_timeout=20)
print("ready", flush=True)
if dist.get_rank() == 1:
    sys.stdin.readline()
    raise ValueError("a bad batch on rank 1")
time.sleep(float(sys.argv[1]))  # waiting in a collective rank 1 never joins (NCCL's wait)
print("waited it out", flush=True)
"""


@pytest.mark.faults
def test_rank_0_that_serves_the_store_stays_until_the_others_read_the_failure():
    # Rank 0's process serves the store, and its exit takes it away: a rank that had not yet
    # read rank 1's failure there (here: stopped meanwhile) then blamed rank 0 and the store.
    procs = _hand_started(["-c", _TOLD, str(slack.guard(120))], world=3)
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        os.kill(procs[2].pid, signal.SIGSTOP)
        procs[1].stdin.write("go\n")
        procs[1].stdin.flush()
        procs[1].wait(timeout=slack.guard(30))
        # Rank 0 names rank 1 within one heartbeat (5 s), then waits for rank 2's word.
        time.sleep(7)
        os.kill(procs[2].pid, signal.SIGCONT)
        (rc0, out0), (rc2, out2) = _finish(procs[0], 60), _finish(procs[2], 60)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.communicate()
    named = "ended with an uncaught exception (ValueError: a bad batch on rank 1)"
    for rc, out in ((rc0, out0), (rc2, out2)):
        assert rc == 3 and named in out and "has not answered" not in out, out


_WAITING = """
import sys, time
import fastddp
fastddp.init_distributed(peer_timeout=2)
print("ready", flush=True)
time.sleep(float(sys.argv[1]))
"""


@pytest.mark.faults
def test_a_stopped_rank_0_that_serves_the_store_is_named():
    # Started by hand (as by srun or mpirun), rank 0's process serves the job's store: when it
    # is stopped, the others hear from neither it nor the store, and must say it is rank 0.
    procs = _hand_started(["-c", _WAITING, str(slack.guard(120))])
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        os.kill(procs[0].pid, signal.SIGSTOP)
        rc, out = _finish(procs[1], 60)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.communicate()
    assert rc == 3, out
    assert "(in rank 0's process) has not answered rank 1" in out, out
    assert "rank 0 is stopped, hung outside Python or dead" in out, out


_SUSPENDED = """
import sys, time
import torch.distributed as dist
import fastddp
fastddp.init_distributed(peer_timeout=2)
print("ready", flush=True)
sys.stdin.readline()  # the whole job is stopped and resumed meanwhile
time.sleep(4)  # two peer timeouts after the resume, for a false alarm to come
dist.barrier()
print(f"rank {dist.get_rank()} carried on", flush=True)
fastddp.shutdown_distributed()
"""


@pytest.mark.faults
def test_a_job_stopped_and_resumed_whole_carries_on():
    # A suspended job (Slurm's scontrol suspend, Ctrl-Z of an mpirun): every rank is stopped
    # for three peer timeouts, then resumed. Each watchdog's heartbeats from the others are
    # that old, but so is its own wait: no rank is lost, and the job goes on.
    procs = _hand_started(["-c", _SUSPENDED])
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
        time.sleep(6)
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [_finish(p, 60) for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.communicate()
    for rank, (rc, out) in enumerate(results):
        assert rc == 0 and f"rank {rank} carried on" in out, out
        assert "has not answered" not in out, out


_JOINING = """
import datetime, sys, time
import fastddp
try:
    fastddp.init_distributed(timeout=datetime.timedelta(seconds=float(sys.argv[1])))
except fastddp.ClusterError as e:
    print(f"refused: {e}", flush=True)
    raise SystemExit(3)
"""


@pytest.mark.faults
def test_a_rank_joining_a_stopped_rank_0_is_told_within_its_timeout():
    # Rank 0's process serves the store and is stopped (a debugger, Ctrl-Z) before rank 1
    # joins: the kernel takes rank 1's connection, and torch's client waited for an answer for
    # good, whatever init_distributed's timeout said.
    port = free_port()
    (first,) = _hand_started(["-c", _JOINING, "120"], ranks=[0], port=port)
    try:
        deadline = time.monotonic() + slack.guard(60)
        while not _listening(port):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        os.kill(first.pid, signal.SIGSTOP)
        began = time.monotonic()
        (second,) = _hand_started(["-c", _JOINING, "5"], ranks=[1], port=port)
        rc, out = _finish(second, 120)
        took = time.monotonic() - began
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first.pid, signal.SIGKILL)
        first.communicate()
    assert rc == 3, out
    assert f"the job's store at 127.0.0.1:{port} took this rank's connection but did not" in out
    assert "is stopped or hung, or another program holds MASTER_PORT" in out, out
    assert took < slack.guard(60), took  # not forever


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
        return True
    return False


def _hand_started(argv, world=2, ranks=None, port=None):
    """``world`` ranks from hand-set variables, each running ``python argv...`` (``ranks``: the
    ranks to start, default all), meeting at ``port`` (default a free one)."""
    port = free_port() if port is None else port
    procs = []
    for rank in range(world) if ranks is None else ranks:
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        for k in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK", "FASTDDP_PEER_TIMEOUT"):
            env.pop(k, None)
        procs.append(subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    return procs


_FINITE = "must be 0 (off) or a positive, finite"


@pytest.mark.parametrize(
    "value, message",
    [("abc", "is not a number of seconds"), ("-1", _FINITE), ("nan", _FINITE)],
)
def test_bad_peer_timeout_is_refused(value, message, tmp_path):
    # By the launcher, on its configuration's exit status, before any worker has started.
    job = _launch(["--steps", "1", "--ckpt-dir", str(tmp_path)],
                  extra_env={"FASTDDP_PEER_TIMEOUT": value})  # fmt: skip
    rc, out = _finish(job, 120)
    assert rc == 2 and f"error: FASTDDP_PEER_TIMEOUT='{value}' {message}" in out, out
    assert "workers failed" not in out and not list(tmp_path.iterdir()), out


def test_a_job_restarted_after_its_last_checkpoint_ends_with_its_parameters(tmp_path):
    # A node that joins as an elastic job ends restarts it from its final checkpoint: with no
    # step left, the job must still end and save, not fail.
    argv = ["--steps", "10", "--ckpt-every", "5", "--ckpt-dir", str(tmp_path / "ckpt")]
    resume_example([*argv, "--out", str(tmp_path / "first.pt")], 2)
    said = resume_example([*argv, "--out", str(tmp_path / "again.pt")], 2)
    assert "starting from step 10" in said and "done, 10 steps, none left to run" in said, said
    first, again = (torch.load(tmp_path / f"{name}.pt") for name in ("first", "again"))
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_every_rank_resumes_from_the_checkpoint_rank_0_sees(tmp_path):
    # A shared filesystem's cache can show one node an older listing of the checkpoints. Here
    # rank 1's view of the folder lacks step-10: ranks resuming from different steps would run
    # different numbers of steps and wait for one another, so the example resumes every rank
    # from rank 0's choice.
    shared = tmp_path / "ckpt"
    resume_example(["--steps", "10", "--ckpt-every", "5", "--ckpt-dir", str(shared)], 2)
    (tmp_path / "view0").symlink_to(shared)
    (tmp_path / "view1").mkdir()
    (tmp_path / "view1" / "step-5").symlink_to(shared / "step-5")
    argv = ["--steps", "10", "--ckpt-every", "5", "--ckpt-dir", str(tmp_path / "view{rank}")]
    outs = resume_ranks(argv, 2)
    for rank, out in enumerate(outs):
        assert f"rank {rank}: attempt 0, starting from step 10 ({tmp_path / 'view0'}" in out, out


def test_a_fresh_start_in_a_folder_of_checkpoints_replaces_them(tmp_path):
    # --resume none in a folder an earlier run filled: its checkpoints go first. The earlier
    # run's step-10, past this run's last, was the latest for a later --resume latest, which
    # then had no step left to run.
    argv = ["--ckpt-every", "5", "--ckpt-dir", str(tmp_path)]
    resume_example([*argv, "--steps", "10", "--seed", "1"], 2)
    old = (tmp_path / "step-5" / "train.pt").read_bytes()
    out = resume_example([*argv, "--steps", "5", "--resume", "none"], 2)
    assert "starting from scratch" in out and "removed 2 earlier checkpoint(s)" in out, out
    assert (tmp_path / "step-5" / "train.pt").read_bytes() != old
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step-5"]
    # Resumed with another --mode: named by the script on every rank, not at the first
    # reduction by the hook's dtypes.
    for said in run_ranks(_refused, 2, [*argv, "--steps", "10", "--mode", "int8-ef"]):
        assert "was saved with --mode bf16-acc-ef; resume with the same --mode" in said, said
    # ... with another --seed (other batches), or fewer --steps than the checkpoint's: refused
    # alike, where the run went on with other data, or said it ran 3 steps and saved 5.
    for said in run_ranks(_refused, 2, [*argv, "--steps", "10", "--seed", "3"]):
        assert "was saved with --seed 0; resume with the same --seed (here 3)" in said, said
    for said in run_ranks(_refused, 2, [*argv, "--steps", "3"]):
        assert "step-5 is at step 5, past --steps 3; give --steps 5 or more" in said, said


def _refused(rank, world_size, argv):
    with pytest.raises(SystemExit) as exit_:
        _resume_rank(rank, world_size, argv)
    return str(exit_.value)


def test_plain_script_with_hand_set_variables_trains():
    # No launcher, no DDP: the variables set by hand, fastddp.all_reduce for the gradients.
    procs = _hand_started([str(ROOT / "examples" / "plain_script.py"), "--steps", "40"])
    outs = [_finish(p, 120) for p in procs]
    for rank, (rc, out) in enumerate(outs):
        assert rc == 0, out
        assert f"rank {rank}/2 (env): final loss" in out, out
        assert "weights identical on all ranks: True" in out
    losses = [float(line.split()[3]) for line in outs[0][1].splitlines() if line.startswith("step")]
    assert losses[-1] < losses[0] / 2, losses  # it trains
