"""The global stream and the loader over it: split rule, exactly-once across DP changes,
O(1) seek, state, sample log. No torchtitan, no processes: ranks are simulated."""

import json

import numpy as np
import pytest
import torch

from titan_ckpt_plus.data.global_stream import GlobalStream
from titan_ckpt_plus.data.loader import (STATE_KEY, DataResumeError, GlobalSampleLoader,
                                         microbatch_ids)

SEQ = 4  # window 5
TOKENS = np.arange(1000, dtype=np.int64) % 997  # 1000 tokens, 200 whole windows per pass
IDENTITY = {"n_tokens": 1000, "tokens_sha256": "abc"}


def stream(seq_len=SEQ, tokens=TOKENS):
    return GlobalStream(tokens, seq_len, IDENTITY)


def ids_of(x, s=None):
    """Which global sequence each row of an input batch is (windows are unique here)."""
    s = s or stream()
    table = {tuple(s.sequence(i)[:-1].tolist()): i for i in range(200)}
    return [table[tuple(r.tolist())] for r in x]


def loaders(dp, b=2, g=12, **kw):
    return [GlobalSampleLoader(stream(), dp_rank=r, dp_world_size=dp, local_batch_size=b,
                               global_batch_size=g, **kw) for r in range(dp)]


def run_steps(ls, steps):
    """Drive every rank like torchtitan: accum microbatches per step. Returns
    [(step index, [ids consumed in this step, microbatch-major then rank])]."""
    its = [iter(x) for x in ls]
    out = []
    for _ in range(steps):
        step_ids = []
        for _m in range(ls[0].accum):
            for it in its:
                batch, lab = next(it)
                inp = batch["input"]
                assert inp.dtype == lab.dtype == torch.int64 and inp.shape == lab.shape
                step_ids += ids_of(inp)
        out.append(step_ids)
    return out


def test_sequence_i_is_window_i_of_the_repeated_token_stream():
    s = stream()
    assert s.sequence(0).tolist() == TOKENS[0:5].tolist()
    assert s.sequence(7).tolist() == TOKENS[35:40].tolist()
    assert s.sequence(200).tolist() == TOKENS[0:5].tolist()  # second pass
    assert s.epoch_of(199) == 0 and s.epoch_of(200) == 1
    odd = GlobalStream(np.arange(11), 3)  # window 4 does not divide 11: passes are not aligned
    assert odd.sequences(2, 2).tolist() == [[8, 9, 10, 0], [1, 2, 3, 4]]
    tiny = GlobalStream(np.arange(3), 6)  # shorter than one window
    assert tiny.sequence(1).tolist() == [1, 2, 0, 1, 2, 0, 1]


def test_split_rule_microbatch_major_then_rank():
    assert list(microbatch_ids(24, 0, 3, 2)) == [24, 25]
    assert list(microbatch_ids(24, 2, 3, 2)) == [28, 29]


@pytest.mark.parametrize("dp", [1, 2, 3, 6])
def test_step_k_is_sequences_kG_to_k1G_in_order_for_any_dp(dp):
    ls = loaders(dp)
    assert ls[0].accum == 12 // (2 * dp)
    for k, ids in enumerate(run_steps(ls, 3)):
        assert ids == list(range(12 * k, 12 * (k + 1)))


def test_labels_are_inputs_shifted_by_one():
    batch, lab = next(iter(loaders(1)[0]))
    inp = batch["input"]
    full = torch.from_numpy(stream().sequences(0, 2))
    assert torch.equal(inp, full[:, :-1]) and torch.equal(lab, full[:, 1:])


def _handover(ls, dp, **kw):
    states = [x.state_dict() for x in ls]
    assert all(s == states[0] for s in states), "state must be identical on every rank"
    new = loaders(dp, **kw)
    for x in new:
        x.load_state_dict(json.loads(json.dumps(states[0])))
    return new


def test_every_sequence_exactly_once_across_dp_2_then_1_then_3():
    seen = []
    a = loaders(2)
    seen += run_steps(a, 3)
    b = _handover(a, 1)
    seen += run_steps(b, 2)
    c = _handover(b, 3)
    seen += run_steps(c, 4)
    flat = [i for step in seen for i in step]
    assert flat == list(range(12 * 9))  # none twice, none skipped, in global order
    info = json.loads(c[0].state_dict()[STATE_KEY])
    assert (info["consumed"], info["steps"], info["dp_degree"]) == (108, 9, 3)


def test_same_dp_resume_yields_the_same_batches_as_uninterrupted():
    ref = run_steps(loaders(2), 6)
    first = loaders(2)
    got = run_steps(first, 2)
    got += run_steps(_handover(first, 2), 4)
    assert got == ref


def test_state_is_json_with_position_and_identity():
    ls = loaders(2)
    run_steps(ls, 2)
    sd = ls[1].state_dict()
    assert list(sd) == [STATE_KEY] and isinstance(sd[STATE_KEY], str)
    info = json.loads(sd[STATE_KEY])
    assert info["mode"] == "global_samples" and info["consumed"] == 24 and info["steps"] == 2
    assert info["seq_len"] == SEQ and info["global_batch_size"] == 12
    assert info["stream"] == {"n_tokens": 1000, "tokens_sha256": "abc"}


def test_seek_cost_does_not_depend_on_the_position():
    class CountingTokens:
        """Records how many tokens each read touches."""

        def __init__(self, n):
            self.n, self.reads = n, []

        def __len__(self):
            return self.n

        def __getitem__(self, key):
            if isinstance(key, slice):
                length = key.stop - key.start
            else:
                length = len(key)
            self.reads.append(length)
            return np.zeros(length, dtype=np.int64)

    tokens = CountingTokens(10**12 + 7)  # a trillion-token "corpus": nothing is scanned
    s = GlobalStream(tokens, 2047)
    for pos in (10**2, 10**5, 10**9, 10**15):
        loader = GlobalSampleLoader(s, dp_rank=1, dp_world_size=4, local_batch_size=2,
                                    global_batch_size=16)
        info = loader._info()
        info.update(consumed=pos, stream={"n_tokens": None, "tokens_sha256": None})
        loader.load_state_dict({STATE_KEY: json.dumps(info)})
        tokens.reads.clear()
        batch, _ = next(iter(loader))
        inp = batch["input"]
        assert tokens.reads == [2 * 2048]  # exactly this rank's two windows
        assert inp.shape == (2, 2047)


def test_seq_len_change_is_refused_with_the_fix():
    ls = loaders(2)
    run_steps(ls, 1)
    sd = ls[0].state_dict()
    other = GlobalSampleLoader(stream(seq_len=8), dp_rank=0, dp_world_size=2,
                               local_batch_size=2, global_batch_size=12)
    with pytest.raises(DataResumeError, match=r"--training.seq_len 4.*exclude_from_loading"):
        other.load_state_dict(sd)


def test_changed_global_batch_still_continues_exactly_once(caplog):
    a = loaders(2, g=8)
    seen = [i for step in run_steps(a, 3) for i in step]
    b = _handover(a, 1, g=4)
    seen += [i for step in run_steps(b, 2) for i in step]
    assert seen == list(range(32))
    assert "global batch size changed from 8" in caplog.text


def test_sample_log_records_every_microbatch(tmp_path):
    path = tmp_path / "s" / "samples.jsonl"
    ls = loaders(2, sample_log=str(path), rank=0)
    run_steps(ls, 2)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(recs) == 2 * 3 * 2
    assert recs[0] == {"step": 1, "microbatch": 0, "rank": 0, "dp_rank": 0, "dp_degree": 2,
                       "seq_ids": [0, 1]}
    assert sorted(i for r in recs for i in r["seq_ids"]) == list(range(24))
    assert {r["step"] for r in recs} == {1, 2}


def test_bad_geometry_is_refused():
    with pytest.raises(ValueError, match="multiple"):
        GlobalSampleLoader(stream(), dp_rank=0, dp_world_size=5, local_batch_size=2,
                           global_batch_size=12)


def test_before_the_first_batch_the_state_is_empty_so_any_saved_format_is_handed_over():
    x = loaders(1)[0]
    assert x.state_dict() == {}
    x.load_state_dict({})  # saved before the first batch: position 0
    assert x.consumed == 0 and x.state_dict()[STATE_KEY]


def test_incomplete_state_is_refused():
    x = loaders(1)[0]
    with pytest.raises(DataResumeError, match="exclude_from_loading"):
        x.load_state_dict({"world_size": 1})
