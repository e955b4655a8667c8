"""End to end on CPU: torchtitan's last-step export with the tiers on (issue 13).

The export is made as stock torchtitan makes it (model only in export_dtype, DCP or HF
safetensors, at step-N of the checkpoint folder); the full state of the last step stays
on both tiers (full_state/step-N on the PFS), so the job can go on from there. Both runs
use torchtitan's own per-rank dataloader, so plugin and stock train on the same data.
"""

import json
import shutil

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from harness import ckpt_events, copy_run, losses, ok, torchrun

pytestmark = pytest.mark.e2e
SAME_DATA = ("--checkpoint.dataloader_resume", "per_rank")
DCP_EXPORT = ("--training.steps", "6", "--checkpoint.export_dtype", "bfloat16", *SAME_DATA)
HF_EXPORT = ("--training.steps", "4", "--checkpoint.export_dtype", "bfloat16",
             "--checkpoint.last_save_in_hf", *SAME_DATA)
STOCK = ("--checkpoint.no-tier-local",)


@pytest.fixture(scope="module")
def dcp_runs(tmp_path_factory):
    stock, plugin = tmp_path_factory.mktemp("stock_dcp"), tmp_path_factory.mktemp("plugin_dcp")
    ok(torchrun(stock, *STOCK, *DCP_EXPORT))
    ok(torchrun(plugin, *DCP_EXPORT))
    return stock, plugin


def _dcp_tensors(step_dir, tmp_path) -> dict:
    out = tmp_path / f"{step_dir.parent.parent.parent.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    return torch.load(out, weights_only=False)


def test_model_only_bf16_export_is_stock_torchtitans_tensor_for_tensor(dcp_runs, tmp_path):
    stock, plugin = dcp_runs
    assert losses(plugin) == losses(stock) and len(losses(stock)) == 6
    pfs = plugin / "dump" / "checkpoint"
    want = _dcp_tensors(stock / "dump" / "checkpoint" / "step-6", tmp_path)
    got = _dcp_tensors(pfs / "step-6", tmp_path)
    assert sorted(got) == sorted(want) and not any(k.startswith("optimizer") for k in got)
    for k, t in want.items():
        assert t.dtype == torch.bfloat16 and got[k].dtype == t.dtype and torch.equal(got[k], t), k
    manifest = json.loads((pfs / "step-6" / "titan_ckpt_plus.json").read_text())
    assert (manifest["kind"], manifest["format"]) == ("export", "DCP")
    full = _dcp_tensors(pfs / "full_state" / "step-6", tmp_path)  # the resumable state beside it
    assert "train_state" in full and any(k.startswith("optimizer") for k in full)
    assert [e["step"] for e in ckpt_events(plugin, "export")] == [6]


def test_restart_after_the_last_step_resumes_at_the_next_step_never_from_the_export(dcp_runs, tmp_path):
    work = copy_run(dcp_runs[1], tmp_path / "more")
    shutil.rmtree(work / "local")  # only the PFS is left: the export and full_state/step-6
    proc = ok(torchrun(work, *DCP_EXPORT, "--training.steps", "8", loss_log="run2.jsonl"))
    rec = ckpt_events(work, "recovery")[-1]
    assert (rec["tier"], rec["step"]) == ("pfs", 6) and rec["bytes_pfs"] > 0
    assert "Training starts at step 7" in proc.stdout
    assert sorted(losses(work, "run2.jsonl")) == [7, 8]
    pfs = work / "dump" / "checkpoint"
    assert (pfs / "step-6" / ".metadata").is_file()  # an export is never purged
    assert (pfs / "step-8" / ".metadata").is_file() and (pfs / "full_state" / "step-8" / ".metadata").is_file()


def test_hf_export_is_written_where_stock_writes_it_and_loads_through_torchtitans_hf_path(tmp_path):
    from safetensors.torch import load_file

    stock, plugin, fresh = tmp_path / "stock", tmp_path / "plugin", tmp_path / "fresh"
    ok(torchrun(stock, *STOCK, *HF_EXPORT))
    ok(torchrun(plugin, *HF_EXPORT))
    s_dir, p_dir = stock / "dump" / "checkpoint" / "step-4", plugin / "dump" / "checkpoint" / "step-4"
    names = sorted(p.name for p in s_dir.glob("*.safetensors"))
    assert names and names == sorted(p.name for p in p_dir.glob("*.safetensors"))
    assert (p_dir / "model.safetensors.index.json").read_text() == (s_dir / "model.safetensors.index.json").read_text()
    for name in names:
        want, got = load_file(s_dir / name), load_file(p_dir / name)
        assert sorted(got) == sorted(want)
        assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)
    load = ("--training.steps", "1", "--checkpoint.initial_load_in_hf", *SAME_DATA)
    proc = ok(torchrun(fresh, "--checkpoint.initial_load_path", str(p_dir), *load))
    assert f"Loading the checkpoint from {p_dir}" in proc.stdout
    assert losses(fresh)[1] != losses(plugin)[1]  # step 1 ran on the exported weights, not a fresh init
    ok(torchrun(tmp_path / "fresh_stock", "--checkpoint.initial_load_path", str(s_dir), *load))
    assert losses(fresh) == losses(tmp_path / "fresh_stock")  # the same weights as stock's export


def test_a_seed_checkpoint_starts_the_job_from_the_model_alone_as_stock_does(tmp_path):
    """torchtitan's create_seed_checkpoint (one rank, step 0), then the job on 2 ranks:
    it loads step 0 as the model alone from the PFS, as stock torchtitan does, not the
    seed run's whole state from its local tier (a one-rank job's dataloader and
    optimizer); it trains as stock torchtitan's job from stock's seed checkpoint does."""
    seed, job = ("--checkpoint.create_seed_checkpoint", *SAME_DATA), ("--training.steps", "4", *SAME_DATA)
    stock, plugin = tmp_path / "stock", tmp_path / "plugin"
    for work, keys in ((stock, STOCK), (plugin, ())):
        ok(torchrun(work, *keys, *seed, nproc=1, loss_log="seed.jsonl"))
    assert (plugin / "dump" / "checkpoint" / "full_state" / "step-0" / ".metadata").exists()
    ok(torchrun(stock, *STOCK, *job))
    proc = ok(torchrun(plugin, *job))
    rec = ckpt_events(plugin, "recovery")[-1]
    assert (rec["tier"], rec["step"], rec["bytes_local"], rec["skipped"]) == ("pfs", 0, 0, [])
    assert "Traceback" not in proc.stdout and "Training starts at step 1" in proc.stdout
    assert losses(plugin) == losses(stock) and len(losses(stock)) == 4
