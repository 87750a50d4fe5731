"""Router initialisation for a merge: mergekit-moe's gate modes, and hf_moe's calibration gates.

mergekit's modes (mergekit 0.1.5, `mergekit/moe/router.py`), reproduced op for op so that a mergekit config gives
the same routers:

    hidden, hidden_last  per layer, the base model's hidden state entering the decoder layer at the last token of each
                         prompt (prompts left-padded with the BOS token, in `hidden_dtype`), averaged over the
                         prompts; negative prompts' average subtracted; the row scaled to unit norm
    hidden_avg           the same with the hidden states averaged over the prompt's tokens (hf_moe averages over
                         the real tokens; mergekit over the padded length, pads included)
    cheap_embed          the sum of the prompts' token embeddings, unit norm, the same row in every layer
    random               N(0, 1); uniform_random: U(-1/sqrt(H), 1/sqrt(H)) (seeded here, unseeded in mergekit)

hf_moe's `calibration` mode (`calibration_rows`): each source's own text runs through the merged model itself, and
at each MoE layer the router's row for expert i is the mean of the MoE block's inputs over source i's tokens, less
the mean over the sources, times one temperature fitted by maximum likelihood so that the router, read as a
classifier of which source a token came from, is calibrated on that text.
"""

from __future__ import annotations

import math

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM

from ..layerwise import layer_inputs, layerwise
from .merge_checks import Source
from .merge_config import MergeConfig


def prompt_tokenizer(path: str):
    """The base model's tokenizer set up as mergekit-moe sets it: left padding with the BOS token (EOS if none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    tokenizer.pad_token_id = tokenizer.bos_token_id
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenize_prompts(prompts: list[str], tokenizer):
    """Each prompt preceded by the BOS token's text, no other special tokens, padded to one length."""
    return tokenizer([(tokenizer.bos_token or "") + p for p in prompts], return_tensors="pt", padding=True,
                     add_special_tokens=False)


def gated_specs(recipe: MergeConfig):
    """The experts that get a router row: the routed ones, then the shared one where it is gated (qwen) or the
    mode draws rows for every expert (random), as mergekit does."""
    specs = list(recipe.experts)
    shared = recipe.shared
    if shared is not None and (shared.positive_prompts or recipe.gate_mode in ("random", "uniform_random")):
        specs.append(recipe.shared)
    return specs


def prompt_gates(recipe: MergeConfig, base: Source, dtype: torch.dtype) -> torch.Tensor:
    """[L, G, H] router rows of every decoder layer for the G experts of `gated_specs`, by mergekit's gate modes."""
    config = base.config.get_text_config()
    num_layers, hidden = config.num_hidden_layers, config.hidden_size
    specs = gated_specs(recipe)
    generator = torch.Generator().manual_seed(recipe.seed)
    if recipe.gate_mode == "random":
        return torch.randn((num_layers, len(specs), hidden), generator=generator)
    if recipe.gate_mode == "uniform_random":
        scale = math.sqrt(1.0 / hidden)
        return torch.rand((num_layers, len(specs), hidden), generator=generator) * 2 * scale - scale
    tokenizer = prompt_tokenizer(recipe.base_model)
    if recipe.gate_mode == "cheap_embed":
        embed = _input_embedding(base)
        rows_of = lambda batch: _cheap_embedding(embed, batch, num_layers)  # noqa: E731
    else:
        hidden_dtype = getattr(torch, recipe.hidden_dtype)
        rows_of = _HiddenStates(base, hidden_dtype, average=recipe.gate_mode == "hidden_avg")
    rows = []
    for spec in specs:
        vector = rows_of(tokenize_prompts(spec.positive_prompts or [], tokenizer))
        if spec.negative_prompts:
            vector -= rows_of(tokenize_prompts(spec.negative_prompts, tokenizer))
        vector /= vector.norm(p=2, dim=-1, keepdim=True).clamp(min=1e-8)
        rows.append(vector)
    return torch.stack(rows, dim=1)  # [L, G, H]


def _input_embedding(base: Source) -> torch.Tensor:
    with init_empty_weights(include_buffers=False):
        meta = AutoModelForCausalLM.from_config(base.config)
    name = next(n for n, p in meta.named_parameters() if p is meta.get_input_embeddings().weight)
    return base.tensors.read(base.names[name])


def _cheap_embedding(embed: torch.Tensor, batch, num_layers: int) -> torch.Tensor:
    """[L, H]: the unit-norm sum of the prompts' token embeddings (pads masked), for every layer."""
    onehot = torch.nn.functional.one_hot(batch["input_ids"], num_classes=embed.shape[0])
    h = onehot.float() @ embed.float()
    summed = (h * batch["attention_mask"].unsqueeze(-1)).sum(dim=1).sum(dim=0, keepdim=True)
    return (summed / summed.norm(dim=-1, keepdim=True).clamp(min=1e-8)).repeat(num_layers, 1)


class _HiddenStates:
    """The base model's hidden states entering each decoder layer on a batch of prompts, read layer by layer."""

    def __init__(self, base: Source, dtype: torch.dtype, average: bool):
        from ..dense_mlp import find_decoder_layers

        with init_empty_weights(include_buffers=False):
            self.model = AutoModelForCausalLM.from_config(base.config, dtype=dtype).eval()
        self.layers_path, self.layers = find_decoder_layers(self.model)
        self.base, self.dtype, self.average = base, dtype, average

    @torch.no_grad()
    def __call__(self, batch) -> torch.Tensor:
        """[L, H] in `dtype`: per layer, the mean over prompts of the last (or mean) token's hidden state."""
        store: dict[int, torch.Tensor] = {}
        handles = layer_inputs(self.layers, store)
        read = lambda key: self.base.tensors.read(self.base.names[key])  # noqa: E731
        try:
            with layerwise(self.model, self.layers_path, read, self.dtype):
                self.model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                      use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        states = torch.stack([store[i] for i in range(len(self.layers))])  # [L, B, T, H]
        if self.average:
            mask = batch["attention_mask"].to(states.dtype)[None, :, :, None]
            states = (states * mask).sum(dim=2) / mask.sum(dim=2)
        else:
            states = states[:, :, -1, :]
        return states.sum(dim=1) / states.shape[1]


# --------------------------------------------------------------------------------------------------------------
# Calibration gates
# --------------------------------------------------------------------------------------------------------------
def domain_means(x: torch.Tensor, labels: torch.Tensor, num: int) -> torch.Tensor:
    """[num, H] fp32: the mean of the rows of `x` [N, H] with each label in 0..num-1 (zero for an absent label)."""
    sums = torch.zeros(num, x.shape[1], dtype=torch.float32).index_add_(0, labels, x.float())
    counts = torch.bincount(labels, minlength=num).clamp_min(1).unsqueeze(1)
    return sums / counts


@torch.no_grad()
def calibration_rows(x: torch.Tensor, labels: torch.Tensor, num: int, max_scale_logit: float = 30.0) -> torch.Tensor:
    """Router rows [num, H] for `num` experts from MoE-block inputs `x` [N, H] of known source `labels` [N].

    Row i is s * (mu_i - mean_j mu_j), mu_i the mean input over source i's tokens. Subtracting the common mean
    changes no routing decision (softmax is shift invariant) and keeps the rows small. The scalar s maximises the
    log-likelihood of the labels under softmax(x W^T): the sharpness is the one the data supports, not an arbitrary
    norm. It is found by Newton's method (the log-likelihood is concave in s), capped where the largest logit
    would exceed `max_scale_logit`.
    """
    x = x.float()
    means = domain_means(x, labels, num)
    rows = means - means.mean(dim=0, keepdim=True)
    z = x @ rows.t()  # [N, num]
    spread = z.std().item()
    if not spread > 0:
        return rows
    cap = max_scale_logit / z.abs().max().item()
    s = min(1.0 / spread, cap)
    own = z.gather(1, labels.unsqueeze(1)).squeeze(1)
    for _ in range(50):
        p = (s * z).softmax(dim=-1)
        mean = (p * z).sum(-1)
        grad = (own - mean).mean().item()
        curvature = ((p * z * z).sum(-1) - mean * mean).mean().item()
        if curvature <= 0:
            break
        step = grad / curvature
        s = min(max(s + step, s / 4), cap)
        if abs(step) < 1e-6 * s or s >= cap:
            break
    return s * rows
