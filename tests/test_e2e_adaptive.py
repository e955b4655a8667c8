"""Adaptive intervals in a real CPU run: a failure is injected, the restart finds it
in the ledger, and the intervals it uses are those the policy code computes."""

import pytest

from harness import ckpt_events, ok, torchrun
from titan_ckpt_plus.policy.ledger import FailureLedger
from titan_ckpt_plus.policy.schedule import IntervalPolicy, Measurements

pytestmark = pytest.mark.e2e
PRIOR_H, WEIGHT = 0.0005, 2.0
ADAPT = ("--checkpoint.adaptive_interval", f"--checkpoint.mtbf_prior_hours={PRIOR_H}",
         f"--checkpoint.mtbf_prior_weight={WEIGHT}", "--checkpoint.min_interval=2",
         "--checkpoint.max_interval=50", "--training.steps=20")


def _replay(ev: dict, evidence: dict) -> tuple:
    policy = IntervalPolicy(2, 50, PRIOR_H * 3600, 30 * 3600, WEIGHT, evidence=evidence)
    m = Measurements(ev["delta_s"], ev["step_time_s"], ev["write_local_s"], ev["write_pfs_s"], ev["uptime_s"])
    local, pfs, mtbf = policy.update(m)
    return local.steps, pfs.steps, mtbf["any"]


def test_failure_lands_in_the_ledger_and_moves_the_interval(tmp_path):
    first = torchrun(tmp_path, *ADAPT, fault="kill_after_step@9:1")
    assert first.returncode != 0
    run1 = ckpt_events(tmp_path, "interval")
    assert run1 and all(e["evidence"] == {"any": [0, 0.0], "unrecoverable_local": [0, 0.0]}
                        for e in run1)  # a first incarnation has seen no failure
    second = torchrun(tmp_path, *ADAPT)
    ok(second)

    summary = FailureLedger(tmp_path / "dump" / "titan_ckpt_plus" / "ledger.jsonl").read()
    assert summary.count("any") == 1 and summary.count("unrecoverable_local") == 0
    assert len(summary.incarnations) == 2
    rec = ckpt_events(tmp_path, "recovery")[-1]
    assert rec["tier"] == "local"

    after = [e for e in ckpt_events(tmp_path, "interval") if e["time"] > rec["time"]]
    assert after
    ev = after[0]
    failures, exposure = ev["evidence"]["any"]
    assert failures == 1 and exposure > 0
    steps_local, steps_pfs, mtbf = _replay(ev, {k: tuple(v) for k, v in ev["evidence"].items()})
    assert (ev["local_steps"], ev["pfs_steps"]) == (steps_local, steps_pfs)
    assert ev["mtbf_any_s"] == pytest.approx(mtbf)
    # the estimator's move: one failure lowers M below what the same exposure without it gives
    assert mtbf == pytest.approx((WEIGHT * PRIOR_H * 3600 + exposure + ev["uptime_s"]) / (WEIGHT + 1))
    no_failure = {k: tuple(v) for k, v in ev["evidence"].items()} | {"any": (0, exposure)}
    assert mtbf < _replay(ev, no_failure)[2]
