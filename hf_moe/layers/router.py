"""Routers ("gates" in FastMoE): score each token against every expert and decide who computes it.

Select one with `MoEConfig.router_type` (or `convert_to_moe(..., router_type=...)`). Built-ins:

    topk           softmax over experts, top-k, optionally renormalised (Mixtral, Qwen3-MoE)
    noisy_topk     learned Gaussian noise on the logits in training (Shazeer et al., 2017)
    switch         top-1 with multiplicative input jitter in training (Switch Transformer)
    gshard         top-2; the second expert is kept with probability 2 * its weight in training (GShard)
    prototype      experts split into Z prototypes, top-(k/Z) inside each (M6-T expert prototyping)
    expert_choice  each expert picks its top-C tokens (Zhou et al., 2022); token choice when not training
    aux_free       sigmoid scores + a per-expert selection bias moved toward balance after each optimizer step
                   (DeepSeek-V3)

Every token-choice router honours `capacity_factor` (`eval_capacity_factor` outside training): an expert takes
at most C = ceil(factor * N * k / E) of the N*k (token, slot) pairs, first choices first, then tokens in order.
The rest are dropped: they contribute zero and the residual connection carries the token. Dropless (no factor)
is the default.

Outside training, `router_skip_threshold` > 0 skips a chosen expert whose weight is below that fraction of the
token's largest weight (dynamic skipping, Lu et al. 2024): its slot becomes -1, so it is not computed
(`skip_small_weights`).

Register your own with `@register_router("name")` on a `Router` subclass; the built-ins use the same registry.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
from torch import nn

from ..compat import init

ROUTERS: dict[str, type[Router]] = {}


def register_router(name: str, *, override: bool = False):
    """Class decorator: make a `Router` subclass selectable as `router_type=name`."""

    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, Router)):
            raise TypeError(f"@register_router({name!r}) must decorate a subclass of hf_moe.Router, got {cls!r}.")
        if name in ROUTERS and ROUTERS[name] is not cls and not override:
            raise ValueError(f"A router named {name!r} is already registered ({ROUTERS[name].__name__}).")
        ROUTERS[name] = cls
        cls.router_type = name
        return cls

    return wrap


def build_router(config) -> Router:
    name = config.router_type
    if name not in ROUTERS:
        raise ValueError(
            f"Unknown router_type {name!r}. Registered routers: {', '.join(sorted(ROUTERS))}. A custom router must "
            "be registered (@hf_moe.register_router) before the model is built or loaded."
        )
    return ROUTERS[name](config)


class RouterOutput(NamedTuple):
    """What a router decided for N tokens over E experts.

    A named tuple, so that every tool that walks a module's output (ZeRO-3's and FSDP's hooks, torch.compile,
    transformers' output recording) sees its tensors; `router_logits` comes first, as in transformers' routers.

    router_logits [N, E] fp32 raw scores (before noise or bias): the z-loss and `output_router_logits`.
    router_probs  [N, E] fp32 routing distribution, rows summing to one: the balancing loss and the entropy.
    Token choice:
      top_k_index   [N, k] int64 chosen experts, -1 where a router chose not to send a slot (GShard)
      top_k_weights [N, k] combine weights, input dtype
      kept          [N, k] bool, False for pairs dropped by capacity; None when dropless
    Expert choice:
      expert_index  [E, C] int64 tokens each expert took; expert_weights [E, C] their combine weights
    """

    router_logits: torch.Tensor
    router_probs: torch.Tensor
    top_k_index: torch.Tensor | None = None
    top_k_weights: torch.Tensor | None = None
    kept: torch.Tensor | None = None
    expert_index: torch.Tensor | None = None
    expert_weights: torch.Tensor | None = None

    @property
    def is_expert_choice(self) -> bool:
        return self.expert_index is not None

    def dispatch_index(self) -> torch.Tensor:
        """[N, k] expert of each pair to compute, -1 for pairs not computed."""
        if self.kept is None:
            return self.top_k_index
        return torch.where(self.kept, self.top_k_index, -1)

    def num_dropped(self) -> torch.Tensor:
        """Pairs dropped by capacity (a 0-dim tensor; reading it is a host sync)."""
        if self.kept is None:
            return torch.zeros((), dtype=torch.int64, device=self.router_logits.device)
        return (~self.kept & (self.top_k_index >= 0)).sum()

    def expert_load(self, num_experts: int) -> torch.Tensor:
        """[E] float32: (token, slot) pairs each expert computes."""
        if self.is_expert_choice:
            return torch.full((num_experts,), float(self.expert_index.shape[1]), device=self.router_logits.device)
        index = self.dispatch_index().reshape(-1)
        valid = index >= 0
        load = torch.zeros(num_experts, dtype=torch.float32, device=index.device)
        return load.scatter_add_(0, index.clamp_min(0), valid.float())


def capacity_kept(top_k_index: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[N, k] bool: which pairs fit in their expert's capacity.

    Priority: every token's first choice before any second choice (GShard, Switch), tokens in order inside a
    slot. Runs on the device with a stable sort; no [N, E] mask is built.
    """
    n, k = top_k_index.shape
    slot_major = top_k_index.t().reshape(-1)  # [k*N]: first choices of all tokens, then second choices, ...
    bucket = torch.where(slot_major >= 0, slot_major, num_experts)
    order = torch.argsort(bucket, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=bucket.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device) - starts[bucket[order]]
    return ((position < capacity) & (slot_major >= 0)).view(k, n).t()


def skip_small_weights(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, threshold: float, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic skipping: ([N, k] index, [N, k] weights) with every slot whose weight is below `threshold` x the row's
    largest weight set to expert -1 (not computed) and weight 0; the largest never is (threshold <= 1). With
    `renormalize` the weights left are divided by their sum. Elementwise on the device: no host sync, no branch on
    the data, so a compiled decode step traces it as it is."""
    top = top_k_weights.amax(dim=-1, keepdim=True)
    skip = top_k_weights < threshold * top
    index = top_k_index.masked_fill(skip, -1)
    weights = top_k_weights.masked_fill(skip, 0.0)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    return index, weights


def unit_weights(weights: torch.Tensor) -> torch.Tensor:
    """Ones of the shape of `weights` [N, k] (MoEfication: a chosen expert counts fully), through which the
    router still learns: the value is w / w = 1 exactly and the gradient is that of log w (straight-through)."""
    positive = weights > 0
    return torch.where(positive, weights / torch.where(positive, weights, 1.0).detach(), 1.0)


class Router(nn.Module):
    """Base of all routers: `weight` [E, H] and the capacity logic.

    Subclasses implement `route(hidden_states [N, H]) -> RouterOutput` (token choice, before capacity);
    `forward` applies capacity. Logits are computed in fp32, as in Switch Transformer.
    """

    router_type = "base"

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.capacity_factor = config.capacity_factor
        self.eval_capacity_factor = config.eval_capacity_factor
        self.unit_weights = config.router_weights == "unit"
        self.skip_threshold = getattr(config, "router_skip_threshold", 0.0)  # dynamic skipping, eval only; 0: off
        self.init_std = config.moe_init_std
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.normal_(self.weight, mean=0.0, std=self.init_std)

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, E] fp32."""
        return nn.functional.linear(hidden_states.float(), self.weight.float())

    def capacity(self, num_tokens: int) -> int | None:
        eval_factor = self.eval_capacity_factor
        factor = self.capacity_factor if self.training or eval_factor is None else eval_factor
        if factor is None:
            return None
        return max(1, math.ceil(factor * num_tokens * self.top_k / self.num_experts))

    def route(self, hidden_states: torch.Tensor) -> RouterOutput:
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor) -> RouterOutput:
        """hidden_states [N, H] -> RouterOutput."""
        out = self.route(hidden_states)
        if out.is_expert_choice:
            return out
        if self.skip_threshold and not self.training:  # (a module attribute: the same branch in every call)
            index, weights = skip_small_weights(out.top_k_index, out.top_k_weights, self.skip_threshold,
                                                self.norm_topk_prob)
            out = out._replace(top_k_index=index, top_k_weights=weights)
        kept = None
        capacity = self.capacity(hidden_states.shape[0])
        if capacity is not None:
            kept = capacity_kept(out.top_k_index, self.num_experts, capacity)
        weights = unit_weights(out.top_k_weights) if self.unit_weights else out.top_k_weights
        return out._replace(top_k_weights=weights.to(hidden_states.dtype), kept=kept)

    def _top_k(self, probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        weights, index = probs.topk(k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, index

    def extra_repr(self) -> str:
        cap = "dropless" if self.capacity_factor is None else f"capacity_factor={self.capacity_factor}"
        return f"{self.router_type}, num_experts={self.num_experts}, top_k={self.top_k}, {cap}"


@register_router("topk")
class TopKRouter(Router):
    """Softmax over experts, then top-k, with optionally renormalised weights (Mixtral, Qwen3-MoE)."""

    def route(self, hidden_states):
        logits = self.logits(hidden_states)
        probs = logits.softmax(dim=-1)
        weights, index = self._top_k(probs, self.top_k)
        return RouterOutput(logits, probs, index, weights)


@register_router("noisy_topk")
class NoisyTopKRouter(Router):
    """Noisy top-k gating (Shazeer et al., 2017): in training, logits + N(0, 1) * softplus(x W_noise); the k
    largest are kept and softmaxed. No noise in eval. `noise_weight` [E, H] starts at zero."""

    def __init__(self, config):
        super().__init__(config)
        self.noise_weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def route(self, hidden_states):
        logits = self.logits(hidden_states)
        noisy = logits
        if self.training:
            std = nn.functional.softplus(nn.functional.linear(hidden_states.float(), self.noise_weight.float()))
            noisy = logits + torch.randn_like(logits) * std
        top, index = noisy.topk(self.top_k, dim=-1)
        return RouterOutput(logits, noisy.softmax(dim=-1), index, top.softmax(dim=-1))


@register_router("switch")
class SwitchRouter(Router):
    """Top-1 routing with multiplicative jitter on the router input in training (Switch Transformer).

    The expert output is scaled by its router probability p, which is how the router learns from the LM loss.
    `router_weights="unit"` scales it by p / p.detach() instead: the value is 1 (an upcycled model stays exact)
    and the gradient is that of log p; `convert_to_moe(router_type="switch")` does that. With `norm_topk_prob` the
    weight is renormalised over the one expert to exactly 1 and the router gets no gradient but the balancing
    loss's (a warning says so).
    """

    def __init__(self, config):
        super().__init__(config)
        if self.top_k != 1:
            raise ValueError(f"The switch router sends each token to one expert: set top_k=1 (got {self.top_k}).")
        if self.norm_topk_prob:
            warnings.warn(
                "router_type='switch' with norm_topk_prob=True weights every expert output by exactly 1 with no "
                "gradient, so the router learns nothing from the LM loss (only from the balancing loss). Set "
                "norm_topk_prob=False (Switch Transformer's weighting), with router_weights='unit' to keep an "
                "upcycled model exact (what convert_to_moe does for the switch router).",
                stacklevel=3,
            )
        self.jitter = config.router_jitter_noise

    def route(self, hidden_states):
        x = hidden_states.float()
        if self.training and self.jitter > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        logits = nn.functional.linear(x, self.weight.float())
        probs = logits.softmax(dim=-1)
        weights, index = self._top_k(probs, 1)
        return RouterOutput(logits, probs, index, weights)


@register_router("gshard")
class GShardRouter(Router):
    """Top-2 with normalised weights; in training the second expert is kept with probability min(1, 2 * g2)
    (GShard's random routing). Use with a capacity factor, as GShard does (2.0 by default in convert_to_moe)."""

    def __init__(self, config):
        super().__init__(config)
        if self.top_k != 2:
            raise ValueError(f"The gshard router is top-2: set top_k=2 (got {self.top_k}).")

    def route(self, hidden_states):
        logits = self.logits(hidden_states)
        probs = logits.softmax(dim=-1)
        weights, index = probs.topk(2, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.training:
            keep_second = torch.rand_like(weights[:, 1]) < 2 * weights[:, 1]
            index = torch.stack([index[:, 0], torch.where(keep_second, index[:, 1], -1)], dim=-1)
        return RouterOutput(logits, probs, index, weights)


@register_router("prototype")
class PrototypeRouter(Router):
    """Expert prototyping (M6-T): the E experts form Z prototypes of E/Z experts; each prototype softmaxes over
    its own experts and picks its top k/Z, so k top-1 choices (Z = k, the default) replace one top-k choice."""

    def __init__(self, config):
        super().__init__(config)
        self.num_prototypes = config.num_prototypes or self.top_k
        z = self.num_prototypes
        if self.num_experts % z or self.top_k % z:
            raise ValueError(
                f"The prototype router needs num_experts ({self.num_experts}) and top_k ({self.top_k}) to be "
                f"multiples of num_prototypes ({z})."
            )

    def route(self, hidden_states):
        logits = self.logits(hidden_states)
        n, z = logits.shape[0], self.num_prototypes
        group = self.num_experts // z
        grouped = logits.view(n, z, group).softmax(dim=-1)  # [N, Z, E/Z]
        weights, index = grouped.topk(self.top_k // z, dim=-1)  # [N, Z, k/Z]
        index = index + torch.arange(z, device=index.device).view(1, z, 1) * group
        weights, index = weights.reshape(n, -1), index.reshape(n, -1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return RouterOutput(logits, grouped.reshape(n, -1) / z, index, weights)


@register_router("expert_choice")
class ExpertChoiceRouter(Router):
    """Expert choice (Zhou et al., 2022): in training, each expert takes its top C = ceil(c * N * k / E) tokens
    by router probability (c = capacity_factor, default 1), so every expert gets the same load, and a token may
    get any number of experts, zero included (the residual carries it).

    Choosing across a sequence lets later tokens influence the routing of earlier ones, which a causal model
    cannot do when it generates. Outside training this router therefore routes by token choice (top-k of the same
    probabilities): evaluation and generation are causal, and a prefix is routed the same whatever follows it.
    """

    def capacity(self, num_tokens: int) -> int | None:
        return None  # expert choice fixes each expert's load itself; token-choice fallback is dropless

    def route(self, hidden_states):
        logits = self.logits(hidden_states)
        probs = logits.softmax(dim=-1)
        if not self.training:
            weights, index = self._top_k(probs, self.top_k)
            return RouterOutput(logits, probs, index, weights)
        n = probs.shape[0]
        factor = self.capacity_factor if self.capacity_factor is not None else 1.0
        per_expert = min(n, max(1, math.ceil(factor * n * self.top_k / self.num_experts)))
        weights, tokens = probs.t().topk(per_expert, dim=-1)  # [E, C]
        return RouterOutput(logits, probs, expert_index=tokens, expert_weights=weights.to(hidden_states.dtype))


@register_router("aux_free")
class AuxFreeRouter(Router):
    """Auxiliary-loss-free balancing (DeepSeek-V3): sigmoid scores; the experts are chosen by score plus a
    per-expert bias `e_score_correction_bias`, which is used only for the choice. The combine weights are the
    plain scores of the chosen experts (renormalised with `norm_topk_prob`).

    The bias is not trained by gradient: after each optimizer step it moves by `router_bias_update_rate` toward
    balance, b_e += rate * sign(mean load - load_e), using the loads of every micro-batch since the previous step
    (summed over processes when torch.distributed is initialised). `update_bias` runs after each step of the
    optimizer attached to the model: `MoETrainer` attaches its own; a plain loop calls
    `hf_moe.attach_aux_free(model, optimizer)` (hf_moe/training/aux_free.py). Training without either warns once
    after `UNATTACHED_WARN_AFTER` forwards whose loads no update took.
    """

    def __init__(self, config):
        super().__init__(config)
        self.bias_update_rate = config.router_bias_update_rate
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))
        self.register_buffer("load_since_update", torch.zeros(config.num_experts), persistent=False)
        self.bias_updates_attached = False  # an optimizer moves the bias after its steps (hf_moe.attach_aux_free)
        self._records_since_update = 0  # training forwards whose loads wait for an update (counted when unattached)

    def route(self, hidden_states):
        logits = self.logits(hidden_states)
        scores = logits.sigmoid()
        _, index = (scores + self.e_score_correction_bias.float()).topk(self.top_k, dim=-1)
        weights = scores.gather(-1, index)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        probs = scores / scores.sum(dim=-1, keepdim=True)
        return RouterOutput(logits, probs, index, weights)

    UNATTACHED_WARN_AFTER = 64

    @torch.no_grad()
    def record_load(self, load: torch.Tensor) -> None:
        self.load_since_update += load.to(self.load_since_update.dtype)
        if not self.bias_updates_attached and not torch.compiler.is_compiling():  # (a compiled step does not count)
            self._records_since_update += 1
            if self._records_since_update == self.UNATTACHED_WARN_AFTER:
                warnings.warn(
                    f"hf_moe: {self._records_since_update} training forwards and the aux_free routers' selection bias "
                    "has not moved: it moves after the steps of the optimizer attached to the model. MoETrainer "
                    "attaches its own; in a plain loop or another Trainer (TRL's), call "
                    "hf_moe.attach_aux_free(model, optimizer) once before training (with an optimizer that is not a "
                    "torch.optim.Optimizer, call model.update_router_biases() after each of its steps).",
                    RuntimeWarning,
                    stacklevel=2,
                )

    @torch.no_grad()
    def update_bias(self) -> None:
        load = self.load_since_update.clone()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(load)
        if load.sum() > 0:
            self.e_score_correction_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.load_since_update.zero_()
        self._records_since_update = 0
