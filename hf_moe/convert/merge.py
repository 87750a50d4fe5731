"""`merge_to_moe`: several dense fine-tunes of one base model -> one hf_moe MoE checkpoint (mergekit-moe, BTX).

Expert i of every MoE layer is source model i's MLP (times its `residual_scale`, plus its `noise_scale` noise); a
shared expert, if any, is its source's MLP, always on (deepseek) or scaled by sigmoid(x . g) (qwen). Everything
else (attention, norms, embeddings, head, and the MLPs of layers left dense) comes from the base model (mergekit) or
is the mean over the experts' source models (`non_expert_weights: average`, Branch-Train-MiX). The routers come
from the gate mode (see `merge_gates`).

The merge streams, as `convert_checkpoint` does (hf_moe/convert/stream.py, whose reader and writer it uses): the
output files are laid out first; then each tensor is read from its source, one at a time (an average: one source's
copy at a time, summed in fp64), and written at its place. An expert is one MLP of one layer of one source. Gates
that need a forward (hidden states, calibration) run the model with one decoder layer in memory at a time
(`hf_moe.layerwise`); calibration gates run the merged model itself, read back from the files just written. Peak
memory is one MLP (or one MoE layer while calibrating) plus the embeddings, whatever the number and size of the
sources. Nothing is written where the recipe or the sources are wrong: every check (`merge_checks`) runs first.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import torch
from accelerate import init_empty_weights
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig

from ..checkpoint import checkpoint_state_dict, resolve_output_directory, same_directory, staging_directory
from ..checkpoint.layout import plan_shards
from ..checkpoint.save import finish
from ..compat import convert_file_size_to_int
from ..configuration import MoEConfig
from ..dense_mlp import DenseMLP, NonFiniteWeightsError, all_finite, find_decoder_layers, find_mlp
from ..modeling import MoEForCausalLM
from .api import OPTIONS, ROUTER_DEFAULTS, _dtype, _license, _select_layers, moe_fields
from .merge_checks import Source, localize, open_sources
from .merge_config import MergeConfig, MergeConfigError, load_merge_config
from .merge_calibration import calibrate
from .merge_gates import gated_specs, prompt_gates
from .stream import _cast_dtype, _check_same_kind, _read_mlp, _ShardWriter

RECIPE_FILE = "hf_moe_merge.yml"


def merge_to_moe(recipe, out: str | os.PathLike, *, max_shard_size: int | str = "5GB", progress: bool = True,
                 **overrides) -> MoEForCausalLM:
    """Merge the dense models of `recipe` into one MoE checkpoint in directory `out`.

    Args:
        recipe: a mergekit-moe YAML file (hf_moe's fields allowed beside mergekit's), its content as a dict, or a
            `MergeConfig` (see `hf_moe.convert.merge_config`).
        out: the output directory, written atomically (it appears only when complete).
        max_shard_size: of the non-expert files (each expert has its own file(s)).
        **overrides: top-level recipe fields to replace (`gate_mode="calibration"`).
    Returns:
        The MoE model on the meta device (config, parameter counts; no weights): load the checkpoint with
        `MoEForCausalLM.from_pretrained(out)`.
    Raises:
        MergeConfigError, MergeSourceError (both ValueError): a malformed recipe, or sources of another architecture,
            shape, vocabulary or tokenizer, before any weight is read.
    """
    recipe = localize(load_merge_config(recipe, **overrides))
    for path in recipe.sources():
        if same_directory(path, out):
            raise MergeConfigError(f"The output directory {out} is the source model {path}: choose another one.")
    dtype = _output_dtype(recipe)
    sources = open_sources(recipe, dtype)
    base = sources[recipe.base_model]
    dtype = dtype or base.tensors.float_dtype()
    plan = _Plan(recipe, sources, dtype, convert_file_size_to_int(max_shard_size))
    target = resolve_output_directory(out, "Cannot write the merged model to")
    rows = prompt_gates(recipe, base, dtype) if recipe.gate_mode != "calibration" else None  # before writing

    with staging_directory(target) as staging, _ShardWriter(staging, plan.shards, plan.layout) as writer:
        total = sum(math.prod(s) * d.itemsize for d, s in plan.layout.values())
        with tqdm(total=total, unit="B", unit_scale=True, desc="Merging", disable=not progress) as bar:
            writer.on_write = bar.update
            plan.write_non_experts(writer)
            plan.write_experts(writer, progress)
            plan.write_zeros(writer)
            if rows is None:
                routers, shared_gates = calibrate(plan, writer, progress)
            else:
                routers, shared_gates = plan.rows_from(rows)
            plan.write_routers(writer, routers, shared_gates)
        writer.close()
        _save_extras(recipe, base, staging)
        finish(plan.moe, staging, target, [writer.weight_map])
    return plan.moe


def _output_dtype(recipe: MergeConfig) -> torch.dtype | None:
    """mergekit's choice: the recipe's dtype, else the base model's config dtype (else the files' own)."""
    if recipe.dtype is not None:
        return _dtype(recipe.dtype)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(recipe.base_model) if os.path.isdir(recipe.base_model) else None
    return _dtype(getattr(config, "dtype", None)) if config is not None else None


def _save_extras(recipe: MergeConfig, base: Source, staging: Path) -> None:
    """The base model's tokenizer and generation config, and the recipe, beside the weights."""
    import yaml
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(recipe.base_model).save_pretrained(staging)
    except (OSError, ValueError):  # a model without a tokenizer is still a model
        pass
    (staging / RECIPE_FILE).write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))


class _Plan:
    """What goes where: the merged model's config and layout, and which source gives each tensor."""

    def __init__(self, recipe: MergeConfig, sources: dict[str, Source], dtype: torch.dtype, max_bytes: int):
        self.recipe, self.sources, self.dtype = recipe, sources, dtype
        self.base = sources[recipe.base_model]
        base_config = self.base.config
        with torch.device("meta"):
            dense = AutoModelForCausalLM.from_config(base_config, dtype=dtype)
        self.layers_path, self.decoder_layers = find_decoder_layers(dense)
        self.moe_layers = _select_layers(recipe.layers, recipe.every, len(self.decoder_layers))
        self.spec = find_mlp(self.decoder_layers[self.moe_layers[0]])
        first = self.read_mlp(recipe.base_model, self.moe_layers[0])
        self.first_kind = first.kind
        self._experts = None  # a one-expert `Experts` that checks each expert written (`_check_expert`)
        self.config = self._config(first)
        with torch.device("meta"):  # (the layout: tied weights tied)
            dense_twin = AutoModelForCausalLM.from_config(base_config, dtype=dtype)
            self.moe = MoEForCausalLM.from_dense(dense_twin, self.config, None)
        if (Path(recipe.base_model) / "generation_config.json").is_file():
            self.moe.generation_config = GenerationConfig.from_pretrained(recipe.base_model)
        self.prefix = {i: f"{self.layers_path}.{i}.{self.config.moe_block_path}." for i in self.moe_layers}
        keep_fp32 = set(getattr(dense, "_keep_in_fp32_modules", None) or ())
        self.layout, self.copied, self.block_keys = {}, [], {}
        for key, meta in checkpoint_state_dict(self.moe).items():
            owner = next((i for i, p in self.prefix.items() if key.startswith(p)), None)
            if owner is not None:
                self.block_keys[key] = owner
                dtype_ = dtype if meta.dtype.is_floating_point else meta.dtype
                self.layout[key] = (dtype_, meta.shape)
            elif key in self.base.names:
                src_dtype, shape = self.base.tensors.dtype_shape(self.base.names[key])
                self.layout[key] = (_cast_dtype(key, src_dtype, dtype, keep_fp32), shape)
                self.copied.append(key)
            else:
                raise MergeConfigError(f"the merged model has a tensor {key!r} that the base model does not hold.")
        meta = {k: torch.empty(s, dtype=d, device="meta") for k, (d, s) in self.layout.items()}
        self.shards = plan_shards(meta, max_bytes)

    def _config(self, first: DenseMLP):
        r = self.recipe
        router_type = r.router.get("router_type", "topk")
        opts = {**OPTIONS, **ROUTER_DEFAULTS.get(router_type, {}), **r.router, "seed": r.seed,
                "num_shared_experts": 1 if r.shared is not None else 0}
        config = MoEConfig.from_base(self.base.config, **moe_fields(
            len(r.experts), r.experts_per_token, "merge", opts, self.moe_layers, first, self.layers_path, self.spec,
            source=r.base_model, license=_license(r.base_model),
        ))
        config.shared_expert_gate = r.shared_expert_gate
        config.moe_conversion["options"] = {
            "gate_mode": r.gate_mode, "architecture": r.architecture or "mixtral",
            "non_expert_weights": r.non_expert_weights, "experts": ", ".join(e.source_model for e in r.experts),
            **({"shared_expert": r.shared.source_model} if r.shared is not None else {}),
            **{k: v for k, v in config.moe_conversion["options"].items() if k not in ("num_shared_experts", "seed")},
        }
        config.moe_conversion["recipe"] = r.to_dict()
        config._validate_moe()
        return config

    def runnable_model(self) -> MoEForCausalLM:
        """The merged model with its parameters on the meta device and its buffers (rotary frequencies) real, for a
        forward whose weights `hf_moe.layerwise` reads layer by layer."""
        with init_empty_weights(include_buffers=False):
            dense = AutoModelForCausalLM.from_config(self.base.config, dtype=self.dtype)
            return MoEForCausalLM.from_dense(dense, self.config, None).eval()

    # ---------------------------------------------------------------------------------------------------------- read
    def read_mlp(self, path: str, layer: int) -> DenseMLP:
        source = self.sources[path]
        try:
            return _read_mlp(source.tensors, source.names, self.decoder_layers[layer], self.spec, self.layers_path,
                             layer, self.dtype, source.config)
        except NonFiniteWeightsError as err:
            raise MergeConfigError(f"{path}, layer {layer}: {err} Nothing was written.") from None

    def expert_mlp(self, spec, layer: int, generator: torch.Generator) -> DenseMLP:
        """Source MLP of `spec` at `layer`, with mergekit's noise_scale (every weight) and residual_scale (down)."""
        mlp = self.read_mlp(spec.source_model, layer)
        _check_same_kind(self.first_kind, mlp, layer)
        for name in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias"):
            t = getattr(mlp, name)
            if t is None:
                continue
            if spec.noise_scale is not None:
                t = t + (torch.randn(t.shape, generator=generator) * spec.noise_scale).to(t.dtype)
            if spec.residual_scale is not None and name in ("down", "down_bias"):
                t = t * spec.residual_scale
            setattr(mlp, name, t)
        return mlp

    # --------------------------------------------------------------------------------------------------------- write
    def write_non_experts(self, writer: _ShardWriter) -> None:
        """Attention, norms, embeddings, head and dense layers' MLPs: the base model's, or the experts' mean."""
        average = self.recipe.non_expert_weights == "average"
        paths = [e.source_model for e in self.recipe.experts]
        for key in self.copied:
            dtype = self.layout[key][0]
            if not average or not dtype.is_floating_point:
                writer.write(key, self.base.tensors.read(self.base.names[key]).to(dtype))
                continue
            total = None
            for path in paths:  # one source's copy in memory at a time, summed exactly in fp64
                source = self.sources[path]
                value = source.tensors.read(source.names[key]).to(torch.float64)
                total = value if total is None else total.add_(value)
            writer.write(key, (total / len(paths)).to(dtype))

    def write_experts(self, writer: _ShardWriter, progress: bool = True) -> None:
        """Expert e of every MoE layer from source e's MLP (and the shared expert from its source's)."""
        generator = torch.Generator().manual_seed(self.recipe.seed)
        for i in tqdm(self.moe_layers, desc=f"Merging {len(self.moe_layers)} MLPs of {len(self.recipe.experts)} models",
                      leave=False, disable=not progress):
            for e, spec in enumerate(self.recipe.experts):
                mlp = self.expert_mlp(spec, i, generator)
                for name, tensor in _expert_tensors(mlp, self.config).items():
                    tensor = _check_finite(tensor.to(self.dtype), spec, f"experts[{e}]", i, name)
                    writer.write(f"{self.prefix[i]}experts.{e}.{name}", tensor)
                self._check_expert(writer, i, e, mlp)
                del mlp
            if self.recipe.shared is not None:
                mlp = self.expert_mlp(self.recipe.shared, i, generator)
                for name, tensor in _shared_tensors(mlp, self.config).items():
                    tensor = _check_finite(tensor.to(self.dtype), self.recipe.shared, "shared_experts[0]", i, name)
                    writer.write(f"{self.prefix[i]}shared_experts.{name}", tensor)

    @torch.no_grad()
    def _check_expert(self, writer: _ShardWriter, layer: int, e: int, mlp: DenseMLP) -> None:
        """Expert e of `layer` as hf_moe's `Experts` computes it from the bytes just written, against the source MLP
        on 16 random hidden states: the largest gap goes into `config.moe_conversion` (`max_abs_expert_diff`)."""
        from ..layers.experts import Experts
        from ..dense_mlp import expert_forward

        if self._experts is None:
            one = copy.deepcopy(self.config)
            one.num_experts = one.num_experts_per_tok = 1
            self._experts = Experts(one).eval()
        for name, _ in list(self._experts.named_parameters()):
            value = writer.read(f"{self.prefix[layer]}experts.{e}.{name}")
            self._experts._parameters[name] = torch.nn.Parameter(value[None], requires_grad=False)
        x = torch.randn(16, mlp.hidden_size, generator=torch.Generator().manual_seed(layer)).to(self.dtype)
        ones = torch.ones(16, 1, dtype=self.dtype)
        got = self._experts(x, torch.zeros(16, 1, dtype=torch.int64), ones).float()
        expected = expert_forward(mlp, x).float()
        gap, size = (got - expected).abs().max().item(), expected.abs().max().item()
        if not (math.isfinite(gap) and math.isfinite(size)):  # (max(0.0, nan) is 0.0: NaN must not pass as a match)
            spec = self.recipe.experts[e]
            raise MergeConfigError(
                f"experts[{e}] ({spec.source_model}) computes non-finite outputs at layer {layer} on a random probe "
                f"(max |output| {size:g}){_scales(spec)}: nothing was written. Lower the scales, or check the source's "
                "weights."
            )
        conv = self.config.moe_conversion
        conv["max_abs_expert_diff"] = max(conv.get("max_abs_expert_diff", 0.0), gap)
        conv["max_abs_mlp_output"] = max(conv.get("max_abs_mlp_output", 0.0), size)

    def router_keys(self, layer: int) -> tuple[str, str | None]:
        gate = f"{self.prefix[layer]}gate.weight"
        shared = f"{self.prefix[layer]}shared_expert_gate.weight" if self.config.shared_expert_gate else None
        return gate, shared

    def write_zeros(self, writer: _ShardWriter) -> None:
        """The routers' other tensors (a noisy router's noise weight, aux_free's bias): zeros, as a fresh router."""
        routers = {k for i in self.moe_layers for k in self.router_keys(i) if k}
        for key in self.block_keys:
            if key in writer.pending and key not in routers:
                dtype, shape = self.layout[key]
                writer.write(key, torch.zeros(shape, dtype=dtype))

    def rows_from(self, rows: torch.Tensor):
        """Router weights [E, H] and shared-expert gate rows [1, H] per MoE layer from [L, G, H] gate rows."""
        experts = len(self.recipe.experts)
        gated = len(gated_specs(self.recipe)) > experts
        routers = {i: rows[i, :experts] for i in self.moe_layers}
        shared = {i: rows[i, experts:experts + 1] if gated else None for i in self.moe_layers}
        return routers, shared

    def write_routers(self, writer: _ShardWriter, routers: dict, shared_gates: dict) -> None:
        for i in self.moe_layers:
            gate_key, shared_key = self.router_keys(i)
            writer.write(gate_key, routers[i].to(self.dtype).contiguous())
            if shared_key is not None:
                row = shared_gates.get(i)
                row = torch.zeros(self.layout[shared_key][1]) if row is None else row
                writer.write(shared_key, row.to(self.dtype).contiguous())


def _scales(spec) -> str:
    scales = [f"{n}={getattr(spec, n):g}" for n in ("noise_scale", "residual_scale") if getattr(spec, n) is not None]
    return f" with {', '.join(scales)}" if scales else ""


def _check_finite(tensor: torch.Tensor, spec, where: str, layer: int, name: str) -> torch.Tensor:
    """`tensor`, an expert's tensor as it is written, after checking that it holds only finite numbers (else nothing is
    written: the error says why)."""
    if all_finite(tensor):
        return tensor
    bad = int((~torch.isfinite(tensor)).sum())
    raise MergeConfigError(
        f"{where} ({spec.source_model}): its {name} at layer {layer} would hold {bad} NaN or infinite value(s) of "
        f"{tensor.numel()} in {str(tensor.dtype).removeprefix('torch.')}{_scales(spec)}: nothing was written. "
        "Lower the scales (or choose a wider dtype), or check the source model's weights."
    )


def _expert_tensors(mlp: DenseMLP, config) -> dict[str, torch.Tensor]:
    """One expert's on-disk tensors (hf_moe's fused layout: gate rows before up rows)."""
    rows = mlp.up.shape[0]
    zeros = lambda n, like: like.new_zeros(n)  # noqa: E731
    out = {"gate_up_proj": torch.cat([mlp.gate, mlp.up])} if config.expert_glu else {"up_proj": mlp.up}
    out["down_proj"] = mlp.down
    if config.expert_bias:
        gate_b = mlp.gate_bias if mlp.gate_bias is not None else zeros(rows, mlp.up)
        up_b = mlp.up_bias if mlp.up_bias is not None else zeros(rows, mlp.up)
        if config.expert_glu:
            out["gate_up_proj_bias"] = torch.cat([gate_b, up_b])
        else:
            out["up_proj_bias"] = up_b
        out["down_proj_bias"] = mlp.down_bias if mlp.down_bias is not None else zeros(mlp.down.shape[0], mlp.down)
    return out


def _shared_tensors(mlp: DenseMLP, config) -> dict[str, torch.Tensor]:
    """The shared expert's on-disk tensors (`SharedExperts`: gate_proj/up_proj/down_proj Linear layers)."""
    out = {"up_proj.weight": mlp.up, "down_proj.weight": mlp.down}
    if config.expert_glu:
        out["gate_proj.weight"] = mlp.gate
    if config.expert_bias:
        rows = mlp.up.shape[0]
        out["up_proj.bias"] = mlp.up_bias if mlp.up_bias is not None else mlp.up.new_zeros(rows)
        out["down_proj.bias"] = mlp.down_bias if mlp.down_bias is not None else mlp.down.new_zeros(mlp.down.shape[0])
        if config.expert_glu:
            out["gate_proj.bias"] = mlp.gate_bias if mlp.gate_bias is not None else mlp.up.new_zeros(rows)
    return out
