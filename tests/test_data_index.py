"""The token index: what it holds, caching, and one builder among concurrent processes."""

import json
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from titan_ckpt_plus.data import token_index
from titan_ckpt_plus.data.token_index import TokenIndex, build_or_open, cache_key

BOS, EOS = 1, 2
DOCS = [f"document {i} " + "x" * (i % 7) for i in range(50)]


def encode(text):  # a stand-in tokenizer: one token per character, plus BOS/EOS
    return [BOS] + [3 + (ord(c) % 200) for c in text] + [EOS]


def encode_batch(texts):
    return [encode(t) for t in texts]


def expected_tokens(docs=DOCS):
    return [t for d in docs for t in encode(d)]


def test_index_is_the_concatenation_of_bos_eos_encoded_documents(tmp_path):
    idx = build_or_open(str(tmp_path), "k", lambda: iter(DOCS), encode_batch,
                        vocab_size=300, total_docs=len(DOCS), batch_size=7)
    assert idx.tokens.dtype == np.uint16
    assert idx.tokens.tolist() == expected_tokens()
    assert idx.n_docs == len(DOCS) and idx.n_tokens == len(expected_tokens())
    starts = idx.doc_offsets.tolist()
    assert starts[0] == 0 and starts[-1] == idx.n_tokens
    for i, d in enumerate(DOCS):
        assert idx.tokens[starts[i]:starts[i + 1]].tolist() == encode(d)
    meta = json.loads((tmp_path / "k" / "meta.json").read_text())
    assert meta["format_version"] == token_index.FORMAT_VERSION
    assert meta["tokens_sha256"] == idx.digest and "build_seconds" in meta


def test_large_vocab_uses_uint32_and_ids_that_do_not_fit_are_refused(tmp_path):
    big = build_or_open(str(tmp_path), "big", lambda: iter(["a"]), lambda ts: [[70000, 5]],
                        vocab_size=100000)
    assert big.tokens.dtype == np.uint32 and big.tokens.tolist() == [70000, 5]
    with pytest.raises(ValueError, match="does not fit"):
        build_or_open(str(tmp_path), "bad", lambda: iter(["a"]), lambda ts: [[70000]],
                      vocab_size=1000)
    assert not (tmp_path / "bad").exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]


def test_second_open_reads_the_cache_without_tokenizing(tmp_path):
    calls = []

    def texts():
        calls.append(1)
        return iter(DOCS)

    a = build_or_open(str(tmp_path), "k", texts, encode_batch)
    b = build_or_open(str(tmp_path), "k", texts, encode_batch)
    assert len(calls) == 1 and a.digest == b.digest


def test_cache_key_covers_format_dataset_and_tokenizer():
    base = {"dataset": "c4_test", "path": "/data/x", "files": [["a.jsonl", 10, 1]], "tokenizer": "t1"}
    k = cache_key(base)
    assert k == cache_key(dict(base)) and k.startswith("c4_test-v1-")
    assert cache_key({**base, "tokenizer": "t2"}) != k
    assert cache_key({**base, "files": [["a.jsonl", 11, 1]]}) != k
    assert cache_key({**base, "path": "/data/y"}) != k


def test_files_signature_sees_size_and_mtime(tmp_path):
    (tmp_path / "a.jsonl").write_text("x")
    sig = token_index.local_files_signature(str(tmp_path))
    assert sig[0][:2] == ["a.jsonl", 1]
    (tmp_path / "a.jsonl").write_text("xy")
    assert token_index.local_files_signature(str(tmp_path)) != sig
    assert token_index.local_files_signature(str(tmp_path / "missing")) is None


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(token_index.CACHE_ENV, str(tmp_path / "c"))
    assert token_index.default_cache_dir() == str(tmp_path / "c")
    monkeypatch.delenv(token_index.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert token_index.default_cache_dir() == str(tmp_path / "x" / "titan_ckpt_plus" / "token_index")


def test_a_failed_build_leaves_nothing_and_the_next_one_builds(tmp_path):
    def failing(texts):
        raise RuntimeError("tokenizer crashed")

    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        build_or_open(str(tmp_path), "k", lambda: iter(DOCS), failing)
    assert sorted(os.listdir(tmp_path)) == ["k.lock"]
    assert build_or_open(str(tmp_path), "k", lambda: iter(DOCS), encode_batch).n_docs == len(DOCS)


def test_leftovers_of_a_dead_builder_are_cleaned_and_rebuilt(tmp_path):
    (tmp_path / "k.tmp.otherhost.12345").mkdir()
    (tmp_path / "k.tmp.otherhost.12345" / "tokens.bin").write_bytes(b"\0" * 10)
    (tmp_path / "k").mkdir()  # a folder without meta.json is never trusted
    idx = build_or_open(str(tmp_path), "k", lambda: iter(DOCS), encode_batch)
    assert idx.tokens.tolist() == expected_tokens()
    assert sorted(os.listdir(tmp_path)) == ["k", "k.lock"]


def test_open_refuses_a_truncated_token_file(tmp_path):
    build_or_open(str(tmp_path), "k", lambda: iter(DOCS), encode_batch)
    with open(tmp_path / "k" / "tokens.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="tokens.bin"):
        TokenIndex.open(str(tmp_path / "k"))


N_WORKERS = 4


def _worker(cache, marker, out, i):
    def texts():
        with open(marker, "a") as f:  # one line per process that tokenizes
            f.write(f"{os.getpid()}\n")
        deadline = time.monotonic() + 60  # build only once every process has started
        while len([p for p in os.listdir(os.path.dirname(marker)) if p.startswith("started.")]) \
                < N_WORKERS and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # and is waiting on the lock
        yield from DOCS

    open(os.path.join(os.path.dirname(marker), f"started.{i}"), "w").close()
    idx = build_or_open(cache, "shared", texts, encode_batch, wait_log_s=0.2)
    with open(f"{out}.{i}", "w") as f:
        json.dump({"digest": idx.digest, "tokens": idx.tokens.tolist()}, f)


def test_concurrent_processes_build_once_and_all_read_the_same_index(tmp_path):
    ctx = mp.get_context("spawn")
    cache, marker, out = str(tmp_path / "cache"), str(tmp_path / "builders"), str(tmp_path / "out")
    procs = [ctx.Process(target=_worker, args=(cache, marker, out, i)) for i in range(N_WORKERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert len(open(marker).read().split()) == 1  # exactly one process tokenized
    results = [json.load(open(f"{out}.{i}")) for i in range(N_WORKERS)]
    assert all(r == results[0] for r in results)
    assert results[0]["tokens"] == expected_tokens()
    assert sorted(os.listdir(cache)) == ["shared", "shared.lock"]
