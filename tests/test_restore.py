"""A restart's walk over the candidates (restore.py) where the ranks' views differ:
every rank must try the same steps, or the job loads a mix of states or hangs."""

import datetime
import os
import pickle
import shutil
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_ckpt_plus import recovery


def test_common_pfs_steps_keeps_the_steps_every_rank_sees_alike():
    same = {2: "/pfs/step-2", 4: "/pfs/step-4"}
    assert recovery.common_pfs_steps([(same, ""), (dict(same), "")]) == ([2, 4], [])
    steps, left = recovery.common_pfs_steps([(same, ""), ({2: "/pfs/step-2"}, "")])
    assert steps == [2] and left == [(4, "ranks [1] do not see it (a file system client's stale view?)")]
    steps, left = recovery.common_pfs_steps([(same, ""), ({2: "/pfs/step-2", 4: "/pfs/full_state/step-4"}, "")])
    assert steps == [2] and left[0][0] == 4 and "different folders" in left[0][1]
    steps, left = recovery.common_pfs_steps([(same, ""), ({}, "OSError(5, 'Input/output error')")])
    assert steps == [] and [s for s, _ in left] == [2, 4]
    assert "not every rank could list the PFS folder (rank 1: OSError(5" in left[0][1]
    assert recovery.common_pfs_steps([]) == ([], [])


def _engine(tmp: str, rank: int, state: dict):
    from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
    from titan_ckpt_plus.telemetry import EventLog

    s = TierSettings(local_root=os.path.join(tmp, f"node{rank}"), pfs_folder=os.path.join(tmp, "pfs"),
                     local_interval=2, pfs_interval=2, local_keep=2, pfs_keep=3, rank=rank, world_size=2,
                     first_on_node=True, job_id="J", layout_tags=[{"world_size": 2}] * 2)
    return TieredCheckpointer(s, lambda: state, EventLog(None))


def _restart_rank(rank: int, tmp: str, scenario: str) -> None:
    """Two ranks (a node folder each) save steps 2 and 4 to both tiers, then restart
    with rank 1's view of the tiers cut as `scenario` says, and record what each
    rank's recover() chose."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        state = {"model": {"w": torch.zeros(4096)}, "train_state": {"step": 0}}
        ckpt = _engine(tmp, rank, state)
        for step in range(1, 5):
            state["model"]["w"].fill_(10 * step + rank)
            state["train_state"]["step"] = step
            ckpt.save(step)
            ckpt.wait_for_staging()
        ckpt.flush()
        if scenario == "promote":  # a preemption: rank 1's PFS client has not seen step 4's seal
            if rank == 1:
                ckpt.pfs.steps = lambda: [2]
            try:
                got = ckpt.promote_newest(time.monotonic() + 60)
            finally:
                ckpt.close()
            _record(tmp, rank, got)
            return
        ckpt.close()
        ckpt = _engine(tmp, rank, state)
        if scenario == "pfs_view":  # rank 1's PFS client does not see step 4 yet
            shutil.rmtree(os.path.join(tmp, f"node{rank}"))  # PFS steps alone to choose from
            if rank == 1:
                ckpt.pfs.steps = lambda: [2]
        elif rank == 1:  # "local_unreadable": rank 1's disk fails as recovery scans it
            def failing(*_):
                raise OSError(5, "Input/output error")
            ckpt.local.held_parts = failing
        try:
            rec = ckpt.recover()
            got = (rec.tier, rec.step, rec.skipped, rec.state["model"]["w"][0].item() if rec.state else None)
        finally:
            ckpt.close()
    finally:
        dist.destroy_process_group()
    _record(tmp, rank, got)


def _record(tmp: str, rank: int, got) -> None:
    with open(os.path.join(tmp, f"out.{rank}"), "wb") as f:
        pickle.dump(got, f)


def _load_rank(rank: int, tmp: str, _scenario: str) -> None:
    """The adapter's load of the chosen step, where the job's state refuses it on rank 1
    alone (one pipeline stage's optimizer): both ranks raise, neither waits alone."""
    from types import SimpleNamespace

    from titan_ckpt_plus.adapters.torchtitan_v022 import TieredCheckpointManager
    from titan_ckpt_plus.restore import Recovery

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        def load_local(_state):
            if rank == 1:
                raise ValueError("checkpoint lacks ['optimizer']")
        manager = SimpleNamespace(tiered=SimpleNamespace(commit_pg=None), _load_local=load_local)
        try:
            TieredCheckpointManager._load_chosen(manager, Recovery("local", step=4, state={}), False)
            got = "loaded"
        except Exception as e:
            got = repr(e)
        dist.all_reduce(torch.ones(1))  # the group is still in step: neither rank was left in a collective
    finally:
        dist.destroy_process_group()
    _record(tmp, rank, got)


def _restart(tmp_path, scenario: str, target=_restart_rank) -> list:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, str(tmp_path), scenario), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
        assert p.exitcode == 0, (f"a rank did not end cleanly ({p.exitcode}): hung or raised; "
                                 f"results written: {sorted(n for n in os.listdir(tmp_path) if 'out' in n)}")
    out = []
    for r in (0, 1):
        with open(tmp_path / f"out.{r}", "rb") as f:
            out.append(pickle.load(f))
    return out


def test_a_pfs_step_one_rank_does_not_see_is_skipped_by_every_rank(tmp_path):
    """Each rank lists the PFS itself. Where rank 1 does not see the newest step, rank 0
    would verify step 4 while rank 1 verified step 2, both checks pass, and the job
    would train on two steps' states: every rank takes step 2, and says why not 4."""
    ranks = _restart(tmp_path, "pfs_view")
    for tier, step, skipped, _ in ranks:
        assert (tier, step) == ("pfs", 2)
        assert [(t, s) for t, s, _ in skipped] == [("pfs", 4)] and "ranks [1] do not see it" in skipped[0][2]


def test_a_rank_that_cannot_read_its_node_folder_reports_none_instead_of_hanging_its_peers(tmp_path):
    """An I/O error while one rank scans its local steps raised before the gather its
    peer waited in: now that rank holds nothing, its part of the local step is held
    nowhere (no replicas here), and both ranks load the PFS step."""
    ranks = _restart(tmp_path, "local_unreadable")
    for tier, step, skipped, _ in ranks:
        assert (tier, step) == ("pfs", 4)
        assert ("local", 4) in [(t, s) for t, s, _ in skipped]


def test_a_preemption_promotes_nothing_where_any_rank_sees_the_newest_step_on_the_pfs(tmp_path):
    """promote_newest: rank 1 does not see step 4's seal yet; alone it would start a
    drain of step 4 that rank 0 skips, and wait in its collectives. The newest PFS step
    any rank sees counts on every rank."""
    for newest, what in _restart(tmp_path, "promote"):
        assert (newest, what) == (4, "the newest local step is already on the PFS")


def test_a_load_the_jobs_state_refuses_on_one_rank_stops_every_rank(tmp_path):
    """The chosen step refused by rank 1's state alone: rank 1 raises its error, rank 0 a
    RuntimeError naming it, and neither is left waiting in the next collective."""
    got = _restart(tmp_path, "", target=_load_rank)
    assert got[1] == repr(ValueError("checkpoint lacks ['optimizer']"))
    assert got[0].startswith("RuntimeError(") and "failed on other ranks" in got[0] and "rank 1: ValueError" in got[0]


def test_a_pfs_folder_no_rank_can_list_stops_the_restart_when_no_local_step_loads(tmp_path):
    """Every rank's listing fails (EIO, EACCES): the PFS steps are unknown, so the
    restart must not go on as a first start (that would train over them later)."""
    from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
    from titan_ckpt_plus.telemetry import EventLog

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    s = TierSettings(local_root=str(tmp_path / "node"), pfs_folder=str(tmp_path / "pfs"), local_interval=1,
                     pfs_interval=1, local_keep=2, pfs_keep=2, rank=0, world_size=1, first_on_node=True,
                     job_id="J")
    ckpt = TieredCheckpointer(s, lambda: {}, EventLog(None))
    try:
        def unreadable():
            raise PermissionError(13, "Permission denied")
        ckpt.pfs.steps = unreadable
        with pytest.raises(RuntimeError, match=r"no rank could list the PFS folder .*PermissionError.*Fix: make"):
            ckpt.recover()
    finally:
        ckpt.close()
        dist.destroy_process_group()
