"""A CPU run with wandb offline: the run file holds the ckpt metrics, at the steps
they became known, in the same rows as the training loss, equal to the JSONL."""

import pytest

from harness import ckpt_events, ok, output, torchrun
from wandb_records import history

pytestmark = pytest.mark.e2e


def test_ckpt_metrics_reach_wandb_next_to_the_loss(tmp_path):
    """With validation at the last step too: torchtitan logs it after that step's
    save, so what the save flushed must not take wandb past that step first."""
    proc = torchrun(tmp_path, "--metrics.enable_wandb", "--validation.enable", "--validation.dataset=c4_test",
                    "--validation.dataset_path=assets/demo/corpus", "--validation.freq=6", "--validation.steps=2",
                    "--validation.seq_len=32", "--validation.local_batch_size=2")
    ok(proc)
    (run,) = list((tmp_path / "dump").rglob("run-*.wandb"))
    rows = history(run)
    validated = sorted(r["_step"] for r in rows if any(k.startswith("validation_metrics/") for k in r))
    assert validated == [1, 6, 12], validated  # torchtitan validates at step 1 too
    commits = {r["ckpt/local/committed_step"]: r for r in rows if "ckpt/local/committed_step" in r}
    events = ckpt_events(tmp_path, "local_commit")
    assert sorted(commits) == [e["step"] for e in events] == list(range(2, 13, 2))
    last = max(r["_step"] for r in rows if "loss_metrics/global_avg_loss" in r)
    for e in events:
        row = commits[e["step"]]
        assert row["ckpt/local/bytes"] == e["bytes"]
        assert row["ckpt/local/background_write_s"] == e["background_write_s"]
        # beside the loss, but for a late commit that lands with the last step's own:
        # one of them goes to the step after training's last (test_telemetry.py)
        assert row["_step"] >= e["step"] and ("loss_metrics/global_avg_loss" in row or row["_step"] > last)
    drains = [r for r in rows if "ckpt/pfs/committed_step" in r]
    assert [r["ckpt/pfs/committed_step"] for r in drains] == [4, 8, 12]
    deltas = [r["ckpt/local/delta_s"] for r in rows if "ckpt/local/delta_s" in r]
    assert deltas == [e["delta_s"] for e in ckpt_events(tmp_path, "stage")]
    # the last save's interval review is recorded by the event thread after that step's
    # metrics were taken: it reaches wandb at close(), after the last step
    reviews = [r["ckpt/interval/local_steps"] for r in rows if "ckpt/interval/local_steps" in r]
    assert reviews == [e["local_steps"] for e in ckpt_events(tmp_path, "interval")] and len(reviews) == 6


def test_every_dashboard_panel_plots_a_key_an_offline_run_logs(tmp_path):
    """Two simulated nodes with a replica each, killed after step 7 and restarted: the
    keys both incarnations log to wandb cover every panel of `titan-ckpt
    wandb-workspace` (saves, replication, drains, intervals, MTBF, recovery)."""
    from harness import torchrun_nodes
    from titan_ckpt_plus import wandb_workspace

    args = ("--metrics.enable_wandb", "--checkpoint.replication_factor=1")
    run1 = torchrun_nodes(tmp_path, *args, nproc=1, fault="kill_after_step@7:1", loss_log="run1.jsonl")
    assert any(p.returncode for p in run1)
    run2 = torchrun_nodes(tmp_path, *args, nproc=1, loss_log="run2.jsonl")
    assert all(p.returncode == 0 for p in run2), output(run2[0])
    files = list((tmp_path / "dump").rglob("run-*.wandb"))
    assert len(files) == 2  # one per incarnation, from the metrics rank
    logged = {k for f in files for row in history(f) for k in row}
    missing = [k for k in wandb_workspace.panel_keys() if k not in logged]
    assert not missing, missing
