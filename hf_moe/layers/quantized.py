"""`QuantizedExperts`: an MoE layer's experts with weight-only int8 weights (made by `hf_moe.quantize_experts`)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..ops import dispatch_ops, expert_weights, experts_forward, kernel_activation, reference
from ..ops.activations import activation_key
from ..ops.infer import experts_infer
from ..ops.int8 import _check_group, dequantize_int8, quantize_int8
from .experts import batched_expert_choice

# config.json's field naming the experts' quantization (written by hf_moe.quantize; read by offload too).
CONFIG_FIELD = "expert_quantization"
# The experts' tensors with an expert dimension first, in the order of `Experts` (biases stay floating point).
WEIGHT_NAMES = ("gate_up_proj", "up_proj", "down_proj")
BIAS_NAMES = ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


class QuantizedExperts(nn.Module):
    """E expert MLPs with int8 weights and fp32 scales, in place of `Experts` (same forward, same attributes).

    Buffers (E experts, H hidden, I intermediate; W = 2I with a gate, else I; scales per output channel, or per
    group of `group_size` inputs):
        gate_up_proj / up_proj      int8 [E, W, H]    gate_up_proj_scale / up_proj_scale   fp32 [E, W] or [E, W, H/g]
        down_proj                   int8 [E, H, I]    down_proj_scale                      fp32 [E, H] or [E, H, I/g]
        gate_up_proj_bias / up_proj_bias [E, W], down_proj_bias [E, H]   (when the experts have biases; not quantized)
    They are buffers, not parameters: the experts are frozen (optimizers never see them), while gradients still
    flow through them to the inputs and the routing weights, so LoRA (or full training) of the other weights works.
    Scales stay fp32 whatever `model.to(dtype)` does.

    Forward: hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k] -> [N, H]. On CPU with the compiled
    extension it runs the int8 kernel (`hf_moe::moe_experts_infer`: dequantized in L1, multiplied in the activations'
    precision, fp32 or bf16); elsewhere the weights are dequantized to the activations' dtype and run through
    `hf_moe.ops.experts_forward` (the same numbers: dequantize, then matmul, is the kernel's reference).
    """

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, has_gate: bool, has_bias: bool,
                 activation: str, group_size: int | None = None, bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        check_group_size(group_size, hidden_dim, intermediate_dim)
        self.num_experts = self.num_local_experts = num_experts
        self.expert_offset, self.ep_plan = 0, None
        self.hidden_dim, self.intermediate_dim = hidden_dim, intermediate_dim
        self.has_gate, self.has_bias, self.is_transposed = has_gate, has_bias, False
        self.activation = activation  # ACT2FN key
        self.act_fn = ACT2FN[activation]
        self.group_size = group_size
        e, h, i = num_experts, hidden_dim, intermediate_dim
        up_rows = 2 * i if has_gate else i
        self.up_name = "gate_up_proj" if has_gate else "up_proj"
        for name, (rows, k) in ((self.up_name, (up_rows, h)), ("down_proj", (h, i))):
            scale_shape = (e, rows) if group_size is None else (e, rows, k // group_size)
            self.register_buffer(name, torch.zeros(e, rows, k, dtype=torch.int8))
            self.register_buffer(f"{name}_scale", torch.zeros(scale_shape, dtype=torch.float32))
        if has_bias:
            self.register_buffer(f"{self.up_name}_bias", torch.zeros(e, up_rows, dtype=bias_dtype))
            self.register_buffer("down_proj_bias", torch.zeros(e, h, dtype=bias_dtype))
        else:
            setattr(self, f"{self.up_name}_bias", None)
            self.down_proj_bias = None

    @classmethod
    def from_config(cls, config) -> QuantizedExperts:
        """Empty int8 experts shaped by an MoEConfig whose `expert_quantization` names them (to load into)."""
        settings = getattr(config, CONFIG_FIELD, None) or {}
        return cls(config.num_experts, config.hidden_size, config.moe_intermediate_size, config.expert_glu,
                   config.expert_bias, config.expert_hidden_act, settings.get("group_size"))

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: nn.Module, group_size: int | None = None) -> QuantizedExperts:
        """Quantize an `Experts` module (or a transformers experts module of the same layout): each output channel
        (or group) of every expert scaled by its max |w| / 127."""
        up, up_bias, down, down_bias = expert_weights(experts)
        e, _, h = up.shape
        activation = getattr(experts, "activation", None) or activation_key(experts.act_fn)
        if activation is None:
            raise ValueError(f"Cannot tell which activation {experts.act_fn!r} computes: give {type(experts).__name__} "
                             "an `activation` attribute naming its ACT2FN key.")
        quantized = cls(e, h, down.shape[2], experts.has_gate, up_bias is not None, activation, group_size,
                        bias_dtype=up.dtype)
        for name, weight in ((quantized.up_name, up), ("down_proj", down)):
            q, scale = quantize_int8(weight, group_size)
            getattr(quantized, name).copy_(q)
            getattr(quantized, f"{name}_scale").copy_(scale)
        if up_bias is not None:
            getattr(quantized, f"{quantized.up_name}_bias").copy_(up_bias)
            quantized.down_proj_bias.copy_(down_bias)
        return quantized.to(up.device)

    def _apply(self, fn, recurse=True):
        """`model.to(dtype)` leaves the int8 weights alone (torch casts floating tensors only) and must leave the
        fp32 scales alone too: they take the device `fn` gives, never its dtype."""
        scales = {name: getattr(self, f"{name}_scale") for name in (self.up_name, "down_proj")}
        super()._apply(fn, recurse)
        for name, scale in scales.items():
            moved = getattr(self, f"{name}_scale")
            if moved.dtype != torch.float32:
                self._buffers[f"{name}_scale"] = scale.to(moved.device)
        return self

    def dequantized(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """{name: weight} with each int8 weight as q * scale in `dtype` ([E, W, H] and [E, H, I])."""
        names = (self.up_name, "down_proj")
        return {n: dequantize_int8(getattr(self, n), getattr(self, f"{n}_scale"), dtype) for n in names}

    def kernel_args(self, dtype: torch.dtype) -> tuple:
        """(w1, w1_scale, b1, w2, w2_scale, b2, activation, glu): the arguments of `hf_moe::moe_experts_infer` after
        its activations and routing weights, the biases cast to the activations' `dtype`."""
        b1, b2 = getattr(self, f"{self.up_name}_bias"), self.down_proj_bias
        return (getattr(self, self.up_name), getattr(self, f"{self.up_name}_scale"),
                None if b1 is None else b1.to(dtype), self.down_proj, self.down_proj_scale,
                None if b2 is None else b2.to(dtype), kernel_activation(self.activation), self.has_gate)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        x = hidden_states.contiguous()
        weights = top_k_weights.to(x.dtype)
        if _compiled_kernel_runs(x, kernel_activation(self.activation)):
            args = self.kernel_args(x.dtype)
            if torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad):
                return _Int8Experts.apply(self, x, top_k_index, weights, *args)
            return experts_infer(x, top_k_index, weights, *args)
        return experts_forward(_Dequantized(self, x.dtype), x, top_k_index, weights)

    def expert_choice(self, hidden_states: torch.Tensor, expert_index: torch.Tensor, expert_weights: torch.Tensor):
        """Expert-choice routing (training only): the dequantized weights through the batched path of `Experts`.

        Args: hidden_states [N, H]; expert_index [E, C] token ids; expert_weights [E, C]. Returns [N, H]."""
        dtype = hidden_states.dtype
        weights = self.dequantized(dtype)
        b1, b2 = getattr(self, f"{self.up_name}_bias"), self.down_proj_bias
        return batched_expert_choice(hidden_states, expert_index, expert_weights, weights[self.up_name],
                                     None if b1 is None else b1.to(dtype), weights["down_proj"],
                                     None if b2 is None else b2.to(dtype), self.activation, self.has_gate)

    def extra_repr(self) -> str:
        scales = "per channel" if self.group_size is None else f"groups of {self.group_size}"
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, {'glu' if self.has_gate else 'mlp'}, "
                f"bias={self.has_bias}, int8 weights (frozen buffers, not LoRA targets), fp32 scales {scales}")


def int8_expert_targets(model: nn.Module, target_parameters) -> list[str]:
    """The entries of a PEFT config's `target_parameters` (full names, or suffixes such as "mlp.experts.gate_up_proj",
    as PEFT matches them) that name int8 expert weights of `model`. Those are buffers: PEFT finds no parameter there
    and adapts nothing."""
    names = [f"{prefix}.{name}" for prefix, module in model.named_modules() if isinstance(module, QuantizedExperts)
             for name in WEIGHT_NAMES if getattr(module, name, None) is not None]
    return sorted({t for t in target_parameters or () for n in names if n == t or n.endswith(f".{t}")})


def int8_lora_message(targets: list[str]) -> str:
    """Why a LoRA on int8 experts cannot be made, and what to do instead."""
    return (
        f"LoRA cannot adapt int8 experts: target_parameters {targets} name the int8 weights that "
        "hf_moe.quantize_experts made, and those are frozen buffers, not parameters, so PEFT finds nothing to adapt "
        "there. Target the layers that stayed in floating point instead (target_modules, e.g. [\"q_proj\", "
        "\"k_proj\", \"v_proj\", \"o_proj\"], and the shared experts' projections if the model has them), or put "
        "the LoRA on the experts of the unquantized model (target_parameters=[\"mlp.experts.gate_up_proj\", "
        "\"mlp.experts.down_proj\"]), merge it with merge_and_unload() and quantize after."
    )


def check_group_size(group_size, hidden_dim: int, intermediate_dim: int) -> None:
    """`group_size` is None (a scale per output channel) or a positive multiple of 32 dividing both input sizes of the
    experts (their hidden and intermediate sizes); else a `ValueError` that says which fit."""
    if group_size is None:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be None or an int (a multiple of 32), got {group_size!r}.")
    for k in (hidden_dim, intermediate_dim):
        _check_group(k, group_size)


def _compiled_kernel_runs(x: torch.Tensor, activation: str) -> bool:
    """The int8 kernel runs on CPU, for fp32 and bf16 activations, where the compiled backend is selected and
    implements the activation."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and activation in reference.KERNEL_ACTIVATIONS and dispatch_ops(x.device, activation).name == "compiled")


class _Dequantized:
    """The attributes `experts_forward` reads, with the weights dequantized to one dtype (the fallback path)."""

    def __init__(self, experts: QuantizedExperts, dtype: torch.dtype):
        self.num_experts, self.has_gate, self.activation = experts.num_experts, experts.has_gate, experts.activation
        self.act_fn = experts.act_fn
        for name, weight in experts.dequantized(dtype).items():
            setattr(self, name, weight)
        for name in BIAS_NAMES:
            bias = getattr(experts, name, None)
            setattr(self, name, None if bias is None else bias.to(dtype))


class _Int8Experts(torch.autograd.Function):
    """The int8 kernel forward, differentiable with respect to the inputs and the routing weights (not the frozen
    weights): the backward dequantizes the layer's weights and differentiates the reference computation."""

    @staticmethod
    def forward(ctx, experts, x, top_k_index, weights, w1, s1, b1, w2, s2, b2, activation, glu):
        ctx.experts = experts
        ctx.save_for_backward(x, top_k_index, weights)
        return experts_infer(x, top_k_index, weights, w1, s1, b1, w2, s2, b2, activation, glu)

    @staticmethod
    def backward(ctx, grad_out):
        x, top_k_index, weights = ctx.saved_tensors
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(ctx.needs_input_grad[1])
            w_ = weights.detach().requires_grad_(ctx.needs_input_grad[3])
            out = experts_forward(_Dequantized(ctx.experts, x.dtype), x_, top_k_index, w_)
            inputs = [t for t in (x_, w_) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, inputs, grad_out))
        grad_x = next(grads) if x_.requires_grad else None
        grad_w = next(grads) if w_.requires_grad else None
        return None, grad_x, None, grad_w, *([None] * 8)
