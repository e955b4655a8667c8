"""A CPU run with wandb offline: the run file holds the ckpt metrics, at the steps
they became known, in the same rows as the training loss, equal to the JSONL."""

import pytest

from harness import ckpt_events, torchrun
from wandb_records import history

pytestmark = pytest.mark.e2e


def test_ckpt_metrics_reach_wandb_next_to_the_loss(tmp_path):
    proc = torchrun(tmp_path, "--metrics.enable_wandb")
    assert proc.returncode == 0, proc.stdout[-3000:]
    (run,) = list((tmp_path / "dump").rglob("run-*.wandb"))
    rows = history(run)
    commits = {r["ckpt/local/committed_step"]: r for r in rows if "ckpt/local/committed_step" in r}
    events = ckpt_events(tmp_path, "local_commit")
    assert sorted(commits) == [e["step"] for e in events] == list(range(2, 13, 2))
    for e in events:
        row = commits[e["step"]]
        assert row["ckpt/local/bytes"] == e["bytes"]
        assert row["ckpt/local/background_write_s"] == e["background_write_s"]
        assert row["_step"] >= e["step"] and "loss_metrics/global_avg_loss" in row
    drains = [r for r in rows if "ckpt/pfs/committed_step" in r]
    assert [r["ckpt/pfs/committed_step"] for r in drains] == [4, 8, 12]
    deltas = [r["ckpt/local/delta_s"] for r in rows if "ckpt/local/delta_s" in r]
    assert deltas == [e["delta_s"] for e in ckpt_events(tmp_path, "stage")]
