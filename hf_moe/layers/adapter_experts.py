"""Adapter experts: E experts that share one frozen dense MLP and differ by small trainable adapters.

Two methods (`config.adapter_experts["method"]`):

    lora  (MixLoRA, arXiv 2404.15159): expert e's projections are W + s B_e A_e, on the projections chosen
          (`target_modules`: gate_proj, up_proj, down_proj), s = lora_alpha / r. Materializes into plain experts.
    pesc  (PESC / Camelidae, arXiv 2401.02731): expert e(x) = F(x) + s U_e act(D_e F(x)), F the frozen MLP: a
          bottleneck adapter on the MLP's output. All of it runs per token (below), but the expert is no MLP of the
          Mixtral shape, so it cannot be materialized into plain experts.

What runs per token and what per (token, expert) pair (N tokens, k experts each, M = N * k pairs, E experts, rank r;
the pairs are sorted by expert as for every hf_moe MoE, and each per-pair low-rank product is one grouped GEMM):

    lora   per token  x W_gate^T, x W_up^T                [N, 2I]   frozen, not repeated per expert
                      A_e x for all E experts             [N, E*2r] as a plain LoRA of rank E*r; each pair takes its
                                                                    expert's columns
                      W_down (sum_j w_j a_j)              [N, H]    frozen; W_down is shared and linear, so the
                                                                    weighted sum over the pairs is taken before it
                      B_down over the pairs' A_down a     [N, E*r] -> [N, H]
           per pair   gather of the token's gate/up rows  [M, 2I]
                      + s B_e (A_e x) on gate and up      [M, 2r] -> [M, 2I]   grouped
                      a = act(gate) * up * w              [M, I]
                      A_down,e a                          [M, r]    grouped
    pesc   per token  F(x), the frozen MLP                [N, H]
                      act(D_e F(x)) for all E experts     [N, E*r], weighted by each chosen expert's routing weight
                                                                    (0 for the others), then U -> [N, H]
           per pair   nothing

In training, the per-pair tensors (the gathered rows [M, 2I], the activations [M, I]) are not kept for the backward
but recomputed in it (`torch.utils.checkpoint` over the per-pair part): what the lora method keeps per layer is then
that of a dense MLP with a LoRA, [N, 2I] and [N, I].

The low-rank products run per token over all E experts cost E/k times the grouped product of the pairs, and what a
plain LoRA of rank E*r costs: with E*r well below I (MixLoRA: 8 x 16 against I = 11008) that is small next to the
frozen projections, and it saves the per-pair gathers and small GEMMs.

At initialisation B (lora) or U (pesc) is zero: the block computes the dense MLP (times the sum of the routing
weights, one with renormalised top-k) and the model the dense model's logits, to fp32 rounding.

In memory the frozen MLP is the child `dense_mlp` (its tensors are the dense model's, not copies; not `base_layer`, the
name by which PEFT recognises its own tuner layers, so that a PEFT LoRA around these blocks merges and unloads), and
each adapter tensor is one parameter with the expert dimension first (`gate_lora_A` [E, r, H]); on disk each expert
has its own keys (`...experts.{e}.gate_lora_A` [r, H]) in its own file, as for every hf_moe checkpoint.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from transformers.activations import ACT2FN

from ..compat import init
from ..ops import dispatch_ops, kernel_activation
from .experts import _load_per_expert_keys

ADAPTER_METHODS = ("lora", "pesc")
LORA_TARGETS = ("gate_proj", "up_proj", "down_proj")
# Keys of the config's `adapter_experts` record, per method (`base_model` is added by the conversion).
SPEC_KEYS = {
    "lora": ("method", "r", "lora_alpha", "target_modules", "lora_dropout"),
    "pesc": ("method", "r", "lora_alpha", "adapter_act", "lora_dropout"),
}
BASE_KEYS = ("name_or_path", "dtype", "fingerprint", "structure", "tensors")
# The child holding the frozen MLP, and its name in checkpoints written before it was renamed (their keys when the user
# unfroze it, and the key names every base fingerprint hashes).
DENSE_MLP, LEGACY_DENSE_MLP = "dense_mlp", "base_layer"


def check_adapter_spec(spec, glu: bool, name: str = "adapter_experts") -> None:
    """Raise ValueError naming the field when `spec` (config.adapter_experts) is not a valid record."""
    if not isinstance(spec, dict):
        raise ValueError(f"{name} must be an object, got {type(spec).__name__}.")
    method = spec.get("method")
    if method not in ADAPTER_METHODS:
        raise ValueError(f"{name}.method must be one of {ADAPTER_METHODS}, got {method!r}.")
    missing = [k for k in SPEC_KEYS[method] if k not in spec]
    if missing:
        raise ValueError(f"{name} lacks {missing} (method {method!r} needs {list(SPEC_KEYS[method])}).")
    r, alpha, dropout = spec["r"], spec["lora_alpha"], spec["lora_dropout"]
    if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1):
        raise ValueError(f"{name}.r (the rank) must be a positive int, got {r!r}.")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"{name}.lora_alpha must be a positive finite number, got {alpha!r}.")
    if not (isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1):
        raise ValueError(f"{name}.lora_dropout must be in [0, 1), got {dropout!r}.")
    if method == "lora":
        targets = spec["target_modules"]
        if not (isinstance(targets, (list, tuple)) and targets and all(t in LORA_TARGETS for t in targets)):
            raise ValueError(
                f"{name}.target_modules must be a non-empty list of {list(LORA_TARGETS)} (the MLP's projections, "
                f"whatever the family calls them), got {targets!r}."
            )
        if len(set(targets)) != len(targets):
            raise ValueError(f"{name}.target_modules lists a projection twice: {targets!r}.")
        if "gate_proj" in targets and not glu:
            raise ValueError(f"{name}.target_modules has gate_proj, but this MLP has no gate (act(x W_up) W_down).")
    elif spec["adapter_act"] not in ACT2FN:
        raise ValueError(f"{name}.adapter_act must be a key of transformers' ACT2FN (e.g. 'gelu'), got "
                         f"{spec['adapter_act']!r}.")
    base = spec.get("base_model")
    if base is not None and not (isinstance(base, dict) and set(BASE_KEYS) <= set(base)):
        raise ValueError(f"{name}.base_model must be an object with {list(BASE_KEYS)}, got {base!r}.")


def adapter_shapes(spec: dict, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    """{parameter name: per-expert shape} of the adapters: lora `{gate,up,down}_lora_{A,B}`, pesc `adapter_down`,
    `adapter_up`. A is [r, in], B [out, r] (PEFT's layout)."""
    r = spec["r"]
    if spec["method"] == "pesc":
        return {"adapter_down": (r, hidden), "adapter_up": (hidden, r)}
    sizes = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    shapes = {}
    for target in LORA_TARGETS:  # (a fixed order, whatever the order of target_modules)
        if target in spec["target_modules"]:
            fan_in, fan_out = sizes[target]
            role = target.removesuffix("_proj")
            shapes[f"{role}_lora_A"], shapes[f"{role}_lora_B"] = (r, fan_in), (fan_out, r)
    return shapes


class FrozenMLP(nn.Module):
    """The dense MLP every expert shares, in canonical form (`nn.Linear` layout [out, in]); frozen.

    Parameters: gate_proj [I, H] (GLU only), up_proj [I, H], down_proj [H, I], and `{name}_bias` ([I] or [H]) when
    the experts have biases (zeros where the dense MLP had none).
    """

    def __init__(self, hidden: int, inter: int, glu: bool, bias: bool):
        super().__init__()
        names = (("gate_proj", inter, hidden),) if glu else ()
        for name, rows, cols in (*names, ("up_proj", inter, hidden), ("down_proj", hidden, inter)):
            self.register_parameter(name, nn.Parameter(torch.zeros(rows, cols), requires_grad=False))
            b = nn.Parameter(torch.zeros(rows), requires_grad=False) if bias else None
            self.register_parameter(f"{name}_bias", b)
        if not glu:
            self.gate_proj = self.gate_proj_bias = None


class AdapterExperts(nn.Module):
    """E experts = one frozen MLP (`dense_mlp`) + per-expert adapters, in place of `Experts` (same forward).

    Parameters (E experts, H hidden, I intermediate, r rank), each with the expert dimension first:
        lora:  `{role}_lora_A` [E, r, in], `{role}_lora_B` [E, out, r] for role in gate, up, down (the targets)
        pesc:  `adapter_down` [E, r, H], `adapter_up` [E, H, r]
    A (and D) are drawn as PEFT draws LoRA's A (uniform, bound 1 / sqrt(in)), each expert its own; B (and U) are
    zero, so a new block computes the dense MLP.
    Forward:
        hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k] -> [N, H]

    Attribute names follow `Experts` (`num_experts`, `has_gate`, `has_bias`, `activation`), so routing statistics,
    the per-expert loader and the checkpoint layout treat it like one. Tools that need expert weights (native export,
    int8, offload, merge, expert parallelism) take the materialized model: `hf_moe.materialize(model)`.
    """

    def __init__(self, config, expert_range: tuple[int, int] | None = None):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        if expert_range is not None and tuple(expert_range) != (0, e):
            raise ValueError(
                "Adapter experts share one frozen MLP and hold a few MB of adapters: they are not split over "
                "processes (expert parallelism). Train them data-parallel, or materialize the model first "
                "(hf_moe.materialize)."
            )
        spec = config.adapter_experts
        check_adapter_spec(spec, config.expert_glu)
        self.num_experts = self.num_local_experts = e
        self.expert_offset, self.ep_plan = 0, None
        self.hidden_dim, self.intermediate_dim = h, i
        self.has_gate, self.has_bias, self.is_transposed = config.expert_glu, config.expert_bias, False
        self.activation = config.expert_hidden_act  # ACT2FN key
        self.act_fn = ACT2FN[self.activation]
        self.method = spec["method"]
        self.rank = spec["r"]
        self.scaling = spec["lora_alpha"] / spec["r"]
        self.targets = tuple(t for t in LORA_TARGETS if t in spec.get("target_modules", ()))
        self.adapter_act = spec.get("adapter_act")
        self.dropout = nn.Dropout(spec["lora_dropout"]) if spec["lora_dropout"] else nn.Identity()
        self.dense_mlp = FrozenMLP(h, i, self.has_gate, self.has_bias)
        for name, shape in adapter_shapes(spec, h, i).items():
            self.register_parameter(name, nn.Parameter(torch.empty(e, *shape)))
        self.reset_parameters()
        self.register_load_state_dict_pre_hook(_load_per_expert_keys)  # on-disk per-expert keys (Trainer resume)
        self.register_load_state_dict_pre_hook(_load_legacy_keys)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """A (and D) uniform in +-1/sqrt(in), as PEFT's LoRA; B (and U) zero."""
        with torch.no_grad():
            for name, param in self.named_parameters(recurse=False):
                if name.endswith(("_lora_B", "adapter_up")):
                    init.zeros_(param)
                elif param.device.type != "meta":
                    bound = 1.0 / math.sqrt(param.shape[-1])
                    draw = torch.rand(param.shape, generator=generator, dtype=torch.float32) * (2 * bound) - bound
                    param.copy_(draw)

    def extra_repr(self) -> str:
        what = f"lora on {', '.join(self.targets)}" if self.method == "lora" else f"pesc ({self.adapter_act})"
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim="
                f"{self.intermediate_dim}, {what}, r={self.rank}, scaling={self.scaling:g}")

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("gate_up_proj", "up_proj", "down_proj"):  # what tools that need expert weights look for
                raise AttributeError(
                    f"Adapter experts hold no `{name}` per expert: each is a frozen MLP shared by all plus a low-rank "
                    "adapter. Materialize them into plain experts first: hf_moe.materialize(model) (or "
                    "`hf-moe materialize IN OUT`)."
                ) from None
            raise

    # ------------------------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------------------------
    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Token choice: [N, H], [N, k], [N, k] -> [N, H]. Pairs with an expert id outside [0, E) (dropped by capacity
        or not sent) contribute nothing."""
        with _autocast_off(hidden_states) as dtype:
            x = hidden_states.to(dtype) if dtype is not None else hidden_states
            ops = dispatch_ops(x.device, kernel_activation(self.activation), x.dtype)
            k = top_k_index.shape[1]
            sorted_slots, slot_to_row, tokens_per_expert = ops.sort_by_expert(top_k_index, self.num_experts)
            token = torch.div(sorted_slots, k, rounding_mode="floor")  # [M]: the token of each sorted row
            expert = top_k_index.reshape(-1).index_select(0, sorted_slots).clamp_min(0)  # [M] (dropped: any id)
            kept = torch.arange(token.shape[0], device=x.device) < tokens_per_expert.sum()  # dropped pairs sort last
            row_weight = top_k_weights.reshape(-1).to(x.dtype).index_select(0, sorted_slots) * kept  # [M]
            rows = _Rows(token, expert, tokens_per_expert, row_weight, lambda t: ops.unpermute(t, slot_to_row, None, k))
            return self._experts(ops, x, rows, dtype)

    def expert_choice(
        self, hidden_states: torch.Tensor, expert_index: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """Expert choice: hidden_states [N, H], expert_index [E, C] token ids, expert_weights [E, C] -> [N, H]. The
        rows are grouped by expert already (C each)."""
        with _autocast_off(hidden_states) as dtype:
            x = hidden_states.to(dtype) if dtype is not None else hidden_states
            ops = dispatch_ops(x.device, kernel_activation(self.activation), x.dtype)
            e, c = expert_index.shape
            token = expert_index.reshape(-1)
            tokens_per_expert = torch.full((e,), c, dtype=torch.int64, device=x.device)
            expert = torch.arange(e, device=x.device).repeat_interleave(c)

            def combine(t: torch.Tensor) -> torch.Tensor:  # (an expert takes a token at most once)
                acc = torch.float64 if t.dtype == torch.float64 else torch.float32
                return t.new_zeros(x.shape[0], t.shape[1], dtype=acc).index_add(0, token, t.to(acc)).to(t.dtype)

            rows = _Rows(token, expert, tokens_per_expert, expert_weights.reshape(-1).to(x.dtype), combine)
            return self._experts(ops, x, rows, dtype)

    def _experts(self, ops, x: torch.Tensor, rows: _Rows, dtype) -> torch.Tensor:
        """The computation of the module docstring: x [N, H] -> [N, H] over the (token, expert) pairs `rows`.
        `dtype`: the autocast dtype, or None (x's). The low-rank products that do not depend on the pair run per token
        over all E experts at once (a GEMM of E * r columns, as a plain LoRA of that rank), and each pair picks its
        expert's r columns; those that do, per pair, grouped by expert."""
        # Every weight in the activations' dtype: the autocast one, else x's (fp32 adapters in a 16-bit model run in its
        # dtype, as under autocast; their gradients stay fp32)
        dtype = dtype if dtype is not None else x.dtype
        cast = lambda t: t.to(dtype) if t is not None else None  # noqa: E731
        base, e, r = self.dense_mlp, self.num_experts, self.rank
        n = x.shape[0]
        slot = rows.token * e + rows.expert  # [M]: the pair's row in a [N * E, ...] per-token-and-expert view
        weight_sum = rows.combine(rows.weight.unsqueeze(1))  # [N, 1]: the sum of each token's kept weights
        if self.method == "pesc":  # all of it per token: act(F(x) D_e^T) U_e^T for every expert, routing-weighted
            y = _dense_mlp(x, base, self.act_fn, self.has_gate, cast)  # [N, H]
            inner = ACT2FN[self.adapter_act](F.linear(self.dropout(y), cast(self.adapter_down).reshape(e * r, -1)))
            weights = x.new_zeros(n * e).index_add(0, slot, rows.weight).view(n, e, 1)  # [N, E, 1]: 0 if not chosen
            up = cast(self.adapter_up).permute(1, 0, 2).reshape(-1, e * r)  # [H, E * r]
            return y * weight_sum + self.scaling * F.linear((inner.view(n, e, r) * weights).view(n, e * r), up)

        # lora: frozen gate/up once per token, gathered per pair; each pair adds its expert's s B_e A_e x
        if self.has_gate:
            h0 = torch.cat([F.linear(x, cast(base.gate_proj), cast(base.gate_proj_bias)),
                            F.linear(x, cast(base.up_proj), cast(base.up_proj_bias))], dim=1)  # [N, 2I]
        else:
            h0 = F.linear(x, cast(base.up_proj), cast(base.up_proj_bias))  # [N, I]
        inputs = [t.removesuffix("_proj") for t in ("gate_proj", "up_proj") if t in self.targets]
        xa = None
        if inputs:
            a = torch.cat([cast(getattr(self, f"{role}_lora_A")) for role in inputs], dim=1)  # [E, R, H]
            xa = F.linear(self.dropout(x), a.reshape(-1, x.shape[1]))  # [N, E * R]: A x per token, every expert
        pairs = lambda h0, xa: self._pairs(ops, rows, slot, h0, xa, inputs, cast)  # noqa: E731
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (h0, xa, rows.weight)):
            # The per-pair tensors ([M, 2I] gathered rows, [M, I] activations: M = k N) are recomputed in the backward
            # rather than kept: what stays is [N, 2I], as for a dense MLP with a LoRA (docs/adapter-experts.md)
            act, down_blocks = checkpoint(pairs, h0, xa, use_reentrant=False)
        else:
            act, down_blocks = pairs(h0, xa)
        out = F.linear(act, cast(base.down_proj))  # [N, H]: W_down once per token
        if base.down_proj_bias is not None:
            out = out + weight_sum * cast(base.down_proj_bias)
        if down_blocks is not None:  # B_down per token over the pairs' A_down blocks
            b = cast(self.down_lora_B).permute(1, 0, 2).reshape(-1, e * r)  # [H, E * r]
            out = out + self.scaling * F.linear(down_blocks, b)
        return out

    def _pairs(self, ops, rows: _Rows, slot, h0: torch.Tensor, xa: torch.Tensor | None, inputs: list[str], cast):
        """The per-pair part of the lora method: h0 [N, W] (the frozen gate/up of each token), xa [N, E * R] (A x of
        every expert, or None) -> (the routing-weighted activations summed per token [N, I], and the pairs' A_down
        blocks [N, E * r] or None)."""
        n, e, r = h0.shape[0], self.num_experts, self.rank
        h = h0.index_select(0, rows.token)  # [M, W]
        if xa is not None:
            low = xa.view(n * e, -1).index_select(0, slot)  # [M, R]: the pair's expert's
            h += self.scaling * ops.grouped_mm(low, self._input_b(inputs, cast), rows.tokens_per_expert, None, None,
                                               True)  # (h is a fresh gather: in place is safe)
        act = _WeightedAct.apply(h, rows.weight, ops, kernel_activation(self.activation), self.has_gate)  # [M, I]
        down_blocks = None
        if "down_proj" in self.targets:  # A_down per pair (grouped), summed into each token's [E * r] block
            low = ops.grouped_mm(self.dropout(act), cast(self.down_lora_A), rows.tokens_per_expert, None, None, True)
            down_blocks = low.new_zeros(n * e, r).index_add(0, slot, low).view(n, e * r)
        return rows.combine(act), down_blocks

    def _input_b(self, inputs: list[str], cast) -> torch.Tensor:
        """[E, W, R]: the B of the targeted input projections (gate, up) as one block-diagonal weight per expert, so
        that one grouped GEMM gives the [M, W] delta of both (W = 2I with a gate, else I; R = r per target; the rows
        of an untargeted projection are zero)."""
        b = {role: cast(getattr(self, f"{role}_lora_B")) for role in inputs}  # each [E, I, r]
        zero = torch.zeros_like(next(iter(b.values())))
        roles = ("gate", "up") if self.has_gate else ("up",)
        return torch.cat([torch.cat([b[role] if role == col else zero for col in inputs], dim=2) for role in roles],
                         dim=1)


class _Rows(NamedTuple):
    """The (token, expert) pairs of one forward, grouped by expert (M rows).

    token, expert [M]: each row's token and expert; tokens_per_expert [E]: group sizes (rows past the groups are
    dropped pairs); weight [M]: routing weights (0 for dropped pairs); combine: [M, D] -> [N, D], the sum of each
    token's rows."""

    token: torch.Tensor
    expert: torch.Tensor
    tokens_per_expert: torch.Tensor
    weight: torch.Tensor
    combine: Callable[[torch.Tensor], torch.Tensor]


class _WeightedAct(torch.autograd.Function):
    """act(gate) * up * w (GLU) or act(h) * w per row, [M, W], [M] -> [M, I], keeping only h and w for the backward,
    which recomputes the activation (`expert_act_backward`), as the experts of every hf_moe MoE do. The compiled ops
    get detached tensors: their bf16 CPU kernel calls ATen `out=` functions from OpenMP worker threads, where grad
    mode is on whatever this thread says, and an input that requires grad there is an error.)"""

    @staticmethod
    def forward(ctx, h, row_weight, ops, activation: str, glu: bool):
        ctx.save_for_backward(h, row_weight)
        ctx.ops, ctx.activation, ctx.glu = ops, activation, glu
        return ops.expert_act(h.detach(), row_weight.detach(), activation, glu)

    @staticmethod
    def backward(ctx, grad):
        h, row_weight = ctx.saved_tensors
        grad_h, grad_w, _ = ctx.ops.expert_act_backward(grad.contiguous(), h.detach(), row_weight.detach(),
                                                        ctx.activation, ctx.glu, False)
        return grad_h, (grad_w if ctx.needs_input_grad[1] else None), None, None, None


def current_key(key: str) -> str:
    """A state-dict key with the frozen MLP's former name (`...experts.base_layer.up_proj`) under its current one."""
    return key.replace(f".experts.{LEGACY_DENSE_MLP}.", f".experts.{DENSE_MLP}.")


def fingerprint_key(key: str) -> str:
    """The name a state-dict key has in a base fingerprint: the frozen MLP under its former name, so that the
    fingerprints recorded before the rename still match."""
    return key.replace(f".experts.{DENSE_MLP}.", f".experts.{LEGACY_DENSE_MLP}.")


def _load_legacy_keys(module, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
    """`load_state_dict` pre-hook: keys of the frozen MLP under its former name (a checkpoint in which the user had
    unfrozen it) load into `dense_mlp`."""
    for key in [k for k in state_dict if k.startswith(f"{prefix}{LEGACY_DENSE_MLP}.")]:
        state_dict[prefix + DENSE_MLP + key[len(prefix) + len(LEGACY_DENSE_MLP):]] = state_dict.pop(key)


def _dense_mlp(x: torch.Tensor, base: FrozenMLP, act_fn, glu: bool, cast) -> torch.Tensor:
    """The frozen MLP on [N, H] -> [N, H]."""
    up = F.linear(x, cast(base.up_proj), cast(base.up_proj_bias))
    h = act_fn(F.linear(x, cast(base.gate_proj), cast(base.gate_proj_bias))) * up if glu else act_fn(up)
    return F.linear(h, cast(base.down_proj), cast(base.down_proj_bias))


@contextlib.contextmanager
def _autocast_off(x: torch.Tensor):
    """Under autocast (Trainer's bf16 with fp32 weights) run in the autocast dtype with autocast off, as
    `hf_moe.ops.experts_forward` does: the grouped GEMMs are custom ops that autocast does not cast. Yields the
    autocast dtype, or None outside autocast."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        yield None
        return
    with torch.autocast(device_type, enabled=False):
        yield torch.get_autocast_dtype(device_type)


# --------------------------------------------------------------------------------------------------------------------
# What an adapter-expert checkpoint holds
# --------------------------------------------------------------------------------------------------------------------
def adapter_blocks(model: nn.Module) -> dict[str, AdapterExperts]:
    """{path of the MoE block: its AdapterExperts} for every block of `model` with adapter experts."""
    return {name.rpartition(".")[0]: m for name, m in model.named_modules() if isinstance(m, AdapterExperts)}


def always_saved(key: str, block_paths) -> bool:
    """Whether a state-dict key is one an adapter-expert checkpoint always holds: everything of an MoE block (the
    router, the adapters) but the frozen MLP, which is the base model's."""
    for path in block_paths:
        if key.startswith(path + ".") and not key.startswith(f"{path}.experts.{DENSE_MLP}."):
            return True
    return False


def check_modules_to_save(model: nn.Module) -> None:
    """Refuse a PEFT `modules_to_save` that wrapped adapter experts: PEFT trains and saves a whole copy of each module
    it names, and adapter experts hold the frozen dense MLP they share (the bulk of the model), so it would be copied,
    trained and saved into the adapter."""
    wrapped = [name for name, module in model.named_modules()
               if isinstance(getattr(module, "original_module", None), AdapterExperts)]
    if wrapped:
        raise ValueError(
            f"modules_to_save names the adapter experts ({wrapped[0]}, ...): PEFT would copy each whole experts "
            "module, the frozen dense MLP included, then train it and save it into the adapter. Leave `experts` "
            "out: train the adapter experts with hf_moe (they train after convert_to_moe; save with save_pretrained), "
            "then put PEFT's LoRA on the saved model; modules_to_save=[\"gate\"] trains the routers "
            "(docs/adapter-experts.md)."
        )


def trained_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The part of `state_dict` (default: the model's) that an adapter-expert checkpoint saves: the routers and
    adapters of every MoE block, and any other parameter that requires grad (one the user unfroze). The rest is the
    base model's, which the checkpoint refers to (`config.adapter_experts["base_model"]`)."""
    if state_dict is None:
        state_dict = model.state_dict()
    paths = list(adapter_blocks(model))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state_dict.items() if always_saved(k, paths) or k in trainable}


def checkpoint_expectations(expected: dict, weight_map: dict, config) -> dict:
    """Of `expected` ({on-disk key: (dtype, shape)} of every tensor a model of `config` holds), those an adapter-expert
    checkpoint must hold (every router and adapter tensor) or does hold (a parameter the user unfroze)."""
    paths = [f"{config.decoder_layers_path}.{i}.{config.moe_block_path}" for i in config.moe_layers]
    return {k: v for k, v in expected.items() if k in weight_map or always_saved(k, paths)}
