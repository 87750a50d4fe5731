"""What the routers did: recording their decisions during one forward, and statistics over many."""

from __future__ import annotations

import torch
from torch import nn

from .layers import RouterOutput, SparseMoeBlock


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's MoE blocks, in forward (layer) order."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


class RouterRecorder:
    """Context manager that records each MoE block's `RouterOutput`, layer by layer, in `outputs`.

    The hooks are removed on exit, so the recompute of gradient checkpointing records nothing twice.
    """

    def __init__(self, model: nn.Module):
        self.blocks = moe_blocks(model)
        self.outputs: list[RouterOutput] = []
        self._handles = []

    def _hook(self, module, args, output: RouterOutput):
        self.outputs.append(output)

    def __enter__(self) -> RouterRecorder:
        self._handles = [block.gate.register_forward_hook(self._hook) for block in self.blocks]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False


class RoutingStats:
    """Per-layer routing statistics summed over training forwards, kept on the device (no host sync until read).

    Per MoE layer: pairs computed by each expert, pairs dropped by capacity, tokens routed, summed router entropy,
    and summed balancing / z losses. `MoEMonitorCallback` reads and resets them at each logging step.
    """

    def __init__(self, num_layers: int, num_experts: int, device: torch.device):
        self.num_layers, self.num_experts = num_layers, num_experts
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
        self.load, self.dropped, self.tokens = zeros(num_layers, num_experts), zeros(num_layers), zeros(num_layers)
        self.entropy, self.aux_loss, self.z_loss = zeros(num_layers), zeros(num_layers), zeros(num_layers)
        self.forwards = 0

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
        for t in (self.load, self.dropped, self.tokens, self.entropy, self.aux_loss, self.z_loss):
            t.zero_()
        self.forwards = 0
