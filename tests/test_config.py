"""The `[checkpoint]` keys parse from TOML and the CLI; bad values fail clearly."""

import pytest

from titan_ckpt_plus import config

TOML = """
[job]
custom_config_module = "titan_ckpt_plus.config"
dump_folder = "{dump}"
[checkpoint]
enable = true
tier_local = true
local_folder = "{local}"
local_interval = 7
interval = 21
"""


def _parse(tmp_path, *cli, local="/tmp/x/local/{node_rank}"):
    from torchtitan.config import ConfigManager

    f = tmp_path / "job.toml"
    f.write_text(TOML.format(dump=tmp_path / "dump", local=local))
    return ConfigManager().parse_args(["--job.config_file", str(f), *cli])


def test_keys_parse_from_toml_and_cli(tmp_path):
    cfg = _parse(tmp_path)
    ck = cfg.checkpoint
    assert (ck.tier_local, ck.local_interval, ck.interval, ck.local_keep_latest_k) == (True, 7, 21, 3)
    cfg = _parse(tmp_path, "--checkpoint.local_interval", "3", "--checkpoint.no-tier-local")
    assert cfg.checkpoint.local_interval == 3 and cfg.checkpoint.tier_local is False
    assert ck.pfs_reuse_files is True
    assert _parse(tmp_path, "--checkpoint.no-pfs-reuse-files").checkpoint.pfs_reuse_files is False
    assert ck.helper_process is False
    assert _parse(tmp_path, "--checkpoint.helper_process").checkpoint.helper_process is True
    assert ck.local_reshard is True
    assert ck.agreements == "auto"
    gloo = _parse(tmp_path, "--checkpoint.agreements", "gloo").checkpoint
    assert gloo.agreements == "gloo"
    config.validate(gloo, str(tmp_path / "dump"))  # gloo without the helper is fine
    hub = _parse(tmp_path, "--checkpoint.agreements", "hub").checkpoint
    assert hub.agreements == "hub"
    config.validate(hub, str(tmp_path / "dump"))
    # the default with the helper: its exchanges go through the hub, nothing to refuse
    config.validate(_parse(tmp_path, "--checkpoint.helper_process").checkpoint, str(tmp_path / "dump"))
    assert _parse(tmp_path, "--checkpoint.no-local-reshard").checkpoint.local_reshard is False
    assert ck.drain_start == "auto"
    assert _parse(tmp_path, "--checkpoint.drain_start", "next_step").checkpoint.drain_start == "next_step"


def test_a_helper_process_where_there_is_no_memfd_is_refused_naming_the_key(tmp_path, monkeypatch):
    """Not Linux: no shared staging buffer for a helper to write from."""
    import os

    cfg = _parse(tmp_path, "--checkpoint.helper_process")
    monkeypatch.delattr(os, "memfd_create")
    with pytest.raises(config.ConfigError, match="helper_process = true needs Linux.*Fix: set helper_process = false"):
        config.validate(cfg.checkpoint, cfg.job.dump_folder)


def test_async_mode_with_the_tiers_on_is_said_at_start_not_ignored(tmp_path):
    """torchtitan's async save is not used with the tiers on (they write in the
    background themselves): the start-up log says so, naming the key and how to
    silence it; nothing is said where it is disabled or the tiers are off."""
    assert config.async_mode_note(_parse(tmp_path).checkpoint) is None
    for mode in ("async", "async_with_pinned_mem"):
        note = config.async_mode_note(_parse(tmp_path, "--checkpoint.async_mode", mode).checkpoint)
        assert note.startswith(f'[checkpoint] async_mode = "{mode}" is not used with tier_local = true')
        assert 'async_mode = "disabled"' in note
    off = _parse(tmp_path, "--checkpoint.async_mode", "async", "--checkpoint.no-tier-local").checkpoint
    assert config.async_mode_note(off) is None


def test_staging_copy_auto_may_copy_in_save_only_on_a_cpu_machine_whose_cores_training_fills(monkeypatch):
    """"auto" leaves the choice to the copy's measured cost only without an accelerator
    (a GPU's copy is a DMA beside the training stream) and where the node's ranks, with
    torch's threads each, use every core (a spare core takes a thread's copy off
    training's); else the thread. "thread" and "save" are taken as they are."""
    import torch

    from titan_ckpt_plus import cpu_fallback

    auto, save = config.Checkpoint(staging_copy="auto"), config.Checkpoint(staging_copy="save")
    assert config.Checkpoint().staging_copy == "auto"
    assert config.staging_copy(auto, accelerator=False, fills_cores=True) == "auto"
    assert config.staging_copy(auto, accelerator=True, fills_cores=True) == "thread"
    assert config.staging_copy(auto, accelerator=False, fills_cores=False) == "thread"
    assert config.staging_copy(save, accelerator=True, fills_cores=False) == "save"
    monkeypatch.setattr(cpu_fallback.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert [cpu_fallback.training_fills_cores(n) for n in (1, 3, 4, 8)] == [False, False, True, True]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert [cpu_fallback.training_fills_cores(n) for n in (1, 2)] == [False, True]


def test_unknown_key_names_the_key(tmp_path):
    from torchtitan.config import ConfigManager

    f = tmp_path / "bad.toml"
    f.write_text('[job]\ncustom_config_module = "titan_ckpt_plus.config"\n'
                 "[checkpoint]\ntier_lcoal = true\n")
    with pytest.raises(ValueError, match="tier_lcoal"):
        ConfigManager().parse_args(["--job.config_file", str(f)])


@pytest.mark.parametrize("cli,key", [
    (["--checkpoint.local_interval", "0"], "local_interval = 0"),
    (["--checkpoint.local_interval", "-5"], "local_interval = -5"),
    (["--checkpoint.interval", "0"], "interval = 0"),
    (["--checkpoint.local_keep_latest_k", "1"], "local_keep_latest_k = 1"),
    (["--checkpoint.keep_latest_k", "1"], "keep_latest_k = 1"),
    (["--checkpoint.local_folder", ""], "needs a node-local folder"),
    (["--checkpoint.local_folder", "/x/{rack}"], "unknown placeholder"),
    (["--checkpoint.preemption_grace_s", "-1"], "preemption_grace_s = -1"),
    (["--checkpoint.agreements", "nccl"], "agreements = 'nccl' is unknown"),
    (["--checkpoint.drain_start", "later"], "drain_start = 'later' is unknown"),
    (["--checkpoint.agreements", "gloo", "--checkpoint.helper_process"],
     'agreements = "gloo" cannot be honoured with helper_process = true'),
])
def test_bad_values_fail_naming_key_and_fix(tmp_path, cli, key):
    cfg = _parse(tmp_path, *cli)
    with pytest.raises(config.ConfigError, match="Fix:") as e:
        config.validate(cfg.checkpoint, cfg.job.dump_folder)
    assert key in str(e.value)


@pytest.mark.parametrize("inside", ["dump/checkpoint", "dump/checkpoint/local/{node_rank}", "dump"])
def test_local_folder_overlapping_pfs_is_refused(tmp_path, inside):
    cfg = _parse(tmp_path, local=str(tmp_path / inside))
    with pytest.raises(config.ConfigError, match="overlaps the PFS folder"):
        config.validate(cfg.checkpoint, cfg.job.dump_folder)


def test_placeholders_expand(monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "3")
    assert config.resolve_local_folder("/nvme/{node_rank}").endswith("/nvme/3")


@pytest.mark.parametrize("recipe", ["llama3_8b_tiered.toml", "debug_tiered.toml"])
def test_shipped_recipes_parse_and_validate(recipe):
    """The 8B recipe turns on what a cluster user wants: wandb, a replica on the next
    node and adaptive intervals."""
    from torchtitan.config import ConfigManager

    from harness import ROOT

    cfg = ConfigManager().parse_args(["--job.config_file", str(ROOT / "train_configs" / recipe)])
    config.validate(cfg.checkpoint, cfg.job.dump_folder)
    if recipe.startswith("llama3_8b"):
        ck = cfg.checkpoint
        assert (ck.tier_local, ck.replication_factor, ck.adaptive_interval) == (True, 1, True)
        assert cfg.metrics.enable_wandb and not ck.last_save_model_only
