"""What the routers did: recording their decisions during one forward, and statistics over many."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .layers import RouterOutput, SparseMoeBlock
from .losses import load_balancing_loss, router_z_loss


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's MoE blocks, in forward (layer) order."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


class RouterRecorder:
    """Collects what each MoE layer's router decided during one forward of the model that owns it.

    One per model, shared by its backbone and its MoE blocks (`router_recorder`). While a recording is open, every
    block appends the `RouterOutput` it got from its router, in layer order. The backbone opens one when its caller
    asks for router logits or in training; the causal-LM head opens one around its whole forward when it computes
    the balancing losses, and the backbone then adds to it rather than starting another. Nothing is recorded
    outside a forward, so the recompute of gradient checkpointing (which runs during backward) records nothing.

    It is a plain object holding a list, not a set of hooks added and removed per call: torch.compile traces it
    without a graph break, and a block records what it received from its router, after any hooks that ZeRO-3 or
    FSDP placed on the router's output. One model must not run forwards in several threads at once while
    recording.
    """

    def __init__(self):
        self.outputs: list[RouterOutput] | None = None

    def start(self) -> bool:
        """Open a recording unless one is open. True if this call opened it (the caller then calls `stop`)."""
        if self.outputs is not None:
            return False
        self.outputs = []
        return True

    def stop(self) -> list[RouterOutput]:
        """Close the recording and return what it holds."""
        outputs, self.outputs = self.outputs, None
        return outputs

    def record(self, routing: RouterOutput) -> None:
        if self.outputs is not None:
            self.outputs.append(routing)

    @contextlib.contextmanager
    def recording(self):
        """`with recorder.recording() as routings:` runs forwards and fills the list `routings` (eager code only)."""
        opened = self.start()
        outputs = self.outputs
        try:
            yield outputs
        finally:
            if opened:
                self.stop()


def routing_losses(
    routings: list[RouterOutput], num_experts: int, token_mask: torch.Tensor | None
) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """Per MoE layer: the Switch balancing loss (None for expert-choice layers, which are balanced by construction)
    and the router z-loss, both fp32 scalars. `token_mask` [N] leaves padding out."""
    balance = [
        None if r.is_expert_choice else load_balancing_loss(r.router_probs, r.top_k_index, num_experts, token_mask)
        for r in routings
    ]
    return balance, [router_z_loss(r.router_logits, token_mask) for r in routings]


def token_mask(attention_mask: torch.Tensor | None, num_tokens: int) -> torch.Tensor | None:
    """The 2-D padding mask as [N] flags, when it lines up with the routed tokens (not during cached decoding)."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.numel() != num_tokens:
        return None
    return attention_mask.reshape(-1) != 0


class RoutingStats:
    """Per-layer routing statistics summed over training forwards, kept on the device (no host sync until read).

    Per MoE layer: pairs computed by each expert, pairs dropped by capacity, tokens routed, summed router entropy,
    and summed balancing / z losses. `MoEMonitorCallback` reads and resets them at each logging step.
    """

    _TENSORS = ("load", "dropped", "tokens", "entropy", "aux_loss", "z_loss")

    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str = "cpu"):
        self.num_layers, self.num_experts = num_layers, num_experts
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
        self.load, self.dropped, self.tokens = zeros(num_layers, num_experts), zeros(num_layers), zeros(num_layers)
        self.entropy, self.aux_loss, self.z_loss = zeros(num_layers), zeros(num_layers), zeros(num_layers)
        self.forwards = 0

    def to(self, device: torch.device) -> None:
        """Move the sums to `device` (in place)."""
        for name in self._TENSORS:
            setattr(self, name, getattr(self, name).to(device))

    @torch.no_grad()
    def add(self, layer: int, routing: RouterOutput, aux_loss: torch.Tensor | None, z_loss: torch.Tensor) -> None:
        probs = routing.router_probs.float()
        self.load[layer] += routing.expert_load(self.num_experts).double()
        self.dropped[layer] += routing.num_dropped().double()
        self.tokens[layer] += probs.shape[0]
        self.entropy[layer] += -(probs * probs.clamp_min(1e-20).log()).sum().double()
        if aux_loss is not None:
            self.aux_loss[layer] += aux_loss.detach().double()
        self.z_loss[layer] += z_loss.detach().double()
        if layer == 0:
            self.forwards += 1

    def summary(self) -> list[dict[str, float]]:
        """Per layer: load fractions, load max/mean, coefficient of variation, drop fraction, mean entropy,
        mean aux and z losses over the forwards since the last reset. Reads the device (one sync)."""
        load = self.load.cpu()
        dropped, tokens, entropy = self.dropped.cpu(), self.tokens.cpu(), self.entropy.cpu()
        aux, z = self.aux_loss.cpu(), self.z_loss.cpu()
        forwards = max(self.forwards, 1)
        out = []
        for layer in range(self.num_layers):
            total = load[layer].sum().item()
            fractions = (load[layer] / total).tolist() if total else [0.0] * self.num_experts
            mean = total / self.num_experts
            pairs = total + dropped[layer].item()
            out.append({
                "load": fractions,
                "load_max_over_mean": (load[layer].max().item() / mean) if mean else 0.0,
                "load_cv": (load[layer].std(unbiased=False).item() / mean) if mean else 0.0,
                "drop_fraction": dropped[layer].item() / pairs if pairs else 0.0,
                "router_entropy": entropy[layer].item() / max(tokens[layer].item(), 1.0),
                "aux_loss": aux[layer].item() / forwards,
                "z_loss": z[layer].item() / forwards,
            })
        return out

    def reset(self) -> None:
        for name in self._TENSORS:
            getattr(self, name).zero_()
        self.forwards = 0
