"""Data resumption benchmark: time to the first batch after resuming at sequence N.

Builds the token index of the demo corpus (assets/demo) once in a fresh cache folder
(the one-time cost), then, for N = 10^2 and 10^5 (and beyond, the stream re-loops),
times a resumed loader: build the dataloader (open the cached index), load a state at
global position N, take the first batch. For contrast, the time to reach position N
without an index (torchtitan's loader at DP 1, tokenizing from the start) is measured.

Prints a markdown table; with ``--update BENCHMARKS.md`` it also replaces (or appends)
the "## Data resumption" section of that file, leaving the other sections alone:

    .venv/bin/python scripts/bench_data.py --update BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from benchmd import record_targets, update_section  # noqa: E402
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SECTION = "## Data resumption"
COMMAND = ".venv/bin/python scripts/bench_data.py --update BENCHMARKS.md"
SEQ_LEN, LOCAL_BATCH, DP, RANK = 8, 8, 4, 3  # global batch 32; rank 3 of 4


def job_config():
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args([
        "--job.config_file", str(ROOT / "tests" / "configs" / "tiny_tiered.toml"),
        "--training.dataset_path", str(ROOT / "assets" / "demo" / "corpus"),
        "--model.hf_assets_path", str(ROOT / "assets" / "demo" / "tokenizer"),
        "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(LOCAL_BATCH)])


def resume_once(adapter, tok, cfg, position: int) -> tuple[float, float]:
    """(seconds from nothing to the first batch, of which seek + first batch)."""
    from titan_ckpt_plus.data.loader import STATE_KEY

    t0 = time.perf_counter()
    loader = adapter.build_dataloader(DP, RANK, tok, cfg)
    info = loader._info()
    info.update(consumed=position, steps=position // loader.global_batch_size)
    t1 = time.perf_counter()
    loader.load_state_dict({STATE_KEY: json.dumps(info)})
    batch, labels = next(iter(loader))
    t2 = time.perf_counter()
    assert batch["input"].shape == (LOCAL_BATCH, SEQ_LEN)
    return t2 - t0, t2 - t1


def replay(tok, cfg, position: int) -> float:
    """Reaching global position N without an index: torchtitan's loader at DP 1 must
    tokenize and pack everything before it (what a re-read would cost)."""
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    t0 = time.perf_counter()
    loader = build_text_dataloader(1, 0, tok, cfg)
    for _ in itertools.islice(iter(loader), position // LOCAL_BATCH + 1):
        pass
    return time.perf_counter() - t0


def run(trials: int) -> tuple[str, list[list[str]]]:
    import torchtitan  # noqa: F401
    import titan_ckpt_plus  # noqa: F401
    from titan_ckpt_plus.adapters import torchtitan_v022, torchtitan_v022_data as adapter
    from torchtitan.components.tokenizer import build_hf_tokenizer

    torchtitan_v022.install()
    cfg = job_config()
    tok = build_hf_tokenizer(cfg)
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TITAN_CKPT_DATA_CACHE"] = cache
        t0 = time.perf_counter()
        stream, _ = adapter.open_stream(tok, cfg)
        build_s = time.perf_counter() - t0
        index = Path(stream.identity["index"])
        meta = json.loads((index / "meta.json").read_text())
        size = sum(p.stat().st_size for p in index.iterdir())
        per_pass = stream.sequences_per_pass
        rows.append(["build the index (one time, first use)", f"{build_s:.2f} s",
                     f"{meta['n_docs']} docs, {meta['n_tokens']:,} tokens, "
                     f"{meta['n_tokens'] / build_s:,.0f} tokens/s, {size / 2**20:.1f} MiB on disk"])
        t0 = time.perf_counter()
        adapter.open_stream(tok, cfg)
        rows.append(["open the cached index", f"{(time.perf_counter() - t0) * 1e3:.1f} ms", ""])
        positions = [10**2, 10**5, 10**7, 10**9]
        results = {}
        timings: dict[int, list] = {pos: [] for pos in positions}
        for _ in range(trials):  # interleaved, so that load on the machine hits all alike
            for pos in positions:
                timings[pos].append(resume_once(adapter, tok, cfg, pos))
        for pos in positions:
            runs = timings[pos]
            total = statistics.median(r[0] for r in runs)
            seek = statistics.median(r[1] for r in runs)
            results[pos] = total
            passes = pos / per_pass
            rows.append([f"resume at sequence {pos:.0e}".replace("e+0", "e"),
                         f"{total * 1e3:.2f} ms",
                         f"seek + first batch {seek * 1e3:.3f} ms; pass {passes:.1f} over the corpus"
                         if passes >= 1 else f"seek + first batch {seek * 1e3:.3f} ms"])
        ratio = results[10**5] / results[10**2]
        for pos in (10**2, 10**5):
            t = replay(tok, cfg, pos)
            rows.append([f"no index: replay to sequence {pos:.0e}".replace("e+0", "e"), f"{t:.2f} s",
                         "torchtitan's loader at DP 1 tokenizing from the start"])
    setup = (f"Demo corpus (assets/demo: 20000 documents, demo BPE tokenizer), seq_len {SEQ_LEN} "
             f"({per_pass:,.0f} sequences per pass), local batch {LOCAL_BATCH}, DP rank {RANK} of "
             f"{DP} (global batch {LOCAL_BATCH * DP}). Resume = build the dataloader with the index "
             f"cached, load a state at global position N, take the first batch; median of {trials} "
             f"interleaved trials, warm page cache, {os.cpu_count()} CPU cores. Time to the first batch at 1e5 "
             f"vs 1e2: **{ratio:.2f}x** (target: within 2x).")
    record_targets("data", [("resume at sequence 1e5 / at 1e2 (time to first batch)", f"{ratio:.2f}x",
                             "<= 2x", ratio <= 2), ("building the index, one time", rows[0][1], "", None)])
    return setup, rows


def markdown(setup: str, rows: list[list[str]]) -> str:
    lines = [f"Command: `{COMMAND}`", "", setup, "",
             "| what | time | notes |", "|---|---:|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--update", type=Path, default=None, help="markdown file whose section to replace")
    args = parser.parse_args()
    t0 = time.perf_counter()
    setup, rows = run(args.trials)
    section = markdown(setup, rows)
    print(section)
    print(f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.update:
        update_section(args.update, SECTION, section)


if __name__ == "__main__":
    main()
