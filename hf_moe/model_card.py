"""The model card (README.md) written with every save and conversion."""

from __future__ import annotations

import os
import re
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


# A Hub repository id: "namespace/name" (the one-part ids of the oldest models now redirect to such a name).
_HUB_ID = re.compile(r"(?!.*(?:--|\.\.))[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_HUB_CACHE = re.compile(r"models--(?P<org>[\w.-]+?)--(?P<name>[\w.-]+)/snapshots/[^/]+/?")


def hub_model_id(name) -> str | None:
    """`name` as a Hugging Face Hub model id when it names one, else None.

    An id has the Hub's form ("HuggingFaceTB/SmolLM2-135M-Instruct") and is not a path that exists here; a snapshot
    in the Hub cache (`.../models--org--name/snapshots/<hash>`) is that repository's id. Anything else (a local
    directory, a model built from a config) has no id: recording its path as `base_model` would make tools that
    read model cards (llama.cpp's converter, the Hub) link to a repository that does not exist.
    """
    if not isinstance(name, str) or not name:
        return None
    cached = _HUB_CACHE.search(name)
    if cached:
        return f"{cached['org']}/{cached['name']}"
    if os.path.exists(name):
        return None
    return name if _HUB_ID.fullmatch(name) else None


def _base_model_line(conv: dict) -> str:
    """The front matter's `base_model:` line: only for a Hub id, decided at conversion (`base_model_hub_id`, where
    the path could be checked) or, for checkpoints converted before it was recorded, from the name now."""
    hub_id = conv["base_model_hub_id"] if "base_model_hub_id" in conv else hub_model_id(conv.get("base_model"))
    return f"base_model: {hub_id}\n" if hub_id else ""


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
        base_model_line=_base_model_line(conv),
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


def _export_exactness(export) -> str:
    """What the export's check found (`hf_moe.export_native(verify=...)`)."""
    if export.max_abs_logit_diff is None:
        return "the same function as the hf_moe model by construction; not measured at export"
    n, total = export.verified_layers
    where = "the whole model" if n == total else (
        f"its first {n} of {total} decoder layers with the embeddings, final norm and LM head (every layer's tensors "
        "are read by the same names)"
    )
    return (
        f"every tensor equals the hf_moe model's, bit for bit (all {export.tensors_checked} read back after writing); "
        f"loaded with plain transformers, {where} gives the hf_moe model's logits within "
        f"{export.max_abs_logit_diff:.2e} on a random probe ({export.probe}); greedy tokens "
        f"{'equal' if export.same_argmax else 'DIFFER'}"
    )


def render_native_card(config, counts: dict, dtype, native_config, export) -> str:
    """The model card of a native export (`hf_moe.export_native`): `config` is the exported hf_moe model's
    MoEConfig, `counts` its `parameter_counts()`, `dtype` its dtype, `native_config` the native config written, and
    `export` the `NativeExport` (with the measured logit difference)."""
    c = config
    conv = dict(c.moe_conversion or {})
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
    exactness = _export_exactness(export)
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
        base_model_line=_base_model_line(conv),
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
        dtype=str(dtype).removeprefix("torch."),
        path_hint="path/to/this/folder",
        aux_coef=native_config.router_aux_loss_coef,
        extra_notes=notes,
    )
