"""Gamma-Poisson MTBF estimate and the append-only failure ledger."""

import json
import os
import threading

import pytest

from titan_ckpt_plus.policy.ledger import FailureLedger
from titan_ckpt_plus.policy.mtbf import GammaPoissonMTBF

H = 3600.0


# -- GammaPoissonMTBF ---------------------------------------------------------


def test_prior_only_gives_prior_mtbf():
    est = GammaPoissonMTBF(prior_mtbf_s=10 * H, prior_weight=2)
    assert (est.shape, est.rate) == (2, 20 * H)
    assert est.mtbf_s == pytest.approx(10 * H)


def test_posterior_is_conjugate_update():
    est = GammaPoissonMTBF(10 * H, 2).observe(failures=3, exposure_s=5 * H)
    assert (est.shape, est.rate) == (5, 25 * H)
    assert est.mtbf_s == pytest.approx(25 * H / 5)  # posterior rate / shape
    assert est.failure_rate == pytest.approx(5 / (25 * H))
    est.observe(failures=1)
    assert est.mtbf_s == pytest.approx(25 * H / 6)


def test_data_overwhelms_prior():
    # prior 10x too high, true MTBF 3 h, 100 failures in 300 h
    est = GammaPoissonMTBF(30 * H, 1).set_evidence(100, 300 * H)
    assert est.mtbf_s == pytest.approx(330 * H / 101)
    assert abs(est.mtbf_s / (3 * H) - 1) < 0.1


def test_set_evidence_replaces():
    est = GammaPoissonMTBF(H, 1).observe(5, 10 * H).set_evidence(1, H)
    assert (est.failures, est.exposure_s) == (1, H)


@pytest.mark.parametrize(
    "args", [(0, 1), (-H, 1), (float("inf"), 1), (H, 0), (H, -1), (H, float("nan")), ("3", 1)]
)
def test_rejects_bad_prior(args):
    with pytest.raises(ValueError):
        GammaPoissonMTBF(*args)


@pytest.mark.parametrize("evidence", [(-1, 0), (1.5, 0), (0, -1), (0, float("inf")), (True, 0)])
def test_rejects_bad_evidence(evidence):
    with pytest.raises(ValueError):
        GammaPoissonMTBF(H).observe(*evidence)


# -- FailureLedger ------------------------------------------------------------


def _run(ledger, inc, t0, t1, clean=False, recovered_from="unset", world_size=8):
    ledger.start(inc, t0, world_size, hostname="n0")
    if recovered_from != "unset":
        ledger.recovery(inc, t0 + 1, recovered_from, step=10, seconds=1.5)
    ledger.heartbeat(inc, t1, step=100)
    if clean:
        ledger.clean_end(inc, t1 + 1)


def test_failure_counting_and_exposure(tmp_path):
    ledger = FailureLedger(tmp_path / "ledger.jsonl")
    _run(ledger, "a", 0, 100)                            # died -> b recovered locally
    _run(ledger, "b", 110, 200, recovered_from="local")  # died -> c fell back to pfs
    _run(ledger, "c", 210, 300, recovered_from="pfs")    # died -> d found nothing
    _run(ledger, "d", 310, 400, recovered_from=None)     # ended cleanly
    ledger.clean_end("d", 401)
    _run(ledger, "e", 500, 600, recovered_from="local")  # still running
    s = ledger.read(current_incarnation="e")
    assert [i.id for i in s.incarnations] == ["a", "b", "c", "d", "e"]
    assert [(f.incarnation, f.t, f.step, f.recovered_from) for f in s.failures] == [
        ("a", 100, 100, "local"),
        ("b", 200, 100, "pfs"),
        ("c", 300, 100, "none"),
    ]
    assert s.count("any") == 3
    assert s.count("unrecoverable_local") == 2
    # durations: a 100, b 90, c 90, d 91 (clean end at 401), e 100
    assert s.exposure_s == pytest.approx(471)
    assert s.evidence("unrecoverable_local") == (2, pytest.approx(471))
    assert s.incarnations[0].world_size == 8 and s.incarnations[0].meta == {"hostname": "n0"}
    with pytest.raises(ValueError):
        s.count("bogus")


def test_last_incarnation_counts_as_failure_unless_named_current(tmp_path):
    ledger = FailureLedger(tmp_path / "l.jsonl")
    _run(ledger, 1, 0, 50)
    _run(ledger, 2, 60, 90, recovered_from="local")
    assert ledger.read(current_incarnation=2).count() == 1
    s = ledger.read()
    assert s.count() == 2
    assert s.failures[-1].recovered_from is None  # not known yet
    assert s.failures[-1].classes == ("any",)


def test_missing_file_is_empty(tmp_path):
    s = FailureLedger(tmp_path / "nope.jsonl").read()
    assert (s.incarnations, s.failures, s.exposure_s) == ([], [], 0.0)


def test_corrupt_lines_are_skipped_with_warning(tmp_path):
    path = tmp_path / "l.jsonl"
    ledger = FailureLedger(path)
    _run(ledger, "a", 0, 100)
    with open(path, "a") as f:
        f.write("{not json\n")
        f.write(json.dumps({"event": "heartbeat", "incarnation": "a", "t": 150}) + "\n")  # no step
        f.write(json.dumps({"event": "teleport", "incarnation": "a", "t": 160}) + "\n")
        f.write("[1, 2]\n\n")
    _run(ledger, "b", 200, 300, clean=True)
    with open(path, "ab") as f:
        f.write(b'{"event": "heartbeat", "incarn')  # torn last line
    with pytest.warns(RuntimeWarning, match="skipped 5 corrupt"):
        s = ledger.read()
    assert s.skipped_lines == 5
    assert [f.incarnation for f in s.failures] == ["a"]
    assert s.exposure_s == pytest.approx(100 + 101)


def test_append_after_torn_line_starts_a_new_line(tmp_path):
    path = tmp_path / "l.jsonl"
    ledger = FailureLedger(path)
    ledger.start("a", 0, 8)
    with open(path, "ab") as f:
        f.write(b'{"event": "heart')
    ledger.heartbeat("a", 10, step=5)
    with pytest.warns(RuntimeWarning):
        s = ledger.read(current_incarnation="a")
    assert s.incarnations[0].last_step == 5 and s.skipped_lines == 1


def test_append_is_one_fsynced_write_on_o_append(tmp_path, monkeypatch):
    calls = []
    real_open, real_write, real_fsync = os.open, os.write, os.fsync
    monkeypatch.setattr(os, "open", lambda p, flags, *a: calls.append(("open", flags)) or real_open(p, flags, *a))
    monkeypatch.setattr(os, "write", lambda fd, b: calls.append(("write", bytes(b))) or real_write(fd, b))
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync",)) or real_fsync(fd))
    ledger = FailureLedger(tmp_path / "l.jsonl")
    ledger.recovery("a", 5.0, "local", step=7, seconds=2.5)
    kinds = [c[0] for c in calls]
    assert kinds == ["open", "write", "fsync"]
    assert calls[0][1] & os.O_APPEND and calls[0][1] & os.O_CREAT
    line = calls[1][1]
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"event": "recovery", "incarnation": "a", "t": 5.0, "tier": "local", "step": 7, "seconds": 2.5}


def test_newlines_in_metadata_stay_on_one_line(tmp_path):
    path = tmp_path / "l.jsonl"
    FailureLedger(path).start("a", 0, 8, note="two\nlines")
    assert path.read_text().count("\n") == 1
    assert FailureLedger(path).read().incarnations[0].meta == {"note": "two\nlines"}


def test_concurrent_appends_stay_whole_lines(tmp_path):
    # Only one rank should write, but O_APPEND single writes keep lines whole anyway.
    ledger = FailureLedger(tmp_path / "l.jsonl")
    ledger.start("a", 0, 8)

    def beat(k):
        for i in range(50):
            ledger.heartbeat("a", 1 + k * 100 + i, step=i)

    threads = [threading.Thread(target=beat, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    lines = (tmp_path / "l.jsonl").read_text().splitlines()
    assert len(lines) == 201 and all(json.loads(line)["incarnation"] == "a" for line in lines)
    assert ledger.read(current_incarnation="a").incarnations[0].last_t == 350


def test_rejects_invalid_records(tmp_path):
    ledger = FailureLedger(tmp_path / "l.jsonl")
    with pytest.raises(ValueError):
        ledger.heartbeat("a", 1.0, step=-1)
    with pytest.raises(ValueError):
        ledger.recovery("a", 1.0, 3, step=1, seconds=1.0)
    with pytest.raises(ValueError):
        ledger.start("a", 1.0, 8, event="oops")
    assert not (tmp_path / "l.jsonl").exists()
