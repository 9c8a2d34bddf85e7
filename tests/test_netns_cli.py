"""``python -m fastddp.netns``'s command line: its own options end where the script begins."""

import pytest

from fastddp import netns
from fastddp.launch.cli import build_parser


def test_the_flags_are_the_launcher_s():
    parser = build_parser()
    flags = {o for action in parser._actions if action.nargs == 0 for o in action.option_strings}
    assert flags == netns.LAUNCH_FLAGS


def test_the_script_s_own_options_stay_its_own():
    argv = ["--nodes", "2", "--max-restarts", "1", "--standalone", "train.py", "--nodes", "1"]
    assert netns.script_at(argv) == 5
    assert netns.script_at(["--rate=1gbit", "-m", "pkg.train", "--rate", "5"]) == 2
    assert netns.script_at(["--nodes", "2", "--", "--odd-name.py"]) == 3
    assert netns.script_at(["--nodes", "2"]) == 2  # no script: refused by main


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rate=-5mbit"], "--rate -5mbit: give a positive rate in bits per second"),
        (["--rate", "1gbps"], "(tc's 'bps' means bytes)"),
        (["--rate", "0mbit"], "--rate 0mbit: give a positive rate"),
        (["--rate", "1bit"], "--rate 1bit: give a positive rate in bits per second, at least 8bit"),
        (["--rate", "0.001kbit"], "--rate 0.001kbit: give a positive rate"),
        (["--rate", "1gbit "], "--rate 1gbit : give a positive rate"),
        (["--delay", "nan"], "--delay must be between 0 and 10000 (ms)"),
        (["--delay", "inf"], "--delay must be between 0 and 10000 (ms)"),
        (["--nnodes", "3"], "--nnodes is set by this tool for its nodes; use --nodes"),
        (["--rdzv-backend", "c10d"], "--rdzv-backend is set by this tool"),
    ],
)
def test_bad_settings_are_refused_before_any_namespace(args, message, capsys):
    with pytest.raises(SystemExit) as refused:
        netns.main([*args, "train.py"])
    assert refused.value.code == 2 and message in capsys.readouterr().err
