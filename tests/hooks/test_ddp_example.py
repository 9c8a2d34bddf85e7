"""``examples/ddp_train.py``, the script users copy, runs as documented and learns; so does
``examples/gpt_train.py`` with ``dtype="auto"``; every example refuses bad options first."""

import json
import re
import runpy
import statistics
import sys
from pathlib import Path

import pytest

from fastddp.testing import slack

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "ddp_train.py"

pytestmark = [pytest.mark.multiproc, pytest.mark.launcher]


def _train(*presets: str) -> dict[str, list[float]]:
    """Each preset's losses: the first as the example's docstring runs it, the others in one
    more launched job (``_ddp_presets.py``)."""
    launch = [sys.executable, "-m", "fastddp.launch", "--standalone", "--nproc-per-node", "2"]
    jobs = [[str(SCRIPT), "--preset", presets[0], "--steps", "41"]]
    jobs.append([str(Path(__file__).with_name("_ddp_presets.py")), "41", *presets[1:]])
    out = ""
    for job in jobs:
        res = slack.run([*launch, *job], cwd=ROOT, capture_output=True, text=True,
                        timeout=slack.guard(150))  # fmt: skip
        out += res.stdout + res.stderr
        assert res.returncode == 0, out
    losses = {}
    for preset in presets:  # each run's lines end with its summary
        run, _, out = out.partition(f"{preset}: 2 rank(s)")
        assert out.startswith(", final loss") and "weights identical on every rank" in out, run
        losses[preset] = [float(v) for v in re.findall(r"step +\d+ loss (\S+)", run)]
    return losses


def test_the_copied_script_learns_as_plain_ddp_does():
    runs = _train("bf16", "none", "int8-ef", "auto")
    plain = runs["none"]
    for preset in ("bf16", "int8-ef", "auto"):
        losses = runs[preset]
        assert len(losses) == len(plain) == 3, losses
        assert losses[-1] < losses[0] / 2, losses  # it learns
        # ... as well as plain DDP: same start, within 5 % at the end.
        assert losses[0] == plain[0] and abs(losses[-1] - plain[-1]) < 0.05 * plain[-1]


def test_the_gpt_example_plans_with_auto(tmp_path):
    out = tmp_path / "gpt.json"
    cmd = [sys.executable, "-m", "fastddp.launch", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "examples" / "gpt_train.py"), "--preset", "auto", "--steps", "24"]
    cmd += ["--width", "32", "--layers", "1", "--seq", "16", "--batch", "2", "--json", str(out)]
    res = slack.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=slack.guard(150))
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads(out.read_text())
    # The default four candidates plan by step 21; the summary names what was kept.
    chose = summary["chose"]
    assert chose in ("none", "bf16", "bf16-acc", "int8-ef") or chose.startswith("mixed ("), chose
    assert summary["median_step_ms"] > 0 and summary["final_loss"] < 4.6, summary  # ln 96
    assert f"chose {summary['chose']}" in res.stdout
    # The JSON keeps the plan with the trial's own steps, every step's time and the phases.
    plan = summary["plan"]
    assert plan["summary"] == chose and set(plan["trial_ms"]) == set(plan["step_ms"])
    assert len(summary["steps_ms"]) == 24 and min(summary["steps_ms"]) > 0
    # The median is of the steps after the plan (of the last half): none of the trial's.
    after = summary["steps_ms"][max(12, plan["made_at_step"] + 1) :]
    assert summary["median_step_ms"] == pytest.approx(statistics.median(after), rel=1e-9)
    assert set(summary["phase_ms"]) == {"forward", "backward", "optimizer"}
    assert all(ms > 0 for ms in summary["phase_ms"].values()), summary["phase_ms"]


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("ddp_train", ["--steps", "0"], "--steps must be at least 1"),
        ("diloco_train", ["--steps", "0"], "--steps must be at least 1"),
        ("diloco_train", ["--pretend-nodes", "-1"], "--pretend-nodes must be 0"),
        ("plain_script", ["--steps", "-1"], "--steps must be at least 1"),
        ("fsdp_train", ["--steps", "0"], "--steps must be at least 1"),
        ("gpt_train", ["--steps", "0"], "--steps must be at least 1"),
        ("gpt_train", ["--json", "/nonexistent/x.json"], "its folder does not exist"),
        ("gpt_train", ["--preset", "bf16", "--allow", "int8-ef"], "--allow names auto's"),
        ("gpt_train", ["--allow", "int8-ef:flat", "bogus"], "'bogus' is no mode; name none"),
        ("gpt_train", ["--allow", "none:flat"], "'none:flat' is no mode; name none"),
        ("gpt_train", ["--allow", "int8-ef:ring"], "'int8-ef:ring' is no mode; name none"),
        ("gpt_train", ["--allow", "none", "bf16", "none"], "--allow names one twice"),
        ("gpt_train", ["--json", "/tmp"], "--json /tmp is a folder; name a file in it"),
        ("resume", ["--ckpt-dir", "c", "--out", "/tmp"], "--out /tmp is a folder; name a file"),
        ("resume", ["--ckpt-dir", "c", "--ckpt-every", "0"], "--ckpt-every must be at least 1"),
        ("resume", ["--ckpt-dir", "c", "--out", "/nonexistent/p.pt"], "its folder does not"),
        ("resume", ["--ckpt-dir", "/etc/hostname"], "--ckpt-dir /etc/hostname is a file"),
        ("resume", ["--ckpt-dir", "/proc/x"], "cannot make --ckpt-dir /proc/x: No such file"),
        # The model's own limits, named before they fail inside it on every rank.
        ("gpt_train", ["--width", "10"], "--width 10 must be a multiple of the model's 4 heads"),
        ("fsdp_train", ["--seq", "2000"], "--seq 2000 is more than the model's 1024 positions"),
        ("fsdp_train", ["--batch", "0"], "--batch must be at least 1"),
        ("diloco_train", ["--steps", "10"], "--sync-every 20 is more than --steps 10"),
    ],
)
def test_the_examples_refuse_bad_options_before_they_start(
    script, args, message, capsys, monkeypatch
):
    # In this process: the checks come before any process group (or training, or output).
    run = runpy.run_path(str(ROOT / "examples" / f"{script}.py"), run_name="example")
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as refused:
        run["main"]()
    assert refused.value.code == 2 and message in capsys.readouterr().err
