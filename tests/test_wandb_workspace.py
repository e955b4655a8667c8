"""`titan-ckpt wandb-workspace`: the workspace spec offline, and plain errors without
credentials. (That every panel's key is logged by a real run: tests/test_e2e_wandb.py.)"""

import json

from titan_ckpt_plus import wandb_workspace
from titan_ckpt_plus.cli import main

ISSUE_PANELS = [  # what a user looks for, and a key that must be on a panel for it
    "ckpt/local/delta_s", "ckpt/pfs/delta_s", "ckpt/local/staging_s", "ckpt/local/background_write_s",
    "ckpt/pfs/background_write_s", "ckpt/local/write_MBps", "ckpt/pfs/write_MBps",
    "ckpt/local/time_to_commit_s", "ckpt/replication/seconds", "ckpt/replication/bytes_sent",
    "ckpt/pfs/drain_lag_steps", "ckpt/interval/local_s", "ckpt/interval/local_tau_s",
    "ckpt/interval/pfs_s", "ckpt/interval/pfs_tau_s", "ckpt/interval/mtbf_any_h",
    "ckpt/interval/failures_any", "ckpt/recovery/seconds", "ckpt/recovery/bytes_local",
    "ckpt/recovery/bytes_peer", "ckpt/recovery/bytes_pfs", "ckpt/interval/expected_waste_local",
]


def test_dry_run_writes_the_workspace_spec_without_network(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # any network use would fail
    out = tmp_path / "ws.json"
    assert main(["wandb-workspace", "team/llama", "--dry-run", "--out", str(out)]) == 0
    assert "nothing was saved to wandb" in capsys.readouterr().out
    spec = json.loads(out.read_text())
    keys = {k for p in spec["panels"] for k in p["keys"]}
    assert set(ISSUE_PANELS) <= keys == set(wandb_workspace.panel_keys())
    view = spec["wandb_view"]
    assert (view["entity"], view["project"]) == ("team", "llama")
    plotted = [m for sec in view["spec"]["section"]["panel_bank_config"]["sections"]
               for panel in sec["panels"] for m in panel["config"]["metrics"]]
    assert sorted(plotted) == sorted(k for p in spec["panels"] for k in p["keys"])


def test_without_credentials_it_says_so_plainly(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert main(["wandb-workspace", "team/llama"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("error: no wandb credentials") and "wandb login" in out and "--dry-run" in out
    assert main(["wandb-workspace", "no-project"]) == 2
