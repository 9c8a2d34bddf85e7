"""``python -m fastddp.netns``'s command line: its own options end where the script begins."""

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
