"""`convert_adapter`: a LoRA adapter trained on a dense model, carried over exactly to its MoE conversion.

A LoRA adapter adds `scaling * B @ A` to a weight. An MoE block is made of the dense MLP's neurons, so the dense
adapter's deltas map onto the experts row for row:

    upcycle   every routed expert copies the dense MLP (its neurons past the shared slice, with shared experts): the
              same delta applies to every expert
    split     expert e holds the dense neurons idx_e: it takes rows idx_e of the gate and up deltas and columns idx_e
              of the down delta. The partition is read back by matching the experts' weights with the dense MLP's.
    shared    the shared experts (`num_shared_experts`) are Linear layers holding their neurons of the MLP, and take
              their rows (columns) of the deltas the same way

On the routed experts the deltas go through PEFT's `target_parameters`: a LoRA on `experts.gate_up_proj [E, 2I, H]`
(`up_proj [E, I, H]` for plain MLPs) and on `experts.down_proj [E, H, I]`, one low-rank pair per expert. The gate and
up deltas share the fused tensor side by side: A = [A_gate; A_up], B = blockdiag(B_gate[idx], B_up[idx]). Each
delta's scaling is folded into its B, so every converted LoRA runs with scaling 1. The adapter's other LoRA layers
(attention, the MLPs of layers left dense, embeddings) and its `modules_to_save` load as they are.

What cannot carry over exactly is refused, with the reason: other PEFT methods, DoRA, LoRA biases, trained MLP
biases or whole MLP modules, and a split model without the dense model its partition is read from.
"""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..dense_mlp import DenseMLP, MLPSpec, extract_mlp, find_decoder_layers, find_mlp
from ..layers.quantized import QuantizedExperts

# LoraConfig fields whose adapters are not `W + scaling * B @ A` on each target.
_REFUSED_FIELDS = {
    "use_dora": "DoRA (a learned magnitude per column of each adapted weight)",
    "lora_bias": "LoRA biases (lora_bias=True)",
    "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "arrow_config": "Arrow routing between LoRA adapters",
    "velora_config": "VeLoRA",
    "kasa_config": "KaSA",
    "megatron_config": "Megatron-parallel LoRA layers",
    "use_bdlora": "block-diagonal LoRA",
    "target_parameters": "LoRA on parameters (target_parameters)",
}
_PREFIX = "base_model.model."  # PEFT's saved names: base_model.model.<module>.lora_A.weight
_LORA_PAIR = re.compile(r"^(?P<module>.+)\.(?P<which>lora_A|lora_B)\.weight$")
_ROLES = ("gate", "up", "down")


class AdapterConversionError(ValueError):
    """A dense adapter cannot be carried over exactly to the MoE model."""


@dataclass
class _Delta:
    """One dense projection's LoRA with its scaling folded in: delta [out, in] = B [out, r] @ A [r, in] (fp32)."""

    A: torch.Tensor
    B: torch.Tensor

    @property
    def rank(self) -> int:
        return self.A.shape[0]


def convert_adapter(
    adapter,
    moe_model,
    *,
    base_model: PreTrainedModel | str | os.PathLike | None = None,
    adapter_name: str = "default",
):
    """Carry a LoRA adapter trained on the dense model over to `moe_model`, its hf_moe conversion.

    Args:
        adapter: a saved PEFT adapter directory, or a `PeftModel` on the dense model (its active adapter).
        moe_model: the `MoEForCausalLM` converted from that dense model (`method="upcycle"` or `"split"`). It is
            wrapped in place, as `PeftModel.from_pretrained` wraps its model.
        base_model: the dense model the adapter was trained on (a model, or its directory). Needed for a split
            conversion (which neurons went to which expert is read from it); for an upcycled one it is optional,
            and when given, which projection is the gate is read from its weights rather than from its name.
            Default for a split: the conversion's recorded source, if that is a local directory.
        adapter_name: the adapter's name in the returned model.
    Returns:
        A `peft.PeftModel` over `moe_model`: the dense MLPs' LoRA deltas on the experts' fused tensors
        (`target_parameters`) and on the shared experts, the other LoRA layers as trained. When the conversion was
        exact (upcycled without noise, or split with every expert chosen), its logits are the dense model's with
        the adapter, up to fp32 rounding. `save_pretrained` writes an ordinary PEFT adapter, which
        `PeftModel.from_pretrained(moe_model, dir)` loads; `merge_and_unload()` merges it into the experts.
    Raises:
        AdapterConversionError: what in the adapter cannot carry over exactly, and why.

    PEFT runs a LoRA on parameters without dropout, so the converted adapter has `lora_dropout=0`: nothing changes
    at inference, but training it further drops no activations.
    """
    from peft import get_peft_model, set_peft_model_state_dict

    config, weights = _read_adapter(adapter)
    _check_config(config)
    if any(isinstance(module, QuantizedExperts) for module in moe_model.modules()):
        raise AdapterConversionError(
            "The MoE model has int8 experts (hf_moe.quantize_experts): frozen buffers, which a LoRA cannot adapt. "
            "Convert the adapter onto the floating-point MoE model, merge it with merge_and_unload(), then quantize."
        )
    plan = _Plan(moe_model, base_model)
    deltas, kept = plan.sort_weights(config, weights)
    if not deltas:
        raise AdapterConversionError(
            "The adapter has no LoRA on the MLPs that became MoE blocks, so nothing needs converting: load it with "
            "`PeftModel.from_pretrained(moe_model, adapter_dir)`."
        )
    modules, parameters = plan.converted_tensors(deltas)
    new_config = plan.converted_config(config, deltas, kept, modules)
    peft_model = get_peft_model(moe_model, new_config, adapter_name=adapter_name)
    # The adapter's own tensors go through PEFT's loader; the converted ones are copied into the LoRA layers PEFT
    # made for them (PEFT's names for nested LoRAs on parameters depend on the order it wrapped them in).
    kept_state = {_PREFIX + k: v for k, v in kept.items()}
    result = set_peft_model_state_dict(peft_model, kept_state, adapter_name=adapter_name)
    if result.unexpected_keys:
        raise AdapterConversionError(
            f"{len(result.unexpected_keys)} tensors of the adapter found no place in the MoE model "
            f"({sorted(result.unexpected_keys)[:6]}). This is a bug in hf_moe.convert_adapter; please report it."
        )
    _fill_modules(peft_model, modules, adapter_name)
    _fill_parameter_wrappers(peft_model, parameters, adapter_name)
    peft_model.train(moe_model.training)
    return peft_model


# --------------------------------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------------------------------
def _read_adapter(adapter) -> tuple[object, dict[str, torch.Tensor]]:
    """(its LoraConfig, its tensors under PEFT's saved names)."""
    from peft import PeftConfig, PeftModel, get_peft_model_state_dict, load_peft_weights

    if isinstance(adapter, PeftModel):
        name = adapter.active_adapter
        return adapter.peft_config[name], get_peft_model_state_dict(adapter, adapter_name=name)
    if isinstance(adapter, (str, os.PathLike)) and os.path.isdir(adapter):
        path = os.fspath(adapter)
        return PeftConfig.from_pretrained(path), load_peft_weights(path, device="cpu")
    raise TypeError(
        f"convert_adapter takes a saved PEFT adapter directory or a PeftModel on the dense model, got {adapter!r}."
    )


def _check_config(config) -> None:
    if getattr(config, "peft_type", None) != "LORA":  # (PeftType is a str enum)
        raise AdapterConversionError(
            f"Only LoRA adapters carry over to an MoE model; this one is {config.peft_type}. Merge it into the dense "
            "model (`merge_and_unload()`) and convert the merged model instead."
        )
    refused = [why for name, why in _REFUSED_FIELDS.items() if getattr(config, name, None)]
    if refused:
        raise AdapterConversionError(
            f"This LoRA adapter uses {', '.join(refused)}, which has no exact counterpart on the experts. Merge it "
            "into the dense model (`merge_and_unload()`) and convert the merged model instead."
        )


def _alpha(config, module: str) -> float:
    """The lora_alpha PEFT gives the LoRA on `module` (a model-relative module name)."""
    from peft.utils.other import get_pattern_key

    if config.alpha_pattern:
        return config.alpha_pattern.get(get_pattern_key(list(config.alpha_pattern), module), config.lora_alpha)
    return config.lora_alpha


def _scaling(config, module: str, rank: int) -> float:
    """The scaling PEFT gives the LoRA of rank `rank` on `module`."""
    alpha = _alpha(config, module)
    return alpha / math.sqrt(rank) if config.use_rslora else alpha / rank


# --------------------------------------------------------------------------------------------------------------
# The MoE model's layout
# --------------------------------------------------------------------------------------------------------------
class _Plan:
    """Where each dense MLP projection of an MoE layer went, and which dense neurons each expert holds."""

    def __init__(self, moe_model, base_model):
        c = moe_model.config
        conv = c.moe_conversion or {}
        self.model, self.config, self.method = moe_model, c, conv.get("method")
        if self.method not in ("upcycle", "split"):
            raise AdapterConversionError(
                f"moe_model.config.moe_conversion records no conversion method (got {self.method!r}), so how its "
                "experts relate to the dense MLP is unknown. convert_adapter needs a model made by convert_to_moe."
            )
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(c.to_base_config())
        _, layers = find_decoder_layers(skeleton)
        self.spec: MLPSpec = find_mlp(layers[c.moe_layers[0]])
        self.num_shared = c.num_shared_experts or 0
        self.dense = _dense_model(base_model, conv.get("base_model"), self.method)
        self._mlps: dict[int, DenseMLP] = {}
        self.swapped = self.dense is not None and self._gate_is_named_up()

    def dense_projections(self, layer: int) -> dict[str, str]:
        """{dense module name in MoE layer `layer`: its role ("gate", "up", "gate_up" or "down")}."""
        s = self.spec
        base = ".".join(p for p in (self.config.decoder_layers_path, str(layer), s.module_path) if p)
        if s.fused:
            return {f"{base}.{s.up}": "gate_up", f"{base}.{s.down}": "down"}
        roles = {f"{base}.{s.up}": "up", f"{base}.{s.down}": "down"}
        if s.gate is not None:
            roles[f"{base}.{s.gate}"] = "up" if self.swapped else "gate"
            roles[f"{base}.{s.up}"] = "gate" if self.swapped else "up"
        return roles

    def block(self, layer: int) -> str:
        return f"{self.config.decoder_layers_path}.{layer}.{self.config.moe_block_path}"

    def sort_weights(self, config, weights):
        """({(layer, role): _Delta} of the MoE layers' dense MLPs ("gate_up" split into "gate" and "up"),
        {every other tensor, under its model-relative name})."""
        owner = {
            module: (layer, role)
            for layer in self.config.moe_layers
            for module, role in self.dense_projections(layer).items()
        }
        replaced = self._replaced_modules()
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        kept, refused = {}, []
        for key, tensor in weights.items():
            name = key.removeprefix(_PREFIX)
            match = _LORA_PAIR.match(name)
            if match and match["module"] in owner:
                pairs.setdefault(match["module"], {})[match["which"]] = tensor
            elif any(name == m or name.startswith(m + ".") for m in replaced):
                refused.append(name)
            else:
                kept[name] = tensor
        whole = [m for m in (config.modules_to_save or []) if any(r == m or r.endswith("." + m) for r in replaced)]
        if refused or whole:
            raise AdapterConversionError(
                f"The adapter trains parts of the dense MLPs other than LoRA pairs ({(sorted(refused) + whole)[:6]}): "
                "biases (bias='all' or 'lora_only'), whole modules (modules_to_save) or another kind of layer. The "
                "MoE model has no dense MLP to put them in. Merge the adapter into the dense model "
                "(`merge_and_unload()`) and convert the merged model instead."
            )
        deltas = {}
        size = self.intermediate_size()
        for module, pair in sorted(pairs.items()):
            if set(pair) != {"lora_A", "lora_B"}:
                raise AdapterConversionError(f"The adapter's LoRA on {module} has only {sorted(pair)}.")
            layer, role = owner[module]
            a, b = pair["lora_A"].float(), pair["lora_B"].float()
            b = b * _scaling(config, module, a.shape[0])
            if role == "gate_up":  # [gate; up] rows, as the conversion reads a fused projection first
                first, second = ("up", "gate") if self.swapped else ("gate", "up")
                deltas[layer, first], deltas[layer, second] = _Delta(a, b[:size]), _Delta(a, b[size:])
            else:
                deltas[layer, role] = _Delta(a, b)
        return deltas, kept

    def _replaced_modules(self) -> list[str]:
        """The dense modules of the MoE layers that no longer exist: the MLP module (or, inline, the bypassed
        projections and the one the block took the place of)."""
        out = []
        for layer in self.config.moe_layers:
            out += list(self.dense_projections(layer))
            if self.spec.module_path and not self.spec.inline:
                out.append(".".join((self.config.decoder_layers_path, str(layer), self.spec.module_path)))
        return out

    # neurons ------------------------------------------------------------------------------------------------
    def intermediate_size(self) -> int:
        """The dense MLP's I."""
        c = self.config
        if self.method == "split":
            return (c.num_experts + self.num_shared) * c.moe_intermediate_size
        return c.moe_intermediate_size + self.num_shared * (c.shared_expert_intermediate_size or 0)

    def neurons(self, layer: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """([the dense neurons routed expert e holds, in its order, for each e], the shared experts' or None)."""
        if self.method == "split":
            return self._split_neurons(layer)
        shared = self.num_shared * (self.config.shared_expert_intermediate_size or 0)
        routed = torch.arange(shared, self.intermediate_size())
        return [routed] * self.config.num_experts, (torch.arange(shared) if shared else None)

    def _split_neurons(self, layer: int):
        """A split's partition, read back: an expert's gate row, up row and down column of a neuron are the dense
        MLP's, bit for bit (the conversion copies them)."""
        mlp = self._mlp(layer)
        block = self.model.get_submodule(self.block(layer))
        experts = block.experts
        dtype = experts.down_proj.dtype  # (a conversion in another dtype rounded the dense weights once)
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        index: dict[bytes, int] = {}
        for n, signature in enumerate(_signatures(cast(mlp.gate), cast(mlp.up), cast(mlp.down))):
            if index.setdefault(signature, n) != n:
                raise AdapterConversionError(
                    f"Neurons {index[signature]} and {n} of the dense MLP of layer {layer} have equal weights, so "
                    "which expert holds which cannot be read back; this adapter cannot be split."
                )
        routed = []
        for e in range(self.config.num_experts):
            up = (experts.gate_up_proj if experts.has_gate else experts.up_proj)[e].detach()
            gate, up = up.chunk(2) if experts.has_gate else (None, up)
            routed.append(_lookup(index, gate, up, experts.down_proj[e].detach(), layer, f"expert {e}"))
        shared = None
        if block.shared_experts is not None:
            s = block.shared_experts
            gate = s.gate_proj.weight.detach() if s.glu else None
            up, down = s.up_proj.weight.detach(), s.down_proj.weight.detach()
            shared = _lookup(index, gate, up, down, layer, "the shared experts")
        return routed, shared

    def _mlp(self, layer: int) -> DenseMLP:
        if layer not in self._mlps:
            _, layers = find_decoder_layers(self.dense)
            self._mlps[layer] = extract_mlp(layers[layer], self.spec, self.dense.config)
        return self._mlps[layer]

    def _gate_is_named_up(self) -> bool:
        """Whether the conversion read the MLP the other way round from its names (it tries both readings and keeps
        the one that computes the MLP): then the projection named up holds the gate."""
        if type(self.dense.config) is not self.config.base_config_class:
            raise AdapterConversionError(
                f"base_model is a {type(self.dense.config).__name__} model; the MoE model was converted from a "
                f"{self.config.base_config_class.__name__} one."
            )
        if self.spec.gate is None and not self.spec.fused:
            return False
        layer = self.config.moe_layers[0]
        mlp = self._mlp(layer)
        _, layers = find_decoder_layers(self.dense)
        owner = layers[layer].get_submodule(self.spec.module_path) if self.spec.module_path else layers[layer]
        if self.spec.fused:
            return not torch.equal(mlp.gate, _out_in(getattr(owner, self.spec.up)).chunk(2)[0])
        return not torch.equal(mlp.gate, _out_in(getattr(owner, self.spec.gate)))

    # the converted adapter ----------------------------------------------------------------------------------
    def parameter_rank(self, deltas) -> int:
        """The rank of every LoRA on the experts' tensors: the largest they need (gate and up side by side), the
        others padded with zero components. One rank keeps the converted LoraConfig free of patterns that PEFT
        would report as matching no module (it checks them against modules only)."""
        ranks = []
        for layer in {layer for layer, _ in deltas}:
            ranks.append(sum(deltas[layer, r].rank for r in ("gate", "up") if (layer, r) in deltas))
            ranks.append(deltas[layer, "down"].rank if (layer, "down") in deltas else 0)
        return max(ranks)

    def converted_tensors(self, deltas):
        """({(shared-expert module, "lora_A" | "lora_B"): tensor},
        {(experts module, parameter name): (A [E, R, in], B [E, out, R])}), in the MoE model's dtype."""
        dtype = next(self.model.parameters()).dtype
        rank = self.parameter_rank(deltas)
        modules, parameters = {}, {}
        for layer in sorted({layer for layer, _ in deltas}):
            roles = {role: deltas[layer, role] for role in _ROLES if (layer, role) in deltas}
            routed, shared = self.neurons(layer)
            experts = self.model.get_submodule(f"{self.block(layer)}.experts")
            glu = self.config.expert_glu
            if "gate" in roles or "up" in roles:
                pairs = [_up_side(roles.get("gate"), roles.get("up"), idx, glu) for idx in routed]
                parameters[experts, "gate_up_proj" if glu else "up_proj"] = _stacked(pairs, rank, dtype)
            if "down" in roles:
                pairs = [_down_side(roles["down"], idx) for idx in routed]
                parameters[experts, "down_proj"] = _stacked(pairs, rank, dtype)
            if shared is not None:
                for role, delta in roles.items():
                    a, b = _down_side(delta, shared) if role == "down" else (delta.A, delta.B[shared])
                    name = f"{self.block(layer)}.shared_experts.{role}_proj"
                    modules[name, "lora_A"], modules[name, "lora_B"] = a.to(dtype), b.to(dtype)
        return modules, parameters

    def converted_config(self, config, deltas, kept, modules):
        """The converted adapter's LoraConfig: every LoRA layer named in full with its rank and alpha (the adapter's
        other layers as trained; the converted ones with scaling 1), and one rank for the experts' tensors."""
        new = copy.deepcopy(config)
        rank, alpha = {}, {}
        for name, tensor in kept.items():  # the adapter's other LoRA layers: rank and alpha as PEFT gave them
            module, _, which = name.partition(".lora_")
            if which in ("A.weight", "embedding_A"):
                rank[module] = tensor.shape[0]
                alpha[module] = _alpha(config, module)
        scaled = set()
        for (module, which), tensor in modules.items():  # the shared experts' converted layers: scaling 1
            if which == "lora_A":
                rank[module] = tensor.shape[0]
                scaled.add(module)
        parameters = []
        for layer in sorted({layer for layer, _ in deltas}):
            experts = f"{self.block(layer)}.experts"
            if (layer, "gate") in deltas or (layer, "up") in deltas:
                parameters.append(f"{experts}.{'gate_up_proj' if self.config.expert_glu else 'up_proj'}")
            if (layer, "down") in deltas:
                parameters.append(f"{experts}.down_proj")
        unit = lambda r: math.sqrt(r) if config.use_rslora else r  # noqa: E731  (the alpha that makes scaling 1)
        new.target_modules = sorted(rank)
        new.target_parameters = parameters
        new.r = self.parameter_rank(deltas)
        new.lora_alpha = unit(new.r)
        new.rank_pattern = {re.escape(m): r for m, r in rank.items()}
        new.alpha_pattern = {re.escape(m): unit(rank[m]) if m in scaled else alpha[m] for m in rank}
        new.layers_to_transform = new.layers_pattern = new.exclude_modules = None
        new.lora_dropout = 0.0  # PEFT's LoRA on parameters has no dropout, nor fan_in_fan_out (Conv1D layers)
        conv1d = [m for m in sorted(rank) if type(self.model.get_submodule(m)).__name__ == "Conv1D"]
        if conv1d:
            raise AdapterConversionError(
                f"The adapter's LoRA layers on {conv1d[:4]} are on Conv1D layers, which PEFT runs with "
                "fan_in_fan_out=True; PEFT's LoRA on the experts' tensors (target_parameters) does not run with it, "
                "and one adapter has one setting. Merge the adapter into the dense model (`merge_and_unload()`) "
                "and convert the merged model instead."
            )
        new.fan_in_fan_out = False
        new.base_model_name_or_path = self.model.config.name_or_path or None
        new.inference_mode = False
        return new


def _dense_model(base_model, recorded: str | None, method: str):
    """The dense model as a loaded model, or None when not needed and not at hand."""
    if isinstance(base_model, PreTrainedModel):
        return base_model
    path = base_model
    if path is None and method == "split" and recorded and os.path.isdir(recorded):
        path = recorded
    if path is None:
        if method == "split":
            raise AdapterConversionError(
                "A split model's experts are a partition of the dense MLP's neurons that the checkpoint does not "
                "record: pass base_model=<the dense model the adapter was trained on, or its directory>, from which "
                "hf_moe reads which neuron went to which expert."
            )
        return None
    return AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype="auto")


def _out_in(module) -> torch.Tensor:
    """A Linear's or Conv1D's weight as [out, in]."""
    weight = module.weight.detach()
    return weight.t() if type(module).__name__ == "Conv1D" else weight


def _signatures(gate, up, down) -> list[bytes]:
    """Per neuron n: the bytes of gate[n], up[n] and down[:, n]."""
    parts = [t for t in (gate, up, down.t()) if t is not None]
    rows = torch.cat([p.detach().float().cpu() for p in parts], dim=1)
    return [row.numpy().tobytes() for row in rows]


def _lookup(index, gate, up, down, layer: int, what: str) -> torch.Tensor:
    found = [index.get(signature) for signature in _signatures(gate, up, down)]
    if None in found:
        raise AdapterConversionError(
            f"In layer {layer}, {what} holds neurons that are not the dense MLP's (trained or cast since the "
            "conversion, or converted from another model), so the split cannot be read back. Convert the adapter "
            "onto the model as convert_to_moe made it, with the dense model the adapter was trained on."
        )
    return torch.tensor(found)


def _up_side(gate: _Delta | None, up: _Delta | None, idx: torch.Tensor, glu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The LoRA pair of one expert's up-side tensor (rows [gate idx; up idx] if GLU, else [up idx]):
    A = [A_gate; A_up], B = blockdiag(B_gate[idx], B_up[idx]) (zero rows for a projection the adapter skips)."""
    n = len(idx)
    parts = [(gate, 0), (up, n if glu else 0)] if glu else [(up, 0)]
    parts = [(d, row) for d, row in parts if d is not None]
    a = torch.cat([d.A for d, _ in parts])
    b = a.new_zeros((2 * n if glu else n, a.shape[0]))
    col = 0
    for d, row in parts:
        b[row:row + n, col:col + d.rank] = d.B[idx]
        col += d.rank
    return a, b


def _down_side(down: _Delta, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The LoRA pair of one expert's down tensor: A = A_down[:, idx], B = B_down."""
    return down.A[:, idx], down.B


def _stacked(pairs, rank: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [E, rank, in], B [E, out, rank]): each expert's pair, padded with zero components to `rank`."""
    a = torch.stack([torch.nn.functional.pad(a, (0, 0, 0, rank - a.shape[0])) for a, _ in pairs])
    b = torch.stack([torch.nn.functional.pad(b, (0, rank - b.shape[1])) for _, b in pairs])
    return a.to(dtype), b.to(dtype)


def _fill_modules(peft_model, modules, adapter_name: str) -> None:
    """Copy the shared experts' converted pairs into the LoRA layers PEFT made on them."""
    for (name, which), tensor in modules.items():
        layer = peft_model.base_model.model.get_submodule(name)
        weight = getattr(layer, which)[adapter_name].weight
        if weight.shape != tensor.shape or layer.scaling[adapter_name] != 1:
            raise AdapterConversionError(
                f"PEFT made a {which} of shape {tuple(weight.shape)} and scaling {layer.scaling[adapter_name]} on "
                f"{name}; the converted one has {tuple(tensor.shape)} and 1. This is a bug in hf_moe.convert_adapter."
            )
        with torch.no_grad():
            weight.copy_(tensor)


def _fill_parameter_wrappers(peft_model, parameters, adapter_name: str) -> None:
    """Copy each expert's pair into PEFT's LoRA on that parameter: `lora_A.weight` [E*r, in] is expert-major,
    `lora_B.weight` [out, r*E] rank-major (PEFT's ParamWrapper reads them as (E, r, in) and (out, r, E))."""
    from peft.tuners.lora.layer import ParamWrapper

    left = dict(parameters)
    for module in peft_model.modules():
        if not isinstance(module, ParamWrapper):
            continue
        key = (module.get_base_layer(), module.parameter_name)
        if key not in left:
            continue
        a, b = left.pop(key)  # [E, r, in], [E, out, r]
        lora_a, lora_b = module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight
        a, b = a.reshape(-1, a.shape[-1]), b.permute(1, 2, 0).reshape(b.shape[1], -1)
        if lora_a.shape != a.shape or lora_b.shape != b.shape or module.scaling[adapter_name] != 1:
            raise AdapterConversionError(
                f"PEFT made a LoRA of shapes {tuple(lora_a.shape)}, {tuple(lora_b.shape)} and scaling "
                f"{module.scaling[adapter_name]} on {module.parameter_name}; the converted one has {tuple(a.shape)}, "
                f"{tuple(b.shape)} and 1. This is a bug in hf_moe.convert_adapter; please report it."
            )
        with torch.no_grad():
            lora_a.copy_(a)
            lora_b.copy_(b)
    if left:
        names = sorted(f"{type(m).__name__}.{p}" for m, p in left)
        raise AdapterConversionError(f"PEFT wrapped none of {names}. This is a bug in hf_moe.convert_adapter.")
