"""A device-mistake catcher that works without a GPU: `DeviceCheck`, a TorchFunctionMode.

    with DeviceCheck(model.device) as check:
        decoder.generate(ids, 32, choose=0)
    check.raise_if_violations()          # tensors made off the device, devices mixed
    print(check.syncs)                   # host synchronisations, by kind

While active it sees every torch call made from Python (torch.*, Tensor methods, torch.nn.functional
entry points; not the calls those make internally, and nothing in C++), and records:

* violations: a tensor factory (torch.zeros, arange, tensor, from_numpy, ...) called without a
  `device=`, which makes a CPU tensor whatever device the model is on; a factory, `.to()` or
  `.cpu()` result on another device than the expected one; an op given tensors on another device
  (0-dim CPU tensors, which every backend accepts as scalars, excepted); a random op given a
  torch.Generator on another device. On a CPU-only machine the expected device is the CPU too, so
  the first kind is what finds the lines that would build CPU tensors next to CUDA ones.
* syncs: calls that make the host wait for the device: `.item()`, `.tolist()`, `.numpy()`,
  `.cpu()`, `int()/float()/bool()` and `__index__` of a tensor, and data-dependent-shape ops
  (nonzero, unique, masked_select, ...). Counted per call, by name, in `syncs`; `sync_count()`.

`strict=True` raises at the offending call instead of collecting (the traceback then names the line).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)

_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor,
              torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye, torch.linspace, torch.logspace,
              torch.from_numpy, torch.empty_strided, torch.scalar_tensor, torch.tril_indices, torch.triu_indices}
_SYNC_METHODS = {"item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__", "__complex__"}
_DATA_DEPENDENT = {"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere", "bincount",
                   "nonzero_static", "_unique2", "repeat_interleave"}


def _name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if func is torch.unique or name == "fn":  # torch.unique is a boolean_dispatch wrapper named "fn"
        return "unique"
    return name


def _tensors(objs: Iterable[Any]) -> Iterable[torch.Tensor]:
    for obj in objs:
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (list, tuple)):
            yield from _tensors(obj)


class DeviceCheckError(RuntimeError):
    """A tensor made or used off the expected device (see `DeviceCheck`)."""


class DeviceCheck(TorchFunctionMode):
    """Records device mistakes and host synchronisations of the torch calls made while active."""

    def __init__(self, expected: torch.device | str, strict: bool = False) -> None:
        super().__init__()
        self.expected = torch.device(expected)
        self.strict = strict
        self.violations: list[str] = []
        self.syncs: Counter[str] = Counter()

    def sync_count(self) -> int:
        return sum(self.syncs.values())

    def reset_counts(self) -> None:
        self.syncs.clear()

    def raise_if_violations(self) -> None:
        if self.violations:
            shown = "\n  ".join(self.violations[:10])
            more = f"\n  ... and {len(self.violations) - 10} more" if len(self.violations) > 10 else ""
            raise DeviceCheckError(f"{len(self.violations)} device mistakes:\n  {shown}{more}")

    def _same(self, device: torch.device) -> bool:
        exp = self.expected
        return device.type == exp.type and (exp.index is None or device.index in (None, exp.index))

    def _flag(self, message: str) -> None:
        message = f"{message} [at {_caller()}]"
        if self.strict:
            raise DeviceCheckError(message)
        self.violations.append(message)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
                           ) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if name in _SYNC_METHODS or name in _DATA_DEPENDENT:
            self.syncs[name] += 1
        if func in _FACTORIES and kwargs.get("device") is None:
            self._flag(f"torch.{name} called without device= (it makes a CPU tensor; the model is on {self.expected})")
        for t in _tensors(list(args) + list(kwargs.values())):
            if not self._same(t.device) and not (t.device.type == "cpu" and t.dim() == 0):
                self._flag(f"{name} got a tensor on {t.device} {tuple(t.shape)}; the model is on {self.expected}")
                break
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and not self._same(gen.device):
            self._flag(f"{name} got a torch.Generator on {gen.device}; the model is on {self.expected}")
        out = func(*args, **kwargs)
        to_host = name == "to" and _asks_for_cpu(args, kwargs)
        if to_host and args[0].device.type != "cpu":
            self.syncs["to(cpu)"] += 1  # a deliberate transfer to the host
        elif name not in ("cpu", "numpy", "tolist") and not to_host:
            for t in _tensors([out]):
                if not self._same(t.device):
                    self._flag(f"{name} returned a tensor on {t.device}; the model is on {self.expected}")
                    break
        return out


def _asks_for_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether a `.to(...)` call names the CPU as its target."""
    targets = list(args[1:]) + [kwargs.get("device")]
    return any(isinstance(x, (str, torch.device)) and torch.device(x).type == "cpu" for x in targets if x is not None)


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module (the line to fix)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__ and not name.startswith(_TORCH_DIR):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"
