"""Which ACT2FN activation an experts module applies, decided without computing anything.

transformers' experts modules hold an activation *module* (`act_fn = ACT2FN[config.hidden_act]`), not its name,
and the dispatch ops need the name. `activation_key` reads it off the module's class and settings, so the answer
is the same inside `torch.compile` and `torch.export` as outside (a numerical probe would be a data-dependent
branch there). Dynamo does not trace the lookup: it runs it once, at trace time, and keeps the result.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.activations import ACT2CLS, ACT2FN

# Plain functions some experts modules use instead of an ACT2FN module (LFM2-MoE's `F.silu`).
_FUNCTIONS = {
    nn.functional.silu: "silu", nn.functional.gelu: "gelu", nn.functional.relu: "relu", torch.relu: "relu",
    torch.sigmoid: "sigmoid", torch.tanh: "tanh",
}


def _settings(act: nn.Module) -> tuple:
    """The values that make two instances of one activation class compute different functions: its public
    attributes, with functions compared by identity (a bound method by its function, a partial by its parts)."""
    items = []
    for name, value in sorted(vars(act).items()):
        if name.startswith("_") or name == "training":
            continue
        if isinstance(value, functools.partial):
            value = (value.func, value.args, tuple(sorted(value.keywords.items())))
        items.append((name, getattr(value, "__func__", value)))
    return tuple(items)


@functools.cache
def _keys_of(cls: type) -> tuple[tuple[str, tuple], ...]:
    """(ACT2FN key, settings of the instance ACT2FN builds) for each key whose class is `cls`."""
    keys = []
    for key, entry in ACT2CLS.items():
        if (entry[0] if isinstance(entry, tuple) else entry) is cls:
            keys.append((key, _settings(ACT2FN[key])))
    return tuple(keys)


@torch.compiler.assume_constant_result
def activation_key(act) -> str | None:
    """The ACT2FN key of `act` (an activation module or function), or None when it is no activation ACT2FN builds.

    A module matches a key when it is an instance of that key's class with the same settings (so a LeakyReLU with
    another slope, or a module with learnable parameters, matches nothing).
    """
    if not isinstance(act, nn.Module):
        try:
            return _FUNCTIONS.get(act)
        except TypeError:  # unhashable callable
            return None
    if next(act.parameters(), None) is not None:
        return None
    settings = _settings(act)
    return next((key for key, ref in _keys_of(type(act)) if ref == settings), None)
