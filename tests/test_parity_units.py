"""Unit tests of the drop-in parity pieces (issue 13): the PFS folder's last-step export
beside the full state, the CPU fallback's integer histc, state digests, the keys
refused at start-up."""

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_ckpt_plus import config, cpu_fallback, digest
from titan_ckpt_plus.tiers.pfs import PfsTier
from titan_ckpt_plus.tiers.pfs_folder import FULL_STATE, HF_INDEX, MANIFEST


def _dcp_step(path, state):
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _full(step):
    return {"w": torch.full((4,), float(step)), "train_state": {"step": step}}


def test_exports_are_never_resumable_and_never_purged(tmp_path):
    tier = PfsTier(str(tmp_path), rank=0, world_size=1, keep_latest_k=2, job_id="mine")
    for s in (2, 4):
        _dcp_step(tmp_path / f"step-{s}", _full(s))
    _dcp_step(tmp_path / "step-6", {"w": torch.zeros(4)})  # stock's model-only export: no manifest
    _dcp_step(tmp_path / FULL_STATE / "step-6", _full(6))  # its full state beside it
    (tmp_path / "step-8").mkdir()  # an HF export
    (tmp_path / "step-8" / HF_INDEX).write_text("{}")
    _dcp_step(tmp_path / "step-10", {"w": torch.zeros(4), "train_state": {"step": 10}})
    (tmp_path / "step-10" / MANIFEST).write_text(json.dumps({"job_id": "mine", "kind": "export"}))

    assert tier.steps() == [2, 4, 6]
    assert tier.exports() == [6, 8, 10]
    assert tier.step_dir(6) == str(tmp_path / FULL_STATE / "step-6")
    assert tier.step_dir(4) == str(tmp_path / "step-4")
    assert tier.purge() == [2]
    assert not (tmp_path / "step-2").exists()
    assert all((tmp_path / f"step-{s}").is_dir() for s in (4, 6, 8, 10))


def test_another_jobs_export_counts_as_its_step(tmp_path):
    (tmp_path / "step-8").mkdir()
    (tmp_path / "step-8" / HF_INDEX).write_text("{}")
    (tmp_path / "step-8" / MANIFEST).write_text(json.dumps({"job_id": "theirs", "kind": "export"}))
    tier = PfsTier(str(tmp_path), rank=0, world_size=1, keep_latest_k=2, job_id="mine")
    assert tier.steps() == [] and tier.other_jobs_steps() == {8: "theirs"}


def test_record_export_checksums_every_file(tmp_path):
    tier = PfsTier(str(tmp_path), rank=0, world_size=1, keep_latest_k=0, job_id="mine")
    (tmp_path / "step-3" / "sharded").mkdir(parents=True)
    (tmp_path / "step-3" / "model.safetensors").write_bytes(b"abc")
    (tmp_path / "step-3" / "sharded" / "shard-1.safetensors").write_bytes(b"de")
    assert tier.record_export(3, "HF safetensors", "torch.bfloat16") == 5
    m = json.loads((tmp_path / "step-3" / MANIFEST).read_text())
    assert (m["kind"], m["job_id"], m["format"]) == ("export", "mine", "HF safetensors")
    assert sorted(m["files"]) == ["model.safetensors", os.path.join("sharded", "shard-1.safetensors")]
    assert tier.is_export(3)


@pytest.mark.parametrize("lo,hi,bins", [(0, 8, 8), (0, 10, 4), (2, 7, 3), (0, 0, 5), (-3, 9, 7)])
def test_integer_histc_counts_as_float_histc_does(lo, hi, bins):
    cpu_fallback._patch_integer_histc()
    x = torch.randint(-5, 12, (1000,), generator=torch.Generator().manual_seed(bins))
    got = torch.histc(x, bins=bins, min=lo, max=hi)
    want = cpu_fallback._histc_integer.original(x.float(), bins=bins, min=lo, max=hi)
    assert got.dtype == torch.int64 and got.tolist() == want.long().tolist()
    f = torch.rand(50)  # floats still go to torch's own kernel
    assert torch.equal(torch.histc(f, bins=4), cpu_fallback._histc_integer.original(f, bins=4))


@pytest.mark.parametrize("flags,native", [("fpu avx2 avx512f avx512_bf16", True), ("fpu avx2 amx_bf16", True),
                                           ("fpu avx2 avx512f", False), (None, True)])
def test_bf16_dot_products_are_read_from_the_cpu_flags(tmp_path, flags, native):
    """The benchmarks train in fp32 where bf16 GEMMs would fall back to a scalar loop;
    a CPU whose flags cannot be read keeps torchtitan's default."""
    info = tmp_path / "cpuinfo"
    if flags is not None:
        info.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert cpu_fallback.cpu_has_bf16_dot(str(info)) is native


@pytest.mark.parametrize("active,native,dtype,sharded,warned", [
    (True, False, "bfloat16", True, True), (True, True, "bfloat16", True, False),
    (True, False, "float32", True, False), (True, False, "bfloat16", False, False),
    (False, False, "bfloat16", True, False)])
def test_bf16_on_a_cpu_without_bf16_dot_products_is_warned_with_the_fix(monkeypatch, active, native,
                                                                         dtype, sharded, warned):
    """Only where the fallback runs, the model is sharded (FSDP applies param_dtype) in bf16
    and the CPU lacks bf16 dot products; the warning names the key and the value to set."""
    monkeypatch.setattr(cpu_fallback, "_ACTIVE", active)
    monkeypatch.setattr(cpu_fallback, "cpu_has_bf16_dot", lambda: native)
    why = cpu_fallback.slow_bf16_warning(dtype, sharded)
    assert (why is not None) is warned
    if warned:
        assert "mixed_precision_param" in why and '"float32"' in why


def test_the_adapter_warns_of_slow_bf16_from_torchtitans_own_job_and_dims(monkeypatch, caplog):
    """The adapter reads torchtitan 0.2.2's own JobConfig and ParallelDims: its default
    job (bf16) sharded over 2 ranks is warned on rank 0 only, the same job in fp32 or
    unsharded is not."""
    from types import SimpleNamespace

    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims

    from titan_ckpt_plus.adapters.torchtitan_v022 import TieredCheckpointManager

    monkeypatch.setattr(cpu_fallback, "_ACTIVE", True)
    monkeypatch.setattr(cpu_fallback, "cpu_has_bf16_dot", lambda: False)
    job = JobConfig()

    def warned(rank: int, shards: int = 2) -> bool:
        dims = ParallelDims(dp_replicate=1, dp_shard=shards, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=shards)
        caplog.clear()
        TieredCheckpointManager._warn_slow_bf16(SimpleNamespace(job_config=job, parallel_dims=dims), rank)
        return any(cpu_fallback.FP32_ARG in r.getMessage() for r in caplog.records)

    assert warned(0) and not warned(1) and not warned(0, shards=1)
    job.training.mixed_precision_param = "float32"
    assert not warned(0)


def test_digest_sees_every_byte_dtype_and_value():
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "train_state": {"step": 3},
             "opt": {"state": {"w": {"exp_avg": torch.ones(3, dtype=torch.bfloat16)}}}}
    base = digest.digest(state)
    assert digest.digest(state) == base
    state["model"]["w"][1, 2] = torch.nextafter(torch.tensor(5.0), torch.tensor(6.0))
    assert digest.digest(state)["model"] != base["model"]
    zeros = {"t": torch.zeros(4, dtype=torch.bfloat16)}  # same bytes, another dtype or shape
    assert digest.digest(zeros) != digest.digest({"t": torch.zeros(4, dtype=torch.float16)})
    assert digest.digest(zeros) != digest.digest({"t": zeros["t"].reshape(2, 2)})
    assert digest.digest(dict(state, train_state={"step": 4}))["train_state"] != base["train_state"]


def test_digest_log_is_off_unless_armed(tmp_path):
    digest.DigestLog(None, 0).record("save", 1, {"a": 1})
    log = digest.DigestLog(str(tmp_path / "d"), 3)
    log.record("save", 1, {"a": torch.ones(2)})
    (rec,) = digest.read(str(tmp_path / "d"))
    assert (rec["when"], rec["step"], rec["rank"]) == ("save", 1, 3)


class _Ckpt:
    enable, tier_local, interval, local_interval, local_folder = True, True, 10, 5, "/tmp/x{node_rank}"
    local_keep_latest_k, keep_latest_k, replication_factor, replication_jump = 2, 3, 0, 0
    replication_backend, preemption_grace_s, adopt_job = "gloo", 0, ""
    last_save_model_only, last_save_in_hf, initial_load_in_hf = True, False, False
    adaptive_interval = False


def test_hf_export_of_the_full_state_is_refused_at_start_with_the_keys(tmp_path):
    ck = _Ckpt()
    ck.last_save_model_only, ck.last_save_in_hf = False, True
    with pytest.raises(config.ConfigError, match="last_save_in_hf = true needs last_save_model_only"):
        config.validate(ck, str(tmp_path))


def test_hf_without_safetensors_is_refused_at_start(tmp_path, monkeypatch):
    ck = _Ckpt()
    ck.last_save_in_hf = True
    real = config.importlib.util.find_spec
    monkeypatch.setattr(config.importlib.util, "find_spec",
                        lambda name, *a: None if name == "safetensors" else real(name, *a))
    with pytest.raises(config.ConfigError, match=r"titan_ckpt_plus\[hf\]"):
        config.validate(ck, str(tmp_path))


def test_mismatches_compare_each_load_with_its_own_save():
    rec = lambda when, step, rank, d, world=2: {"when": when, "step": step, "rank": rank,
                                                "world_size": world, "digest": d}
    records = [rec("save", 4, 0, {"m": "a", "dl": "x"}), rec("save", 4, 1, {"m": "b", "dl": "y"}),
               rec("load", 4, 0, {"m": "a"}), rec("load", 4, 1, {"m": "b", "dl": "y"})]
    assert digest.mismatches(records) == []
    assert digest.mismatches(records + [rec("load", 4, 1, {"m": "c"})]) == [
        "rank 1 step 4: m differs after the load"]
    lone = [rec("load", 4, 0, {"m": "a"}, world=1)]
    assert digest.mismatches(lone + records) == []
    assert "not digested" in digest.mismatches(lone + records, strict=True)[0]


def test_inspect_lists_exports_and_full_state_and_verifies_an_hf_export(tmp_path):
    from titan_ckpt_plus import inspect

    pfs = tmp_path / "dump" / "checkpoint"
    tier = PfsTier(str(pfs), rank=0, world_size=1, keep_latest_k=0, job_id="mine")
    _dcp_step(pfs / FULL_STATE / "step-4", _full(4))
    (pfs / "step-4").mkdir()
    (pfs / "step-4" / "model-00001-of-00001.safetensors").write_bytes(b"weights")
    (pfs / "step-4" / HF_INDEX).write_text("{}")
    tier.record_export(4, "HF safetensors", "torch.bfloat16")
    steps, _ = inspect.list_steps(str(tmp_path / "dump"))
    by_path = {s.path: s.state for s in steps}
    assert by_path[str(pfs / "step-4")] == "export (HF safetensors, bfloat16), not resumable"
    assert by_path[str(pfs / FULL_STATE / "step-4")] == "complete, stock (no manifest)"
    checks, _ = inspect.verify_path(str(tmp_path / "dump"))
    assert [c.status for c in checks if c.path == str(pfs / "step-4")] == ["ok"]
    (pfs / "step-4" / "model-00001-of-00001.safetensors").write_bytes(b"weightz")
    checks, _ = inspect.verify_path(str(tmp_path / "dump"))
    assert any(c.status == "FAILED" and c.path.endswith(".safetensors") for c in checks)


_FAILED_RUN = """
import os, signal, sys, time, types
from titan_ckpt_plus.adapters.torchtitan_v022 import TieredCheckpointManager
m = types.SimpleNamespace(_sigterm_at=None)
m._on_sigterm = lambda *_: setattr(m, "_sigterm_at", time.monotonic()) or print("noted", flush=True)
signal.signal(signal.SIGTERM, m._on_sigterm)
if sys.argv[1] == "before":  # the launcher's SIGTERM came while the rank still trained
    os.kill(os.getpid(), signal.SIGTERM)
try:
    raise RuntimeError("[gloo] Connection reset by peer")  # training's collective, a peer gone
except RuntimeError:
    TieredCheckpointManager._sigterm_ends_a_failed_run(m)
    print("closing", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's SIGTERM while close() waits
    time.sleep(5)
print("outlived the SIGTERM", flush=True)
"""


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_sigterm_ends_a_failed_runs_close_at_once(when):
    """Training raised (a peer died): the launcher's SIGTERM ends the rank at once, as
    in stock torchtitan, instead of being noted as a preemption while close() waits
    for the dead peer's vote until torchrun's SIGKILL 30 s later. The error is logged."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _FAILED_RUN, when], capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert p.returncode == -15, p.stdout + p.stderr
    assert p.stdout.split() == (["noted"] if when == "before" else ["closing"])
    assert "training failed; closing" in p.stderr and "Connection reset by peer" in p.stderr
