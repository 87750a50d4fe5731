"""Summaries of a saved MoE checkpoint, read from its config and safetensors headers (no weights loaded)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint import EXPERT_KEY, INDEX_NAME, load_tokenizer, read_index, read_json, reading, validate_checkpoint
from .checkpoint.headers import read_header
from .inputs import token_ids
from .model_card import block_diff_text


@dataclass
class ShardInfo:
    filename: str
    num_tensors: int = 0
    num_bytes: int = 0
    experts: set[int] = field(default_factory=set)


@dataclass
class CheckpointSummary:
    config: dict
    total_params: int
    expert_params: int
    shards: list[ShardInfo]

    @property
    def active_params(self) -> int:
        c = self.config
        routed = self.expert_params * c["num_experts_per_tok"] // c["num_experts"]
        return self.total_params - self.expert_params + routed


def summarize_checkpoint(directory: str | Path) -> CheckpointSummary:
    """Validate the directory (nothing outside it is read), then count parameters and describe each file."""
    directory = Path(directory)
    with reading(directory):  # (a save into it meanwhile waits)
        validate_checkpoint(directory)
        config = read_json(directory, "config.json", "the checkpoint")
        weight_map, _ = read_index(directory)
        headers = {name: read_header(directory, name, INDEX_NAME)[0] for name in sorted(set(weight_map.values()))}
    shards: dict[str, ShardInfo] = {}
    total = expert = 0
    for filename, header in headers.items():
        info = shards[filename] = ShardInfo(filename)
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            numel = math.prod(meta["shape"])
            begin, end = meta["data_offsets"]
            info.num_tensors += 1
            info.num_bytes += end - begin
            total += numel
            match = EXPERT_KEY.match(key)
            if match:
                expert += numel
                info.experts.add(int(match["expert"]))
    return CheckpointSummary(config, total, expert, list(shards.values()))


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def _size(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    raise AssertionError


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _weighting(config: dict) -> str:
    """How the chosen experts' outputs are combined."""
    if config.get("router_weights") == "unit":
        return "unit weights"
    return "renormalised weights" if config["norm_topk_prob"] else "softmax weights"


def _shared(config: dict) -> str:
    shared = config.get("num_shared_experts") or 0
    if not shared:
        return ""
    return f", + {shared} shared (intermediate {config['shared_expert_intermediate_size']} each)"


def format_summary(summary: CheckpointSummary, directory: str | Path) -> str:
    c = summary.config
    num_layers = c.get("num_hidden_layers") or c.get("n_layer")
    conv = c.get("moe_conversion") or {}
    lines = [
        f"hf_moe checkpoint: {directory}",
        f"  base model       {conv.get('base_model', '?')} "
        f"({c['base_model_type']}, {c.get('architectures', ['?'])[0]})",
        f"  MoE layers       {len(c['moe_layers'])} of {num_layers}: {_ranges(c['moe_layers'])}",
        f"  experts          {c['num_experts']} per MoE layer, top-{c['num_experts_per_tok']} ({_weighting(c)})"
        f"{_shared(c)}",
        f"  expert MLP       {'GLU' if c['expert_glu'] else 'plain'}, {c['expert_hidden_act']}, "
        f"intermediate {c['moe_intermediate_size']}{', biases' if c['expert_bias'] else ''}",
        f"  parameters       {_count(summary.total_params)} total, {_count(summary.active_params)} active per token "
        f"({_count(summary.expert_params)} in experts)",
        f"  dtype            {c.get('dtype', '?')}",
        "  shard layout",
        f"    {'file':<44} {'tensors':>7} {'size':>10}  holds",
    ]
    for shard in summary.shards:
        holds = (
            f"expert {_ranges(sorted(shard.experts))} of every MoE layer"
            if shard.experts
            else "non-expert tensors (embeddings, attention, norms, routers, head)"
        )
        lines.append(f"    {shard.filename:<44} {shard.num_tensors:>7} {_size(shard.num_bytes):>10}  {holds}")
    options = ", ".join(f"{k}={v}" for k, v in sorted((conv.get("options") or {}).items()))
    method = f"{conv.get('method')}{f' ({options})' if options else ''}"
    if "max_abs_logit_diff" in conv:
        lines.append(
            f"  conversion       {method}: max |logit - dense logit| = {conv['max_abs_logit_diff']:.2e} on a "
            "random probe"
        )
    elif "max_abs_block_diff" in conv:
        lines.append(f"  conversion       {method}: max |MoE block - dense MLP| = {block_diff_text(conv)} per layer")
    elif "max_abs_expert_diff" in conv:
        lines.append(
            f"  conversion       {method}: every expert within {conv['max_abs_expert_diff']:.2e} of its source MLP"
        )
    elif conv:
        lines.append(f"  conversion       {method}")
    return "\n".join(lines)



# --------------------------------------------------------------------------------------------------------------
# Routing over a text file
# --------------------------------------------------------------------------------------------------------------
def _read_ids(tokenizer, data_file: Path, max_tokens: int) -> list[int]:
    """The first `max_tokens` tokens of the file, read and tokenized piece by piece until there are that many (the
    rest of the file is never read: `hf_moe.inputs.token_ids`)."""
    if not data_file.is_file():
        raise FileNotFoundError(f"--data {data_file}: no such file.")
    ids = token_ids(data_file, tokenizer, max_tokens, "--data", records=False)
    if not ids:
        raise ValueError(f"{data_file} has no text to route.")
    return ids


def _route_files(directory, data_files, max_tokens: int, block_size: int):
    """(config, {file: (RoutingStats, first-choice counts [layers, E], tokens)}) of the saved model over each file."""
    import torch

    from .modeling import MoEForCausalLM
    from .routing import RoutingStats

    files = [Path(f) for f in ([data_file for data_file in data_files] if isinstance(data_files, (list, tuple))
                               else [data_files])]
    for name, value in (("max_tokens", max_tokens), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"--data {f}: no such file.")
    model = MoEForCausalLM.from_pretrained(directory).eval()
    try:
        tokenizer = load_tokenizer(directory)
    except Exception as err:  # noqa: BLE001 - no tokenizer, or one that does not load
        raise FileNotFoundError(f"{directory} has no tokenizer to read {files[0]} with ({err}).") from None
    layers, experts = len(model.config.moe_layers), model.config.num_experts
    zero = torch.zeros(())
    out = {}
    for f in files:
        ids = _read_ids(tokenizer, f, max_tokens)
        stats = RoutingStats(layers, experts, torch.device("cpu"))
        first = torch.zeros(layers, experts, dtype=torch.float64)
        with torch.no_grad():
            for start in range(0, len(ids), block_size):
                with model.base_model.router_recorder.recording() as routings:
                    model(torch.tensor([ids[start : start + block_size]]))
                for layer, routing in enumerate(routings):
                    stats.add(layer, routing, None, zero)
                    if routing.top_k_index is not None:
                        choice = routing.top_k_index[:, 0]
                        first[layer] += torch.bincount(choice[choice >= 0], minlength=experts).double()
        out[str(f)] = (stats, first, len(ids))
    return model.config, out


def routing_summary(directory: str | Path, data_file, max_tokens: int = 4096, block_size: int = 256):
    """Run the saved model (eval mode) over the first `max_tokens` tokens of a text file (or of each of several) and
    summarise, per MoE layer, how its router spread them (see `RoutingStats.summary`). Returns (config, summary,
    tokens read)."""
    config, per_file = _route_files(directory, data_file, max_tokens, block_size)
    stats = list(per_file.values())
    total = stats[0][0]
    for other, _, _ in stats[1:]:
        for name in total._TENSORS:
            setattr(total, name, getattr(total, name) + getattr(other, name))
        total.forwards += other.forwards
    return config, total.summary(), sum(n for _, _, n in stats)


def domain_routing(directory: str | Path, data_files: list, max_tokens: int = 4096, block_size: int = 256):
    """Which expert each domain's tokens go to: (config, {file: ([layers, E] shares of the tokens' first choices,
    tokens)}), one file per domain."""
    config, per_file = _route_files(directory, list(data_files), max_tokens, block_size)
    shares = {}
    for name, (_, first, tokens) in per_file.items():
        shares[name] = ((first / first.sum(1, keepdim=True).clamp_min(1)).tolist(), tokens)
    return config, shares


def format_domain_routing(config, shares: dict) -> str:
    """Per MoE layer and domain: the share (%) of the domain's tokens whose first choice is each expert, and the
    expert most of them go to (named by its source model for a merged model)."""
    experts = config.num_experts
    shown = min(experts, 16)
    recipe = (config.moe_conversion or {}).get("recipe") or {}
    names = [Path(e.get("source_model", "")).name for e in recipe.get("experts", [])]
    width = max(12, *(len(Path(f).name) for f in shares))
    head = " ".join(f"{f'e{e}':>5}" for e in range(shown)) + (" ..." if experts > shown else "")
    lines = [
        "routing by domain: share (%) of each domain's tokens whose first choice is each expert"
        + (f" (experts: {', '.join(f'e{i}={n}' for i, n in enumerate(names))})" if names else ""),
        f"{'layer':>5} {'domain':<{width}} {head}  top",
    ]
    for index, layer in enumerate(config.moe_layers):
        for name, (per_layer, _) in shares.items():
            row = per_layer[index]
            top = max(range(experts), key=row.__getitem__)
            label = f"e{top}" + (f" ({names[top]})" if top < len(names) else "")
            cells = " ".join(f"{100 * v:5.1f}" for v in row[:shown]) + (" ..." if experts > shown else "")
            lines.append(f"{layer:>5} {Path(name).name:<{width}} {cells}  {label} {100 * row[top]:.0f}%")
    tokens = ", ".join(f"{Path(n).name} {t}" for n, (_, t) in shares.items())
    lines.append(f"tokens read: {tokens}")
    return "\n".join(lines)


def format_routing(config, summary: list[dict], num_tokens: int) -> str:
    """A layers x experts table of load shares (%), with max/mean, CV, drops and entropy per layer."""
    experts = config.num_experts
    shown = min(experts, 16)
    head = " ".join(f"{f'e{e}':>5}" for e in range(shown)) + (" ..." if experts > shown else "")
    lines = [
        f"routing of {num_tokens} tokens (eval mode; router {config.router_type}, top-{config.num_experts_per_tok}, "
        f"uniform share {100 / experts:.1f}%)",
        f"{'layer':>5} {head}  {'max/mean':>8} {'cv':>6} {'dropped':>7} {'entropy':>7}",
    ]
    for layer, values in zip(config.moe_layers, summary):
        shares = " ".join(f"{100 * s:5.1f}" for s in values["load"][:shown]) + (" ..." if experts > shown else "")
        lines.append(
            f"{layer:>5} {shares}  {values['load_max_over_mean']:8.2f} {values['load_cv']:6.2f} "
            f"{100 * values['drop_fraction']:6.1f}% {values['router_entropy']:7.3f}"
        )
    return "\n".join(lines)


def save_heatmap(config, summary: list[dict], path: str | Path) -> None:
    """Layers x experts heatmap of the load shares, as a PNG (needs matplotlib: pip install hf-moe[plot])."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("The routing heatmap needs matplotlib: `pip install hf-moe[plot]`.") from None
    shares = [[100 * s for s in values["load"]] for values in summary]
    fig, ax = plt.subplots(figsize=(max(4, 0.4 * config.num_experts + 2), max(3, 0.3 * len(shares) + 1.5)))
    image = ax.imshow(shares, aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(shares)), [str(i) for i in config.moe_layers])
    ax.set_title(f"tokens per expert (%), uniform = {100 / config.num_experts:.1f}%")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
