"""The passes of a shrink over a checkpoint's MoE layers, which every method (methods.py) drives the same way.

    forward_pass  the calibration rows through the model one decoder layer at a time, the model never loaded whole:
                  its parameters stay on the meta device, each layer is read from the files just before it runs and
                  released after (`hf_moe.layerwise.layerwise`); when an MoE block has run, `visit` sees its
                  input and output and may hand the next layer another output instead (the shrunk block's)
    cut_pass      no forward at all: each layer's router and experts read, cut to the rows kept, written
    layer_data    what a visit measures on one layer: its routing, and every expert's output where the method needs it

Peak memory of a forward pass is one decoder layer, every expert's output on the calibration tokens, and the
activations of the calibration batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from accelerate import init_empty_weights
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from ..layerwise import layerwise
from .layer import LayerData, combine, expert_outputs, route, select_rows
from .layout import MoELayout
from .output import ShrunkWriter, head_class

SEARCH_BYTES = 768 << 20  # every expert's output on the tokens a layer's search uses: at most this much (fp32)

# visit(layer, block, hidden [rows, T, H], output [rows, T, H]) -> the output the next layer sees, or None (unchanged)
Visit = Callable[[int, torch.nn.Module, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def empty_model(layout: MoELayout):
    """The checkpoint's model with its parameters on the meta device (buffers real): hf_moe's head or the native
    family's causal LM."""
    with init_empty_weights(include_buffers=False):
        return (head_class(layout.config)(layout.config) if not layout.is_native
                else AutoModelForCausalLM.from_config(layout.config))


def load_buffers(layout: MoELayout, layer: int, block: torch.nn.Module) -> None:
    """Give MoE layer `layer`'s block its persistent buffers' saved values (an aux_free router's bias)."""
    prefix = layout.memory_prefix(layer)
    for name, buffer in block.named_buffers():
        owner, _, attr = name.rpartition(".")
        module = block.get_submodule(owner) if owner else block
        key = layout.disk_prefix(layer) + name
        if attr not in module._non_persistent_buffers_set and key in layout.source.entries:
            module._buffers[attr] = layout.read(prefix + name).to(buffer.dtype)


def forward_pass(layout: MoELayout, ids: torch.Tensor, visit: Visit, desc: str, progress: bool) -> None:
    """Run ids [rows, T] through the model on the meta device layer by layer, calling `visit` after each MoE block."""
    model = empty_model(layout).eval()
    bar = tqdm(total=len(layout.moe_layers), disable=not progress, desc=desc)

    def hook_for(layer: int):
        def hook(block, args, output):
            new = visit(layer, block, args[0], output[0] if isinstance(output, tuple) else output)
            bar.update()
            if new is None:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return hook

    handles = []
    for layer in layout.moe_layers:
        block = model.get_submodule(layout.memory_prefix(layer)[:-1])
        handles.append(block.register_forward_pre_hook(lambda b, args, layer=layer: load_buffers(layout, layer, b)))
        handles.append(block.register_forward_hook(hook_for(layer)))
    try:
        with torch.no_grad(), layerwise(model, layout.layers_path, layout.read, torch.float32):
            model.base_model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        bar.close()


def router_keys(layout: MoELayout, layer: int) -> list[str]:
    """In-memory keys of layer `layer`'s router tensors that are on disk."""
    disk, memory = layout.disk_prefix(layer) + "gate.", layout.memory_prefix(layer) + "gate."
    return [memory + k[len(disk):] for k in layout.source.entries if k.startswith(disk)]


def cut_pass(layout: MoELayout, writer: ShrunkWriter, kept_for: Callable[[int], list[int]], desc: str,
             progress: bool) -> dict[int, list[int]]:
    """Each MoE layer's router and experts read, cut to the rows `kept_for(layer)` and written; {layer: rows}."""
    kept_by_layer = {}
    for layer in tqdm(layout.moe_layers, desc=desc, disable=not progress):
        kept = kept_for(layer)
        prefix = layout.memory_prefix(layer)
        router = {k[len(prefix) + 5:]: layout.read(k) for k in router_keys(layout, layer)}
        experts = {n: layout.read(f"{prefix}experts.{n}") for n in layout.expert_params}
        index = torch.tensor(kept)
        writer.write_layer(layer, select_rows(router, kept, layout.num_experts),
                           {n: t.index_select(0, index) for n, t in experts.items()})
        kept_by_layer[layer] = kept
    return kept_by_layer


def layer_data(block, params: dict, x: torch.Tensor, original: torch.Tensor | None, num_experts: int, seed: int,
               with_outputs: bool) -> LayerData:
    """The layer's routing on a sample of the tokens x [N, H] (all of them when they fit SEARCH_BYTES), and with
    `with_outputs` every expert's output there and the target: the block's routed output on the original model's
    input at the same tokens (`original` [N, H]) where given, else on x. `params`: {name: fused tensor [E, ...]}."""
    n = max(1, min(x.shape[0], SEARCH_BYTES // (4 * num_experts * x.shape[1])))
    if n < x.shape[0]:
        sample = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:n].sort().values
        x = x.index_select(0, sample)
        original = None if original is None else original.index_select(0, sample)
    index, weights, logits = route(block.gate, x)
    data = LayerData(x, logits, index, weights)
    if with_outputs:
        data.outputs = expert_outputs(block.experts, params, x)
        if original is None:
            data.routed = combine(data.outputs, index, weights)
        else:
            target_index, target_weights, _ = route(block.gate, original)
            data.routed = combine(expert_outputs(block.experts, params, original), target_index, target_weights)
    return data
