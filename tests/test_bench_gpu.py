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
