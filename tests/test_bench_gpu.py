"""scripts/bench_gpu.py's clock, without torchrun: which steps save, how each step is
classified, and what the table is made from."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_gpu  # noqa: E402


class Future:
    def __init__(self, polls: int) -> None:
        self.polls = polls

    def done(self) -> bool:
        self.polls -= 1
        return self.polls < 0


class StockLike:
    """torchtitan's CheckpointManager as SaveClock sees it: each save's background
    write stays busy for three step boundaries."""

    def __init__(self) -> None:
        self.save_future, self.saved, self.waits = None, [], 0

    def save(self, curr_step, last_step=False):
        self.saved.append(curr_step)
        self.save_future = Future(3)

    def maybe_wait_for_staging(self):
        self.waits += 1


def test_saves_only_after_the_background_work_and_two_undisturbed_steps(tmp_path):
    ckpt, stopped = StockLike(), []
    plan = {"warmup": 2, "saves": 2, "budget_s": 60, "out": str(tmp_path / "clock.json")}
    clock = bench_gpu.SaveClock(ckpt, plan, lambda: stopped.append(True))
    for step in range(1, 40):
        ckpt.maybe_wait_for_staging()
        ckpt.save(step)
        if stopped:
            break
    assert ckpt.saved == [3, 9] and step == 15 and not clock.waiting
    out = json.loads((tmp_path / "clock.json").read_text())
    kinds = {s["step"]: s["kind"] for s in out["steps"]}
    assert [kinds[s] for s in range(4, 10)] == ["save"] + ["background"] * 3 + ["undisturbed"] * 2
    assert out["saves"] == [3, 9] and set(out["blocked"]) == {"3", "9"}
    summary = bench_gpu.summarize(out, [], [])
    assert summary["saves"] == 1 and summary["clock"] == "host clock" and summary["lost"] is not None
    body = bench_gpu.table({"plugin": summary, "resume": "not run"})
    assert "| 2. training thread blocked per save" in body and "not measured" in body


def test_the_table_reads_the_pinned_bytes_from_the_staging_buffers_own_log_line(caplog, monkeypatch):
    """Row 5 is parsed from the line HostBuffer logs when it pins (here with a stand-in
    for cudaHostRegister, and with it failing: torch's allocator's power of two). Met
    only where torch sees the buffer pinned, which a CPU run never does."""
    import logging

    import torch

    from titan_ckpt_plus import staging

    n = (5 << 20) + 7
    with caplog.at_level(logging.INFO, logger="titan_ckpt_plus"):
        staging.HostBuffer(pin=True, register=lambda buf: (lambda: None)).ensure(n)
    st = bench_gpu._staging(caplog.text)
    assert st == {"state": n, "pinned": n, "how": "in place", "is_pinned": False}
    assert bench_gpu._staging_cell(st).startswith("5.0 MiB pinned for 5.0 MiB = 1.000x (in place")
    assert bench_gpu._staging_ok(st) is False and bench_gpu._staging_ok(dict(st, is_pinned=True)) is True

    caplog.clear()
    monkeypatch.setattr(staging, "allocator_pinned", lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8))
    with caplog.at_level(logging.INFO, logger="titan_ckpt_plus"):
        staging.HostBuffer(pin=True, register=lambda buf: 1 / 0).ensure(n)
    st = bench_gpu._staging(caplog.text)
    assert bench_gpu._staging_cell(st).startswith("8.0 MiB pinned for 5.0 MiB = 1.600x (by torch")
    assert bench_gpu._staging_ok(dict(st, is_pinned=True)) is False
    assert "| 5. host memory pinned for staging" in bench_gpu.table({"plugin": {"staging": st}})


def test_the_stager_mend_lets_stock_pinned_staging_save_a_class_twice(monkeypatch):
    """Stock `async_with_pinned_mem` closes DCP's stager after each save, which clears
    its deepcopy table; the next save fails (pytorch/torchtitan#3476; torch 2.11's stager
    closes itself after every stage). Here that sequence fails where this torch has the
    bug, and with the bench's mend every save copies the state, a class in it as itself."""
    import torch
    from torch.distributed.checkpoint import _state_dict_stager as sds

    monkeypatch.setattr(sds.StateDictStager, "close", sds.StateDictStager.close)  # undone after the test
    state = {"t": torch.arange(4.0), "kind": torch.optim.AdamW, "lr": [0.1]}
    stager = sds.StateDictStager()
    stager.stage(state)
    stager.close()
    try:  # torch 2.11 to 2.13; a torch that fixed it stages here too
        stager.stage({"lr": [0.1]})
    except KeyError as e:
        assert "type" in str(e)
    bench_gpu._mend_stager()
    stager = sds.StateDictStager()
    for _ in range(3):
        staged = stager.stage(state)
        stager.close()
        assert staged["kind"] is torch.optim.AdamW and torch.equal(staged["t"], state["t"])
        assert staged["lr"] == [0.1] and staged["lr"] is not state["lr"]
