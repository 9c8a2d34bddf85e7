"""``python -m fastddp.launch``'s options that torchrun would take with a traceback (or take in
silence) are refused with the fix, before anything runs (``fastddp.launch.options``)."""

import importlib
import re
import socket

import pytest
import torch

from fastddp.launch import cli, options
from fastddp.launch.net import LaunchError

C10D = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "abc"], "--nnodes abc: give N or MIN:MAX, whole numbers of at least 1"),
        (["--nnodes", "0"], "--nnodes 0: give N or MIN:MAX, whole numbers of at least 1"),
        (["--nnodes", "1:2:3"], "--nnodes 1:2:3: give N or MIN:MAX"),
        (["--nnodes", "2:1"], "--nnodes 2:1: MIN is above MAX; give MIN:MAX with MIN <= MAX"),
        (["--nproc-per-node", "0"], "--nproc-per-node 0: give at least 1 process per node"),
        (["--nproc-per-node", "-2"], "--nproc-per-node -2: give at least 1 process per node"),
        (["--nproc-per-node", "lots"], "--nproc-per-node lots: Unsupported nproc_per_node value"),
        pytest.param(
            ["--nproc-per-node", "gpu"],
            "--nproc-per-node gpu: Cuda is not available; give a number of processes, or auto or "
            "cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there"),
        ),
        ([*C10D, "host1:abc"], "--rdzv-endpoint host1:abc: the port 'abc' must be a number"),
        ([*C10D, "host1:70000"], "host1:70000: the port '70000' must be a number from 0 to 65535"),
        ([*C10D, "::1"], "--rdzv-endpoint ::1: an IPv6 address goes in brackets"),
        ([*C10D, "[::1"], "--rdzv-endpoint [::1: write it as HOST[:PORT]"),
        ([*C10D, ":29400"], "--rdzv-endpoint :29400: no host"),
        ([*C10D, "host1:0"], "port 0 picks a free port on this node, which the other nodes"),
        # torch's static rendezvous has no default port: it failed with a traceback.
        (
            ["--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1", "--nnodes", "1"],
            "the static rendezvous takes no default port; give HOST:PORT",
        ),
        (["--preflight-timeout", "0"], "the preflight timeout must be positive, finite seconds"),
        # (inf: a probe of an unreachable master that never ended)
        (["--preflight-timeout", "inf"], "must be positive, finite seconds, got inf"),
        (["--master-port", "70000"], "--master-port 70000: give a port from 1 to 65535"),
        (["--master-port", "-5"], "--master-port -5: give a port from 1 to 65535"),
        (["--standalone", "--nnodes", "2"], "--standalone runs one node, and --nnodes 2 asks for"),
    ],
)
def test_a_bad_option_is_refused_with_the_fix(args, message, capsys, monkeypatch):
    monkeypatch.delenv(options.PREFLIGHT_TIMEOUT_VAR, raising=False)
    assert cli.main(["--dry-run", "--cluster", "none", *args, "train.py"]) == 2
    err = capsys.readouterr().err
    assert "fastddp.launch: error: " in err and message in err, err


def test_a_bad_preflight_timeout_variable_is_refused_and_help_still_works(capsys, monkeypatch):
    monkeypatch.setenv(options.PREFLIGHT_TIMEOUT_VAR, "abc")
    cli.build_parser()  # --help builds it: the variable is read after parsing
    assert cli.main(["--dry-run", "--cluster", "none", "--standalone", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "FASTDDP_PREFLIGHT_TIMEOUT='abc' is not a number of seconds" in err, err
    monkeypatch.setenv(options.PREFLIGHT_TIMEOUT_VAR, "inf")
    assert cli.main(["--dry-run", "--cluster", "none", "--standalone", "train.py"]) == 2
    assert "must be positive, finite seconds, got inf" in capsys.readouterr().err
    monkeypatch.setenv(options.PREFLIGHT_TIMEOUT_VAR, "7.5")
    args = cli.build_parser().parse_args(["--standalone", __file__])
    options.check(args)
    assert args.preflight_timeout == 7.5


@pytest.mark.parametrize(
    "value, want",
    [
        ("gpu07", ("gpu07", options.DEFAULT_RDZV_PORT)),
        ("gpu07:1234", ("gpu07", 1234)),
        ("10.0.0.1:0", ("10.0.0.1", 0)),
        ("[fd00::1]", ("[fd00::1]", options.DEFAULT_RDZV_PORT)),
        ("[fd00::1]:5", ("[fd00::1]", 5)),
    ],
)
def test_an_endpoint_is_read_as_torchrun_reads_it(value, want):
    assert options.endpoint(value) == want


@pytest.mark.parametrize("value", ["[fd00::1]x", "[]:5", "host:", "host:-1"])
def test_a_malformed_endpoint_is_refused(value):
    with pytest.raises(LaunchError, match=re.escape(f"--rdzv-endpoint {value}: ")):
        options.endpoint(value)


def _global_ipv6() -> list[str]:
    """This machine's IPv6 addresses of global scope (/proc/net/if_inet6: scope 00)."""
    import ipaddress
    from pathlib import Path

    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return []
    return [str(ipaddress.ip_address(int(f[0], 16))) for f in map(str.split, lines) if f[3] == "00"]


def test_an_ipv6_address_of_this_machine_is_local():
    # A c10d endpoint given as this node's IPv6 address makes this node the store's host; the
    # preflight must not probe it as another node's (and wait for a store nobody serves).
    from fastddp.launch import net

    assert net.is_local("127.0.0.1") and net.is_local("::1")
    assert not net.is_local("192.0.2.1") and not net.is_local("2001:db8::1")  # documentation nets
    mine = _global_ipv6()
    if not mine:
        pytest.skip("this machine has no global IPv6 address")
    assert all(net.is_local(a) for a in mine), mine


def test_an_ipv6_master_gets_the_interface_that_reaches_it():
    # The interface goes to GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME: an IPv6 master's was
    # looked up among IPv4 addresses only, and left unset.
    from fastddp.launch import net

    assert net.route_to("::1", 9) == ("::1", net.interfaces()["127.0.0.1"])
    for addr in _global_ipv6():
        local, iface = net.route_to(addr, 9)
        assert (
            local == addr
            and iface is not None
            and iface in dict((name, i) for i, name in socket.if_nameindex())
        ), (addr, iface)


def test_node_rank_zero_must_own_the_master_address():
    # The static rendezvous's store is served by node rank 0 at --master-addr: elsewhere
    # torch would retry it as a client for its whole timeout, and the other nodes wait.
    # (fastddp.launch.preflight is also the name of that module's function)
    preflight = importlib.import_module("fastddp.launch.preflight")
    preflight._check_owns_master("localhost", "127.0.0.1")
    with pytest.raises(LaunchError, match=r"but 192.0.2.1 is not an address of this node"):
        preflight._check_owns_master("192.0.2.1", "192.0.2.1")


def test_a_gloo_interface_is_checked_before_the_workers_start():

    from fastddp.launch import net

    preflight = importlib.import_module("fastddp.launch.preflight")
    loop = net.interfaces()["127.0.0.1"]
    preflight._check_gloo_interfaces(loop, multi_node=False)
    other = [n for _, n in socket.if_nameindex() if n != loop]
    if other:
        preflight._check_gloo_interfaces(other[0], multi_node=True)
    with pytest.raises(LaunchError, match=r"GLOO_SOCKET_IFNAME=eth9x: no interface eth9x on"):
        preflight._check_gloo_interfaces("eth9x", multi_node=False)
    with pytest.raises(LaunchError, match=r"is the loopback interface, and the other nodes"):
        preflight._check_gloo_interfaces(loop, multi_node=True)


def test_a_refused_master_port_is_not_told_to_wait_longer():
    # A refused connection is waited for past --preflight-timeout already (node 0 may still be
    # starting): its error does not tell the user to raise that timeout.
    from fastddp.launch import net
    from fastddp.testing.ports import free_port

    port = free_port()  # nothing listens there
    with pytest.raises(LaunchError) as refused:
        net.probe("127.0.0.1", port, "127.0.0.1", "lo", 0.2, None, not_started=0.4)
    message = str(refused.value)
    assert f"cannot reach the master 127.0.0.1:{port} within 0 s" in message, message
    assert "connection refused" in message and "--preflight-timeout" not in message, message


def test_a_master_port_held_by_closed_connections_is_named_so():
    # A closed outgoing connection keeps its local port in TIME_WAIT for a minute, and no
    # listener can bind it then: the error says so, and where to take a port instead, rather
    # than send the user looking for a process that listens there.

    from fastddp.launch import net
    from fastddp.testing.ports import port_in_time_wait

    port = port_in_time_wait()
    with pytest.raises(net.PortTaken) as held:
        net.check_port_free("127.0.0.1", port)
    low, high = net.ephemeral_range()
    message = str(held.value)
    assert held.value.listened is False, message
    assert "No process listens on it: connections of this machine hold it" in message, message
    assert "TIME_WAIT" in message and f"ephemeral range {low}-{high}" in message, message
    assert f"Choose a port below {low} with --master-port" in message, message
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert net.port_states(port) == {"LISTEN": 1}
        with pytest.raises(net.PortTaken) as listened:
            net.check_port_free("127.0.0.1", port)
    assert listened.value.listened is True
    assert "Another job or a leftover process holds it" in str(listened.value)


class _Impostor:
    """A program that holds a port and is not a store: it keeps connections open in silence,
    answers them with ``reply``, or closes them."""

    def __init__(self, reply=None, close=False):
        import threading

        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.held = []

        def serve():
            while True:
                try:
                    conn, _ = self.server.accept()
                except OSError:
                    return
                if reply is not None:
                    conn.recv(64)
                    conn.sendall(reply)
                if close:
                    conn.close()
                else:
                    self.held.append(conn)

        threading.Thread(target=serve, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.close()
        for conn in self.held:
            conn.close()


@pytest.mark.parametrize("libuv", [True, False])
def test_a_store_passes_the_store_check(libuv):
    from datetime import timedelta

    import torch.distributed as dist

    from fastddp.launch import net

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, use_libuv=libuv, timeout=timedelta(seconds=10)
    )
    store.set("k", "v")
    with socket.create_connection(("127.0.0.1", store.port), timeout=5) as conn:
        net.check_store(conn, "here")
    net.probe("127.0.0.1", store.port, "127.0.0.1", "lo", 5.0, store=True)
    assert store.get("k") == b"v"  # the query changed nothing


@pytest.mark.parametrize(
    "impostor, why",
    [
        (dict(), "it sent no answer to a store query within 1 s"),
        (
            dict(reply=b"HTTP/1.0 400 Bad Request\r\n\r\n"),
            "it answered a store query with b'HTTP/1.0'",
        ),
        (dict(close=True), "it closed the connection at a store query"),
    ],
    ids=["silent", "another-protocol", "closes"],
)
def test_a_program_that_is_not_a_store_fails_the_store_check(impostor, why, monkeypatch):
    # torchrun's agents would wait on a silent one for ever, and fail on the others only
    # after the rendezvous timeout: the preflight names it at once.
    from fastddp.launch import net

    monkeypatch.setattr(net, "STORE_ANSWER_S", 1.0)
    with _Impostor(**impostor) as other:
        with pytest.raises(LaunchError) as failed:
            net.probe("127.0.0.1", other.port, "127.0.0.1", "lo", 5.0, store=True)
        net.probe("127.0.0.1", other.port, "127.0.0.1", "lo", 5.0)  # not asked: it connects
    message = str(failed.value)
    assert (
        f"127.0.0.1:{other.port} accepts connections but is not a torch.distributed store: {why}"
        in message
    ), message
    assert "Another program holds that port, or the port is wrong" in message, message


def test_torchruns_abbreviations_keep_their_meaning():
    # "--no-p" is torchrun's --no-python; beside --no-preflight it was refused as ambiguous.
    parser = cli.build_parser()
    for given in ("--no-p", "--no-"):
        args = parser.parse_args([given, "prog"])
        assert args.no_python and not args.no_preflight, given
    assert parser.parse_args(["--no-pre", "train.py"]).no_preflight


def test_a_directory_python_runs_is_a_training_script(tmp_path, capsys, monkeypatch):
    # python runs a directory that holds __main__.py, as torchrun's workers do; one without
    # it is named as such.
    monkeypatch.delenv(options.PREFLIGHT_TIMEOUT_VAR, raising=False)
    package = tmp_path / "job"
    package.mkdir()
    line = ["--dry-run", "--cluster", "none", "--standalone", str(package)]
    assert cli.main(line) == 0
    assert f"{package} is a directory without __main__.py" in capsys.readouterr().err
    (package / "__main__.py").write_text("print('trained')\n")
    assert cli.main(line) == 0
    assert "warning" not in capsys.readouterr().err
