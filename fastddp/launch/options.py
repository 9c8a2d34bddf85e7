"""The launcher's options checked before anything runs.

torchrun takes some bad options with a traceback from deep inside (``--nnodes 2:1`` fails an
assert, ``--rdzv-endpoint host:abc`` an ``int()``), and some without a word (``--nnodes 0``).
:func:`check` refuses each with what to give instead, on every node alike, before the
preflight or torchrun sees them. :func:`given_on_command_line` tells the options a command line
sets, and :func:`normalise` makes torchrun's own rewrites.
"""

import argparse
import copy
import math
import os
import sys
import uuid
from typing import Optional

from torch.distributed import run as torchrun

from fastddp.launch.net import LaunchError

__all__ = [
    "DEFAULT_RDZV_PORT",
    "PREFLIGHT_TIMEOUT_VAR",
    "check",
    "endpoint",
    "given_on_command_line",
    "join_endpoint",
    "most_nodes",
    "node_span",
    "normalise",
    "script_apart",
    "torchruns_first",
]

DEFAULT_RDZV_PORT = 29400  # torchrun's, for an endpoint without a port
PREFLIGHT_TIMEOUT_VAR = "FASTDDP_PREFLIGHT_TIMEOUT"
_FORM = "write it as HOST[:PORT], an IPv6 address in brackets ([fd00::1]:29400)"


def _port(text: str, what: str) -> int:
    if not text.isdigit() or not 0 <= int(text) < 65536:  # 0: a free port, on one node
        raise LaunchError(f"{what}: the port {text!r} must be a number from 0 to 65535")
    return int(text)


def endpoint(value: str, default: Optional[int] = DEFAULT_RDZV_PORT) -> tuple[str, Optional[int]]:
    """``--rdzv-endpoint``'s host (an IPv6 address kept in brackets) and port (``default``
    where it names none)."""
    what = f"--rdzv-endpoint {value}"
    if value.startswith("["):
        host, closed, rest = value[1:].partition("]")
        if not closed or not host or (rest and not rest.startswith(":")):
            raise LaunchError(f"{what}: {_FORM}")
        return f"[{host}]", _port(rest[1:], what) if rest else default
    if value.count(":") > 1:
        raise LaunchError(f"{what}: an IPv6 address goes in brackets; {_FORM}")
    host, colon, port = value.partition(":")
    if not host:
        raise LaunchError(f"{what}: no host; {_FORM}")
    return host, _port(port, what) if colon else default


def join_endpoint(host: str, port: Optional[str] = None) -> str:
    """An endpoint of ``host`` (an IPv6 address put in brackets) and ``port``, if any."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return host if port is None else f"{host}:{port}"


def most_nodes(nnodes) -> int:
    """The most nodes ``--nnodes`` admits; 2 for one that does not parse (:func:`check` refuses
    it later, with the fix), so that nothing is dropped as if it were one node."""
    span = node_span(nnodes)
    return 2 if span is None else span[1]


def node_span(nnodes) -> Optional[tuple[int, int]]:
    """``--nnodes``' fewest and most nodes, as torchrun reads them; None for one that does not
    parse (:func:`check` refuses it, with the fix)."""
    try:
        return torchrun.parse_min_max_nnodes(str(nnodes))
    except (ValueError, RuntimeError, AssertionError):  # torch's, by the form of the error
        return None


def check(args: argparse.Namespace) -> None:
    """Refuse the options torchrun would fail on obscurely; fill in ``preflight_timeout``.

    Raises:
        LaunchError: an option cannot work; the message names it and what to give.
    """
    nnodes = str(args.nnodes)
    parts = nnodes.split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts) or int(parts[0]) < 1:
        raise LaunchError(f"--nnodes {nnodes}: give N or MIN:MAX, whole numbers of at least 1")
    if int(parts[0]) > int(parts[-1]):
        raise LaunchError(f"--nnodes {nnodes}: MIN is above MAX; give MIN:MAX with MIN <= MAX")
    nproc = str(args.nproc_per_node)
    try:
        count = torchrun.determine_local_world_size(nproc)
    except ValueError as e:
        others = [k for k in ("auto", "cpu", "gpu") if k != nproc]  # (not the one that failed)
        raise LaunchError(
            f"--nproc-per-node {nproc}: {str(e).rstrip('.')}; give a number of processes, or "
            f"{', '.join(others[:-1])} or {others[-1]}"
        ) from None
    if count < 1:
        raise LaunchError(f"--nproc-per-node {nproc}: give at least 1 process per node")
    if args.rdzv_endpoint:
        _, port = endpoint(args.rdzv_endpoint, default=None)
        if port == 0 and int(parts[-1]) > 1:  # each node would pick a port of its own
            raise LaunchError(
                f"--rdzv-endpoint {args.rdzv_endpoint}: port 0 picks a free port on this node, "
                f"which the other nodes of --nnodes {nnodes} cannot know; give a fixed port"
            )
        if args.rdzv_backend == "static" and port is None:  # torch: "Port is absent"
            raise LaunchError(
                f"--rdzv-endpoint {args.rdzv_endpoint}: the static rendezvous takes no default "
                "port; give HOST:PORT (or --master-addr and --master-port)"
            )
    if args.max_restarts < 0:  # torchrun: an AssertionError's traceback
        raise LaunchError(f"--max-restarts {args.max_restarts}: give 0 or more restarts")
    _check_backend(args.rdzv_backend)
    port = args.master_port
    if port is not None and not 1 <= int(port) <= 65535:  # (torchrun's parser made it an int)
        raise LaunchError(f"--master-port {port}: give a port from 1 to 65535")
    if args.standalone and int(parts[-1]) > 1:
        raise LaunchError(
            f"--standalone runs one node, and --nnodes {nnodes} asks for more: the others "
            "would wait for a rendezvous that only this node can reach. Drop --standalone and "
            "give every node --rdzv-endpoint (or --master-addr and --node-rank)"
        )
    _check_script(args)
    if args.preflight_timeout is None:
        raw = os.environ.get(PREFLIGHT_TIMEOUT_VAR, "20")
        try:
            args.preflight_timeout = float(raw)
        except ValueError:
            raise LaunchError(
                f"{PREFLIGHT_TIMEOUT_VAR}={raw!r} is not a number of seconds; set it right or "
                "unset it (20 s)"
            ) from None
    if not 0 < args.preflight_timeout < math.inf:  # (inf: a probe that never ends)
        raise LaunchError(
            f"the preflight timeout must be positive, finite seconds, got {args.preflight_timeout} "
            f"(--preflight-timeout or {PREFLIGHT_TIMEOUT_VAR})"
        )


def _check_backend(backend: str) -> None:
    """A rendezvous backend torch does not know: refused now, not after the network checks
    with a traceback from the agent."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    known = getattr(registry, "_registry", None)  # its own, plus entry points' (torchrun.handlers)
    if known is not None and backend not in known:
        raise LaunchError(
            f"--rdzv-backend {backend}: not a rendezvous backend torch knows; give one of "
            f"{', '.join(sorted(known))} (c10d for several nodes, or static with --master-addr)"
        )


def _check_script(args: argparse.Namespace) -> None:
    """A script that is not there: refused before any worker starts (each would fail alone,
    and ``--max-restarts`` would start them again); a dry run says so and goes on. What Python
    runs is taken: a file (a zip archive too), or a directory that holds ``__main__.py``."""
    script = args.training_script
    runnable = os.path.isfile(script) or os.path.isfile(os.path.join(script, "__main__.py"))
    if args.module or args.no_python or runnable:
        return
    what = "is a directory without __main__.py" if os.path.isdir(script) else "does not exist"
    message = (
        f"the training script {script} {what} (in {os.getcwd()}); give the path of a Python "
        "file, -m for a module, or --no-python for a program"
    )
    if not args.dry_run:
        raise LaunchError(message)
    print(f"fastddp.launch: warning: {message}", file=sys.stderr, flush=True)


class _TorchrunsFirst(argparse.ArgumentParser):
    """torchrun's parser, where an abbreviation torchrun takes keeps its meaning: ``--no-p`` is
    its ``--no-python``, and would be ambiguous with ``--no-preflight`` (of ``ours``) here."""

    ours: frozenset = frozenset()

    def _get_option_tuples(self, option_string):
        found = super()._get_option_tuples(option_string)
        theirs = [match for match in found if match[0] not in self.ours]
        return theirs if len(found) > 1 and theirs else found


def torchruns_first(parser: argparse.ArgumentParser, ours) -> None:
    """Read an abbreviation that matches torchrun's options and those of the group ``ours`` as
    torchrun's (its parser's class changed in place: copies of it keep the rule)."""
    parser.__class__ = _TorchrunsFirst
    parser.ours = frozenset(ours._group_actions)


class _Unparsed(Exception):
    pass


def _unparsed(message: str):
    raise _Unparsed(message)


def script_apart(
    parser: argparse.ArgumentParser, argv: list[str]
) -> tuple[list[str], Optional[list[str]]]:
    """``argv`` up to the training script, and the script's own arguments (None where they
    cannot be told apart: then ``argv`` whole).

    argparse takes every ``--x`` on the line for an abbreviation of a launcher option, the
    script's too: ``train.py --log`` (or ``-m fastddp.bench allreduce --nproc 7``) fails as
    torchrun's "ambiguous option". Read without abbreviations, the line splits at the script
    wherever the launcher's own options are written out; where one is abbreviated, it is left
    to the parser as torchrun's own is.
    """
    strict = copy.copy(parser)
    strict.allow_abbrev = False
    strict.error = _unparsed
    # A -h of the launcher's own is left to the parse that follows, to print the help once;
    # one among the script's arguments is the script's.
    strict.print_help = lambda file=None: None
    strict.exit = lambda status=0, message=None: _unparsed("help")
    try:
        tail = list(strict.parse_args(argv).training_script_args)
    except _Unparsed:
        return argv, None
    if tail and argv[-len(tail) :] != tail:  # (a "--" argparse took away)
        return argv, None
    return argv[: len(argv) - len(tail)], tail


def given_on_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Return the option names (dests) that ``argv`` sets explicitly."""
    # argparse fills in a default only where the namespace lacks the attribute, so whatever
    # still holds the marker afterwards was not on the command line.
    unset = object()
    ns = argparse.Namespace(**{action.dest: unset for action in parser._actions})
    parser.parse_args(argv, namespace=ns)
    return {dest for dest, value in vars(ns).items() if value is not unset}


def normalise(args: argparse.Namespace) -> argparse.Namespace:
    """Apply the same rewrites ``torch.distributed.run.run`` makes before launching."""
    args = argparse.Namespace(**vars(args))
    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    if args.standalone or (
        args.rdzv_backend == "static"
        and not args.rdzv_endpoint
        and args.master_port is None
        and max_nodes == 1
    ):
        # A run id of its own, as torchrun gives it: a given --rdzv-id names no other node here.
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    return args
