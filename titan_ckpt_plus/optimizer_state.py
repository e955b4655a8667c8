"""The flattened optimizer state dict, without rebuilding it on every save.

torch's `get_optimizer_state_dict` maps every parameter to its name again on each
call: about 8 ms of Python for the debug model, inside the window a save blocks the
training loop. What it returns is made of the optimizer's own objects: the state
tensors (updated in place by every step) and the values of `param_groups` (which
the LR scheduler replaces). So the mapping is built once, checked against torch's
own result, and reused while the optimizer holds the same objects; every call
checks that by identity and rebuilds otherwise (a loaded checkpoint, a new group).
An optimizer whose dict this cannot reproduce exactly is never cached.
"""

import logging
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

log = logging.getLogger("titan_ckpt_plus")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_NESTED = StateDictOptions(flatten_optimizer_state_dict=False)


def _same(container, key, obj) -> bool:
    if isinstance(container, dict):
        return container.get(key, _same) is obj  # .get: opt.state is a defaultdict
    return key < len(container) and container[key] is obj


class OptimizerStateCache:
    """`state_dict()` equal to `{k: v for each (model, optimizer) pair of
    get_optimizer_state_dict(model, optimizer, flatten=True)}`, as torchtitan's
    OptimizersContainer.state_dict() returns it: same keys in the same order, the
    same tensor objects, equal plain values."""

    def __init__(self, model_parts: list, optimizers: list) -> None:
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.getters: list[tuple[str, Any, Any]] | None = None  # (key, source, name)
        self.checks: list[tuple[Any, Any, Any]] = []  # (container, key, object it must hold)
        self.sizes: list[tuple[Any, int]] = []  # (container, len it must have)
        self.usable = True
        self.builds = 0

    def state_dict(self) -> dict[str, Any]:
        if self.getters is not None and self._still_valid():
            return {k: src[name] for k, src, name in self.getters}
        full = {k: v for model, opt in zip(self.model_parts, self.optimizers)
                for k, v in get_optimizer_state_dict(model, opt, options=_FLAT).items()}
        if self.usable:
            self._build(full)
        return full

    def _still_valid(self) -> bool:
        return (all(len(c) == n for c, n in self.sizes)
                and all(_same(c, k, o) for c, k, o in self.checks))

    def _build(self, full: dict[str, Any]) -> None:
        """Map every key of torch's dict to where its value lives; keep the mapping
        only if it reproduces `full` exactly."""
        self.builds += 1
        where: dict[str, tuple[Any, Any]] = {}
        checks, sizes = [], []
        for model, opt in zip(self.model_parts, self.optimizers):
            nested = get_optimizer_state_dict(model, opt, options=_NESTED)
            # load_state_dict() replaces both containers: check the attributes themselves
            checks += [(vars(opt), "param_groups", opt.param_groups), (vars(opt), "state", opt.state)]
            sizes += [(opt.param_groups, len(opt.param_groups)), (opt.state, len(opt.state))]
            for i, (named, group) in enumerate(zip(nested["param_groups"], opt.param_groups)):
                checks.append((opt.param_groups, i, group))
                sizes += [(group, len(group)), (group["params"], len(group["params"]))]
                for j, (fqn, p) in enumerate(zip(named["params"], group["params"])):
                    checks.append((group["params"], j, p))
                    for k in group:
                        if k != "params":
                            where[f"param_groups.{fqn}.{k}"] = (group, k)
                    state = opt.state.get(p)
                    if state is None:
                        continue
                    checks.append((opt.state, p, state))
                    sizes.append((state, len(state)))
                    for name, v in state.items():
                        where[f"state.{fqn}.{name}"] = (state, name)
                        if isinstance(v, torch.Tensor):
                            checks.append((state, name, v))
        exact = where.keys() == full.keys() and all(
            src[name] is v if isinstance(v, torch.Tensor) else src[name] == v
            for (src, name), v in ((where[k], v) for k, v in full.items()))
        if not exact:
            self.usable, self.getters = False, None
            log.info("[titan_ckpt_plus] this optimizer's state dict is not one the cache can map: "
                     "torch rebuilds it at every save")
            return
        self.getters = [(k, *where[k]) for k in full]
        self.checks, self.sizes = checks, sizes
