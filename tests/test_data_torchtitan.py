"""The torchtitan side of data resumption, in process: packing parity with torchtitan's
own loader, checkpoints through DCP (ours and stock torchtitan's per-rank state),
startup validation, the TrainSpec registration, streaming datasets."""

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_ckpt_plus import config, flavors  # before torchtitan: no full plugin install
from titan_ckpt_plus.adapters import torchtitan_v022_data as adapter
from titan_ckpt_plus.data.loader import STATE_KEY, DataResumeError, GlobalSampleLoader
from titan_ckpt_plus.staging import copy_into

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "configs" / "tiny_tiered.toml"
DEMO = ROOT / "assets" / "demo" / "corpus" / "train.jsonl"

flavors.register()
adapter.install()  # what the plugin's install() ends with: the TrainSpec and the DCP hook


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first 300 documents of the demo corpus (about 600 sequences of 33 tokens)."""
    d = tmp_path_factory.mktemp("corpus")
    with open(DEMO) as f:
        (d / "train.jsonl").write_text("".join(itertools.islice(f, 300)))
    return d


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TITAN_CKPT_DATA_CACHE", str(tmp_path_factory.getbasetemp() / "token_cache"))
    monkeypatch.delenv("TITAN_CKPT_SAMPLE_LOG", raising=False)


def job(corpus, *overrides):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args([
        "--job.config_file", str(CONFIG), "--training.dataset_path", str(corpus),
        "--model.hf_assets_path", str(ROOT / "assets" / "demo" / "tokenizer"), *overrides])


@pytest.fixture(scope="module")
def tokenizer(corpus):
    from torchtitan.components.tokenizer import build_hf_tokenizer

    return build_hf_tokenizer(job(corpus))


def stock_loader(dp, rank, tok, cfg):
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    return build_text_dataloader(dp, rank, tok, cfg)


def batches(loader, n):
    return [(b["input"].clone(), lab.clone()) for b, lab in itertools.islice(iter(loader), n)]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                    for x, y in zip(a, b))


def test_at_dp_1_the_stream_is_torchtitans_own_packing_across_re_loops(corpus, tokenizer):
    cfg = job(corpus)
    ours = adapter.build_dataloader(1, 0, tokenizer, cfg)
    assert isinstance(ours, GlobalSampleLoader) and not ours.per_rank
    per_pass = ours.stream.sequences_per_pass
    n = int(per_pass * 1.3) // 2 + 1  # past the end of the first pass
    assert same(batches(ours, n), batches(stock_loader(1, 0, tokenizer, cfg), n))


def test_index_is_built_once_and_reused(corpus, tokenizer):
    cfg = job(corpus)
    a, _ = adapter.open_stream(tokenizer, cfg)
    b, _ = adapter.open_stream(tokenizer, cfg)
    assert a.identity == b.identity and Path(a.identity["index"]).is_dir()


def test_global_state_round_trips_through_dcp_once_for_all_ranks(corpus, tokenizer, tmp_path):
    cfg = job(corpus)
    src = adapter.build_dataloader(1, 0, tokenizer, cfg)
    batches(src, 5)
    dcp.save({"dataloader": src}, checkpoint_id=str(tmp_path / "ck"))
    meta = dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata()
    assert [k for k in meta.state_dict_metadata if k.startswith("dataloader.")] == [
        f"dataloader.{STATE_KEY}"]
    dst = adapter.build_dataloader(1, 0, tokenizer, cfg)
    dcp.load({"dataloader": dst}, checkpoint_id=str(tmp_path / "ck"))
    assert dst.consumed == src.consumed == 10
    assert same(batches(dst, 3), batches(src, 3))


def test_stock_per_rank_checkpoint_loads_as_is_at_the_same_dp(corpus, tokenizer, tmp_path):
    cfg = job(corpus)
    stock = stock_loader(1, 0, tokenizer, cfg)
    it = iter(stock)
    for _ in range(7):
        next(it)
    dcp.save({"dataloader": stock}, checkpoint_id=str(tmp_path / "stock"))
    stock_sd = stock.state_dict()
    expected = [(b["input"].clone(), lab.clone()) for b, lab in itertools.islice(it, 6)]

    ours = adapter.build_dataloader(1, 0, tokenizer, cfg)
    dcp.load({"dataloader": ours}, checkpoint_id=str(tmp_path / "stock"))
    assert ours.per_rank
    assert same(batches(ours, 6), expected)

    # It keeps saving per-rank state (plus a marker), which it, and stock torchtitan, resume.
    sd = ours.state_dict()
    assert set(sd) == {"dp_rank_0", "world_size", STATE_KEY}
    assert json.loads(sd[STATE_KEY])["mode"] == "per_rank"
    dcp.save({"dataloader": ours}, checkpoint_id=str(tmp_path / "again"))
    after = batches(ours, 2)
    again = adapter.build_dataloader(1, 0, tokenizer, cfg)
    dcp.load({"dataloader": again}, checkpoint_id=str(tmp_path / "again"))
    assert same(batches(again, 2), after)
    plain = stock_loader(1, 0, tokenizer, cfg)
    dcp.load({"dataloader": plain}, checkpoint_id=str(tmp_path / "again"))
    assert same(batches(plain, 2), after)

    # The local tier hands the saved dict to load_state_dict through copy_into, which
    # keeps the live keys: before the first batch the live state is {}, so any format passes.
    local = adapter.build_dataloader(1, 0, tokenizer, cfg)
    local.load_state_dict(copy_into(local.state_dict(), sd, "dataloader"))
    assert local.per_rank and same(batches(local, 2), after)
    local = adapter.build_dataloader(1, 0, tokenizer, cfg)  # torchtitan's state, no marker
    local.load_state_dict(copy_into(local.state_dict(), stock_sd, "dataloader"))
    assert local.per_rank and same(batches(local, 6), expected)


def test_stock_per_rank_checkpoint_at_another_dp_is_refused_before_reading(corpus, tokenizer, tmp_path):
    cfg = job(corpus, "--training.global_batch_size", "6")
    fake = {"dataloader": {"dp_rank_0": b"x", "dp_rank_1": b"y", "world_size": 2}}
    dcp.save(fake, checkpoint_id=str(tmp_path / "stock2"))
    for dp, rank in ((1, 0), (3, 2)):
        ours = adapter.build_dataloader(dp, rank, tokenizer, cfg)
        with pytest.raises(DataResumeError) as e:
            dcp.load({"dataloader": ours}, checkpoint_id=str(tmp_path / "stock2"))
        msg = str(e.value)
        assert "data-parallel degree 2" in msg and f"data-parallel degree {dp}" in msg
        assert "--checkpoint.exclude_from_loading dataloader" in msg
        assert ours._load_hint is None
    with pytest.raises(DataResumeError, match="data-parallel degree 2"):  # the local-tier path
        ours.load_state_dict(fake["dataloader"])


def test_a_checkpoint_without_dataloader_state_gets_a_clear_error(corpus, tokenizer, tmp_path):
    dcp.save({"other": torch.zeros(2)}, checkpoint_id=str(tmp_path / "none"))
    ours = adapter.build_dataloader(1, 0, tokenizer, job(corpus))
    with pytest.raises(DataResumeError, match="exclude_from_loading"):
        dcp.load({"dataloader": ours}, checkpoint_id=str(tmp_path / "none"))


def test_loads_without_our_loader_are_untouched(tmp_path):
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path / "w"))
    out = {"w": torch.zeros(4)}
    dcp.load(out, checkpoint_id=str(tmp_path / "w"))
    assert out["w"].tolist() == [0, 1, 2, 3]


# ---- startup validation ------------------------------------------------------------------

def test_indivisible_global_batch_names_the_keys_and_the_fixes(corpus, tokenizer):
    cfg = job(corpus, "--training.global_batch_size", "12")
    with pytest.raises(config.ConfigError) as e:
        adapter.build_dataloader(5, 0, tokenizer, cfg)
    msg = str(e.value)
    for part in ("[training] global_batch_size = 12", "data-parallel degree 5",
                 "[training] local_batch_size = 2", "--training.global_batch_size",
                 "a multiple of local_batch_size x DP degree = 10", "1, 2, 3, 6"):
        assert part in msg, msg
    cfg = job(corpus, "--training.global_batch_size", "12", "--training.local_batch_size", "4")
    with pytest.raises(config.ConfigError, match=r"--training.local_batch_size to one of 1, 2, 3, 6"):
        adapter.build_dataloader(2, 0, tokenizer, cfg)


def test_default_global_batch_follows_the_dp_degree(corpus):
    cfg = job(corpus)
    assert adapter.resolve_global_batch(cfg, 3) == 6


def test_unknown_mode_is_refused(corpus, tokenizer):
    cfg = job(corpus, "--checkpoint.dataloader_resume", "bogus",
              "--checkpoint.local_folder", str(corpus / "local"))
    with pytest.raises(config.ConfigError, match="dataloader_resume = 'bogus'"):
        adapter.build_dataloader(1, 0, tokenizer, cfg)
    with pytest.raises(config.ConfigError, match="dataloader_resume"):
        config.validate(cfg.checkpoint, str(corpus / "dump"))


@pytest.mark.parametrize("overrides", [["--checkpoint.dataloader_resume", "per_rank"],
                                       ["--checkpoint.no-enable"]])
def test_per_rank_mode_and_no_checkpointing_keep_torchtitans_loader(corpus, tokenizer, overrides):
    from torchtitan.components.dataloader import ParallelAwareDataloader

    loader = adapter.build_dataloader(1, 0, tokenizer, job(corpus, *overrides))
    assert type(loader) is ParallelAwareDataloader


def test_llama3_spec_uses_our_loader_and_flavors_still_resolve():
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("llama3")
    assert spec.build_dataloader_fn.func is adapter.build_dataloader
    assert {"tiny", "100M", "debugmodel"} <= set(spec.model_args)
    adapter.install()  # idempotent
    assert get_train_spec("llama3") is spec


def test_streaming_dataset_falls_back_to_per_rank_state(corpus, tokenizer, tmp_path):
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS["stream_test"] = DatasetConfig(
        path=str(corpus), loader=lambda p: load_dataset(p, split="train", streaming=True),
        sample_processor=lambda s: s["text"])
    try:
        cfg = job(corpus, "--training.dataset", "stream_test")
        ours = adapter.build_dataloader(1, 0, tokenizer, cfg)
        assert ours.per_rank and ours.stream is None
        assert same(batches(ours, 3), batches(stock_loader(1, 0, tokenizer, cfg), 3))
        assert json.loads(ours.state_dict()[STATE_KEY])["mode"] == "per_rank"
        # A global-sample position cannot be continued on a stream that has no index.
        src = adapter.build_dataloader(1, 0, tokenizer, job(corpus))
        batches(src, 2)
        dcp.save({"dataloader": src}, checkpoint_id=str(tmp_path / "g"))
        with pytest.raises(DataResumeError, match="streaming"):
            dcp.load({"dataloader": adapter.build_dataloader(1, 0, tokenizer, cfg)},
                     checkpoint_id=str(tmp_path / "g"))
    finally:
        del DATASETS["stream_test"]
