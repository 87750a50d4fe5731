"""The model card (README.md) written with every save and conversion."""

from __future__ import annotations

from pathlib import Path

from .version import __version__

_MARKER = "<!-- hf_moe model card:"
_HERE = Path(__file__).resolve().parent
# model_cards/ at the top of a source checkout (and of editable installs); inside the package in a wheel.
TEMPLATES = _HERE.parent / "model_cards" if (_HERE.parent / "model_cards").is_dir() else _HERE / "model_cards"


def block_diff_text(conv: dict) -> str:
    """The block difference a streaming conversion recorded, with its scale: '3.91e-03 (dense MLP outputs up to
    2.3e+02)'."""
    text = f"{conv['max_abs_block_diff']:.2e}"
    if "max_abs_mlp_output" in conv:
        text += f" (dense MLP outputs up to {conv['max_abs_mlp_output']:.2g})"
    return text


def _template(name: str = "moe_model_card.md") -> str:
    return (TEMPLATES / name).read_text()


def is_generated_card(text: str) -> bool:
    return _MARKER in text


def _millions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _weighting(config) -> str:
    if config.router_weights == "unit":
        weights = "unit weights (every chosen expert counts fully)"
    else:
        weights = "renormalised top-k weights" if config.norm_topk_prob else "raw softmax weights"
    if config.num_shared_experts:
        weights += (
            f"; plus {config.num_shared_experts} always-active shared expert(s) of intermediate size "
            f"{config.shared_expert_intermediate_size}"
        )
    return weights


def render_model_card(model) -> str:
    """Fill the template from the model's config and parameter counts."""
    c = model.config
    conv = dict(c.moe_conversion or {})
    counts = model.parameter_counts()
    base_model = conv.get("base_model") or "unknown"
    options = ", ".join(f"{k}={v}" for k, v in sorted(conv.get("options", {}).items()))
    method = conv.get("method", "unknown")
    if "max_abs_logit_diff" in conv:
        diff = conv["max_abs_logit_diff"]
        exactness = (
            f"logits differ from the base model's by at most {diff:.2e} on a random probe at conversion "
            f"({conv.get('probe', 'probe')}); greedy tokens {'equal' if conv.get('same_argmax') else 'DIFFER'}"
        )
    elif "max_abs_block_diff" in conv:
        exactness = (
            f"every MoE block's output differs from the dense MLP's by at most {block_diff_text(conv)}; "
            f"streaming conversion, probe: {conv.get('probe', 'random')}"
        )
    elif "max_abs_expert_diff" in conv:  # a merge (hf_moe/convert/merge.py)
        exactness = (
            f"every expert reproduces its source model's MLP within {conv['max_abs_expert_diff']:.2e} (outputs up to "
            f"{conv.get('max_abs_mlp_output', float('nan')):.2g}) on a random probe, as written to disk"
        )
    else:
        exactness = "not measured"
    return _template().format(
        title=f"{base_model.rstrip('/').split('/')[-1]} MoE: {c.num_experts} experts, top-{c.num_experts_per_tok}",
        base_model=base_model,
        license=conv.get("license") or "other",
        hf_moe_version=__version__,
        base_architecture=model.base_model_class.__name__,
        base_model_type=c.base_model_type,
        num_moe_layers=len(c.moe_layers),
        num_layers=c.get_text_config().num_hidden_layers,
        moe_layers=", ".join(map(str, c.moe_layers)),
        num_experts=c.num_experts,
        top_k=c.num_experts_per_tok,
        normalisation=_weighting(c),
        expert_kind="gated (GLU)" if c.expert_glu else "plain MLP",
        expert_act=c.expert_hidden_act,
        intermediate_size=c.moe_intermediate_size,
        expert_bias=", with biases" if c.expert_bias else "",
        total_params=_millions(counts["total"]),
        active_params=_millions(counts["active"]),
        conversion=f"`{method}`" + (f" ({options})" if options else ""),
        exactness=exactness,
        dtype=str(model.dtype).removeprefix("torch."),
        path_hint="path/to/this/folder",
        aux_coef=c.router_aux_loss_coef,
    )


def render_native_card(model, native_config, export) -> str:
    """The model card of a native export (`hf_moe.export_native`): `model` is the hf_moe model exported,
    `native_config` the native config written, `export` the `NativeExport` (with the measured logit difference)."""
    c = model.config
    conv = dict(c.moe_conversion or {})
    counts = model.parameter_counts()
    base_model = conv.get("base_model") or "unknown"
    options = ", ".join(f"{k}={v}" for k, v in sorted(conv.get("options", {}).items()))
    conversion = f"`{conv.get('method', 'unknown')}`" + (f" ({options})" if options else "")
    if "max_abs_logit_diff" in conv:
        conversion += f"; at conversion, logits within {conv['max_abs_logit_diff']:.2e} of the dense base model's"
    elif "max_abs_block_diff" in conv:
        conversion += f"; at conversion (streamed), every MoE block within {block_diff_text(conv)} of its dense MLP"
    num_layers = c.get_text_config().num_hidden_layers
    dense = [i for i in range(num_layers) if i not in c.moe_layers]
    moe_layers_text = f"all {num_layers}" if not dense else (
        f"{len(c.moe_layers)} of {num_layers}: {', '.join(map(str, c.moe_layers))}; dense MLP in "
        f"{', '.join(map(str, dense))} (`mlp_only_layers`)"
    )
    if export.max_abs_logit_diff is not None:
        exactness = (
            f"reproduces the hf_moe model's logits: these files, loaded with plain transformers, differ from the "
            f"hf_moe model by at most {export.max_abs_logit_diff:.2e} on a random probe ({export.probe}); greedy tokens "
            f"{'equal' if export.same_argmax else 'DIFFER'}"
        )
    else:
        exactness = "the same function as the hf_moe model by construction; not measured at export"
    license_id = conv.get("license")
    notes = ""
    if c.router_z_loss_coef:
        notes += (
            f"\n- The hf_moe model had a router z-loss (`router_z_loss_coef={c.router_z_loss_coef}`); "
            f"`{export.architecture}` has none, so fine-tuning this export does not add it."
        )
    return _template("native_export_card.md").format(
        title=f"{base_model.rstrip('/').split('/')[-1]} MoE ({export.architecture}): {c.num_experts} experts, "
        f"top-{c.num_experts_per_tok}",
        model_type=export.model_type,
        architecture=export.architecture,
        base_model=base_model,
        base_model_type=c.base_model_type,
        license_line=f"license: {license_id}\n" if license_id else "",
        license_text=f"`{license_id}`, the base model's" if license_id else (
            "not recorded at conversion: the base model's licence applies; see its model card"
        ),
        hf_moe_version=__version__,
        moe_layers_text=moe_layers_text,
        num_experts=c.num_experts,
        top_k=c.num_experts_per_tok,
        normalisation="renormalised to sum to one" if c.norm_topk_prob else "raw softmax weights (not renormalised)",
        intermediate_size=c.moe_intermediate_size,
        total_params=_millions(counts["total"]),
        active_params=_millions(counts["active"]),
        conversion=conversion,
        exactness=exactness,
        dtype=str(model.dtype).removeprefix("torch."),
        path_hint="path/to/this/folder",
        aux_coef=native_config.router_aux_loss_coef,
        extra_notes=notes,
    )
