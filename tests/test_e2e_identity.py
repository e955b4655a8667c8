"""Job identity end to end (1 CPU rank): an identity file that cannot be trusted is
ignored with one warning and never leads to a load; a PFS folder holding another
identity's steps is refused before any step, and adopt_job continues that job on
purpose. (Jobs sharing a node folder, a new dump folder on a used disk and uneven
replicas are in the fault matrix: scripts/chaos.py, tests/test_chaos.py.)"""

import json
import shutil
from pathlib import Path

import pytest

from harness import ckpt_events, copy_run, job_dir, job_id, losses, ok, torchrun

pytestmark = pytest.mark.e2e
STEPS = 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("identity_ref")
    proc = torchrun(work, nproc=1)
    ok(proc)
    return work


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """Preempted (SIGTERM) after step 5: its newest local step is on the PFS too, so
    the PFS folder deterministically holds this job's steps."""
    work = tmp_path_factory.mktemp("identity_stopped")
    torchrun(work, nproc=1, fault="sigterm_after_step@5:0", loss_log="run1.jsonl")
    ev = ckpt_events(work, "preemption")
    assert ev and ev[-1]["pfs_step"] == max(e["step"] for e in ckpt_events(work, "local_commit"))
    return work


def _same_losses_from(work, reference, first, name):
    got, ref = losses(work, name), losses(reference)
    assert [got.get(s) for s in range(first, STEPS + 1)] == [ref[s] for s in range(first, STEPS + 1)]


def test_garbled_identity_beside_pfs_steps_is_refused_then_adopted(reference, stopped, tmp_path):
    work = copy_run(stopped, tmp_path / "w")
    old_id = job_id(work)
    ident = work / "dump" / "titan_ckpt_plus" / "job.json"
    ident.write_bytes(b'{"format": 1, "job_id": ')  # torn
    proc = torchrun(work, nproc=1, loss_log="run2.jsonl")
    assert proc.returncode != 0
    assert f"ignored {ident}: not JSON" in proc.stdout
    step = ckpt_events(work, "preemption")[-1]["pfs_step"]
    assert f"of job(s) ['{old_id}']" in proc.stdout and f"{step}]" in proc.stdout
    assert f"adopt_job = '{old_id}'" in proc.stdout and "step:  1" not in proc.stdout
    assert ident.read_bytes() == b'{"format": 1, "job_id": '  # a refused start changes nothing

    proc = torchrun(work, "--checkpoint.adopt_job", old_id, nproc=1, loss_log="run2.jsonl")
    ok(proc)
    assert f"adopt_job = '{old_id}': this job" in proc.stdout
    rec = ckpt_events(work, "recovery")[-1]
    assert (rec["tier"], rec["step"], rec["bytes_pfs"]) == ("local", step, 0)
    _same_losses_from(work, reference, step + 1, "run2.jsonl")
    assert json.loads(ident.read_text())["job_id"] == old_id


def test_identity_naming_another_missing_folder_is_ignored_and_nothing_is_loaded(reference, stopped, tmp_path):
    work = copy_run(stopped, tmp_path / "w")
    old = job_dir(work)
    ident = work / "dump" / "titan_ckpt_plus" / "job.json"
    ident.write_text(json.dumps(dict(json.loads(ident.read_text()), dump_folder="/nonexistent/run")))
    shutil.rmtree(work / "dump" / "checkpoint")  # only local steps are left to tempt it
    proc = torchrun(work, nproc=1, loss_log="run2.jsonl")
    ok(proc)
    assert proc.stdout.count(f"ignored {ident}") == 1 and "no longer exists" in proc.stdout
    assert not ckpt_events(work, "recovery") and "Training starts at step 1" in proc.stdout
    _same_losses_from(work, reference, 1, "run2.jsonl")
    assert job_dir(work) != old and list(old.glob("step-*/COMMIT.json"))
