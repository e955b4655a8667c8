"""`titan-ckpt ls LOCAL_FOLDER` and `titan-ckpt clean` on node folders built by hand:
a running job (its lock held by another process), a resumable one, stale ones (dump
folder missing, now another job's, without identity), a garbled JOB.json and steps
written before job identities. No torch, no torchrun."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import ROOT, run_without_torch
from titan_ckpt_plus.cli import COMMANDS, _remove, build_parser, main
from titan_ckpt_plus.inspect import job_status, node_folder_problem
from titan_ckpt_plus.tiers import files
from titan_ckpt_plus.tiers.local import JOB_RECORD, NodeJob, node_jobs

STALE = {"gone-c": "stale: dump folder missing",
         "moved-d": "stale: dump folder is now job other-x",
         "(no identity)": "legacy: no job identity, never loaded"}
KEPT = {"run-a": "running", "res-b": "resumable",
        "noid-e": "orphaned: its dump folder has no job identity (adopt_job = 'noid-e' there continues it)"}


def _steps(folder: Path, steps, nbytes: int = 1000) -> None:
    for s in steps:
        (folder / f"step-{s}").mkdir(parents=True)
        (folder / f"step-{s}" / "rank-00000.data").write_bytes(b"x" * nbytes)


def _identity(dump: Path, job_id: str) -> None:
    (dump / "titan_ckpt_plus").mkdir(parents=True)
    files.atomic_write_json(str(dump / "titan_ckpt_plus" / "job.json"), {
        "format": 1, "job_id": job_id, "dump_folder": os.path.realpath(dump), "created_at": 0.0})


def _job(local: Path, job_id: str, dump: Path, steps=(2,)) -> Path:
    folder = local / f"job-{job_id}"
    _steps(folder, steps)
    files.atomic_write_json(str(folder / JOB_RECORD), {
        "format": 1, "job_id": job_id, "dump_folder": os.path.realpath(dump), "created_at": 0.0,
        "host": "node0", "pid": 1, "started_at": 0.0})
    return folder


def _age(folder: Path, hours: float) -> None:
    t = time.time() - hours * 3600
    for base, _, names in os.walk(folder):
        for n in names:
            os.utime(os.path.join(base, n), (t, t))


@pytest.fixture
def node(tmp_path) -> Path:
    """A node folder with one job of each status (run-a's lock is not held here)."""
    local, dumps = tmp_path / "local", tmp_path / "dumps"
    for job_id, ident in (("run-a", "run-a"), ("res-b", "res-b"), ("moved-d", "other-x")):
        _identity(dumps / job_id, ident)
    (dumps / "noid-e").mkdir()
    _job(local, "run-a", dumps / "run-a", steps=(8, 10, 12))
    _job(local, "res-b", dumps / "res-b", steps=(4, 6))
    _job(local, "gone-c", dumps / "gone-c", steps=(1, 2, 3, 4, 5, 6, 7, 8))
    _job(local, "moved-d", dumps / "moved-d")
    _job(local, "noid-e", dumps / "noid-e")
    _job(local, "garb-f", dumps / "res-b")
    (local / "job-garb-f" / JOB_RECORD).write_text("{not json")
    _steps(local, (100, 200))  # written before job identities, last touched 2 h ago
    for s in (100, 200):
        _age(local / f"step-{s}", 2)
    return local


class Holder:
    """Another process holding a job folder's lock, as a running job's first rank does."""

    def __init__(self, folder: Path) -> None:
        code = ("import sys\nfrom titan_ckpt_plus.tiers.local import JobLock\n"
                "lock = JobLock(sys.argv[1])\nassert lock.acquire() == ''\n"
                "print('held', flush=True)\nsys.stdin.read()\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], cwd=ROOT,
                                     env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"
        self.who = f"pid {self.proc.pid} on {os.uname().nodename}"

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture
def running(node):
    holder = Holder(node / "job-run-a")
    yield holder
    holder.stop()


def _cli(capsys, *argv) -> tuple[int, list[str]]:
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().out.splitlines()


def _rows(lines) -> dict[str, dict]:
    """job -> row of the node table, as a dict of its columns."""
    body = [line for line in lines if not line.startswith("#")]
    header = body[0].split()
    return {cells[0]: dict(zip(header, cells))
            for cells in (re.split(r"\s{2,}", line) for line in body[1:])}


def _clean_lines(lines, verb: str) -> dict[str, str]:
    """Job id (or "(no identity)") -> its line, for lines starting with `verb`."""
    out = {}
    for line in lines:
        if line.startswith(verb + " job "):
            out[line.split()[len(verb.split()) + 1]] = line
        elif line.startswith(verb + " legacy steps "):
            out["(no identity)"] = line
    return out


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _left(local: Path) -> set[str]:
    return set(os.listdir(local))


# ---- ls -------------------------------------------------------------------


def test_ls_node_folder_lists_each_job_with_its_status(node, running, capsys):
    rc, lines = _cli(capsys, "ls", node)
    assert rc == 0
    assert lines[0] == f"# node folder {node}: 7 jobs"
    rows = _rows(lines)
    assert {j: r["status"] for j, r in rows.items()} == dict(
        STALE, **KEPT, **{"garb-f": "unknown: JOB.json: unreadable (Expecting property name "
                                    "enclosed in double quotes: line 1 column 2 (char 1))"})
    assert rows["run-a"]["writing"] == f"yes ({running.who})"
    assert all(r["writing"] == "no" for j, r in rows.items() if j != "run-a")
    assert rows["run-a"]["steps"] == "8,10,12" and rows["res-b"]["steps"] == "4,6"
    assert rows["gone-c"]["steps"] == "1,...,6,7,8 (8 steps)"
    assert rows["(no identity)"]["steps"] == "100,200" and rows["(no identity)"]["dump_folder"] == "-"
    assert rows["res-b"]["dump_folder"] == os.path.realpath(node.parent / "dumps" / "res-b")
    assert rows["garb-f"]["dump_folder"] == "(JOB.json: unreadable)"
    assert rows["(no identity)"]["size"] == "2.0 KiB"  # 2 x 1000 B
    assert rows["gone-c"]["size"] == files.human_bytes(_size(node / "job-gone-c"))
    assert rows["(no identity)"]["age"] == "2.0h"
    assert all(re.fullmatch(r"\d+s", r["age"]) for j, r in rows.items() if j != "(no identity)")
    assert lines[-1] == f"# stale steps are never deleted by a job: titan-ckpt clean {node} --dry-run"


def test_ls_keeps_the_dump_folder_listing(node, capsys):
    dump = node.parent / "dumps" / "res-b"
    files.atomic_write_json(str(dump / "titan_ckpt_plus" / "local_roots.json"), [str(node / "job-res-b")])
    rc, lines = _cli(capsys, "ls", dump)
    assert rc == 0
    assert f"# local root {node / 'job-res-b'} (from local_roots.json)" in lines
    assert any(line.startswith("tier ") for line in lines)


def test_ls_of_an_empty_folder_lists_nothing(tmp_path, capsys):
    rc, lines = _cli(capsys, "ls", tmp_path)
    assert rc == 1 and "no steps found" in lines


def test_ls_node_folder_refuses_local_root(node, capsys):
    rc, lines = _cli(capsys, "ls", node, "--local-root", node / "job-res-b")
    assert rc == 2 and lines[0].startswith("error: --local-root goes with a dump folder")


# ---- job_status / node_folder_problem --------------------------------------


def _node_job(job_id, dump, problem="", writing="") -> NodeJob:
    return NodeJob(job_id, "/x", {} if problem else {"dump_folder": str(dump)}, problem,
                   [], 0, 0.0, writing)


def test_job_status(tmp_path):
    _identity(tmp_path / "mine", "a")
    _identity(tmp_path / "other", "b")
    (tmp_path / "garbled" / "titan_ckpt_plus").mkdir(parents=True)
    (tmp_path / "garbled" / "titan_ckpt_plus" / "job.json").write_text('{"format": 1}')
    (tmp_path / "bare").mkdir()
    cases = {
        ("a", "mine", ""): ("resumable", False),
        ("a", "mine", "pid 1"): ("running", False),
        ("a", "other", "pid 1"): ("running", False),
        ("a", "other", ""): ("stale: dump folder is now job b", True),
        ("a", "nowhere", ""): ("stale: dump folder missing", True),
        ("a", "bare", ""): ("orphaned: its dump folder has no job identity (adopt_job = 'a' there "
                            "continues it)", False),
        ("a", "garbled", ""): ("orphaned: its dump folder's identity is unusable (adopt_job = 'a' "
                               "there continues it)", False),
    }
    for (job_id, dump, writing), want in cases.items():
        assert job_status(_node_job(job_id, tmp_path / dump, writing=writing)) == want, (job_id, dump)
    assert job_status(_node_job("a", None, problem="/x/JOB.json: missing")) == (
        "unknown: JOB.json: missing", False)


def test_node_folder_problem(node, tmp_path):
    assert node_folder_problem(str(node)) == ""
    assert "one job's folder" in node_folder_problem(str(node / "job-res-b"))
    assert "is a dump folder" in node_folder_problem(str(tmp_path / "dumps" / "res-b"))
    assert "no such folder" in node_folder_problem(str(tmp_path / "nowhere"))
    pfs = tmp_path / "dumps" / "res-b" / "checkpoint" / "step-4"
    pfs.mkdir(parents=True)
    (pfs / ".metadata").write_bytes(b"")
    assert "PFS steps" in node_folder_problem(str(pfs.parent))


# ---- clean ----------------------------------------------------------------


def test_clean_dry_run_lists_the_stale_and_legacy_steps_and_changes_nothing(node, running, capsys):
    before = {p: p.stat().st_mtime for p in node.rglob("*")}
    rc, lines = _cli(capsys, "clean", node, "--dry-run")
    assert rc == 0
    would = _clean_lines(lines, "would remove")
    assert set(would) == set(STALE)
    for job_id, status in STALE.items():
        assert would[job_id].endswith(": " + status)
    gone = node.parent / "dumps" / "gone-c"
    size_c = files.human_bytes(_size(node / "job-gone-c"))
    assert would["gone-c"] == (f"would remove job gone-c (8 steps, {size_c}), "
                               f"dump folder {gone}: stale: dump folder missing")
    assert would["(no identity)"] == (f"would remove legacy steps (2 steps, 2.0 KiB), directly in {node}: "
                                      "legacy: no job identity, never loaded")
    assert "(1 step, " in would["moved-d"]
    assert f"kept run-a: still writing ({running.who})" in lines
    assert "kept res-b: resumable" in lines
    assert any(line.startswith("kept garb-f: unknown: JOB.json") for line in lines)
    assert "kept noid-e: orphaned: its dump folder has no job identity" in "\n".join(lines)
    size = 2000 + sum(_size(node / f"job-{j}") for j in ("gone-c", "moved-d"))
    assert lines[-1] == f"total: would remove 11 steps, {files.human_bytes(size)}; kept 4 of 7 jobs"
    assert {p: p.stat().st_mtime for p in node.rglob("*")} == before


def test_clean_removes_exactly_the_stale_and_legacy_steps(node, running, capsys):
    rc, lines = _cli(capsys, "clean", node)
    assert rc == 0
    assert set(_clean_lines(lines, "removed")) == set(STALE)
    assert _left(node) == {"job-run-a", "job-res-b", "job-garb-f", "job-noid-e"}
    assert sorted(os.listdir(node / "job-res-b")) == [JOB_RECORD, "step-4", "step-6"]
    assert running.proc.poll() is None  # the running job's lock is still its own
    rc, lines = _cli(capsys, "ls", node)
    assert rc == 0 and set(_rows(lines)) == {"run-a", "res-b", "garb-f", "noid-e"}
    rc, lines = _cli(capsys, "clean", node)  # nothing left to remove
    assert rc == 0 and lines[-1] == "total: removed 0 steps, 0 B; kept 4 of 4 jobs"


def test_clean_job_selects_a_named_job_but_never_a_running_one(node, running, capsys):
    rc, lines = _cli(capsys, "clean", node, "--job", "res-b", "--job", "garb-f", "--job", "run-a",
                     "--dry-run")
    assert rc == 0
    assert set(_clean_lines(lines, "would remove")) == set(STALE) | {"res-b", "garb-f"}
    assert f"kept run-a: still writing ({running.who})" in lines
    rc, lines = _cli(capsys, "clean", node, "--job", "res-b")
    assert rc == 0 and _left(node) == {"job-run-a", "job-garb-f", "job-noid-e"}
    rc, lines = _cli(capsys, "clean", node, "--job", "nope")
    assert rc == 2 and lines == [f"error: no job nope in {node}"]


def test_clean_older_than_selects_idle_jobs_by_their_newest_file(node, running, capsys):
    _age(node / "job-res-b", 10)
    _age(node / "job-run-a", 10)
    _age(node / "job-garb-f", 2)
    rc, lines = _cli(capsys, "clean", node, "--older-than", "5", "--dry-run")
    assert rc == 0
    assert set(_clean_lines(lines, "would remove")) == set(STALE) | {"res-b"}
    assert f"kept run-a: still writing ({running.who})" in lines
    rc, lines = _cli(capsys, "clean", node, "--older-than", "1", "--dry-run")
    assert set(_clean_lines(lines, "would remove")) == set(STALE) | {"res-b", "garb-f"}


def test_legacy_steps_written_to_within_the_hour_are_kept(node, capsys):
    (node / "step-200" / "rank-00000.data").write_bytes(b"y")  # an older plugin's job, now
    rc, lines = _cli(capsys, "clean", node, "--dry-run")
    assert "kept (no identity): legacy: no job identity, written to within the hour (kept)" in lines


def test_clean_skips_a_job_that_took_its_lock_after_the_listing(node, capsys):
    job = next(j for j in node_jobs(str(node)) if j.job_id == "gone-c")
    assert job.writing == ""
    holder = Holder(node / "job-gone-c")  # the job started right then
    try:
        assert _remove(job) == f"still writing ({holder.who})"
        assert (node / "job-gone-c" / "step-8").is_dir()
    finally:
        holder.stop()
    assert _remove(job) == "" and not (node / "job-gone-c").exists()


def test_clean_refuses_what_is_not_a_node_folder(node, tmp_path, capsys):
    assert _cli(capsys, "clean", tmp_path / "nowhere")[0] == 2
    rc, lines = _cli(capsys, "clean", node / "job-res-b")  # its steps are not legacy ones
    assert rc == 2 and "one job's folder" in lines[0]
    assert _cli(capsys, "clean", tmp_path / "dumps" / "res-b")[0] == 2
    assert (node / "job-res-b" / "step-4").is_dir()


def test_help_texts_have_examples():
    assert "clean" in COMMANDS
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = sub.choices["clean"].format_help()
    assert "examples:" in text and "titan-ckpt clean " in text and "exit status" in text
    assert "titan-ckpt ls /local_nvme/ckpt/0" in sub.choices["ls"].format_help()


def test_ls_and_clean_import_no_torch(node):
    code = ("from titan_ckpt_plus.cli import main\n"
            f"local = {str(node)!r}\n"
            "assert main(['ls', local]) == 0\n"
            "assert main(['clean', local, '--dry-run']) == 0\n"
            "assert main(['clean', local]) == 0\n")
    run_without_torch(code)
    assert _left(node) == {"job-run-a", "job-res-b", "job-garb-f", "job-noid-e"}
