"""Runs the tiny CPU job under torchrun for the end-to-end tests."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from titan_ckpt_plus import digest  # noqa: E402
from titan_ckpt_plus.digest import DIGEST_ENV  # noqa: E402

CONFIG = ROOT / "tests" / "configs" / "tiny_tiered.toml"
TORCHRUN = Path(sys.executable).with_name("torchrun")
LAUNCH = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m", "torch.distributed.run"]


def torchrun(workdir: Path, *overrides: str, nproc: int = 2, fault: str = "", nnodes: int = 1,
             node_rank: int = 0, port: int = 0, timeout: int = 300, loss_log: str = "losses.jsonl",
             config: Path = CONFIG, env: dict | None = None,
             local: Path | None = None, module: str = "torchtitan.train",
             digests: bool = True) -> subprocess.CompletedProcess:
    """One torchrun invocation of the test job (`module`: the trainer) with its dump and
    local folders under `workdir` (the local folders under `local` instead, if given: jobs
    sharing a node's disk); returns the finished process (stdout and stderr together).

    `digests` (benchmarks turn it off: it costs a pass over the state per save) arms the
    state-digest hook in workdir/digests and fails the run's caller if any rank's state
    right after a load differs from that step's state when it was saved (at the same
    world size; titan_ckpt_plus/digest.py)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONPATH=path,
               TITAN_CKPT_LOSS_LOG=str(workdir / loss_log), TITAN_CKPT_FAULT=fault,
               WANDB_MODE="offline", TITAN_CKPT_NO_FINAL_SLEEP="1", **(env or {}))
    if digests:
        env.setdefault(DIGEST_ENV, str(workdir / "digests"))
    if nnodes == 1:
        launch = ["--standalone"]
    else:
        launch = ["--nnodes", str(nnodes), "--node_rank", str(node_rank), "--rdzv_backend", "c10d",
                  "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "titan-ckpt-test"]
    cmd = [*LAUNCH, *launch, "--nproc_per_node", str(nproc), "-m", module,
           "--job.config_file", str(config), "--job.dump_folder", str(workdir / "dump"),
           "--checkpoint.local_folder", str((local or workdir / "local") / "{node_rank}"), *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if digests and os.path.isdir(env[DIGEST_ENV]):
        bad = digest.mismatches(digest.read(env[DIGEST_ENV]))
        assert not bad, f"state after a load differs from the saved state: {bad[:6]}"
    return proc


_FATAL = ("Fatal Python error", "terminate called", "Traceback (most recent call last)",
          "Segmentation fault", "exitcode")


def output(proc, tail: int = 4000) -> str:
    """A failed job's output for an assertion message: every line that says how a
    process died (with the 40 after it: a native abort's thread dump) and the last
    `tail` characters. The tail alone lost the dump of a rank that aborted at exit."""
    lines = proc.stdout.splitlines()
    keep = set()
    for i, line in enumerate(lines):
        if any(m in line for m in _FATAL):
            keep.update(range(i, min(i + 41, len(lines))))
    excerpt = "\n".join(lines[i] for i in sorted(keep))
    return f"exit {proc.returncode}\n--- how it died ---\n{excerpt}\n--- last output ---\n{proc.stdout[-tail:]}"


def ok(*procs):
    """Fail unless every process exited 0; returns the first (or only) one."""
    for p in procs:
        assert p.returncode == 0, output(p)
    return procs[0]


def run_without_torch(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter, then fail unless it imported no torch module:
    the CLI and the policy room must work on a machine without a training stack."""
    check = ("\nimport sys as _s\n"
             "_bad = sorted(n for n in _s.modules if n == 'torch' or n.startswith('torch.'))\n"
             "assert not _bad, _bad\n")
    proc = subprocess.run([sys.executable, "-c", code + check], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_nodes(workdir: Path, *overrides: str, nnodes: int = 2, nproc: int = 2,
                   fault: str = "", loss_log: str = "losses.jsonl", timeout: int = 300,
                   env: dict | None = None) -> list:
    """`nnodes` torchrun agents on this machine (a c10d rendezvous on 127.0.0.1),
    each node with its own local folder; returns each agent's finished process."""
    import concurrent.futures as cf

    port = free_port()
    with cf.ThreadPoolExecutor(nnodes) as pool:
        futs = [pool.submit(torchrun, workdir, *overrides, nproc=nproc, fault=fault, nnodes=nnodes,
                            node_rank=n, port=port, timeout=timeout, loss_log=loss_log, env=env)
                for n in range(nnodes)]
        return [f.result() for f in futs]


def events(path: Path, kind: str | None = None) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if kind is None or rec.get("event") == kind:
                out.append(rec)
    return out


def losses(workdir: Path, name: str = "losses.jsonl") -> dict[int, float]:
    """step -> loss; a later incarnation's value for a step overrides an earlier one."""
    return {r["step"]: r["loss"] for r in events(workdir / name, "loss")}


def sample_records(path: Path) -> list[dict]:
    """What TITAN_CKPT_SAMPLE_LOG wrote: one record per rank and microbatch."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def by_step(recs: list[dict]) -> dict[int, list[int]]:
    """step -> the step's sequence ids, microbatch-major then DP rank."""
    from collections import defaultdict

    steps = defaultdict(list)
    for r in recs:
        steps[r["step"]].append(r)
    return {s: [i for r in sorted(rs, key=lambda r: (r["microbatch"], r["dp_rank"]))
                for i in r["seq_ids"]] for s, rs in steps.items()}


def ckpt_events(workdir: Path, kind: str) -> list[dict]:
    return events(workdir / "dump" / "titan_ckpt_plus" / "events.jsonl", kind)


def job_id(work: Path) -> str:
    """The id of the job whose dump folder is work/dump."""
    return json.loads((work / "dump" / "titan_ckpt_plus" / "job.json").read_text())["job_id"]


def job_dir(work: Path, node: str = "0") -> Path:
    """The job's subfolder of a node's local folder (tiers/local.py)."""
    return work / "local" / node / f"job-{job_id(work)}"


def load_digests(work: Path, step: int) -> dict[int, dict]:
    """rank -> the digest of its state right after loading `step`, from the runs in `work`
    (torchrun arms the hook): two restarts at one world size that loaded the same state
    have equal ones, whatever they loaded it from."""
    return {r["rank"]: r["digest"] for r in digest.read(str(work / "digests"))
            if r["when"] == "load" and r["step"] == step}


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a run's folders that is still the same job, so tests can restart one
    killed run in several ways: a copied dump folder is a new job (identity.py), so the
    copy's identity and local_roots.json are pointed at the copy's folders."""
    shutil.copytree(src, dst)
    plugin = dst / "dump" / "titan_ckpt_plus"
    ident = json.loads((plugin / "job.json").read_text())
    ident["dump_folder"] = os.path.realpath(dst / "dump")
    (plugin / "job.json").write_text(json.dumps(ident))
    roots = plugin / "local_roots.json"
    if roots.exists():
        roots.write_text(json.dumps([r.replace(str(src), str(dst)) for r in json.loads(roots.read_text())]))
    return dst


def flip_byte(path: Path, where: float = 0.5) -> None:
    raw = bytearray(path.read_bytes())
    raw[int(len(raw) * where)] ^= 0xFF
    path.write_bytes(bytes(raw))


def pfs_step(work: Path, step: int) -> Path:
    """Where a PFS step's full state is: full_state/step-N beside a last-step export."""
    pfs = work / "dump" / "checkpoint"
    full = pfs / "full_state" / f"step-{step}"
    return full if (full / ".metadata").exists() else pfs / f"step-{step}"


def files_of(folder: Path, but: tuple = ("JOB.json", ".lock")) -> dict[str, tuple | None]:
    """Every file under `folder` -> (size, mtime in ns), every folder -> None, but files
    named in `but` (a job's claim of its local folder rewrites JOB.json): equal before
    and after a run that wrote nothing there."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(folder.rglob("*")) if p.name not in but}
