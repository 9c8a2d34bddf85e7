"""What a single-node launch exposes: with ``--standalone`` every listening socket of the job
(torch's store servers in the launcher, Gloo in the workers) is bound to loopback."""

import datetime
import ipaddress
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from fastddp.testing import slack

ROOT = Path(__file__).resolve().parents[2]
# Holds its group (and so its sockets) until the test has seen them, 300 s at most.
WORKER = """
import os, time, fastddp
print("worker sockets on", os.environ.get("GLOO_SOCKET_IFNAME"), flush=True)
with fastddp.distributed_session() as env:
    end = time.monotonic() + 300
    while not os.path.exists(os.environ["SEEN"]) and time.monotonic() < end:
        time.sleep(0.1)
"""


def _listening() -> dict[int, str]:
    """Listening TCP sockets of this network namespace: inode -> local address."""
    out = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            raw = bytes.fromhex(fields[1].split(":")[0])
            # The kernel prints each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            out[int(fields[9])] = str(ipaddress.ip_address(socket.inet_ntop(family, words)))
    return out


def _tree(root: int) -> list[int]:
    """``root`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _sockets_of(pids: list[int]) -> dict[str, list[str]]:
    """Local address of every listening socket the processes hold, by pid."""
    listening = _listening()
    out: dict[str, list[str]] = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in listening:
                    out.setdefault(str(pid), []).append(listening[inode])
    return out


def test_the_helper_sees_a_store_listening_everywhere():
    # A plain TCPStore server listens on every interface: the check below must notice that.
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=5), False)
    addresses = _sockets_of([os.getpid()])[str(os.getpid())]
    assert any(not ipaddress.ip_address(a).is_loopback for a in addresses), addresses
    del store


@pytest.mark.multiproc
@pytest.mark.launcher
def test_standalone_listens_on_loopback_only(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    seen_file = tmp_path / "seen"
    env["SEEN"] = str(seen_file)
    cmd = [sys.executable, "-m", "fastddp.launch", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.Popen(
        [*cmd, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # Two store servers in the launcher and a Gloo listener per worker.
        deadline, seen = time.monotonic() + slack.guard(60), {}
        while time.monotonic() < deadline and proc.poll() is None:
            seen = _sockets_of(_tree(proc.pid))
            if sum(map(len, seen.values())) >= 4:
                break
            time.sleep(0.2)
        seen_file.touch()  # the workers may end now
        out, _ = proc.communicate(timeout=slack.guard(60))
    finally:
        seen_file.touch()  # a failed check: the workers end by themselves
        proc.kill()
    assert proc.returncode == 0, out
    # Gloo's sockets on loopback by choice, not because this host's name resolves there.
    assert "GLOO_SOCKET_IFNAME=lo (one node: nothing listens beyond this machine)" in out, out
    assert out.count("worker sockets on lo") == 2, out
    assert sum(map(len, seen.values())) >= 4, (seen, out)
    for pid, addresses in seen.items():
        for address in addresses:
            assert ipaddress.ip_address(address).is_loopback, (pid, addresses)
