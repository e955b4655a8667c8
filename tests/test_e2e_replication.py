"""Neighbor replication on two simulated nodes (two torchrun agents, 2 ranks each,
c10d rendezvous on 127.0.0.1, one local folder per node)."""

import shutil
from pathlib import Path

import pytest

from harness import ckpt_events, copy_run, files_of, flip_byte, job_dir, load_digests, losses, ok, torchrun, torchrun_nodes

pytestmark = pytest.mark.e2e
REPL = ("--checkpoint.replication_factor=1",)
STEPS = 12


def _recovery(work):
    return ckpt_events(work, "recovery")[-1]


def _same_losses_from(work, reference, first, name):
    got, ref = losses(work, name), losses(reference)
    steps = range(first, STEPS + 1)
    assert [got.get(s) for s in steps] == [ref[s] for s in steps]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("repl_ref")
    ok(*torchrun_nodes(work, *REPL))
    return work


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """A 2x2 job whose rank 3 (node 1) is killed after step 7; local step 6 committed
    with replicas. Tests copy it before changing anything."""
    work = tmp_path_factory.mktemp("repl_killed")
    procs = torchrun_nodes(work, *REPL, fault="kill_after_step@7:3", loss_log="run1.jsonl")
    assert any(p.returncode != 0 for p in procs)
    assert max(e["step"] for e in ckpt_events(work, "local_commit")) == 6
    return work


def test_every_node_holds_its_neighbors_parts(reference):
    for node, others in (("0", (2, 3)), ("1", (0, 1))):
        step = job_dir(reference, node) / "step-12"
        for r in others:
            assert (step / f"rank-{r:05d}.data").is_file()
    rep = ckpt_events(reference, "replication")
    assert [e["step"] for e in rep] == list(range(2, 13, 2)) and all(e["ok"] for e in rep)
    assert all(e["bytes_received"] > 0 for e in rep)


def test_wiped_node_recovers_from_its_neighbor_never_from_another_jobs_parts(reference, killed, tmp_path):
    """Node 1 lost this job's folder. Both node folders also hold another job's newer
    steps (the reference run's, up to step 12: own parts and replicas of each other's
    ranks). The restart comes back from node 0's replicas of this job's step 6, with
    0 PFS bytes, bit exact; the other job's files are logged, not used, not deleted."""
    work = copy_run(killed, tmp_path / "w")
    shutil.rmtree(job_dir(work, "1"))
    for node in ("0", "1"):
        other = job_dir(reference, node)
        shutil.copytree(other, work / "local" / node / other.name)
    procs = torchrun_nodes(work, *REPL, loss_log="run2.jsonl")
    ok(*procs)
    rec = _recovery(work)
    assert (rec["tier"], rec["step"], rec["bytes_pfs"]) == ("local", 6, 0)
    assert rec["bytes_peer"] > 0 and rec["source"] == "local+peer"
    _same_losses_from(work, reference, 7, "run2.jsonl")
    other_id = job_dir(reference).name[len("job-"):]
    found = ckpt_events(work, "foreign_local_steps")
    assert sorted(f["jobs"][0]["job_id"] for f in found) == [other_id, other_id]
    # rank 0 may be on either agent: the c10d rendezvous assigns ranks in join order
    assert sum("holds other jobs' local steps, ignored" in p.stdout for p in procs) == 1
    for node in ("0", "1"):
        assert sorted(p.name for p in (work / "local" / node / f"job-{other_id}").glob("step-*/COMMIT.json")
                      for p in [p.parent]) == ["step-10", "step-12", "step-8"]


def test_all_local_folders_wiped_resumes_from_the_pfs(reference, killed, tmp_path):
    work = copy_run(killed, tmp_path / "w")
    shutil.rmtree(work / "local")
    ok(*torchrun_nodes(work, *REPL, loss_log="run2.jsonl"))
    rec = _recovery(work)
    assert (rec["tier"], rec["step"], rec["bytes_local"], rec["bytes_peer"]) == ("pfs", 4, 0, 0)
    assert rec["bytes_pfs"] > 0
    _same_losses_from(work, reference, 5, "run2.jsonl")


def test_corrupt_replica_is_rejected_and_an_older_step_is_used(reference, killed, tmp_path):
    work = copy_run(killed, tmp_path / "w")
    shutil.rmtree(work / "local" / "1")
    flip_byte(job_dir(work) / "step-6" / "rank-00002.data")
    ok(*torchrun_nodes(work, *REPL, loss_log="run2.jsonl"))
    rec = _recovery(work)
    assert (rec["tier"], rec["step"], rec["bytes_pfs"]) == ("local", 4, 0)
    skipped = {(t, s): why for t, s, why in rec["skipped"]}
    assert "rank 2" in skipped[("local", 6)] and "crc32c" in skipped[("local", 6)]
    _same_losses_from(work, reference, 5, "run2.jsonl")


def test_placement_refuses_a_copy_on_the_same_host(tmp_path):
    proc = torchrun(tmp_path, *REPL)
    assert proc.returncode != 0
    assert "replication_factor = 1 needs 2 failure domains" in proc.stdout
    assert "step:  1" not in proc.stdout


def test_a_node_lost_for_good_restarts_on_one_node_from_its_parts_and_replicas(killed, tmp_path):
    """[checkpoint] local_reshard (the default): node 1 is gone and the job restarts on node 0 alone, 2
    ranks instead of 4. Node 0 holds its own parts and its neighbor's replicas, so the
    newest local step (6) is loaded resharded by DCP, with no PFS byte; the state loaded
    that way from local step 4 is the PFS step 4's, resharded the same way, and so is
    the state of two nodes that fetch the parts their folders lack from each other."""
    more = ("--checkpoint.exclude_from_loading", "dataloader")
    work = copy_run(killed, tmp_path / "w")
    shutil.rmtree(work / "local" / "1")
    ok(torchrun(work, *more, loss_log="run2.jsonl"))
    rec = _recovery(work)
    assert (rec["tier"], rec["step"], rec["resharded_from"]) == ("local", 6, 4)
    assert (rec["bytes_pfs"], rec["bytes_peer"]) == (0, 0) and rec["bytes_local"] > 0
    assert sorted(losses(work, "run2.jsonl")) == list(range(7, STEPS + 1))
    # retention removed the 4-rank steps whole, replicas and all, once 3 steps of 2 ranks were kept
    assert sorted(p.name for p in job_dir(work).glob("step-*")) == ["step-10", "step-12", "step-8"]
    older = copy_run(killed, tmp_path / "older")
    shutil.rmtree(older / "local" / "1")
    shutil.rmtree(job_dir(older) / "step-6")
    ok(torchrun(older, *more, loss_log="run2.jsonl"))
    assert (_recovery(older)["tier"], _recovery(older)["step"], _recovery(older)["bytes_pfs"]) == ("local", 4, 0)
    pfs = copy_run(killed, tmp_path / "pfs")
    shutil.rmtree(pfs / "local")
    ok(torchrun(pfs, *more, loss_log="run2.jsonl"))
    assert (_recovery(pfs)["tier"], _recovery(pfs)["step"]) == ("pfs", 4)
    assert load_digests(older, 4) == load_digests(pfs, 4) and len(load_digests(pfs, 4)) == 2
    assert losses(older, "run2.jsonl") == losses(pfs, "run2.jsonl")
    # Back on two nodes of 1 rank, node 1's folder holding only its own parts (2, 3): it
    # fetches the manifests and layouts of ranks 0 and 1 from node 0, to make DCP's
    # metadata, but no data: new rank 1's shards are old ranks 2 and 3's. Step 6's rank 1
    # part fails node 0's check, so step 6 is skipped and step 4 loads, resharded.
    spread = copy_run(killed, tmp_path / "spread")
    for part in job_dir(spread, "1").glob("step-*/rank-0000[01].*"):
        part.unlink()
    flip_byte(job_dir(spread) / "step-6" / "rank-00001.data")
    # load_only (a look) fetches nothing into the node folders: the PFS step loads instead
    before = files_of(spread / "local")
    look = ok(*torchrun_nodes(spread, *more, "--checkpoint.load_only", "--training.steps", "5", nproc=1,
                              loss_log="look.jsonl"))
    assert "recovered step 4 from the pfs tier" in look.stdout
    assert "lack parts of it, and load_only = true fetches nothing into them" in look.stdout
    assert files_of(spread / "local") == before
    ok(*torchrun_nodes(spread, *more, nproc=1, loss_log="run2.jsonl"))
    rec = _recovery(spread)
    assert (rec["tier"], rec["step"], rec["resharded_from"], rec["bytes_pfs"]) == ("local", 4, 4, 0)
    assert rec["source"] == "local+peer (resharded from world size 4)"
    skipped = {(t, s): why for t, s, why in rec["skipped"]}
    assert "rank-00001.data" in skipped[("local", 6)] and "crc32c" in skipped[("local", 6)]
    fetched = [p for s in (4, 6) for p in job_dir(killed).glob(f"step-{s}/rank-0000[01].*") if p.suffix != ".data"]
    assert rec["bytes_peer"] == sum(p.stat().st_size for p in fetched) and len(fetched) == 8
    assert rec["parts_fetched"] == []
    assert load_digests(spread, 4) == load_digests(older, 4)
    for node in ("0", "1"):  # the 4-rank steps, fetched into or not, went whole
        assert sorted(p.name for p in job_dir(spread, node).glob("step-*")) == ["step-10", "step-12", "step-8"]
    assert losses(spread, "run2.jsonl") == losses(pfs, "run2.jsonl")


def test_a_layout_change_on_both_nodes_fetches_each_others_parts_two_ranks_a_folder(killed, tmp_path):
    """The 2 x 2 FSDP job back on its 2 nodes as FSDP 2 x TP 2 (another layout, the same world
    size), each node folder holding only its own ranks' parts of step 4 (step 6 gone): each
    node's first rank fetches the other node's 2 manifests and layouts, and the data of those
    parts its ranks read (not all), both ranks of a node check the folder's share and DCP
    reshards; the state and losses equal the PFS step 4's under the same layout."""
    more = ("--checkpoint.exclude_from_loading", "dataloader", "--parallelism.data_parallel_shard_degree", "2",
            "--parallelism.tensor_parallel_degree", "2")
    runs = {}
    for name, keys in (("fetched", ()), ("pfs", ("--checkpoint.no-local-reshard",))):
        work = runs[name] = copy_run(killed, tmp_path / name)
        shutil.rmtree(work / "digests")  # the FSDP saves' per-rank digests: another layout's shards
        for node, theirs in (("0", (2, 3)), ("1", (0, 1))):
            shutil.rmtree(job_dir(work, node) / "step-6")
            for r in theirs:
                for part in job_dir(work, node).glob(f"step-*/rank-{r:05d}.*"):
                    part.unlink()
        ok(*torchrun_nodes(work, *REPL, *more, *keys, loss_log="run2.jsonl"))
    a, b = _recovery(runs["fetched"]), _recovery(runs["pfs"])
    assert (a["tier"], a["step"], a["resharded_from"], a["bytes_pfs"]) == ("local", 4, 4, 0)
    # every other node's manifest and layout; data only of the parts a node's ranks read
    small = {r: sum(p.stat().st_size for p in job_dir(killed).glob(f"step-4/rank-{r:05d}.*") if p.suffix != ".data")
             for r in range(4)}
    data = {r: (job_dir(killed) / "step-4" / f"rank-{r:05d}.data").stat().st_size for r in range(4)}
    moved = [tuple(x) for x in a["parts_fetched"]]
    assert 0 < len(moved) < 4 and {node for node, _ in moved} == {0, 2}
    assert all((node == 0) == (old >= 2) for node, old in moved)  # each node the other's
    assert a["bytes_peer"] == sum(small.values()) + sum(small[old] + data[old] for _, old in moved)
    assert (b["tier"], b["step"]) == ("pfs", 4)
    assert load_digests(runs["fetched"], 4) == load_digests(runs["pfs"], 4) and len(load_digests(runs["pfs"], 4)) == 4
    assert losses(runs["fetched"], "run2.jsonl") == losses(runs["pfs"], "run2.jsonl")
