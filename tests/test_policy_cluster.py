"""`titan-ckpt plan --cluster`: the design article's 405B arithmetic, the tier formulas, the CLI."""

import json
import math
from pathlib import Path

import re

import pytest
from harness import run_without_torch

from titan_ckpt_plus.cli import main
from titan_ckpt_plus.policy.cluster import (
    LLAMA3_MTBF_GPU_HOURS,
    PRESETS,
    Cluster,
    get_cluster,
    load_cluster,
    parse_count,
    plan,
    with_overrides,
)
from titan_ckpt_plus.policy.young import overhead_fraction, young_interval

REPO = Path(__file__).resolve().parents[1]


def rows_by_tier(c):
    return {r.tier: r for r in plan(c)}


# -- the design article (shared/notes/seed-distributed-checkpoint.txt, sections 3 and 9) --


def test_article_405b_arithmetic():
    # "405B, 14 bytes per parameter (bf16 params + fp32 master + Adam m, v; no gradients) -> 5.7 TB;
    #  TP=8 CP=16 PP=16 DP=128 = 16384 H100s; deduplicated, about 350 MB per GPU; 2048 nodes write
    #  2.8 GB each; at 500 GB/s aggregate 5.7 TB takes 11 s; 419 interruptions in 54 days -> 3.09 h."
    c = Cluster(params=405e9, bytes_per_param=14, gpus=16384, gpus_per_node=8, pfs_gbps=500,
                mtbf_gpu_hours=54 * 24 * 16384 / 419, replication_factor=1)
    assert round(c.total_bytes / 1e12, 1) == 5.7
    assert round(c.bytes_per_rank / 1e6, -1) == 350  # 346 MB
    assert c.nodes == 2048 and round(c.node_bytes / 1e9, 1) == 2.8
    assert round(c.job_mtbf_s / 3600, 2) == 3.09
    rows = rows_by_tier(c)
    assert round(rows["pfs"].drain_s) == 11  # 11.3 s
    assert rows["sync-pfs"].delta_s == rows["pfs"].drain_s  # a synchronous save blocks for the whole write
    # "350 MB over PCIe 5.0 ... at a real 25-30 GB/s, under 0.1 s"
    assert rows["local"].delta_s < 0.1
    # The optimizer shard alone (12 B/param: fp32 master + m + v) is ~0.30 GB per GPU.
    assert round(with_overrides(c, bytes_per_param=12).bytes_per_rank / 1e9, 2) == 0.30


def test_405b_preset_matches_the_article():
    c = PRESETS["llama3-405b-16384gpu"]
    assert (c.params, c.bytes_per_param, c.gpus, c.pfs_gbps) == (405e9, 14, 16384, 500)
    assert round(c.job_mtbf_s / 3600, 2) == 3.09
    assert LLAMA3_MTBF_GPU_HOURS == pytest.approx(54 * 24 * 16384 / 419)


def test_article_staging_table():
    # Section 6.4: 70B / 1024 GPUs (14 B) ~1.0 GB per GPU, ~7.7 GB per node; 8B / 8 GPUs (12 B) 12 GB, 96 GB.
    c70, c8 = PRESETS["llama3-70b-1024gpu"], PRESETS["llama3-8b-8gpu"]
    assert round(c70.bytes_per_rank / 1e9, 1) == 1.0 and round(c70.node_bytes / 1e9, 1) == 7.7
    assert c8.bytes_per_rank == 12e9 and c8.node_bytes == 96e9


# -- formulas -------------------------------------------------------------------


def test_tier_formulas():
    c = Cluster(params=70e9, bytes_per_param=14, gpus=1024, gpus_per_node=8, host_copy_gbps=20, nvme_gbps=4,
                network_gbps=40, pfs_gbps=100, job_mtbf_hours=10, replication_factor=2, p_unrecoverable=0.2)
    r = rows_by_tier(c)
    per_rank, node, total = 70e9 * 14 / 1024, 70e9 * 14 / 128, 70e9 * 14
    m, m_unrec, p = 36000.0, 36000.0 / 0.2, 0.2
    local, pfs, tiers, sync = r["local"], r["pfs"], r["local+pfs"], r["sync-pfs"]

    assert local.bytes_per_rank == pytest.approx(per_rank)
    assert local.delta_s == pytest.approx(per_rank / 20e9)
    assert local.write_s == pytest.approx(node / 4e9)
    assert local.replication_s == pytest.approx(2 * node / 40e9)
    commit = node / 4e9 + max(2 * node / 40e9, 2 * node / 4e9)  # copies are fsync'd by the receivers
    assert local.tau_s == pytest.approx(young_interval(local.delta_s, m)) and local.rule == "young"
    assert local.mtbf_s == m
    assert local.lost_per_failure_s == pytest.approx(local.tau_s / 2 + commit)
    assert local.busy == pytest.approx(commit / local.tau_s)
    assert local.waste == pytest.approx(local.delta_s / local.tau_s + (1 - p) * (local.tau_s / 2 + commit) / m)

    drain = total / 100e9
    assert pfs.delta_s == 0 and pfs.drain_s == pytest.approx(drain)
    assert pfs.mtbf_s == pytest.approx(m_unrec)
    assert pfs.tau_s == pytest.approx(math.sqrt(2 * drain * m_unrec))
    assert pfs.waste == pytest.approx((pfs.tau_s / 2 + drain) / m_unrec)

    assert tiers.waste == pytest.approx(local.waste + pfs.waste)
    assert sync.delta_s == pytest.approx(drain)
    assert sync.tau_s == pytest.approx(young_interval(drain, m))
    assert sync.waste == pytest.approx(overhead_fraction(drain, m))  # Young's sqrt(2 delta / M)
    assert tiers.waste < sync.waste


def test_tau_floors():
    base = PRESETS["llama3-405b-16384gpu"]
    # Slow NVMe: the local interval cannot be shorter than the durable commit.
    slow = rows_by_tier(with_overrides(base, nvme_gbps=0.01))["local"]
    assert slow.rule == "write-bound" and slow.tau_s == pytest.approx(slow.lost_per_failure_s - slow.tau_s / 2)
    assert slow.busy == pytest.approx(1.0)
    # Failures so frequent that Young's PFS interval is below the drain itself.
    r = rows_by_tier(with_overrides(base, job_mtbf_hours=0.001, p_unrecoverable=1.0, pfs_gbps=5))
    assert r["pfs"].rule == "drain-bound" and r["pfs"].tau_s == pytest.approx(r["pfs"].drain_s)
    # A PFS step is a local step: never more often than the local tier.
    r = rows_by_tier(with_overrides(base, nvme_gbps=0.01, pfs_gbps=1e6, network_gbps=1e4, p_unrecoverable=1.0))
    assert r["pfs"].rule == "raised to local" and r["pfs"].tau_s == r["local"].tau_s
    # p_unrecoverable 0: the PFS tier never protects anything.
    r = rows_by_tier(with_overrides(base, p_unrecoverable=0.0))
    assert math.isinf(r["pfs"].tau_s) and r["pfs"].waste == 0.0


def test_pfs_capped_by_node_links_and_mtbf_sources():
    c = Cluster(params=1e9, bytes_per_param=10, gpus=16, gpus_per_node=8, network_gbps=2, pfs_gbps=100)
    assert c.pfs_effective_gbps == 4  # 2 nodes x 2 GB/s
    assert rows_by_tier(c)["pfs"].drain_s == pytest.approx(1e10 / 4e9)
    assert c.job_mtbf_s == pytest.approx(LLAMA3_MTBF_GPU_HOURS / 16 * 3600)
    assert with_overrides(c, job_mtbf_hours=2).job_mtbf_s == 7200
    # A per-GPU MTBF given later replaces an inherited job MTBF.
    assert with_overrides(c, job_mtbf_hours=2, mtbf_gpu_hours=1600).job_mtbf_hours == 2
    assert with_overrides(with_overrides(c, job_mtbf_hours=2), mtbf_gpu_hours=1600).job_mtbf_s == 100 * 3600


@pytest.mark.parametrize("bad", [
    {"replication_factor": 1},  # one node: no other failure domain
    {"gpus": 0}, {"pfs_gbps": -1}, {"p_unrecoverable": 1.5}, {"gpus": 8.5}, {"job_mtbf_hours": 0},
])
def test_rejects_bad_clusters(bad):
    with pytest.raises(ValueError):
        with_overrides(Cluster(), **bad)


def test_parse_count():
    assert parse_count("405B") == 405e9 and parse_count("405e9") == 405e9 and parse_count(8e9) == 8e9
    assert parse_count("1.5T") == 1.5e12 and parse_count("70_000M") == 70e9
    with pytest.raises(ValueError):
        parse_count("70x")


def test_cluster_files(tmp_path):
    toml = tmp_path / "mine.toml"
    toml.write_text('base = "llama3-405b-16384gpu"\npfs_gbps = 1000\nparams = "405B"\n')
    c = load_cluster(str(toml))
    assert (c.name, c.pfs_gbps, c.gpus, c.params) == ("mine", 1000, 16384, 405e9)
    js = tmp_path / "j.json"
    js.write_text(json.dumps({"cluster": {"params": 1e9, "gpus": 16, "replication_factor": 1}}))
    assert get_cluster(str(js)).nodes == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"pfs_gbs": 1}))
    with pytest.raises(ValueError, match="unknown cluster field"):
        load_cluster(str(bad))
    with pytest.raises(ValueError, match="neither a preset"):
        get_cluster(str(tmp_path / "missing.toml"))


# -- CLI ------------------------------------------------------------------------


def table(out):
    """tier -> cells of the plan table (rows after the header line; cells are 2+ spaces apart)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("tier "))
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines[start + 1:start + 5]]
    return {c[0]: c for c in cells}


@pytest.mark.parametrize("name", list(PRESETS))
def test_cli_presets(name, capsys):
    assert main(["plan", "--cluster", name]) == 0
    out = capsys.readouterr().out
    assert f"cluster {name}" in out
    assert list(table(out)) == ["local", "pfs", "local+pfs", "sync-pfs"]
    assert "waste: local+pfs" in out


def test_cli_405b_numbers_and_overrides(capsys):
    assert main(["plan", "--cluster", "llama3-405b-16384gpu"]) == 0
    out = capsys.readouterr().out
    assert "5.67 TB" in out and "346 MB per GPU" in out and "job MTBF 3.09 h" in out
    rows = table(out)
    assert rows["pfs"][2] == "0 (drained)" and rows["pfs"][5] == "11.3 s"  # delta, drain
    assert rows["sync-pfs"][2] == "11.3 s"  # delta
    assert rows["local"][2] == "0.0138 s" and rows["local"][7] == "17.6 s"  # delta, tau
    assert main(["plan", "--cluster", "llama3-405b-16384gpu", "--pfs-gbps", "1000", "--bytes-per-param", "2",
                 "--mtbf-hours", "6"]) == 0
    out = capsys.readouterr().out
    assert "405B params x 2 B = 810 GB" in out and "job MTBF 6 h (given)" in out
    assert table(out)["sync-pfs"][2] == "0.81 s"


def test_cli_markdown_and_file(tmp_path, capsys):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"base": "llama3-70b-1024gpu", "gpus": 2048}))
    assert main(["plan", "--cluster", str(f), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| tier | bytes/rank |" in out and "| sync-pfs |" in out and "2048 GPUs on 256 node(s)" in out


def test_cli_delta_mode_still_works_and_errors(capsys):
    assert main(["plan", "--delta", "600", "--mtbf-hours", "3.09"]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[:3] == ["600", "60.9", "32.8"]
    assert main(["plan"]) == 0  # defaults: 600,120,60,10,2 at 3.09 h
    assert len(capsys.readouterr().out.splitlines()) == 7
    for argv in (["plan", "--pfs-gbps", "5"],  # an override needs --cluster
                 ["plan", "--cluster", "llama3-8b-8gpu", "--delta", "2"],
                 ["plan", "--cluster", "nope"],
                 ["plan", "--cluster", "llama3-8b-8gpu", "--replication-factor", "1"],
                 ["plan", "--cluster", "llama3-8b-8gpu", "--mtbf-hours", "1", "--mtbf-gpu-hours", "9"]):
        with pytest.raises(SystemExit):
            main(argv)


@pytest.mark.parametrize("name", list(PRESETS))
def test_docs_tables_are_current(name, capsys):
    doc = REPO / "docs" / "plan_at_scale.md"
    if not doc.exists():
        pytest.skip("docs/plan_at_scale.md not present")
    assert main(["plan", "--cluster", name]) == 0
    assert f"$ titan-ckpt plan --cluster {name}\n" + capsys.readouterr().out in doc.read_text()


def test_no_torch_import():
    code = (
        "import sys, io, contextlib\n"
        "import titan_ckpt_plus.policy.cluster\n"
        "from titan_ckpt_plus.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['plan', '--cluster', 'llama3-405b-16384gpu']) == 0\n"
    )
    run_without_torch(code)
