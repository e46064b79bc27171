"""A user's training state (name -> module, optimizer, or any ``state_dict`` object) as DCP entries.

:func:`dcp_entries` checks a ``state`` dict once and turns every value into a DCP ``Stateful``:

* ``torch.nn.Module`` (FSDP2-sharded, DDP-wrapped or plain): ``get_model_state_dict`` /
  ``set_model_state_dict``, so FSDP2 DTensor shards are saved as shards and DDP's ``module.``
  prefix is dropped (a checkpoint of a DDP run loads into a plain or FSDP2 module and back);
* ``torch.optim.Optimizer``: ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with
  the module in ``state`` that owns its parameters, so its state is keyed by parameter FQN (not
  by index) and resharded like the module;
* anything else with callable ``state_dict()`` and ``load_state_dict()`` (LR schedulers, a data
  position, counters): its own methods.  Values that are not sharded tensors are taken to be the
  same on every rank (DCP keeps one copy).

Anything else is refused with :class:`~trainer.errors.StateError` naming the entry.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.errors import StateError

#: The checkpointer's own DCP entry (the step); no entry of ``state`` may have this name.
RESERVED = "checkpointer"


class _ModuleEntry:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, state_dict)


class _OptimizerEntry:
    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module = module
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, state_dict)


class _ObjectEntry:
    def __init__(self, name: str, obj: Any) -> None:
        self.name = name
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        sd = self.obj.state_dict()
        if not isinstance(sd, dict):
            raise StateError(self.name, f"state_dict() returned a {type(sd).__name__}, not a dict")
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)


def _owner(name: str, optimizer: torch.optim.Optimizer, modules: dict[str, torch.nn.Module]) -> torch.nn.Module:
    """The module of ``state`` whose parameters the optimizer updates."""
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [m for m in modules.values() if ids & {id(p) for p in m.parameters()}]
    if not owners:
        raise StateError(
            name, "the optimizer updates parameters of no module in state; put its module in state too"
        )
    if len(owners) > 1:
        raise StateError(name, "the optimizer updates parameters of several modules in state; "
                               "wrap them in one module")
    return owners[0]


def dcp_entries(state: Any) -> dict[str, Any]:
    """``state`` as DCP Stateful entries, or StateError naming the entry that cannot be saved."""
    if not isinstance(state, dict) or not state:
        raise StateError(None, f"must be a non-empty dict of name -> object, got {type(state).__name__}")
    modules: dict[str, torch.nn.Module] = {}
    for name, obj in state.items():
        if not isinstance(name, str) or not name or "." in name:
            raise StateError(name, "names must be non-empty strings without '.'")
        if name == RESERVED:
            raise StateError(name, "this name is the checkpointer's own; use another")
        if isinstance(obj, torch.nn.Module):
            modules[name] = obj
    entries: dict[str, Any] = {}
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            entries[name] = _ModuleEntry(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            entries[name] = _OptimizerEntry(_owner(name, obj, modules), obj)
        elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            entries[name] = _ObjectEntry(name, obj)
        else:
            raise StateError(
                name, f"cannot save a value of type {type(obj).__name__}: it is not a torch.nn.Module, "
                "not a torch.optim.Optimizer, and has no state_dict()/load_state_dict()"
            )
    return entries
