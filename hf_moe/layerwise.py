"""Running a model whose weights stay on disk: each decoder layer is read just before it runs and dropped after.

A merge's gates (the base model on the prompts for mergekit's `hidden` gates, the merged model on each source's
text for calibration gates) and `shrink` (each MoE layer chosen on the activations reaching it) run forwards of
models that may not fit in memory beside everything else. A leaf: imports nothing of hf_moe. The model
is built with its parameters on the meta device (buffers such as the rotary frequencies are real); hooks on its
decoder layers fill a layer's parameters from `read(key)` before the layer runs and put them back on meta after, so
the forward holds the embeddings and one decoder layer at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

Reader = Callable[[str], torch.Tensor]


def _slots(module: nn.Module, prefix: str) -> list[tuple[nn.Module, str, str]]:
    """(owner module, attribute, full key) of each parameter of `module` (tied ones once)."""
    out = []
    for name, _ in module.named_parameters():
        path, _, attr = name.rpartition(".")
        out.append((module.get_submodule(path) if path else module, attr, prefix + name))
    return out


def fill_parameters(module: nn.Module, prefix: str, read: Reader, dtype: torch.dtype, skip=lambda key: False) -> None:
    """Give every parameter of `module` (keys `prefix + name`, on meta or not) the value `read(key)`, cast to `dtype`
    if floating; `release` undoes it."""
    for owner, attr, key in _slots(module, prefix):
        if skip(key):
            continue
        value = read(key)
        value = value.to(dtype) if value.is_floating_point() else value
        old = owner._parameters[attr]
        if tuple(value.shape) != tuple(old.shape):
            raise ValueError(f"{key}: read a tensor of shape {tuple(value.shape)}, the parameter is {tuple(old.shape)}")
        owner._parameters[attr] = nn.Parameter(value, requires_grad=False)


def release(module: nn.Module) -> None:
    """Put every parameter of `module` back on the meta device (its memory is freed)."""
    for owner, attr, _ in _slots(module, ""):
        p = owner._parameters[attr]
        owner._parameters[attr] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)


@contextlib.contextmanager
def layerwise(model: nn.Module, layers_path: str, read: Reader, dtype: torch.dtype, skip=lambda key: False):
    """While the block runs, `model.base_model(...)` computes with weights read layer by layer (see the module
    docstring). `skip(key)` leaves a parameter for the caller to fill (a router set by a hook of its own).

    Everything outside the decoder layers but the output head (embeddings, final norm) is read at entry.
    """
    layers = model.get_submodule(layers_path)
    head = model.get_output_embeddings()
    head_params = {id(p) for p in head.parameters()} if head is not None else set()
    input_params = {id(p) for p in model.get_input_embeddings().parameters()}
    outside = []
    for name, param in model.named_parameters():
        if name.startswith(layers_path + ".") or (id(param) in head_params and id(param) not in input_params):
            continue
        outside.append(name)
    for name in outside:
        path, _, attr = name.rpartition(".")
        owner = model.get_submodule(path)
        value = read(name)
        owner._parameters[attr] = nn.Parameter(value.to(dtype) if value.is_floating_point() else value,
                                               requires_grad=False)

    def before(index):
        def hook(module, args, kwargs):
            fill_parameters(module, f"{layers_path}.{index}.", read, dtype, skip)

        return hook

    def after(module, args, kwargs, output):
        release(module)

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(before(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(after, with_kwargs=True))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        release(model)


def layer_inputs(layers: nn.ModuleList, store: dict[int, torch.Tensor]):
    """Hooks recording the hidden states [B, T, H] entering each decoder layer into `store[i]`. Returns handles."""

    def hook(index):
        def record(module, args, kwargs):
            store[index] = (args[0] if args else kwargs["hidden_states"]).detach()

        return record

    return [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
