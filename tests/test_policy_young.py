"""Young/Daly formulas, checked against the Llama 3 numbers."""

import math

import pytest

from titan_ckpt_plus.policy.young import (
    LLAMA3_MTBF_S,
    checkpoints_per_day,
    daly_interval,
    expected_lost_work,
    overhead_fraction,
    young_interval,
    young_table,
)


def test_llama3_mtbf_is_3_09_hours():
    assert round(LLAMA3_MTBF_S / 3600, 2) == 3.09


@pytest.mark.parametrize("mtbf_s", [LLAMA3_MTBF_S, 3.09 * 3600])
def test_llama3_numbers(mtbf_s):
    # delta = 600 s (blocking PFS save) -> tau 60.9 min, overhead 32.8 %
    assert round(young_interval(600, mtbf_s) / 60, 1) == 60.9
    assert round(overhead_fraction(600, mtbf_s) * 100, 1) == 32.8
    # delta = 2 s (async local snapshot) -> tau 3.5 min, overhead 1.9 %
    assert round(young_interval(2, mtbf_s) / 60, 1) == 3.5
    assert round(overhead_fraction(2, mtbf_s) * 100, 1) == 1.9


def test_overhead_is_save_cost_plus_lost_work_at_optimum():
    delta, mtbf = 60.0, LLAMA3_MTBF_S
    tau = young_interval(delta, mtbf)
    assert expected_lost_work(tau) == tau / 2
    assert overhead_fraction(delta, mtbf) == pytest.approx(delta / tau + expected_lost_work(tau) / mtbf)
    # and tau minimises that first-order waste
    waste = lambda t: delta / t + expected_lost_work(t) / mtbf
    assert waste(tau) < waste(tau * 0.9) and waste(tau) < waste(tau * 1.1)


def test_daly():
    delta, mtbf = 60.0, LLAMA3_MTBF_S
    assert daly_interval(delta, mtbf) == pytest.approx(young_interval(delta, mtbf) - delta)
    assert daly_interval(delta, mtbf, restart_s=600) == pytest.approx(math.sqrt(2 * delta * (mtbf + 600)) - delta)
    # delta >= M: the expansion breaks down, checkpoint once per MTBF
    assert daly_interval(5000, 3000) == 3000
    assert daly_interval(3000, 3000, 100) == 3000


def test_checkpoints_per_day():
    assert checkpoints_per_day(3600) == 24
    assert checkpoints_per_day(3590, 10) == 24


def test_young_table_rows():
    rows = young_table([600, 2], LLAMA3_MTBF_S)
    assert [r.delta_s for r in rows] == [600, 2]
    assert round(rows[0].tau_s / 60, 1) == 60.9
    assert rows[0].lost_work_s == pytest.approx(rows[0].tau_s / 2)
    assert rows[1].checkpoints_per_day == pytest.approx(86400 / (rows[1].tau_s + 2))


@pytest.mark.parametrize("bad", [(-1, 100), (1, 0), (1, -5), (float("nan"), 100)])
def test_rejects_bad_inputs(bad):
    with pytest.raises(ValueError):
        young_interval(*bad)
    with pytest.raises(ValueError):
        overhead_fraction(*bad)
