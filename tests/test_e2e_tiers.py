"""End to end on CPU: 2 gloo ranks under torchrun, the tiny llama3 job.

One uninterrupted reference run; every other run is compared with it bit for bit.
"""

import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from harness import (ckpt_events, copy_run, files_of, flip_byte, job_dir, load_digests, losses, ok, output, pfs_step,
                     torchrun)
from titan_ckpt_plus.cpu_fallback import usable_cores
from titan_ckpt_plus.tiers.local import JobLock

pytestmark = pytest.mark.e2e
STEPS = 12


def _killed(proc):
    assert proc.returncode != 0, output(proc)
    assert "SIGKILL" in proc.stdout
    return proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("reference")
    ok(torchrun(work))
    return work


def _recovery(work):
    recs = ckpt_events(work, "recovery")
    assert recs, "no recovery recorded"
    return recs[-1]


def _same_losses_from(work, reference, first_step, name):
    got, ref = losses(work, name), losses(reference)
    steps = list(range(first_step, STEPS + 1))
    assert [got.get(s) for s in steps] == [ref[s] for s in steps]


def test_both_tiers_written_at_their_intervals(reference):
    assert [e["step"] for e in ckpt_events(reference, "local_commit")] == list(range(2, 13, 2))
    assert [e["step"] for e in ckpt_events(reference, "pfs_commit")] == [4, 8, 12]
    local = job_dir(reference)
    assert sorted(p.name for p in local.glob("step-*/COMMIT.json") for p in [p.parent]) == [
        "step-10", "step-12", "step-8"]  # local_keep_latest_k = 3
    pfs = reference / "dump" / "checkpoint"
    for s in (4, 8, 12):
        assert (pfs / f"step-{s}" / ".metadata").is_file()
        assert (pfs / f"step-{s}" / "titan_ckpt_plus.json").is_file()
    assert len(losses(reference)) == STEPS
    # agreements = "auto" (the default) without helper_process: every vote and drain
    # agreed by gloo collectives, no hub process started
    events = ckpt_events(reference, "local_commit") + ckpt_events(reference, "pfs_commit")
    assert {e["agreed_by"] for e in events} == {"gloo"}


def test_stock_torchtitan_resumes_from_a_drained_pfs_step(tmp_path):
    """A PFS step drained by the plugin, loaded by torchtitan's own CheckpointManager
    (tier_local = false). The tiered run keeps torchtitan's per-rank dataloader state
    (dataloader_resume = "per_rank") so that stock torchtitan can load every key; with
    the default global-sample state stock torchtitan needs exclude_from_loading =
    ["dataloader"] (docs/data_resumption.md)."""
    ref, stock = tmp_path / "ref", tmp_path / "stock"
    ok(torchrun(ref, "--checkpoint.dataloader_resume=per_rank"))
    (stock / "dump" / "checkpoint").mkdir(parents=True)
    shutil.copytree(ref / "dump" / "checkpoint" / "step-8", stock / "dump" / "checkpoint" / "step-8")
    proc = ok(torchrun(stock, "--checkpoint.no-tier-local"))
    assert "Loading the checkpoint from" in proc.stdout and "[titan_ckpt_plus] tiers on" not in proc.stdout
    _same_losses_from(stock, ref, 9, "losses.jsonl")
    assert not (stock / "local").exists()
    assert not list((stock / "dump" / "checkpoint").glob("step-12/titan_ckpt_plus.json"))


def test_sigkill_mid_training_resumes_bit_exact_from_newest_local_step(reference, tmp_path):
    """With staging_copy = "auto" (the default) on a CPU machine whose cores the 2
    ranks fill (CI's 2), the first copy runs on the copy thread and measures itself,
    the next ones in save() (the tiny state's copy is short); with cores to spare, all
    on the thread. The matrix's killed runs keep the thread, as on a GPU."""
    _killed(torchrun(tmp_path, fault="kill_after_step@7:1", loss_log="run1.jsonl"))
    newest = max(e["step"] for e in ckpt_events(tmp_path, "local_commit"))
    assert newest == 6
    where = {e["step"]: e["copy_thread"] for e in ckpt_events(tmp_path, "stage")}
    if usable_cores() <= 2:  # the 2 ranks, one thread each, fill the cores (cpu_fallback.training_fills_cores)
        assert where[2] == "ckpt-staging-copy" and "MainThread" in (where[4], where[6]), where
    else:
        assert set(where.values()) == {"ckpt-staging-copy"}, where
    ok(torchrun(tmp_path, loss_log="run2.jsonl"))
    rec = _recovery(tmp_path)
    assert (rec["tier"], rec["step"], rec["bytes_pfs"]) == ("local", 6, 0)
    assert rec["bytes_local"] > 0
    _same_losses_from(tmp_path, reference, 7, "run2.jsonl")


def test_load_step_goes_back_and_the_steps_it_left_are_never_loaded_again(reference, tmp_path):
    """torchtitan's load_step = 4 on a job that reached step 12: step 4 is loaded (from the
    PFS, the tier holding it), the local steps after it are removed and the PFS ones set
    aside. Killed after step 7, the job restarts from the new run's step 6, not from
    the step 12 it left, and trains on bit exact: retention kept the new run's steps. A
    load_step no tier holds stops the job before its first step, naming the steps there;
    with load_only (a look at an old step) nothing is removed, moved or written: not in
    the tiers, nor in the job's events and failure ledger (its start would count as a
    failure of the job's), it lets the node folder's lock go once loaded (the job may
    restart there while it runs), and a SIGTERM ends it."""
    work = copy_run(reference, tmp_path / "work")
    before = [files_of(work / "dump"), files_of(work / "local")]
    # load_only: a look at step 4, moving nothing; a preemption notice after its step 10 ends it
    # there, as it ends stock torchtitan's run (a look saves nothing: no grace period to use).
    # Once loaded it lets the node folder's lock go: the job may restart there meanwhile.
    probe = _LockProbe(work, "look.jsonl", after=5)
    probe.start()
    look = torchrun(work, "--checkpoint.load_step", "4", "--checkpoint.load_only", "--training.steps", "12",
                    fault="sigterm_after_step@10:0", loss_log="look.jsonl")
    probe.join(timeout=10)
    assert "Training starts at step 5" in look.stdout and "recovered step 4 from the pfs tier" in look.stdout
    assert "sigterm_after_step at step 10" in look.stdout and max(losses(work, "look.jsonl")) < 11
    assert probe.holder == "" and probe.steps_then < len(losses(work, "look.jsonl")), \
        f"the look held the lock after loading: {probe.holder!r}, {probe.steps_then} steps then"
    probe.lock.release()
    assert [files_of(work / "dump"), files_of(work / "local")] == before
    assert sorted(p.parent.name for p in job_dir(work).glob("step-*/COMMIT.json")) == ["step-10", "step-12", "step-8"]
    proc = _killed(torchrun(work, "--checkpoint.load_step", "4", fault="kill_after_step@7:1", loss_log="run2.jsonl"))
    rec = _recovery(work)
    assert (rec["tier"], rec["step"], rec["load_step"], rec["bytes_local"]) == ("pfs", 4, 4, 0)
    assert "moved PFS steps [8, 12]" in proc.stdout
    aside = work / "dump" / "checkpoint" / "set_aside" / "after_step_4"
    assert sorted(p.name for p in aside.iterdir()) == ["export-step-12", "step-12", "step-8"]
    assert sorted(p.parent.name for p in job_dir(work).glob("step-*/COMMIT.json")) == ["step-6"]
    typo = torchrun(work, "--checkpoint.load_step", "5", loss_log="typo.jsonl")
    assert typo.returncode != 0 and "Training starts" not in typo.stdout
    assert "[checkpoint] load_step = 5: step 5 is held by neither the local tier nor the PFS. " \
           "This job's steps: [4, 6]. Fix: set load_step to one of them" in typo.stdout
    ok(torchrun(work, loss_log="run3.jsonl"))
    rec = _recovery(work)
    assert (rec["tier"], rec["step"], rec["bytes_pfs"], rec["load_step"]) == ("local", 6, 0, -1)
    ran, ref = losses(work, "run2.jsonl"), losses(reference)
    assert [ran[s] for s in (5, 6, 7)] == [ref[s] for s in (5, 6, 7)]
    _same_losses_from(work, reference, 7, "run3.jsonl")


class _LockProbe(threading.Thread):
    """Beside a look: once it has logged step `after`, takes the node folder's job lock
    (the look lets it go once loaded) and holds it. `steps_then`: the steps the look had
    logged by then; fewer than it logs in the end shows it was still running."""

    def __init__(self, work: Path, log: str, after: int) -> None:
        super().__init__(daemon=True)
        self.work, self.log, self.after = work, log, after
        self.lock, self.holder, self.steps_then = None, "never tried", 0

    def run(self) -> None:
        deadline = time.monotonic() + 240
        while self.after not in losses(self.work, self.log) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.lock = JobLock(str(job_dir(self.work)))
        self.holder = self.lock.acquire()
        self.steps_then = len(losses(self.work, self.log))


@pytest.fixture(scope="module")
def torn(tmp_path_factory) -> Path:
    """A run whose rank 1 is killed while writing local step 8, then restarted."""
    work = tmp_path_factory.mktemp("torn")
    _killed(torchrun(work, fault="kill_during_local_write@8:1", loss_log="run1.jsonl"))
    return work


def test_step_torn_by_a_kill_is_never_loaded(reference, torn):
    step8 = job_dir(torn) / "step-8"
    assert step8.is_dir() and not (step8 / "COMMIT.json").exists()
    ok(torchrun(torn, loss_log="run2.jsonl"))
    rec = _recovery(torn)
    assert (rec["tier"], rec["step"]) == ("local", 6)
    _same_losses_from(torn, reference, 7, "run2.jsonl")


def test_flipped_bytes_fall_back_to_an_older_valid_step(reference, torn):
    flip_byte(job_dir(torn) / "step-12" / "rank-00001.data")
    flip_byte(pfs_step(torn, 12) / "__1_0.distcp")
    proc = ok(torchrun(torn, loss_log="run3.jsonl"))
    rec = _recovery(torn)
    assert (rec["tier"], rec["step"]) == ("local", 10)
    skipped = {(t, s): why for t, s, why in rec["skipped"]}
    assert "crc32c" in skipped[("local", 12)] and ("pfs", 12) in skipped
    assert "skipped local step 12" in proc.stdout
    _same_losses_from(torn, reference, 11, "run3.jsonl")


def test_without_local_reshard_a_changed_dp_degree_skips_local_and_reshards_from_pfs(torn):
    # The previous run saved step 12 again; corrupt its PFS copy so the fallback to an
    # older PFS step is exercised too.
    flip_byte(pfs_step(torn, 12) / "__0_0.distcp")
    proc = ok(torchrun(torn, "--checkpoint.exclude_from_loading", "dataloader", "--checkpoint.no-local-reshard",
                        nproc=1, loss_log="run4.jsonl"))
    rec = _recovery(torn)
    assert (rec["tier"], rec["step"], rec["bytes_local"]) == ("pfs", 8, 0)
    assert rec["bytes_pfs"] > 0
    assert "Training starts at step 9" in proc.stdout


def test_a_changed_dp_degree_loads_the_newest_local_step_resharded_reading_no_pfs_byte(reference, tmp_path):
    """[checkpoint] local_reshard (the default): restarted on 1 rank, the job loads local
    step 12 from both ranks' parts in its node folder, resharded by DCP, with no PFS step
    there; its state and its next losses are those of the same step resharded from the PFS."""
    more = ("--checkpoint.exclude_from_loading", "dataloader", "--training.steps", "14")
    local = copy_run(reference, tmp_path / "local")
    shutil.rmtree(local / "dump" / "checkpoint")
    proc = ok(torchrun(local, *more, nproc=1, loss_log="run2.jsonl"))
    rec = _recovery(local)
    assert (rec["tier"], rec["step"], rec["resharded_from"], rec["bytes_pfs"]) == ("local", 12, 2, 0)
    parts = sum(p.stat().st_size for p in (job_dir(local) / "step-12").glob("rank-*.*") if p.suffix != ".json")
    assert rec["bytes_local"] > parts  # each part checked whole, then DCP's reads
    assert "from the local (resharded from world size 2) tier" in proc.stdout
    pfs = copy_run(reference, tmp_path / "pfs")
    shutil.rmtree(pfs / "local")
    ok(torchrun(pfs, *more, nproc=1, loss_log="run2.jsonl"))
    assert (_recovery(pfs)["tier"], _recovery(pfs)["step"]) == ("pfs", 12)
    assert load_digests(local, 12) == load_digests(pfs, 12) and len(load_digests(pfs, 12)) == 1
    got = losses(local, "run2.jsonl")
    assert sorted(got) == [13, 14] and got == losses(pfs, "run2.jsonl")


def test_a_tp_restart_of_the_fsdp_job_loads_its_newest_local_step_resharded(reference, tmp_path):
    """The same 2 ranks, FSDP then tensor parallel: local step 12 is another parallel
    layout at the same world size, resharded from the node folder; the losses after it
    equal those after PFS step 12 loaded under TP. (No digests: the hook compares a load
    with the save of the same rank and world size, here another layout's shard.)"""
    tp = ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2",
          "--checkpoint.exclude_from_loading", "dataloader", "--training.steps", "14")
    local = copy_run(reference, tmp_path / "local")
    shutil.rmtree(local / "dump" / "checkpoint")
    ok(torchrun(local, *tp, loss_log="run2.jsonl", digests=False))
    rec = _recovery(local)
    assert (rec["tier"], rec["step"], rec["resharded_from"], rec["bytes_pfs"]) == ("local", 12, 2, 0)
    pfs = copy_run(reference, tmp_path / "pfs")
    shutil.rmtree(pfs / "local")
    ok(torchrun(pfs, *tp, loss_log="run2.jsonl", digests=False))
    assert (_recovery(pfs)["tier"], _recovery(pfs)["step"]) == ("pfs", 12)
    got = losses(local, "run2.jsonl")
    assert sorted(got) == [13, 14] and got == losses(pfs, "run2.jsonl")


def test_failed_saves_are_logged_counted_and_training_goes_on(reference, tmp_path):
    """With agreements = "hub" (the job's hub instead of gloo collectives, which the
    reference run uses): a failed local write and a failed drain are counted and logged,
    and training goes on as it would; the hub ends with the job."""
    proc = ok(torchrun(tmp_path, "--checkpoint.agreements=hub", fault="enospc_local_write@4:1,eio_pfs_write@8:0"))
    assert {e["agreed_by"] for e in ckpt_events(tmp_path, "local_commit")} == {"hub"}
    assert _helpers_left(tmp_path) == []
    failed = {(e["tier"], e["step"]) for e in ckpt_events(tmp_path, "save_failed")}
    assert ("local", 4) in failed and ("pfs", 8) in failed
    assert "No space left on device" in proc.stdout and "training continues" in proc.stdout
    assert [e["step"] for e in ckpt_events(tmp_path, "local_commit")] == [2, 6, 8, 10, 12]
    # Step 4 failed locally but was due on the PFS: drained from the staged bytes
    # (rank 1) and rank 0's uncommitted part. (That failed parts are removed at once is
    # checked on a really full disk: scripts/chaos.py, disk-full.)
    assert [e["step"] for e in ckpt_events(tmp_path, "pfs_commit")] == [4, 12]
    assert losses(tmp_path) == losses(reference)  # a failed save does not touch training


def test_local_steps_of_another_layout_with_a_part_held_nowhere_and_no_pfs_step_refuse_to_start_over(reference, tmp_path):
    work = copy_run(reference, tmp_path / "copy")
    shutil.rmtree(work / "dump" / "checkpoint")  # nothing to reshard from
    for part in job_dir(work).glob("step-*/rank-00001.*"):  # nor from local: rank 1's parts are gone
        part.unlink()
    proc = torchrun(work, nproc=1, loss_log="run2.jsonl")
    assert proc.returncode != 0
    assert "refusing to load a corrupt one or to silently start over" in proc.stdout
    assert "skipped local step 12" in proc.stdout
    assert not losses(work, "run2.jsonl")  # not one step trained from scratch


def _helpers_left(work: Path, wait_s: float = 5.0) -> list[int]:
    """The byte helper and hub processes of the runs in `work` (their environment names
    its loss log) still alive after `wait_s`: none once their ranks are gone
    (PR_SET_PDEATHSIG)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read()
                with open(f"/proc/{pid}/stat") as f:
                    zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                continue
            ours = b"titan_ckpt_plus.tiers.byte_helper" in cmd or b"titan_ckpt_plus.tiers.hub" in cmd
            if ours and str(work).encode() in env and not zombie:
                left.append(int(pid))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def test_with_helper_processes_a_kill_in_a_helpers_write_resumes_bit_exact(reference, tmp_path):
    """[checkpoint] helper_process = true: each rank's local files and PFS copies are
    written by its helper process, and the ranks agree on them through the job's hub.
    A kill injected in rank 1's helper while it writes step 8 kills rank 1 (the fault
    keeps its meaning); no helper or hub outlives its rank; the restart, helpers on,
    resumes bit for bit from step 6 and drains on."""
    run1 = _killed(torchrun(tmp_path, "--checkpoint.helper_process", fault="kill_during_local_write@8:1",
                            loss_log="run1.jsonl"))
    # rank 0 waited in close() for rank 1's vote: torchrun's SIGTERM ended it, not its SIGKILL 30 s on
    assert len(re.findall(r"exitcode +: -9 ", run1.stdout)) == 1, output(run1)
    commits = ckpt_events(tmp_path, "local_commit")
    assert [e["step"] for e in commits] == [2, 4, 6] and all(e["by_helper"] for e in commits)
    assert all(e["agreed_by"] == "hub" for e in commits)
    assert [(e["step"], e["by_helper"], e["agreed_by"]) for e in ckpt_events(tmp_path, "pfs_commit")] == [
        (4, True, "hub")]
    assert _helpers_left(tmp_path) == []
    ok(torchrun(tmp_path, "--checkpoint.helper_process", loss_log="run2.jsonl"))
    rec = _recovery(tmp_path)
    assert (rec["tier"], rec["step"]) == ("local", 6)
    _same_losses_from(tmp_path, reference, 7, "run2.jsonl")
    assert [(e["step"], e["by_helper"]) for e in ckpt_events(tmp_path, "pfs_commit")][1:] == [(8, True), (12, True)]
    assert _helpers_left(tmp_path) == []
