"""Checkpoint events reach torchtitan's metric loggers: every event's figures, each at
a step no older than the event (no torchrun; the wandb run file: test_e2e_wandb.py)."""

from titan_ckpt_plus.telemetry import EventLog


def _commit(step: int) -> dict:
    return dict(step=step, staging_s=0.01, background_write_s=0.1 * step, time_to_commit_s=0.2,
                bytes=1000 + step)


def test_two_commits_between_two_steps_are_logged_one_step_apart(tmp_path):
    """A logger keeps one value per key and step: a commit that lands late, just
    before the next one, would otherwise be overwritten by it."""
    log = EventLog(str(tmp_path / "events.jsonl"))
    log.record("local_commit", **_commit(10))
    log.record("stage", delta_s=0.003, wait_prev_s=0.0)
    log.record("local_commit", **_commit(12))
    log.record("save_failed", tier="pfs")
    log.record("save_failed", tier="pfs")  # counts add up within a step
    log.record("sched", step=12)  # no metrics: nothing pending for it
    first = log.take_metrics()
    assert first["ckpt/local/committed_step"] == 10 and first["ckpt/local/bytes"] == 1010
    assert first["ckpt/local/delta_s"] == 0.003 and first["ckpt/failures/pfs_save_failed"] == 2
    second = log.take_metrics()
    assert second["ckpt/local/committed_step"] == 12 and second["ckpt/local/bytes"] == 1012
    assert "ckpt/local/delta_s" not in second and "ckpt/failures/pfs_save_failed" not in second
    assert log.take_metrics() == {}
    log.flush()


def test_what_waits_past_the_last_step_is_logged_at_close_after_it(tmp_path):
    """The last step's save flushes both tiers, so its commit and a late one of the
    step before land together: both are logged, the second after the last step, and
    only at close(): torchtitan's validation logs the last step after its save, and
    wandb drops a step older than the newest it has seen."""
    from titan_ckpt_plus.adapters.torchtitan_v022 import TieredCheckpointManager

    logged = []

    class Logger:
        def log(self, metrics, step):
            logged.append((step, metrics.get("ckpt/local/committed_step"), metrics.get("ckpt/interval/local_steps")))

    manager = object.__new__(TieredCheckpointManager)
    manager.events, manager._metrics_logger, manager._wandb_declared = EventLog(None), Logger(), False
    manager.events.path = str(tmp_path / "events.jsonl")  # records kept without its writer thread
    manager.events.submit = lambda *a, **k: None
    for s in (8, 10):
        manager.events.record("local_commit", **_commit(s))
    manager._log_metrics(11)
    assert logged == [(11, 8, None)]  # a step within training logs one, the other waits
    manager.events.record("local_commit", **_commit(12))
    manager._saving_step = 12
    manager._log_metrics(12)  # the last step's save: one value per key, nothing past it yet
    assert logged == [(11, 8, None), (12, 10, None)]
    manager.events.record("interval", step=12, local_steps=3, pfs_steps=6, mtbf_any_s=3600.0,
                          mtbf_unrecoverable_s=7200.0)  # from the event thread, late
    manager._log_leftovers()
    assert logged[2:] == [(13, 12, 3)]
    manager._log_leftovers()
    assert len(logged) == 3  # taken once
