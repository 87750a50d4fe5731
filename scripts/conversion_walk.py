"""The walk of `hf_moe.convert_to_moe`: the hf_moe functions a tiny Llama passes through on its way to an MoE model.

    python scripts/conversion_walk.py

A stop is an hf_moe function that makes a piece of the finished model, itself or through what it calls: while it is
on the call stack, a function returns an object the finished model holds (the model, its config, a module or
attribute of one of its modules, the class of one of them), a constructor (`__init__`, `__new__`, `__post_init__`)
of hf_moe runs on such an object, or one is set as a module's attribute. Checks, estimates and probes that build
nothing of the model are not on the walk. Measured with `sys.setprofile` in a fresh process (the per-base classes are
made on the first conversion of a family, so a process that converted a Llama before walks fewer stops). Prints one
stop a line, in the order first reached, then `N stops in M modules`. docs/architecture.md, "The path of a
conversion", reads the walk.
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_moe

_PLAIN = (bool, int, float, str, bytes, tuple)  # shared or interned: their identity names no piece of the model


def _stack(frame) -> list[tuple[str, str]]:
    """(module, function) of each hf_moe frame from the outermost to `frame`."""
    found = []
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] == "hf_moe" and "__create_fn__" not in frame.f_code.co_qualname:
            found.append((module, frame.f_code.co_qualname))
        frame = frame.f_back
    return found[::-1]


def walk(convert, *args, **kwargs) -> tuple[object, list[tuple[str, str]]]:
    """(what `convert(*args, **kwargs)` returns, its stops in the order first reached)."""
    events, alive = [], []  # (id of an object, the stack that made or placed it); `alive` keeps the ids unique

    def record(value, frame) -> None:
        if value is not None and not isinstance(value, _PLAIN):
            alive.append(value)
            events.append((id(value), _stack(frame)))

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        code = frame.f_code
        if event == "return" and module.split(".")[0] == "hf_moe":
            for value in arg if isinstance(arg, (tuple, list)) else (arg,):
                record(value, frame)
        elif event == "call" and module.split(".")[0] == "hf_moe" and code.co_name in (
                "__init__", "__new__", "__post_init__") and code.co_argcount:
            record(frame.f_locals.get(code.co_varnames[0]), frame)
        elif event == "call" and module.startswith("torch.nn") and code.co_name in ("__setattr__", "add_module"):
            record(frame.f_locals.get("value", frame.f_locals.get("module")), frame)

    sys.setprofile(profile)
    try:
        result = convert(*args, **kwargs)
    finally:
        sys.setprofile(None)
    held = {id(result), id(result.config), id(type(result.config))}
    for module in result.modules():
        held.update((id(module), id(type(module))))
        held.update(id(v) for v in vars(module).values() if v is not None and not isinstance(v, _PLAIN))
    stops = []
    for key, stack in events:
        if key in held:
            stops += [stop for stop in dict.fromkeys(stack) if stop not in stops]
    return result, stops


def main() -> int:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    _, stops = walk(hf_moe.convert_to_moe, LlamaForCausalLM(config), 4, 2, verify=False)
    for module, function in stops:
        print(f"{module}.{function}")
    print(f"{len(stops)} stops in {len({module for module, _ in stops})} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
