"""Job identity (identity.py) and a job's claim on its node subfolder (no torch)."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from harness import ROOT, run_without_torch
from titan_ckpt_plus import config, identity
from titan_ckpt_plus.tiers.local import JOB_RECORD, claim_job_dir, job_dir, lock_holder, others_note


def _first_start(dump) -> identity.JobIdentity:
    est = identity.establish(str(dump))
    identity.commit(est)
    return est.identity


def test_first_start_makes_an_identity_and_later_starts_keep_it(tmp_path):
    dump = tmp_path / "dump"
    est = identity.establish(str(dump), now=1.8e9)
    assert est.write and not est.warnings and identity.valid_job_id(est.identity.job_id)
    assert est.identity.job_id.startswith("20270115-")  # sortable by creation time
    identity.commit(est)
    raw = json.loads((dump / "titan_ckpt_plus" / "job.json").read_text())
    assert raw == {"format": 1, "job_id": est.identity.job_id, "dump_folder": os.path.realpath(dump),
                   "created_at": 1.8e9, "adopted_from": "", "dump_inode": os.stat(dump).st_ino}
    again = identity.establish(str(dump))
    assert again.identity == est.identity and not again.write and not again.warnings
    assert identity.establish(str(tmp_path / "other")).identity.job_id != est.identity.job_id


def test_an_identity_from_before_inodes_gets_one_and_then_survives_a_rename(tmp_path):
    dump = tmp_path / "dump"
    (dump / "titan_ckpt_plus").mkdir(parents=True)
    old = {"format": 1, "job_id": "20260101-000000-abcdef01", "dump_folder": os.path.realpath(dump),
           "created_at": 0}
    (dump / "titan_ckpt_plus" / "job.json").write_text(json.dumps(old))
    est = identity.establish(str(dump))
    assert est.write and est.identity.job_id == old["job_id"]
    identity.commit(est)
    raw = json.loads((dump / "titan_ckpt_plus" / "job.json").read_text())
    assert raw["dump_inode"] == os.stat(dump).st_ino
    dump.rename(tmp_path / "renamed")
    assert identity.establish(str(tmp_path / "renamed")).identity.job_id == old["job_id"]


@pytest.mark.parametrize("content, reason", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"format": 2, "job_id": "a", "dump_folder": "/x", "created_at": 0}', "newer than this plugin's"),
    (b'{"format": 1, "job_id": "../up", "dump_folder": "/x", "created_at": 0}', "invalid job_id"),
    (b'{"job_id": "a", "dump_folder": "/x", "created_at": 0}', "no valid format"),
    (b"\xff\xfe", "not JSON"),
])
def test_an_unusable_identity_file_is_ignored_with_one_warning_naming_it(tmp_path, content, reason):
    dump = tmp_path / "dump"
    path = dump / "titan_ckpt_plus" / "job.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    est = identity.establish(str(dump))
    assert len(est.warnings) == 1 and str(path) in est.warnings[0] and reason in est.warnings[0]
    assert est.write and est.set_aside == str(path)
    assert path.read_bytes() == content  # nothing changes before commit (a refused start)
    identity.commit(est)
    assert identity.read(str(path)) == est.identity
    (aside,) = path.parent.glob("job.json.ignored-*")
    assert aside.read_bytes() == content  # kept for the user, never overwritten


def test_a_copied_dump_folder_is_a_new_job_and_a_renamed_one_the_same(tmp_path):
    original = _first_start(tmp_path / "a")
    copy = tmp_path / "b"
    (copy / "titan_ckpt_plus").mkdir(parents=True)
    (copy / "titan_ckpt_plus" / "job.json").write_bytes((tmp_path / "a" / "titan_ckpt_plus" / "job.json").read_bytes())
    est = identity.establish(str(copy))
    assert est.identity.job_id != original.job_id
    assert f"job {original.job_id}'s" in est.warnings[0] and "another job's dump folder" in est.warnings[0]
    assert "adopt_job" in est.warnings[0]
    # the copy's original gone: still not this folder (another inode), still a new job
    (tmp_path / "a").rename(tmp_path / "elsewhere")
    est = identity.establish(str(copy))
    assert est.identity.job_id != original.job_id and "no longer exists" in est.warnings[0]
    # the original itself renamed (or seen through another mount): the same job, new path
    est = identity.establish(str(tmp_path / "elsewhere"))
    assert est.identity.job_id == original.job_id and not est.warnings and est.write
    assert "this is that folder, now" in est.notes[0]
    identity.commit(est)
    again = identity.establish(str(tmp_path / "elsewhere"))
    assert again.identity.dump_folder == os.path.realpath(tmp_path / "elsewhere") and not again.write


def test_an_identity_file_that_cannot_be_read_now_is_not_replaced(tmp_path):
    path = tmp_path / "dump" / "titan_ckpt_plus" / "job.json"
    path.mkdir(parents=True)  # reading it fails with an OSError, as an I/O error would
    with pytest.raises(OSError):
        identity.establish(str(tmp_path / "dump"))


def test_adopt_job_takes_an_identity_on_purpose_and_is_idempotent(tmp_path):
    mine = _first_start(tmp_path / "dump")
    est = identity.establish(str(tmp_path / "dump"), adopt="20260101-000000-abcdef01")
    assert est.identity.job_id == "20260101-000000-abcdef01" and est.identity.adopted_from == mine.job_id
    assert "takes job 20260101-000000-abcdef01's identity" in est.notes[0]
    identity.commit(est)
    again = identity.establish(str(tmp_path / "dump"), adopt="20260101-000000-abcdef01")
    assert not again.write and "already this job's identity" in again.notes[0]


def test_adopt_job_must_be_a_job_id(tmp_path):
    ckpt = config.Checkpoint(tier_local=True, local_folder=str(tmp_path / "l"), adopt_job="../../etc")
    ckpt.enable, ckpt.interval, ckpt.keep_latest_k, ckpt.folder = True, 10, 3, "checkpoint"
    with pytest.raises(config.ConfigError, match=r"adopt_job = '../../etc' is not a job id"):
        config.validate(ckpt, str(tmp_path / "dump"))


def test_a_second_process_of_one_job_on_a_node_is_refused_while_the_first_holds_it(tmp_path):
    folder = job_dir(str(tmp_path), "20260101-000000-abcdef01")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom titan_ckpt_plus.tiers.local import claim_job_dir\n"
         f"lock, why = claim_job_dir({folder!r}, {{'job_id': 'x', 'dump_folder': '/d'}})\n"
         "assert not why, why\nprint('held', flush=True)\ntime.sleep(60)"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lock_holder(folder).startswith(f"pid {holder.pid} on ")
        t0 = time.monotonic()
        lock, why = claim_job_dir(folder, {"job_id": "x", "dump_folder": "/d"}, wait_s=0.3)
        assert lock is None and f"pid {holder.pid}" in why and "{node_rank}" in why
        assert time.monotonic() - t0 >= 0.3  # it waited for the holder to let go first
        lock, why = claim_job_dir(folder, {"job_id": "x", "dump_folder": "/d"}, wait_s=0, look=True)
        assert lock is None and "Fix: give this load_only run a [checkpoint] local_folder of its own" in why
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 5
    while lock_holder(folder) and time.monotonic() < deadline:
        time.sleep(0.01)
    lock, why = claim_job_dir(folder, {"job_id": "x", "dump_folder": "/d"})  # a killed holder frees it
    assert lock is not None and not why
    assert json.loads(open(os.path.join(folder, JOB_RECORD)).read())["dump_folder"] == "/d"
    lock.release()


def test_a_restart_clears_a_killed_incarnations_torn_files_and_starts_on_a_full_disk(tmp_path, monkeypatch):
    """A SIGKILL mid-write leaves `<name>.tmp<pid>` files: removed once the restart holds
    the lock (they are never read). On a disk too full for a new JOB.json the same
    job's record stays and the job starts; another job's record is not taken over."""
    import errno

    from titan_ckpt_plus.tiers import files, local

    folder = job_dir(str(tmp_path), "20260101-000000-abcdef01")
    os.makedirs(os.path.join(folder, "step-4"))
    torn = [os.path.join(folder, "step-4", "rank-00001.data.tmp4242"), os.path.join(folder, "JOB.json.tmp4242")]
    kept = [os.path.join(folder, "step-4", "rank-00000.data"), os.path.join(folder, "step-4", "rank-00000.json")]
    for p in torn + kept:
        open(p, "wb").write(b"x" * 100)
    mine = {"job_id": "20260101-000000-abcdef01", "dump_folder": "/d"}
    open(os.path.join(folder, JOB_RECORD), "w").write(json.dumps(mine))

    def full(fd, chunk):
        os.write(fd, bytes(chunk[:1]))  # a write cut short by the full disk
        raise OSError(errno.ENOSPC, "No space left on device")

    def no_room(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "write_all", full)  # the new JOB.json's bytes: its .tmp<pid> goes too
    monkeypatch.setattr(local.os, "pwrite", no_room)  # not even the lock's holder line fits
    lock, why = claim_job_dir(folder, dict(mine, pid=2))
    assert lock is not None and not why
    assert [os.path.exists(p) for p in torn + kept] == [False, False, True, True]
    assert sorted(os.listdir(folder)) == [".lock", JOB_RECORD, "step-4"]
    assert json.loads(open(os.path.join(folder, JOB_RECORD)).read()) == mine
    lock.release()
    lock, why = claim_job_dir(folder, {"job_id": "20270101-000000-0ther0b0", "dump_folder": "/e"})
    assert lock is None and "No space left" in why
    assert local.remove_torn(folder) == []


def test_identity_imports_no_torch():
    run_without_torch("import titan_ckpt_plus.identity, titan_ckpt_plus.tiers.local")


def test_a_full_disk_message_names_other_jobs_leftovers(tmp_path):
    node = tmp_path / "node"
    mine, other = node / "job-mine", node / "job-20260101-000000-0ther0b0"
    for d, n in ((mine / "step-4", 10), (other / "step-8", 3 << 20), (node / "step-2", 1 << 20)):
        d.mkdir(parents=True)
        (d / "rank-00000.data").write_bytes(b"\0" * n)
    (other / JOB_RECORD).write_text('{"job_id": "x", "dump_folder": "/pfs/old-run"}')
    note = others_note(str(node), "mine")
    assert "other jobs' steps there take 4.0 MiB" in note
    assert "job 20260101-000000-0ther0b0 (dump folder /pfs/old-run): 1 step, 3.0 MiB" in note
    assert "steps without a job identity (written before them): 1 step, 1.0 MiB" in note
    assert f"titan-ckpt clean {node}" in note and "never deletes them" in note
    shutil.rmtree(other)
    shutil.rmtree(node / "step-2")
    assert "no other job's steps there" in others_note(str(node), "mine")


def test_pfs_retention_keeps_another_jobs_steps(tmp_path):
    """Two jobs pointed at one absolute [checkpoint] folder, both running: each one's
    retention deletes only its own (or unattributed, stock) steps."""
    from titan_ckpt_plus.tiers.pfs import MANIFEST, PfsTier

    for step, owner in ((2, "mine"), (4, "theirs"), (6, "mine"), (8, None), (10, "theirs"), (12, "mine")):
        d = tmp_path / f"step-{step}"
        d.mkdir()
        (d / ".metadata").write_bytes(b"m")
        if owner:
            (d / MANIFEST).write_text(json.dumps({"step": step, "job_id": owner, "files": {}}))
    tier = PfsTier(str(tmp_path), rank=0, world_size=1, keep_latest_k=2, job_id="mine")
    assert tier.owners() == {2: "mine", 4: "theirs", 6: "mine", 8: None, 10: "theirs", 12: "mine"}
    assert tier.purge() == [2, 6]  # own steps 2, 6, 8 (stock), 12: the newest two are kept
    assert tier.steps() == [4, 8, 10, 12]


def test_pfs_steps_newer_than_a_resume_are_set_aside_whole_never_another_jobs(tmp_path):
    """After a restart at step 6 (load_step = 6, or newer steps that failed their checks):
    this job's steps after it, stock ones, a last step's full state and its export too,
    move to set_aside/after_step_6/ whole, so no later restart loads them, retention keeps
    the new run's and no save of those numbers deletes them; another job's stay."""
    from titan_ckpt_plus.tiers.pfs import MANIFEST, PfsTier

    def step(d, owner, kind="full"):
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"m")
        (d / "__0_0.distcp").write_bytes(b"d")
        if owner:
            (d / MANIFEST).write_text(json.dumps({"step": 0, "job_id": owner, "kind": kind, "files": {}}))
    for s, owner in ((2, "mine"), (6, "mine"), (8, None), (10, "theirs"), (12, "mine")):
        step(tmp_path / f"step-{s}", owner)
    step(tmp_path / "step-14", "mine", kind="export")
    step(tmp_path / "full_state" / "step-14", "mine")
    step(tmp_path / "step-16", "theirs", kind="export")
    tier = PfsTier(str(tmp_path), rank=0, world_size=1, keep_latest_k=2, job_id="mine")
    assert PfsTier(str(tmp_path), rank=1, world_size=2, keep_latest_k=2, job_id="mine").set_aside_after(6) == (
        [], "", 0)
    moved, dest, before = tier.set_aside_after(6)
    assert (moved, dest, before) == ([8, 12, 14], str(tmp_path / "set_aside" / "after_step_6"), 0)
    assert sorted(os.listdir(dest)) == ["export-step-14", "step-12", "step-14", "step-8"]
    assert (tmp_path / "set_aside" / "after_step_6" / "step-14" / "__0_0.distcp").exists()  # whole
    assert tier.steps() == [2, 6, 10] and tier.exports() == [16]
    assert tier.set_aside_after(6) == ([], "", 0)
    step(tmp_path / "step-7", "mine")  # gone back to 6 again, later
    assert tier.set_aside_after(6) == ([7], str(tmp_path / "set_aside" / "after_step_6.1"), 1)
    from titan_ckpt_plus.inspect import _set_aside  # what titan-ckpt ls says of them
    assert "in set_aside (after_step_6: steps [8, 12, 14], after_step_6.1: steps [7]), never loaded" \
        in _set_aside(str(tmp_path))
    assert tier.steps() == [2, 6, 10]


def test_pfs_retention_reads_each_manifest_once_and_unmakes_a_step_first(tmp_path, monkeypatch):
    """After every drain, retention lists the steps and their owners: one read of each
    manifest (the drain takes the GIL back from training after every system call). A
    purge cut short leaves no complete step it meant to delete: its .metadata goes first."""
    from titan_ckpt_plus.tiers import files
    from titan_ckpt_plus.tiers.pfs import MANIFEST, PfsTier

    for step in (2, 4, 6):
        d = tmp_path / f"step-{step}"
        d.mkdir()
        (d / ".metadata").write_bytes(b"m")
        (d / "__0_0.distcp").write_bytes(b"d")
        (d / MANIFEST).write_text(json.dumps({"step": step, "job_id": "mine", "files": {}}))
    tier = PfsTier(str(tmp_path), rank=0, world_size=1, keep_latest_k=1, job_id="mine")
    reads, read_json = [], files.read_json
    monkeypatch.setattr(files, "read_json", lambda p: reads.append(p) or read_json(p))

    def killed(path):
        raise RuntimeError("killed while retiring the parts")
    monkeypatch.setattr(tier, "_retire_parts", killed)
    with pytest.raises(RuntimeError, match="killed"):
        tier.purge()
    assert sorted(reads) == [str(tmp_path / f"step-{s}" / MANIFEST) for s in (2, 4, 6)]
    assert tier.steps() == [4, 6]  # step 2 is no longer a candidate ...
    assert (tmp_path / "step-2" / MANIFEST).exists() and (tmp_path / "step-2" / "__0_0.distcp").exists()
    monkeypatch.undo()
    assert tier.purge() == [4] and sorted(os.listdir(tmp_path)) == [".spare", "step-2", "step-6"]
