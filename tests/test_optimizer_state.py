"""The cached optimizer state dict equals torchtitan's own, save after save: the same
keys in the same order, the same tensor objects, equal plain values; it rebuilds when
the optimizer's objects change and refuses optimizers it cannot reproduce."""

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torchtitan.components.optimizer import OptimizersContainer

from titan_ckpt_plus.optimizer_state import OptimizerStateCache


def _setup(optimizer_cls=torch.optim.AdamW):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = OptimizersContainer([model], optimizer_cls, {"lr": 1e-2, "weight_decay": 0.1})
    sched = LambdaLR(opt.optimizers[0], lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, steps):
    for _ in range(steps):
        (model(torch.randn(3, 8)).sum() + sum(p.sum() for p in model.parameters())).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k] is v, k
        else:
            assert got[k] == v, k


def test_matches_torchtitans_state_dict_while_the_lr_changes():
    model, opt, sched = _setup()
    cache = OptimizerStateCache(opt.model_parts, opt.optimizers)
    lrs = set()
    for _ in range(4):
        _train(model, opt, sched, 2)
        got = cache.state_dict()
        _assert_same(got, opt.state_dict())
        lrs.add(got["param_groups.0.weight.lr"])
    assert cache.usable and cache.builds == 1 and len(lrs) == 4
    step = cache.state_dict()["state.0.weight.step"]
    _train(model, opt, sched, 1)  # the step counter is updated in place: still the same object
    assert cache.state_dict()["state.0.weight.step"] is step and int(step) == 9


def test_rebuilds_when_the_optimizer_state_is_replaced():
    model, opt, sched = _setup()
    cache = OptimizerStateCache(opt.model_parts, opt.optimizers)
    _train(model, opt, sched, 2)
    cache.state_dict()
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state_dict().items()}
    opt.load_state_dict(saved)  # new state tensors and new group dicts
    _assert_same(cache.state_dict(), opt.state_dict())
    assert cache.builds == 2
    extra = nn.Parameter(torch.zeros(2))
    model.register_parameter("extra", extra)
    opt.optimizers[0].add_param_group({"params": [extra]})
    _train(model, opt, None, 1)  # the scheduler knows one group only
    _assert_same(cache.state_dict(), opt.state_dict())
    assert cache.builds == 3 and "state.extra.exp_avg" in cache.state_dict()


class _NestedStateSGD(torch.optim.SGD):
    """Keeps a nested dict in its state, which torch flattens further."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["stats"] = {"norm": float(p.norm())}


def test_an_optimizer_it_cannot_reproduce_is_never_cached():
    model, opt, sched = _setup(_NestedStateSGD)
    cache = OptimizerStateCache(opt.model_parts, opt.optimizers)
    for _ in range(2):
        _train(model, opt, sched, 1)
        _assert_same(cache.state_dict(), opt.state_dict())
    assert not cache.usable and cache.getters is None
