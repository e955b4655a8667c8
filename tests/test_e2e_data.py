"""End to end on CPU: dataloader resumption by global sample count (issue 5).

The tiny llama3 job of tests/configs/tiny_tiered.toml with a fixed global batch of 12
sequences (local batch 2: DP 2 -> 3 microbatches, DP 1 -> 6, DP 3 -> 2), every rank
recording the global sequence ids it consumes (TITAN_CKPT_SAMPLE_LOG).
"""

import itertools
import os
from pathlib import Path

import pytest

from harness import by_step, losses, ok, ROOT, torchrun
from harness import sample_records as records

pytestmark = pytest.mark.e2e
G = 12
STEPS = 12


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first 2000 demo documents (about 4000 sequences): a quick index build."""
    d = tmp_path_factory.mktemp("corpus")
    with open(ROOT / "assets" / "demo" / "corpus" / "train.jsonl") as f:
        (d / "train.jsonl").write_text("".join(itertools.islice(f, 2000)))
    return d


@pytest.fixture(scope="module", autouse=True)
def token_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TITAN_CKPT_DATA_CACHE", str(tmp_path_factory.mktemp("token_cache")))
        yield


def run(work: Path, corpus: Path, nproc: int, *overrides: str, samples: str = "samples.jsonl",
        global_batch: int = G, **kw):
    os.environ["TITAN_CKPT_SAMPLE_LOG"] = str(work / samples)
    try:
        return torchrun(work, "--training.dataset_path", str(corpus),
                        "--training.global_batch_size", str(global_batch), *overrides,
                        nproc=nproc, **kw)
    finally:
        del os.environ["TITAN_CKPT_SAMPLE_LOG"]


def test_dp_2_then_1_then_3_consumes_every_sequence_exactly_once(corpus, tmp_path):
    ok(run(tmp_path, corpus, 2, "--training.steps", "4", samples="s1.jsonl"))
    p2 = ok(run(tmp_path, corpus, 1, "--training.steps", "8", samples="s2.jsonl"))
    assert "data resumes at global sequence 48 (step 4" in p2.stdout
    assert "recovered step 4 from the local (resharded from world size 2) tier" in p2.stdout
    p3 = ok(run(tmp_path, corpus, 3, "--training.steps", "12", samples="s3.jsonl"))
    assert "data resumes at global sequence 96 (step 8" in p3.stdout
    assert "saved at DP 1, now DP 3 x local batch 2 x 2 microbatches" in p3.stdout
    assert "recovered step 8 from the local (resharded from world size 1) tier" in p3.stdout

    runs = [records(tmp_path / f"s{i}.jsonl") for i in (1, 2, 3)]
    for recs, dp, steps in zip(runs, (2, 1, 3), ((1, 4), (5, 8), (9, 12))):
        assert {r["dp_degree"] for r in recs} == {dp}
        assert {r["dp_rank"] for r in recs} == set(range(dp))
        assert {r["step"] for r in recs} == set(range(steps[0], steps[1] + 1))
        assert len(recs) == (steps[1] - steps[0] + 1) * (G // 2)  # one record per microbatch
    everything = [i for recs in runs for r in recs for i in r["seq_ids"]]
    assert sorted(everything) == list(range(STEPS * G))  # none twice, none skipped
    steps = by_step([r for recs in runs for r in recs])
    for k in range(1, STEPS + 1):  # step k is the k-th global batch, in stream order
        assert steps[k] == list(range((k - 1) * G, k * G)), k
    assert len(losses(tmp_path)) == STEPS


def test_same_dp_resume_is_bit_exact(corpus, tmp_path):
    ref, work = tmp_path / "ref", tmp_path / "work"
    ok(run(ref, corpus, 2))
    killed = run(work, corpus, 2, fault="kill_after_step@7:1", samples="s1.jsonl",
                 loss_log="run1.jsonl")
    assert killed.returncode != 0 and "SIGKILL" in killed.stdout
    p = ok(run(work, corpus, 2, samples="s2.jsonl", loss_log="run2.jsonl"))
    assert "Training starts at step 7" in p.stdout
    got, want = losses(work, "run2.jsonl"), losses(ref)
    assert [got.get(s) for s in range(7, STEPS + 1)] == [want[s] for s in range(7, STEPS + 1)]
    ref_steps, resumed = by_step(records(ref / "samples.jsonl")), by_step(records(work / "s2.jsonl"))
    assert {k: resumed[k] for k in range(7, STEPS + 1)} == {k: ref_steps[k] for k in range(7, STEPS + 1)}


def test_global_batch_the_dp_degree_cannot_divide_fails_at_startup(corpus, tmp_path):
    proc = run(tmp_path, corpus, 2, global_batch=6)
    assert proc.returncode != 0
    out = proc.stdout
    assert "ConfigError" in out and "[training] global_batch_size = 6 cannot be divided over " \
        "data-parallel degree 2 with [training] local_batch_size = 2" in out
    assert "--training.global_batch_size" in out and "--training.local_batch_size" in out
    assert not losses(tmp_path) and "step:  1" not in out and "Training starts" not in out


def test_per_rank_checkpoint_is_refused_at_another_dp_with_how_to_proceed(corpus, tmp_path):
    ok(run(tmp_path, corpus, 2, "--training.steps", "4", "--checkpoint.dataloader_resume",
            "per_rank", samples="none.jsonl"))
    assert not (tmp_path / "none.jsonl").exists()  # torchtitan's own loader ran
    proc = run(tmp_path, corpus, 1, "--training.steps", "8")
    assert proc.returncode != 0
    assert "DataResumeError" in proc.stdout
    assert "written at data-parallel degree 2" in proc.stdout
    assert "--checkpoint.exclude_from_loading dataloader" in proc.stdout
    assert "Training starts" not in proc.stdout
