"""CLI: `plan` table, `simulate` table, and the no-torch guarantee."""

from pathlib import Path

import pytest
from harness import run_without_torch

from titan_ckpt_plus.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[1]


def test_plan_prints_llama3_table(capsys):
    assert main(["plan", "--delta", "600,120,60,10,2", "--mtbf-hours", "3.09"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert list(rows) == ["600", "120", "60", "10", "2"]
    # delta, tau_min, overhead_%, lost_per_failure_min, ckpts_per_day
    assert rows["600"][1:3] == ["60.9", "32.8"]
    assert rows["600"][3] == "30.4"  # tau / 2 = 60.89 / 2
    assert rows["2"][1:3] == ["3.5", "1.9"]
    assert rows["600"][4] == "20"  # 86400 s / (3654 s + 600 s)


def test_plan_rejects_bad_delta(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--delta", "abc"])


def test_subcommands_registered_in_one_place():
    assert {"plan", "simulate"} <= set(COMMANDS)


def test_simulate_table(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("# failure times, seconds\n3000\n9000\n20000\n")
    args = ["simulate", "--trace", str(trace), "--hours", "10", "--mtbf-hours", "2", "--fixed", "500"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[2:]]
    assert rows[0][:3] == ["oracle", rows[0][1], "1.000"]
    assert rows[-1][:2] == ["fixed", "500"]
    assert len(rows) == 5  # oracle, 3 adaptive priors, fixed 500
    assert "3 failures" in out


def test_no_torch_import():
    code = (
        "import importlib, pkgutil, sys\n"
        "import titan_ckpt_plus.policy as p\n"
        "for m in pkgutil.iter_modules(p.__path__):\n"
        "    importlib.import_module('titan_ckpt_plus.policy.' + m.name)\n"
        "import titan_ckpt_plus.cli\n"
        "assert len([n for n in sys.modules if n.startswith('titan_ckpt_plus.policy.')]) >= 5\n"
    )
    run_without_torch(code)
