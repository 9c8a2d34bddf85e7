"""A pytest plugin: the tests that cost the most CPU time, listed at the end of a session.

    python -m pytest -p fastddp.testing.cpu_report [--cpu-report N]

On a small machine the suite is CPU-bound: a test that waits (on a timeout, a link, a peer)
costs little, whatever ``--durations`` says of its wall time, while a test that starts
launchers and workers costs their start-ups however briefly it runs. A test's CPU time here is
that of its own process and of the processes it started and waited for (``RUSAGE_CHILDREN``),
launched jobs and namespace nodes included; not that of the pooled ranks, which outlive it,
nor of a process reaped after it ends. ``tests/conftest.py`` loads it for every stream.
"""

import resource

import pytest


def _cpu_s() -> float:
    own, waited = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


def pytest_addoption(parser):
    parser.getgroup("terminal reporting").addoption(
        "--cpu-report", type=int, default=15, metavar="N",
        help="list the N tests that took the most CPU time, with what they waited for (0: none)",
    )  # fmt: skip


def pytest_configure(config):
    if config.getoption("cpu_report") > 0:
        config.pluginmanager.register(_Report(config.getoption("cpu_report")), "cpu_report")


class _Report:
    """One session's tests and their CPU times (a session of its own keeps its own, as
    pytest's ``pytester`` runs one inside another)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.spent: list[tuple[float, str]] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        start = _cpu_s()
        yield
        self.spent.append((_cpu_s() - start, item.nodeid))

    def pytest_terminal_summary(self, terminalreporter):
        if not self.spent:
            return
        total = sum(cpu for cpu, _ in self.spent)
        shown = min(self.count, len(self.spent))
        terminalreporter.write_sep(
            "=", f"costliest {shown} tests by CPU time (all {total:.0f} CPU s)"
        )
        for cpu, nodeid in sorted(self.spent, reverse=True)[:shown]:
            terminalreporter.write_line(f"{cpu:8.2f} CPU s  {nodeid}")
