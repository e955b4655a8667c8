"""IntervalController decisions and the failure-trace simulator."""

import math

import pytest

from titan_ckpt_plus.policy.controller import IntervalController
from titan_ckpt_plus.policy.simulate import (
    AdaptivePolicy,
    FixedPolicy,
    Job,
    PoissonTrace,
    oracle_policy,
    simulate,
    standard_policies,
)
from titan_ckpt_plus.policy.young import daly_interval, young_interval

M = 3.09 * 3600


def _measured(**kw):
    c = IntervalController(min_interval=10, max_interval=5000, **kw)
    c.observe_step_time(2.0)
    c.observe_delta("local", 2.0)
    c.observe_delta("pfs", 600.0)
    return c


# -- controller ---------------------------------------------------------------


def test_default_before_measurements():
    c = IntervalController(10, 1000)
    d = c.interval("local", M)
    assert (d.steps, d.tau_s) == (10, None) and d.reason.startswith("default")
    c.observe_delta("local", 2.0)
    assert c.interval("local", M).reason.startswith("default: no step time")
    assert IntervalController(10, 1000, default_interval=200).interval("pfs", M).steps == 200


def test_young_interval_in_steps():
    c = _measured()
    local = c.interval("local", M)
    assert local.tau_s == pytest.approx(young_interval(2.0, M))
    assert local.steps == math.ceil(young_interval(2.0, M) / 2.0)  # 106 steps
    assert local.reason == "young"
    assert c.interval("pfs", M).steps == math.ceil(young_interval(600.0, M) / 2.0)


def test_daly_uses_smoothed_restart():
    c = _measured(use_daly=True)
    c.observe_restart(300.0)
    d = c.interval("pfs", M)
    assert d.reason == "daly" and d.tau_s == pytest.approx(daly_interval(600.0, M, 300.0))


def test_clamps():
    c = _measured()
    assert c.interval("local", 60.0).steps == 10  # tau 15.5 s -> 8 steps -> min
    assert "clamped to min_interval" in c.interval("local", 60.0).reason
    d = c.interval("pfs", 1e9)
    assert d.steps == 5000 and "clamped to max_interval" in d.reason
    assert c.interval("pfs", math.inf).steps == 5000


def test_never_below_last_background_write():
    c = _measured()
    c.observe_write("local", 900.0)  # 450 steps, Young would say 106
    d = c.interval("local", M)
    assert d.steps == 450 and d.tau_s == 900.0 and d.reason == "write-bound"
    # the write floor wins over max_interval too: an earlier save would only stall
    c.observe_write("local", 20000.0)
    d = c.interval("local", M)
    assert d.steps == 10000 and "exceeds max_interval" in d.reason
    # it is the latest write that counts, not a smoothed one
    c.observe_write("local", 1.0)
    assert c.interval("local", M).reason == "young"


def test_exponential_smoothing():
    c = _measured(smoothing=0.5)
    c.observe_delta("local", 10.0)  # 2 -> 6
    assert c.interval("local", M).tau_s == pytest.approx(young_interval(6.0, M))
    c.observe_step_time(4.0)  # 2 -> 3
    assert c.interval("local", M).steps == math.ceil(young_interval(6.0, M) / 3.0)


@pytest.mark.parametrize(
    "kwargs", [dict(min_interval=0, max_interval=10), dict(min_interval=10, max_interval=5), dict(min_interval=1, max_interval=10, smoothing=0)]
)
def test_rejects_bad_config(kwargs):
    with pytest.raises(ValueError):
        IntervalController(**kwargs)


def test_rejects_bad_observations():
    c = IntervalController(1, 10)
    for call in (lambda: c.observe_delta("nvme", 1), lambda: c.observe_delta("local", -1),
                 lambda: c.observe_step_time(0), lambda: c.interval("local", 0)):
        with pytest.raises(ValueError):
            call()


# -- simulator ----------------------------------------------------------------

# Scaled-down job: MTBF 1000 s, ~1000 failures, so a run takes ~0.1 s.
JOB = Job(total_work_s=1e6, step_time_s=1.0, delta_local_s=5.0, delta_pfs_s=20.0, restart_s=30.0, p_unrecoverable=0.1)
TRUE_MTBF = 1000.0


def test_no_failures_costs_only_checkpoints():
    job = Job(total_work_s=1000, step_time_s=1.0, delta_local_s=2.0, delta_pfs_s=10.0)
    r = simulate(job, FixedPolicy("f", 100, 500), [])
    # saves at 100..900 (500 goes to pfs), none at the very end
    assert r.checkpoints == {"local": 8, "pfs": 1}
    assert r.checkpoint_s == 8 * 2 + 10 and r.lost_s == pytest.approx(0) and r.failures == 0
    assert r.wasted_fraction == pytest.approx(26 / 1026)


def test_failure_rolls_back_to_newest_save():
    job = Job(total_work_s=1000, step_time_s=1.0, delta_local_s=0.0, delta_pfs_s=0.0, restart_s=50.0, p_unrecoverable=0.0)
    r = simulate(job, FixedPolicy("f", 100, 10_000), [250.0])
    # failure at step 250 loses 50 steps, then restarts for 50 s
    assert (r.wall_s, r.restart_s, r.lost_s) == (1100.0, 50.0, 50.0)


def test_unrecoverable_failure_falls_back_to_pfs():
    job = Job(total_work_s=1000, step_time_s=1.0, delta_local_s=0.0, delta_pfs_s=0.0, p_unrecoverable=1.0)
    r = simulate(job, FixedPolicy("f", 100, 200), [350.0])
    assert r.unrecoverable_failures == 1 and r.lost_s == 150.0  # back to step 200, not 300


def test_save_not_restorable_until_its_write_finished():
    job = Job(total_work_s=1000, step_time_s=1.0, delta_local_s=0.0, delta_pfs_s=0.0,
              p_unrecoverable=0.0, write_local_s=80.0)
    r = simulate(job, FixedPolicy("f", 100, 10_000), [250.0])
    # the step-200 save (t=200) is only durable at t=280, so the failure at
    # t=250 restores the step-100 save and loses 150 steps.
    assert r.lost_s == 150.0


def test_failure_during_restart_restarts_again():
    job = Job(total_work_s=1000, step_time_s=1.0, delta_local_s=0.0, delta_pfs_s=0.0, restart_s=50.0, p_unrecoverable=0.0)
    r = simulate(job, FixedPolicy("f", 100, 10_000), [250.0, 270.0])
    assert (r.failures, r.restart_s, r.lost_s, r.wall_s) == (2, 20.0 + 50.0, 50.0, 1120.0)


def test_oracle_is_young_per_tier():
    o = oracle_policy(JOB, TRUE_MTBF)
    assert o.intervals(0) == (math.ceil(young_interval(5, 1000)), math.ceil(young_interval(20, 10_000)))


def test_adaptive_matches_oracle_from_bad_priors_and_beats_untuned_fixed():
    trace = PoissonTrace(TRUE_MTBF, seed=0)
    policies = standard_policies(JOB, TRUE_MTBF, [TRUE_MTBF * 10, TRUE_MTBF / 10], fixed_steps=[500])
    oracle, too_high, too_low, fixed = (simulate(JOB, p, trace, seed=0, warmup_failures=5) for p in policies)
    assert oracle.failures > 900 and oracle.warmup_reached
    for r in (too_high, too_low):
        assert r.wasted_fraction <= 1.05 * oracle.wasted_fraction, r
        assert abs(r.final_intervals[0] / oracle.final_intervals[0] - 1) < 0.1
        assert r.wasted_fraction < fixed.wasted_fraction / 2
    assert fixed.wasted_fraction > 1.5 * oracle.wasted_fraction


def test_same_trace_same_failures_for_every_policy():
    trace = PoissonTrace(TRUE_MTBF, seed=3)
    job = Job(total_work_s=50_000, step_time_s=1.0, delta_local_s=5, delta_pfs_s=20, p_unrecoverable=0.5)
    a = simulate(job, FixedPolicy("a", 100, 100), trace, seed=3)
    b = simulate(job, FixedPolicy("a", 100, 100), trace, seed=3)
    assert (a.wall_s, a.failures, a.unrecoverable_failures) == (b.wall_s, b.failures, b.unrecoverable_failures)
    assert 0 < a.unrecoverable_failures < a.failures


def test_adaptive_policy_uses_estimator_and_controller():
    p = AdaptivePolicy("a", prior_mtbf_s=1000.0, prior_pfs_mtbf_s=10_000.0, min_interval=10)
    assert p.intervals(0.0) == (10, 10)  # nothing measured yet
    p.on_step_time(1.0)
    p.on_checkpoint("local", 5.0, 0.0)
    p.on_checkpoint("pfs", 20.0, 0.0)
    assert p.intervals(0.0) == (100, math.ceil(young_interval(20, 10_000)))
    p.on_failure(1000.0, True, 30.0)
    assert p.any.failures == 1 and p.unrecoverable.failures == 1
