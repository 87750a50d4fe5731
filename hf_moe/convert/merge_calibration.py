"""Calibration gates: the merged model reads each source's own text, and each router is set from what reaches it.

All sources' text goes through the merged model (read back from the files just written, one decoder layer at a
time) in one batch. Just before MoE block l runs, a hook on it computes block l's router from its inputs
(`calibration_rows`): so router l sees exactly the hidden states that the routers before it produce, and the rows
are those of the merged model, not of the base model or of any one source. A gated shared expert (qwen) gets the
unit-norm mean of its own source's inputs, mergekit's scale for that gate (zero, a constant 0.5, without text).
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import EXPERT_PARAM_NAMES
from ..layers import SparseMoeBlock
from ..layerwise import layerwise
from .merge_gates import calibration_rows, domain_means

BLOCK_TOKENS = 256


def source_text(spec, tokenizer, max_tokens: int) -> list[int]:
    """Token ids of a source's calibration text: its calibration_data file, else its positive prompts."""
    from .split import calibration_text

    if spec.calibration_data is not None:
        return calibration_text(spec.calibration_data, tokenizer, max_tokens)[0].tolist()
    return tokenizer("\n\n".join(spec.positive_prompts or []))["input_ids"][:max_tokens]


def calibration_batch(plan) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(input ids [B, T], the source label of each row [B], tokens per source): every source's text cut into rows
    of one length. Label E is the shared expert's text."""
    from transformers import AutoTokenizer

    recipe = plan.recipe
    tokenizer = AutoTokenizer.from_pretrained(recipe.base_model)
    specs = list(recipe.experts)
    shared = recipe.shared
    if plan.config.shared_expert_gate and shared is not None and (shared.calibration_data or shared.positive_prompts):
        specs.append(shared)
    texts = [source_text(s, tokenizer, recipe.calibration_tokens) for s in specs]
    short = min(len(t) for t in texts)
    if short < 2:
        raise ValueError(f"gate_mode=calibration: {specs[[len(t) for t in texts].index(short)].source_model}'s text "
                         f"gives {short} token(s); give each expert more calibration text.")
    length = min(BLOCK_TOKENS, short)
    rows, labels = [], []
    for label, ids in enumerate(texts):
        for start in range(0, len(ids) - length + 1, length):
            rows.append(ids[start:start + length])
            labels.append(label)
    return torch.tensor(rows), torch.tensor(labels), [len(t) // length * length for t in texts]


@torch.no_grad()
def calibrate(plan, writer, progress: bool = True) -> tuple[dict, dict]:
    """({MoE layer: router weight [E, H]}, {MoE layer: shared gate row [1, H] or None}) from calibration text."""
    ids, row_labels, counts = calibration_batch(plan)
    num = len(plan.recipe.experts)
    labels = row_labels.repeat_interleave(ids.shape[1])  # [B*T]
    model = plan.runnable_model()
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    routers, shared_rows, accuracy = {}, {}, []
    bar = tqdm(total=len(blocks), desc="Calibrating routers", leave=False, disable=not progress)

    def set_router(layer: int):
        def hook(block, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            routed = labels < num
            weight = calibration_rows(x[routed], labels[routed], num)
            block.gate._parameters["weight"] = nn.Parameter(weight.to(plan.dtype), requires_grad=False)
            accuracy.append((x[routed] @ weight.t()).argmax(-1).eq(labels[routed]).float().mean().item())
            routers[layer] = weight
            shared_rows[layer] = None
            if block.shared_expert_gate is not None:
                row = domain_means(x, labels, num + 1)[num:] if bool((labels == num).any()) else None
                if row is None:
                    row = torch.zeros(1, x.shape[1])
                row = row / row.norm(dim=-1, keepdim=True).clamp(min=1e-8)
                block.shared_expert_gate._parameters["weight"] = nn.Parameter(row.to(plan.dtype), requires_grad=False)
                shared_rows[layer] = row
            bar.update()

        return hook

    handles = [b.register_forward_pre_hook(set_router(i)) for i, b in zip(plan.moe_layers, blocks)]
    routers_keys = {k for i in plan.moe_layers for k in plan.router_keys(i) if k}
    try:
        with layerwise(model, plan.layers_path, _reader(plan, writer), plan.dtype, skip=routers_keys.__contains__):
            model.base_model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        bar.close()
    plan.config.moe_conversion["calibration"] = {
        "tokens_per_source": counts,
        "top1_own_expert": [round(a, 4) for a in accuracy],
        "note": "per MoE layer, the fraction of the calibration tokens whose first choice is their source's expert",
    }
    return routers, shared_rows


def _reader(plan, writer):
    """Model key -> tensor, from the files being written: fused expert parameters stacked from their experts."""
    experts = len(plan.recipe.experts)

    def read(key: str) -> torch.Tensor:
        head, _, name = key.rpartition(".")
        if name in EXPERT_PARAM_NAMES and head.endswith(".experts"):
            return torch.stack([writer.read(f"{head}.{e}.{name}") for e in range(experts)])
        return writer.read(key)

    return read

