"""Replication benchmark, in one run on this machine:

1. transport: the plugin's replica exchange (sizes, accept, chunked bytes, both
   directions at once, the data streamed through one reused chunk, here to no file)
   against raw gloo isend/irecv of the same bytes between the same two processes;
   also the whole replica path (streamed to its file, CRC-checked, fsync'd: what
   replication does) against raw send/recv plus an fsync'd write of the bytes; and
   the host memory a receive holds, streamed against landing whole (the path before);
2. restart to first step on two simulated nodes (2 torchrun agents x 2 ranks,
   debugmodel), recovering from own disk, from a neighbor, and from the PFS, with
   the bytes read from each tier; and with node 1 lost for good, restarted on node 0
   alone (2 ranks): from its own parts and node 1's replicas, resharded (local_reshard),
   against the PFS step (local_reshard = false); on 2 nodes x 1 rank, each node
   folder holding its own parts only; and a 4-node job of 1 rank each restarted on 3
   nodes (node 3 lost): a node fetches the layouts of the parts its folder lacks, and
   the data of those its ranks read.

    .venv/bin/python scripts/bench_replication.py [--update BENCHMARKS.md]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
from benchmd import record_targets, update_section  # noqa: E402
from harness import ckpt_events, events, free_port, torchrun, torchrun_nodes  # noqa: E402
from titan_ckpt_plus.cpu_fallback import fp32_args  # noqa: E402
from titan_ckpt_plus.tiers.files import piece_size  # noqa: E402

SECTION = "## Replication and recovery"


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def _held(receive) -> int:
    """The host memory `receive()` took beyond what the process held before it (its peak)."""
    from titan_ckpt_plus.telemetry import peak_rss_since_last

    peak_rss_since_last()  # the peak from here on
    before = _rss()
    receive()
    return peak_rss_since_last() - before


def _worker(rank: int, port: int, nbytes: int, folder: str, out) -> None:
    from titan_ckpt_plus.replication import Part, Wire, check_part
    from titan_ckpt_plus.tiers import files
    from titan_ckpt_plus.tiers.local import LocalTier

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    peer = 1 - rank
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    layout = b"L" * 4096
    manifest = files.json_bytes({"job_id": "bench", "rank": rank, "step": 1, "world_size": 2,
                                 "layout_tag": {}, "files": {
        "data": files.entry(data.numpy()), "layout": files.entry(layout)}})
    part = Part(manifest, layout, data.numpy())
    wire, stream = Wire(dist.group.WORLD), Wire(dist.group.WORLD)
    tier = LocalTier(os.path.join(folder, f"tier-{rank}"), rank, 2, True, 2, job_id="bench")
    sink = torch.empty(nbytes, dtype=torch.uint8)

    def streamed() -> None:  # what replication does: to the file as it arrives
        with tier.receive_replica(1, peer) as to_file:
            got, why = stream.exchange(peer, part, peer, 4 * nbytes, sink=to_file.write)
            check_part(got, peer, 1, 2, "bench", {}, streamed=to_file.entry())
            to_file.finish(got.manifest, got.layout)

    def whole() -> None:  # the path before: land whole, then write
        got, why = Wire(dist.group.WORLD).exchange(peer, part, peer, 4 * nbytes)
        check_part(got, peer, 1, 2, "bench", {})
        files.write_durable(os.path.join(folder, f"whole-{rank}"), got.data)

    held = {}
    for name, receive in (("held_streamed", streamed), ("held_whole", whole)):
        dist.barrier()
        held[name] = _held(receive)
    raw, ours, raw_disk, ours_disk = [], [], [], []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend, data, peer), dist.P2POp(dist.irecv, sink, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        raw.append(time.perf_counter() - t0)
        files.write_durable(os.path.join(folder, f"raw-{rank}"), sink.numpy())
        raw_disk.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        wire.exchange(peer, part, peer, 4 * nbytes, sink=lambda chunk: None)  # replication's path, no disk
        ours.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        streamed()
        ours_disk.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(dict(held, **{k: statistics.median(v) for k, v in
                              (("raw", raw), ("ours", ours), ("raw_disk", raw_disk), ("ours_disk", ours_disk))}))
    dist.destroy_process_group()


def transport(nbytes: int, folder: Path) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    folder.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(free_port(), nbytes, str(folder), q), nprocs=2,
                       start_method="spawn")
    return q.get()


COMMON = ("--model.flavor=debugmodel", "--training.seq_len=64", "--checkpoint.replication_factor=1",
          *fp32_args())
LOST = "node 0 alone, 2 ranks (node 1 lost), its parts and replicas resharded"
LOST_PFS = "node 0 alone, 2 ranks (node 1 lost), local_reshard = false"
SPREAD = "2 nodes x 1 rank, each node's own parts only: the other's layouts fetched, resharded"
LOST_OF_4 = "3 nodes x 1 rank (a 4-node job, node 3 lost): the parts each rank reads fetched, resharded"


def _job_id(killed: Path) -> str:
    """The killed job's id: each restart adopts it, as a user moving its folders would
    (a moved dump folder is another job's otherwise, issue 12)."""
    return json.loads((killed / "dump" / "titan_ckpt_plus" / "job.json").read_text())["job_id"]


def _drop_replicas(work: Path) -> None:
    """Each node folder keeps its own ranks' parts only (node n: ranks 2n, 2n+1)."""
    for node in ("0", "1"):
        theirs = (2, 3) if node == "0" else (0, 1)
        for r in theirs:
            for part in (work / "local" / node).glob(f"job-*/step-*/rank-{r:05d}.*"):
                part.unlink()


def restarts(base: Path) -> list[dict]:
    killed = base / "killed"
    procs = torchrun_nodes(killed, *COMMON, fault="kill_after_step@7:3", loss_log="run1.jsonl", timeout=900)
    assert any(p.returncode for p in procs)
    # Each scenario restarts a copy of the killed job's folders: a moved dump folder is
    # another job's (issue 12) unless the restart adopts its identity, as a user would.
    job_id = _job_id(killed)
    rows = []
    one_node = ("--checkpoint.replication_factor=0",)  # node 1 lost for good: no neighbor left
    for name, wipe, extra in (("own disk", [], None), ("neighbor", ["local/1"], None), ("PFS", ["local"], None),
                              (LOST, ["local/1"], one_node),
                              (LOST_PFS, ["local/1"], (*one_node, "--checkpoint.no-local-reshard")),
                              (SPREAD, _drop_replicas, None)):
        work = base / f"restart-{len(rows)}"
        shutil.copytree(killed, work)
        for w in [wipe] if callable(wipe) else wipe:
            w(work) if callable(w) else shutil.rmtree(work / w)
        t0 = time.time()
        args = (*COMMON, f"--checkpoint.adopt_job={job_id}")
        nproc = 1 if name == SPREAD else 2
        procs = (torchrun_nodes(work, *args, nproc=nproc, loss_log="run2.jsonl", timeout=900) if extra is None
                 else [torchrun(work, *args, *extra, loss_log="run2.jsonl", timeout=900)])
        assert all(p.returncode == 0 for p in procs), procs[0].stdout[-3000:]
        rec = ckpt_events(work, "recovery")[-1]
        rows.append(_row(name, work, rec, t0))
    return rows


def _row(name: str, work: Path, rec: dict, t0: float) -> dict:
    first = min(e["time"] for e in events(work / "run2.jsonl", "loss"))
    fetched = f"{len(rec.get('parts_fetched', []))} of {rec.get('parts_lacking', 0)}"
    return {"source": name, "tier": rec.get("source", rec["tier"]), "step": rec["step"],
            "restart_to_first_step_s": first - t0, "recovery_s": rec["seconds"], "fetched": fetched,
            "local": rec["bytes_local"], "peer": rec["bytes_peer"], "pfs": rec["bytes_pfs"]}


def lost_of_four(base: Path) -> dict:
    """A 4-node job (1 rank each, replicas on the next node) killed after step 7, node 3
    lost for good, restarted on 3 nodes: each node folder holds 2 of the 4 parts, and
    lacks 2; a rank reads the 2 parts its new shard overlaps."""
    killed = base / "killed4"
    procs = torchrun_nodes(killed, *COMMON, nnodes=4, nproc=1, fault="kill_after_step@7:3",
                           loss_log="run1.jsonl", timeout=900)
    assert any(p.returncode for p in procs)
    job_id = _job_id(killed)
    work = base / "restart-lost-of-4"
    shutil.copytree(killed, work)
    shutil.rmtree(work / "local" / "3")
    t0 = time.time()
    procs = torchrun_nodes(work, *COMMON, f"--checkpoint.adopt_job={job_id}", nnodes=3, nproc=1,
                           loss_log="run2.jsonl", timeout=900)
    assert all(p.returncode == 0 for p in procs), procs[0].stdout[-3000:]
    return _row(LOST_OF_4, work, ckpt_events(work, "recovery")[-1], t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)  # more than a chunk: what a receive holds shows
    ap.add_argument("--update", type=Path)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench_repl_"))
    nbytes = args.mib << 20
    t = transport(nbytes, base / "transport")
    mbps = lambda s: nbytes / s / 2**20  # noqa: E731
    lines = [
        f"Command: `.venv/bin/python scripts/bench_replication.py --update BENCHMARKS.md` "
        f"({os.cpu_count()} cores, gloo on loopback; medians of 5).", "",
        f"Transport, {args.mib} MiB each way at once between two processes:", "",
        "| path | raw gloo send/recv | plugin | plugin / raw (target >= 0.70) |", "|---|---|---|---|",
        f"| wire only | {mbps(t['raw']):.0f} MiB/s | {mbps(t['ours']):.0f} MiB/s | "
        f"{t['raw'] / t['ours']:.2f} {'met' if t['raw'] / t['ours'] >= 0.7 else 'NOT met'} |",
        f"| + CRC check + fsync'd write (the plugin's streamed to its file) | {mbps(t['raw_disk']):.0f} MiB/s "
        f"(no CRC) | {mbps(t['ours_disk']):.0f} MiB/s | {t['raw_disk'] / t['ours_disk']:.2f} |", "",
        f"Host memory a receive held beyond the process's before it (peak, rank 0's first receive): streamed "
        f"to its file {t['held_streamed'] / 2**20:.0f} MiB (one landing chunk of "
        f"{piece_size(nbytes) >> 20} MiB), landing whole then written (the path before) "
        f"{t['held_whole'] / 2**20:.0f} MiB, for a part of {args.mib} MiB.", "",
        "Restart to first training step, 2 simulated nodes x 2 ranks, debugmodel, killed after "
        "step 7 (local step 6 committed with replicas, PFS step 4); two rows restart on node 0 "
        "alone at 2 ranks, with node 1's folder gone (a DP change: 4 ranks' parts resharded to 2); one "
        "on 2 nodes x 1 rank, each node folder stripped of the other's replicas (each fetches the other "
        "node's layouts, and the data its rank reads); the last a 4-node job of 1 rank each with node 3 "
        "lost, restarted on 3 nodes:", "",
        "| recovered from | tier | step | restart to first step | of which recovery | resharded: parts whose data "
        "moved / parts node folders lacked | bytes local disk | bytes from peers | bytes PFS |",
        "|---|---|---|---|---|---|---|---|---|"]
    rows = [("replica transfer / raw gloo send/recv, same bytes", f"{t['raw'] / t['ours']:.2f} "
             f"({mbps(t['ours']):.0f} / {mbps(t['raw']):.0f} MiB/s)", ">= 0.70", t["raw"] / t["ours"] >= 0.7)]
    for r in [*restarts(base / "restarts"), lost_of_four(base / "restarts")]:
        need_pfs = r["source"] in ("PFS", LOST_PFS)
        rows.append((f"restart to first step, from {r['source']}", f"{r['restart_to_first_step_s']:.1f} s "
                     f"(recovery {r['recovery_s']:.2f} s; PFS bytes {r['pfs']})",
                     "reported" if need_pfs else "0 bytes from the PFS",
                     None if need_pfs else r["pfs"] == 0))
        lines.append(f"| {r['source']} | {r['tier']} | {r['step']} | {r['restart_to_first_step_s']:.1f} s | "
                     f"{r['recovery_s']:.2f} s | {r['fetched'] if 'resharded' in r['tier'] else ''} | "
                     f"{r['local']} | {r['peer']} | {r['pfs']} |")
    body = "\n".join(lines)
    print(body)
    record_targets("replication", rows)
    if args.update:
        update_section(args.update, SECTION, body)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
