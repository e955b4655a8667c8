"""`titan-ckpt ls / verify / report` on a real run's folders (one tiny torchrun run),
copies of them with corrupted or torn steps, and the no-torch guarantee."""

import json
import math
import os
from pathlib import Path

import pytest

from harness import ckpt_events, copy_run, events, flip_byte, job_dir, ok, run_without_torch, torchrun
from titan_ckpt_plus.cli import COMMANDS, build_parser, main
from titan_ckpt_plus.report import render

REPO = Path(__file__).resolve().parents[1]
e2e = pytest.mark.e2e


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("inspect_run")
    proc = torchrun(work)
    ok(proc)
    return work


def _copy(run: Path, dest: Path) -> Path:
    """A copy of the run whose local_roots.json points at the copy's job folder."""
    return copy_run(run, dest / "copy")


def _cli(capsys, *argv) -> tuple[int, list[str]]:
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().out.splitlines()


def _ls_rows(lines) -> dict[tuple[str, int], dict]:
    """(tier, step) -> row as a dict of the header's columns; a last step's full state
    beside its export is tier "pfs-full"."""
    body = [line for line in lines if not line.startswith("#")]
    header = body[0].split()
    rows = {}
    for line in body[1:]:
        cells = line.split()
        # state may hold spaces: tier folder step committed <state...> parts size unit age replicas
        row = dict(zip(header[:4], cells[:4]))
        row.update(state=" ".join(cells[4:-5]), parts=cells[-5], size=" ".join(cells[-4:-2]),
                   age=cells[-2], replicas=cells[-1])
        tier = "pfs-full" if row["folder"].endswith("/full_state") else row["tier"]
        rows[(tier, int(row["step"]))] = row
    return rows


# ---- ls -------------------------------------------------------------------


@e2e
def test_ls_lists_committed_local_and_pfs_steps(run, capsys):
    rc, lines = _cli(capsys, "ls", run / "dump")
    assert rc == 0
    assert f"# local root {job_dir(run)} (from local_roots.json)" in lines
    rows = _ls_rows(lines)
    # local_keep_latest_k = 3. A non-first rank may still hold its part of an older,
    # uncommitted step (its retention ran before the node's COMMIT of the last step).
    rows = {k: r for k, r in rows.items() if r["committed"] == "yes"}
    assert sorted(s for t, s in rows if t == "local") == [8, 10, 12]
    assert sorted(s for t, s in rows if t == "pfs") == [4, 8, 12]
    assert sorted(s for t, s in rows if t == "pfs-full") == [12]  # beside step 12's export
    pfs = run / "dump" / "checkpoint"
    for (tier, step), row in rows.items():
        assert row["committed"] == "yes" and row["parts"] == "2"
        assert row["replicas"] == ("0" if tier == "local" else "-")  # one node: no replicas
        assert row["folder"] == str({"local": job_dir(run), "pfs": pfs, "pfs-full": pfs / "full_state"}[tier])
        assert row["size"].endswith("MiB")
    assert rows[("local", 12)]["state"] == "committed" and rows[("pfs", 4)]["state"] == "complete"
    assert rows[("pfs", 12)]["state"] == "export (DCP, float32), not resumable"


@e2e
def test_ls_finds_local_roots_from_explicit_args_without_the_record(run, tmp_path, capsys):
    work = _copy(run, tmp_path)
    (work / "dump" / "titan_ckpt_plus" / "local_roots.json").unlink()
    rc, lines = _cli(capsys, "ls", work / "dump")
    assert rc == 0 and any("no local roots known" in line for line in lines)
    assert {t for t, _ in _ls_rows(lines)} == {"pfs", "pfs-full"}
    rc, lines = _cli(capsys, "ls", work / "dump", "--local-root", job_dir(work))
    assert sorted(s for (t, s), r in _ls_rows(lines).items() if t == "local" and r["committed"] == "yes") == [
        8, 10, 12]


@e2e
def test_ls_replicas_column(run, tmp_path, capsys):
    """A replica is stored under its source rank's names, so the node's own ranks come
    from COMMIT.json's node_ranks, or else from world_size / nodes in local_roots.json."""
    work = _copy(run, tmp_path)
    root = job_dir(work)
    rows = _ls_rows(_cli(capsys, "ls", work / "dump", "--local-root", root)[1])
    assert rows[("local", 12)]["replicas"] == "0"
    # as if the run had two nodes of one rank each: one of the two parts is a replica
    (work / "dump" / "titan_ckpt_plus" / "local_roots.json").write_text(
        json.dumps([str(root), str(work / "local" / "1")]))
    for s in (8, 12):  # as written before COMMIT.json recorded node_ranks
        c = root / f"step-{s}" / "COMMIT.json"
        c.write_text(json.dumps({k: v for k, v in json.loads(c.read_text()).items() if k != "node_ranks"}))
    commit = root / "step-10" / "COMMIT.json"
    assert json.loads(commit.read_text())["node_ranks"] == [0, 1]
    rc, lines = _cli(capsys, "ls", work / "dump")
    assert f"# local root {work / 'local' / '1'} (from local_roots.json): not visible from this host" in lines
    rows = _ls_rows(lines)
    assert [rows[("local", s)]["replicas"] for s in (8, 10, 12)] == ["1", "0", "1"]
    # a root known only from --local-root: the node count is unknown
    (work / "dump" / "titan_ckpt_plus" / "local_roots.json").unlink()
    rows = _ls_rows(_cli(capsys, "ls", work / "dump", "--local-root", root)[1])
    assert [rows[("local", s)]["replicas"] for s in (8, 10, 12)] == ["?", "0", "?"]


@e2e
def test_torn_steps_show_as_not_committed(run, tmp_path, capsys):
    work = _copy(run, tmp_path)
    (job_dir(work) / "step-10" / "COMMIT.json").unlink()
    (work / "dump" / "checkpoint" / "step-4" / ".metadata").unlink()
    (work / "dump" / "checkpoint" / "step-4" / "titan_ckpt_plus.json").unlink()
    rc, lines = _cli(capsys, "ls", work / "dump")
    rows = _ls_rows(lines)
    assert (rows[("local", 10)]["committed"], rows[("local", 10)]["state"]) == ("no", "torn (no COMMIT.json)")
    assert (rows[("pfs", 4)]["committed"], rows[("pfs", 4)]["state"]) == ("no", "torn (no .metadata)")
    assert rows[("local", 8)]["committed"] == rows[("local", 12)]["committed"] == "yes"
    # A torn step is not a checksum failure: its parts still verify.
    rc, lines = _cli(capsys, "verify", job_dir(work) / "step-10")
    assert rc == 0 and all("not committed" in line for line in lines[:-1]) and len(lines) == 3


# ---- verify ---------------------------------------------------------------


@e2e
def test_verify_passes_on_the_clean_run_for_every_kind_of_path(run, capsys):
    rc, lines = _cli(capsys, "verify", run / "dump")
    assert rc == 0
    ok = [line for line in lines if line.startswith("ok ")]
    committed = [line for line in ok if line.split()[3] == "committed;"]
    assert len(committed) == 3 * 2  # 3 steps x 2 rank parts
    assert len([line for line in ok if line.split()[1] == "pfs"]) == 4  # 4, 8, 12's export, 12's full state
    assert len(ok) == len(lines) - 2 and lines[-1].endswith(" 0 FAILED, 0 unverified, 0 torn")
    local, pfs = job_dir(run), run / "dump" / "checkpoint"
    for path, n in ((local / "step-12", 2), (local, len(ok) - 4), (local.parent, len(ok) - 4),
                    (pfs / "step-8", 1), (pfs, 4)):
        rc, lines = _cli(capsys, "verify", path)
        assert rc == 0 and len(lines) == n + 1, lines
        assert all(line.startswith("ok ") for line in lines[:-1])
    assert _cli(capsys, "verify", run / "nope")[0] == 2


@e2e
def test_verify_fails_naming_each_corrupted_file(run, tmp_path, capsys):
    work = _copy(run, tmp_path)
    bad_local = job_dir(work) / "step-12" / "rank-00001.data"
    bad_pfs = work / "dump" / "checkpoint" / "step-8" / "__0_0.distcp"
    flip_byte(bad_local)
    flip_byte(bad_pfs)
    rc, lines = _cli(capsys, "verify", work / "dump")
    assert rc == 1
    failed = [line.split()[2] for line in lines if line.startswith("FAILED")]
    assert failed == [str(bad_local), str(bad_pfs)]
    assert all("crc32c" in line for line in lines if line.startswith("FAILED"))
    assert lines[-1].endswith(" 2 FAILED, 0 unverified, 0 torn")
    # each file is named from its own step folder too; the clean rank still passes
    rc, lines = _cli(capsys, "verify", bad_local.parent)
    assert rc == 1 and lines[0].startswith("ok ") and lines[1].split()[2] == str(bad_local)
    rc, lines = _cli(capsys, "verify", bad_pfs.parent)
    assert rc == 1 and lines[0].split()[2] == str(bad_pfs)


@e2e
def test_verify_stock_pfs_step_is_unverified_and_missing_manifest_fails(run, tmp_path, capsys):
    work = _copy(run, tmp_path)
    (work / "dump" / "checkpoint" / "step-4" / "titan_ckpt_plus.json").unlink()
    rc, lines = _cli(capsys, "verify", work / "dump" / "checkpoint")
    assert rc == 0 and lines[0].startswith("unverified") and "stock" in lines[0]
    gone = job_dir(work) / "step-8" / "rank-00000.json"
    gone.unlink()  # a committed step with a part lacking its manifest cannot be loaded
    rc, lines = _cli(capsys, "verify", job_dir(work) / "step-8")
    assert rc == 1 and lines[0].split()[2] == str(gone)


# ---- report ---------------------------------------------------------------


def _image_size(path: str) -> tuple[int, int]:
    import matplotlib.image

    img = matplotlib.image.imread(path)
    return img.shape[1], img.shape[0]


def _points(records, key):
    return [float(r["step"]) for r in records], [float(r[key]) for r in records]


@e2e
def test_report_pngs_open_and_plot_the_records(run, tmp_path, capsys):
    rep = render(str(run / "dump"), str(tmp_path / "rep"))
    assert [os.path.basename(f) for f in rep.files] == ["delta.png", "background_write.png", "interval.png"]
    for f in rep.files[:2]:
        assert _image_size(f) == (800, 450)
    # fixed intervals (local 2, PFS 4) against Young's tau for the measured delta: a
    # record after every save, the waste of the configured interval beside the optimum
    iv = ckpt_events(run, "interval")
    assert [e["step"] for e in iv] == [2, 4, 6, 8, 10, 12] and not any(e["adaptive"] for e in iv)
    assert rep.series["interval/local interval"][1] == [2.0] * 6
    assert rep.series["interval/pfs interval"][1] == [4.0] * 6
    assert rep.series["interval/local tau"][1] == [e["local_tau_s"] for e in iv]
    for e in iv[1:]:  # from the second save on a step time is known
        assert e["local_s"] == pytest.approx(2 * e["step_time_s"])
        assert e["local_waste"] > e["local_optimal_waste"] > 0  # 2 steps is far below tau here
    assert rep.series["delta/local delta"] == _points(ckpt_events(run, "stage"), "delta_s")
    assert rep.series["background_write/local write"] == _points(
        ckpt_events(run, "local_commit"), "background_write_s")
    assert rep.series["background_write/pfs write"] == _points(
        ckpt_events(run, "pfs_commit"), "background_write_s")
    assert rep.series["delta/local delta"][0] == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    assert not rep.marks  # no recovery in an uninterrupted run
    rc, lines = _cli(capsys, "report", run / "dump", "--out", tmp_path / "cli")
    assert rc == 0 and f"wrote {tmp_path / 'cli' / 'delta.png'}" in lines


@e2e
def test_report_interval_panel_and_failures_marked(run, tmp_path):
    """The run's records plus a later incarnation's (recovery, a save of step 8 again, a
    failed save), "interval" records as the adaptive policy writes them, and a failure
    ledger saying the run's incarnation died without a clean end."""
    from titan_ckpt_plus.policy.ledger import FailureLedger

    dump = tmp_path / "dump"
    (dump / "titan_ckpt_plus").mkdir(parents=True)
    ev = [e for e in events(run / "dump" / "titan_ckpt_plus" / "events.jsonl") if e["event"] != "interval"]
    t0 = min(e["time"] for e in ev)
    ledger = FailureLedger(dump / "titan_ckpt_plus" / "ledger.jsonl")
    ledger.start("a", t0 - 1, world_size=2)
    ledger.heartbeat("a", t0 + 0.01, step=1)
    ledger.start("b", t0 + 650, world_size=2)
    ledger.recovery("b", t0 + 660, "local", 6, 0.4)
    ledger.clean_end("b", t0 + 700)
    ev.append({"event": "failure", "time": t0 + 600, "class": "node", "step": 7})
    ev.append({"event": "recovery", "time": t0 + 660, "step": 6, "tier": "local", "seconds": 0.4,
               "bytes_local": 1, "bytes_pfs": 0, "skipped": []})
    ev += [{"event": "stage", "tier": "local", "step": 8, "delta_s": 0.5, "time": t0 + 670},
           {"event": "save_failed", "tier": "local", "step": 10, "error": "disk full", "time": t0 + 680}]
    ev += [{"event": "interval", "step": 2 * i, "local_steps": i + 2, "pfs_steps": 2 * i + 4,
            "local_tau_s": 10.0 * (i + 1), "pfs_tau_s": 20.0 * (i + 1),
            "mtbf_any_s": math.inf if i == 0 else 3600.0 * i, "mtbf_unrecoverable_s": 7200.0,
            "local_optimal_steps": 3, "local_s": 1.5 * (i + 2), "local_waste": 0.01 * (i + 1),
            "local_optimal_waste": 0.005 if i else None, "adaptive": False,
            "time": t0 + 120 * i} for i in range(5)]
    (dump / "titan_ckpt_plus" / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ev))
    last = max((e for e in ev if e["time"] < t0 + 650 and e["event"] != "failure"),
               key=lambda e: e["time"])  # the dead incarnation's last sign of life: step 8
    assert last["step"] == 8
    rep = render(str(dump))
    out = dump / "titan_ckpt_plus" / "report"
    assert rep.files == [str(out / n) for n in ("delta.png", "background_write.png", "interval.png")]
    assert _image_size(rep.files[2]) == (800, 1200) and not rep.notes
    minutes = pytest.approx([i * 2.0 for i in range(5)])  # 120 s apart: a 10-minute span
    assert rep.series["interval/local interval"] == (minutes, [2.0, 3.0, 4.0, 5.0, 6.0])
    assert rep.series["interval/pfs interval"] == (minutes, [4.0, 6.0, 8.0, 10.0, 12.0])
    assert rep.series["interval/local tau"] == (minutes, [10.0, 20.0, 30.0, 40.0, 50.0])
    assert rep.series["interval/pfs tau"] == (minutes, [20.0, 40.0, 60.0, 80.0, 100.0])
    # fixed intervals against the policy's: its steps, the interval in s, waste in %
    assert rep.series["interval/local Young"] == (minutes, [3.0] * 5)
    assert rep.series["interval/local interval (s)"] == (minutes, [3.0, 4.5, 6.0, 7.5, 9.0])
    assert rep.series["interval/local waste, interval in use"][1] == pytest.approx([1, 2, 3, 4, 5])
    assert rep.series["interval/local waste at tau"][1] == pytest.approx([0.5] * 4)  # None: not yet
    assert "interval/pfs Young" not in rep.series  # not in these records
    # MTBF in hours; the first, infinite estimate is not plotted
    assert rep.series["interval/MTBF any"] == (pytest.approx([2.0, 4.0, 6.0, 8.0]), [1.0, 2.0, 3.0, 4.0])
    assert rep.series["interval/MTBF unrecoverable"][1] == [2.0] * 5
    # the second incarnation's step 8 is plotted too (the line breaks where steps go back)
    assert rep.series["delta/local delta"][0][-2:] == [12.0, 8.0]
    assert rep.series["delta/failed save"] == ([10.0], [0.0])
    # recovery at the step resumed from; failures at the "failure" event and at the
    # dead incarnation's last event (later than its last ledger heartbeat)
    assert rep.marks["delta"] == [("recovery", 6.0), ("failure", 7.0), ("failure", float(last["step"]))]
    assert [k for k, _ in rep.marks["interval[2]"]] == ["recovery", "failure", "failure"]
    assert [x for _, x in rep.marks["interval[2]"]] == pytest.approx(
        [11.0, 10.0, (last["time"] - t0) / 60])  # minutes


# ---- CLI plumbing ---------------------------------------------------------


def test_commands_registered_with_usage_in_their_help():
    assert {"ls", "verify", "report"} <= set(COMMANDS)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in ("ls", "verify", "report"):
        text = sub.choices[name].format_help()
        assert "examples:" in text and f"titan-ckpt {name} " in text, text
    assert "exit status" in sub.choices["verify"].format_help()


@e2e
def test_ls_verify_report_import_no_torch(run, tmp_path):
    code = (
        "import sys\n"
        "from titan_ckpt_plus.cli import main\n"
        f"dump, out = {str(run / 'dump')!r}, {str(tmp_path / 'rep')!r}\n"
        "assert main(['ls', dump]) == 0\n"
        "assert main(['verify', dump]) == 0\n"
        "assert main(['report', dump, '--out', out]) == 0\n"
        "assert 'matplotlib' in sys.modules\n"
    )
    run_without_torch(code)
    assert (tmp_path / "rep" / "delta.png").is_file()
