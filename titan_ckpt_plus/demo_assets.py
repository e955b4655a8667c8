"""Build the offline demo assets: a synthetic text corpus and a 2048-token BPE tokenizer.

    python -m titan_ckpt_plus.demo_assets OUT_DIR      # e.g. assets/demo

torchtitan 0.2.2's wheel ships neither its test tokenizer nor its ``c4_test`` data, and the
target machines have no network.  This builds, deterministically from a fixed seed:

* ``OUT_DIR/corpus/train.jsonl``: one ``{"text": ...}`` per line, ~20k distinct documents of
  varied length written by a small random grammar (so the language is learnable and the loss
  falls).  torchtitan's ``c4_test`` dataset loads it with
  ``training.dataset = "c4_test"`` and ``training.dataset_path = "OUT_DIR/corpus"``
  (``datasets.load_dataset(path, split="train")`` maps ``train.jsonl`` to the train split).
* ``OUT_DIR/tokenizer/tokenizer.json`` + ``tokenizer_config.json``: byte-level BPE with exactly
  2048 tokens (llama3 ``debugmodel``'s vocab_size) and ``<|begin_of_text|>`` /
  ``<|end_of_text|>`` as BOS/EOS, used with ``model.hf_assets_path = "OUT_DIR/tokenizer"``.

A stamp file (``OUT_DIR/demo_assets.json``) makes a rebuild with the same version a no-op.
This module imports neither torch nor torchtitan.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time

__all__ = ["VERSION", "VOCAB_SIZE", "build", "generate_documents", "is_built"]

VERSION = 1
VOCAB_SIZE = 2048
NUM_DOCS = 20_000
SEED = 20240607
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
STAMP = "demo_assets.json"

_NOUNS = (
    "river mountain village farmer merchant bridge castle forest lantern harbor ship "
    "garden teacher student engine clock window market road letter song painter baker "
    "soldier queen king child dog horse bird tree stone field cloud storm winter summer "
    "library book machine doctor sailor island tower wall door key map coin candle "
    "wheel mill valley lake boat cart sword shield crown feather rope basket kettle "
    "orchard meadow cellar workshop chapel fountain"
).split()
_ADJS = (
    "old young quiet bright dark small large green silver golden cold warm ancient "
    "narrow wide tired clever gentle brave careful distant hidden empty busy honest "
    "proud simple strange wooden heavy swift"
).split()
_VERBS = (  # (base, past, third person)
    "walk climb carry build watch follow find paint repair open close visit guard "
    "clean count measure cross lift pull push plant fill"
).split()
_ADVS = "slowly quickly carefully quietly gladly often rarely suddenly calmly".split()
_PREPS = "near behind beside under above across beyond inside".split()
_TIMES = (
    "at dawn|in the morning|at noon|in the evening|at night|before the rain|"
    "after the market|during the festival|in early spring|in late autumn"
).split("|")
_SYLLABLES = (
    "ba be bi bo da de di do ka ke ki ko la le li lo ma me mi mo na ne ni no ra re ri "
    "ro sa se si so ta te ti to va ve vi vo za ze zu mar tel ron dal ven kor lin"
).split()


def _past(verb: str) -> str:
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"


def _third(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _plural(noun: str) -> str:
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    if noun == "child":
        return "children"
    return noun + "s"


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def _number_words(n: int) -> str:
    ones = "zero one two three four five six seven eight nine ten eleven twelve".split()
    return ones[n] if n < len(ones) else str(n)


class _Grammar:
    """A tiny English-like grammar: subject/verb agreement, plurals and counts agree,
    and each document keeps a cast of named people and one home place."""

    def __init__(self, rng: random.Random):
        self.people = sorted({_name(rng, rng.choice((2, 3))) for _ in range(600)})
        self.places = sorted({_name(rng, rng.choice((2, 3))) + "ton" for _ in range(300)})

    def noun_phrase(self, rng: random.Random) -> str:
        noun = rng.choice(_NOUNS)
        if rng.random() < 0.25:
            n = rng.randint(2, 12)
            return f"{_number_words(n)} {rng.choice(_ADJS)} {_plural(noun)}"
        article = "the" if rng.random() < 0.6 else ("an" if noun[0] in "aeiou" else "a")
        if rng.random() < 0.5:
            adj = rng.choice(_ADJS)
            article = "the" if article == "the" else ("an" if adj[0] in "aeiou" else "a")
            return f"{article} {adj} {noun}"
        return f"{article} {noun}"

    def sentence(self, rng: random.Random, cast: list[str], home: str) -> str:
        who = rng.choice(cast)
        verb = rng.choice(_VERBS)
        kind = rng.random()
        if kind < 0.35:
            s = f"{who} {_past(verb)} {self.noun_phrase(rng)} {rng.choice(_PREPS)} {home}"
        elif kind < 0.55:
            s = f"Every day {who} {_third(verb)} {self.noun_phrase(rng)} {rng.choice(_ADVS)}"
        elif kind < 0.7:
            others = [c for c in cast if c != who]
            other = rng.choice(others) if others else "a friend"
            s = f"{rng.choice(_TIMES).capitalize()} {who} and {other} {_past(verb)} {self.noun_phrase(rng)}"
        elif kind < 0.85:
            s = f"The {rng.choice(_NOUNS)} of {home} was {rng.choice(_ADJS)} and {rng.choice(_ADJS)}"
        else:
            n = rng.randint(2, 40)
            s = f"{who} counted {n} {_plural(rng.choice(_NOUNS))} {rng.choice(_PREPS)} the {rng.choice(_NOUNS)}"
        return s[0].upper() + s[1:] + ("." if rng.random() < 0.9 else "!")

    def document(self, rng: random.Random, index: int) -> str:
        home = rng.choice(self.places)
        cast = rng.sample(self.people, rng.randint(1, 4))
        # Varied length: mostly short, a long tail up to ~60 sentences.
        n_sent = min(60, max(1, int(rng.lognormvariate(1.6, 0.8))))
        head = f"Record {index} from {home}."
        body = " ".join(self.sentence(rng, cast, home) for _ in range(n_sent))
        return f"{head} {body}"


def generate_documents(num_docs: int = NUM_DOCS, seed: int = SEED):
    """Yield the corpus documents (deterministic for a given num_docs and seed).

    Every document starts with "Record <index>", so all documents are distinct.
    """
    rng = random.Random(seed)
    grammar = _Grammar(rng)
    for i in range(num_docs):
        yield grammar.document(rng, i)


def _params(num_docs: int, seed: int, vocab_size: int) -> dict:
    return {"version": VERSION, "num_docs": num_docs, "seed": seed, "vocab_size": vocab_size}


def is_built(out_dir: str, num_docs: int = NUM_DOCS, seed: int = SEED) -> bool:
    """True if OUT_DIR holds assets built by this version with these parameters."""
    try:
        with open(os.path.join(out_dir, STAMP)) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return False
    want = _params(num_docs, seed, VOCAB_SIZE)
    if any(stamp.get(k) != v for k, v in want.items()):
        return False
    return all(
        os.path.isfile(os.path.join(out_dir, p))
        for p in ("corpus/train.jsonl", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json")
    )


def _write_corpus(path: str, num_docs: int, seed: int) -> str:
    sha = hashlib.sha256()
    with open(path, "w", encoding="utf-8") as f:
        for doc in generate_documents(num_docs, seed):
            line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
            sha.update(line.encode())
            f.write(line)
    return sha.hexdigest()


def _train_tokenizer(corpus_path: str, out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        with open(corpus_path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    tok.train_from_iterator(texts(), trainer=trainer)
    got = tok.get_vocab_size()
    if got != vocab_size:
        raise RuntimeError(f"tokenizer has {got} tokens, expected {vocab_size}: corpus too small")
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": True,
        "model_max_length": 131072,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def build(out_dir: str, num_docs: int = NUM_DOCS, seed: int = SEED, force: bool = False) -> bool:
    """Build the assets under out_dir; returns False if they were already built (no-op)."""
    out_dir = os.path.abspath(out_dir)
    if not force and is_built(out_dir, num_docs, seed):
        return False
    os.makedirs(out_dir, exist_ok=True)
    # Build in a scratch folder next to the target, then move into place, so an
    # interrupted build never leaves a half-written asset behind a stale stamp.
    stamp_path = os.path.join(out_dir, STAMP)
    if os.path.exists(stamp_path):
        os.remove(stamp_path)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=out_dir)
    try:
        os.makedirs(os.path.join(tmp, "corpus"))
        os.makedirs(os.path.join(tmp, "tokenizer"))
        corpus = os.path.join(tmp, "corpus", "train.jsonl")
        digest = _write_corpus(corpus, num_docs, seed)
        _train_tokenizer(corpus, os.path.join(tmp, "tokenizer"), VOCAB_SIZE)
        for sub in ("corpus", "tokenizer"):
            dst = os.path.join(out_dir, sub)
            if os.path.exists(dst):
                shutil.rmtree(dst)
            os.replace(os.path.join(tmp, sub), dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stamp = dict(_params(num_docs, seed, VOCAB_SIZE), corpus_sha256=digest)
    with open(stamp_path, "w") as f:
        json.dump(stamp, f, indent=2)
        f.write("\n")
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m titan_ckpt_plus.demo_assets", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("out_dir", help="output folder, e.g. assets/demo")
    p.add_argument("--num-docs", type=int, default=NUM_DOCS)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    if build(args.out_dir, args.num_docs, args.seed, args.force):
        print(f"built demo assets in {args.out_dir} ({time.monotonic() - t0:.1f}s)")
    else:
        print(f"demo assets in {args.out_dir} are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
