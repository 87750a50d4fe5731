"""The experts' activation, forward and backward, with the routing weight folded in (as the CPU kernels do).

    forward:   a = act(gate) * up * w_r    (GLU: h = [gate | up], I = W / 2)   or   a = act(h) * w_r
    backward:  grad_h = d a / d h . grad_a,   grad_w_r = sum_i grad_a[r, i] * a[r, i] / w_r   (the unscaled output),
               and, on request, the forward output a, which the down projection's weight gradient needs next.

Activations (the compiled CPU set): silu, gelu (erf), gelu_tanh, relu, relu2. Values are computed in fp32 (fp64
for fp64) and rounded once to the tensor's dtype. tanh is written with exp (no tanh in `tl.math`, and the
interpreter has no libdevice): tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2 |y|), which does not overflow.

Block sizes (sm90): [16, 128] tiles, 4 warps: 16 values per thread per operand. These kernels are memory bound,
so what matters is occupancy: ptxas gives the backward 80-117 registers per thread (it was 160-200 with [16, 256]
tiles), which leaves room for 4 blocks of 128 threads per SM. The backward walks a row block across all its
columns, because the routing weight's gradient is a sum over the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import INTERPRETING, accumulator, cast, check_device, launch

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")
GPU_BLOCKS = dict(BLOCK_R=16, BLOCK_W=128, num_warps=4)
INTERPRETER_BLOCKS = dict(BLOCK_R=16, BLOCK_W=16)

# Globals a kernel reads must be constexpr; they go right of a tensor (constexpr * tensor fails in the interpreter).
_SQRT_HALF = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_C = tl.constexpr(0.044715)


@triton.jit
def _tanh(y):
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -t, t)


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == "silu":
        return x * tl.sigmoid(x)
    elif ACT == "gelu":
        return 0.5 * x * (1.0 + tl.math.erf(x * _SQRT_HALF))
    elif ACT == "gelu_tanh":
        return 0.5 * x * (1.0 + _tanh((x + x * x * x * _GELU_C) * _SQRT_2_OVER_PI))
    elif ACT == "relu":
        return tl.maximum(x, 0.0)
    else:  # relu2
        r = tl.maximum(x, 0.0)
        return r * r


@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    """d act / d x."""
    if ACT == "silu":
        s = tl.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    elif ACT == "gelu":
        return 0.5 * (1.0 + tl.math.erf(x * _SQRT_HALF)) + x * _INV_SQRT_2PI * tl.exp(-0.5 * x * x)
    elif ACT == "gelu_tanh":
        t = _tanh((x + x * x * x * _GELU_C) * _SQRT_2_OVER_PI)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + x * x * _GELU_C * 3.0)
    elif ACT == "relu":
        return tl.where(x > 0, 1.0, 0.0)
    else:  # relu2
        return 2.0 * tl.maximum(x, 0.0)


@triton.jit
def _act_fwd_kernel(
    h_ptr, scale_ptr, out_ptr, M, W, stride_hm, stride_hw,
    ACT: tl.constexpr, GLU: tl.constexpr, HAS_SCALE: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """h [M, 2W] (GLU) or [M, W], any strides; scale [M] or None -> out [M, W] contiguous."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (rows[:, None] < M) & (cols[None, :] < W)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_hm
    gate = tl.load(h_rows + cols[None, :] * stride_hw, mask=mask, other=0.0).to(COMPUTE)
    a = _act(gate, ACT)
    if GLU:
        a = a * tl.load(h_rows + (cols[None, :] + W) * stride_hw, mask=mask, other=0.0).to(COMPUTE)
    if HAS_SCALE:
        a = a * tl.load(scale_ptr + rows, mask=rows < M, other=0.0).to(COMPUTE)[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * W + cols[None, :], cast(a, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_bwd_kernel(
    grad_ptr, h_ptr, scale_ptr, grad_h_ptr, grad_scale_ptr, out_ptr, M, W,
    stride_gm, stride_gw, stride_hm, stride_hw,
    ACT: tl.constexpr, GLU: tl.constexpr, HAS_SCALE: tl.constexpr, RETURN_OUTPUT: tl.constexpr,
    COMPUTE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """grad [M, W], h [M, 2W] or [M, W], scale [M] or None -> grad_h like h (contiguous), grad_scale [M] (when
    scaled), out [M, W] (when RETURN_OUTPUT)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = rows < M
    rows64 = rows.to(tl.int64)
    width_h = 2 * W if GLU else W
    if HAS_SCALE:
        scale = tl.load(scale_ptr + rows, mask=in_rows, other=0.0).to(COMPUTE)
    grad_scale = tl.zeros((BLOCK_R,), dtype=COMPUTE)
    for col0 in range(0, W, BLOCK_W):
        cols = col0 + tl.arange(0, BLOCK_W)
        mask = in_rows[:, None] & (cols[None, :] < W)
        g = tl.load(grad_ptr + rows64[:, None] * stride_gm + cols[None, :] * stride_gw, mask=mask, other=0.0)
        g = g.to(COMPUTE)
        h_rows = h_ptr + rows64[:, None] * stride_hm
        gate = tl.load(h_rows + cols[None, :] * stride_hw, mask=mask, other=0.0).to(COMPUTE)
        act = _act(gate, ACT)
        value = act
        if GLU:
            up = tl.load(h_rows + (cols[None, :] + W) * stride_hw, mask=mask, other=0.0).to(COMPUTE)
            value = act * up
        if HAS_SCALE:
            grad_scale += tl.sum(g * value, axis=1)
            g = g * scale[:, None]
            value = value * scale[:, None]
        grad_h_rows = grad_h_ptr + rows64[:, None] * width_h
        d_gate = g * _act_grad(gate, ACT)
        if GLU:
            tl.store(grad_h_rows + cols[None, :], cast(d_gate * up, grad_h_ptr.dtype.element_ty), mask=mask)
            tl.store(grad_h_rows + cols[None, :] + W, cast(g * act, grad_h_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(grad_h_rows + cols[None, :], cast(d_gate, grad_h_ptr.dtype.element_ty), mask=mask)
        if RETURN_OUTPUT:
            tl.store(out_ptr + rows64[:, None] * W + cols[None, :], cast(value, out_ptr.dtype.element_ty), mask=mask)
    if HAS_SCALE:
        tl.store(grad_scale_ptr + rows, cast(grad_scale, grad_scale_ptr.dtype.element_ty), mask=in_rows)


def _check(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"hf_moe Triton activation kernels implement {', '.join(ACTIVATIONS)}, not {activation!r}; "
                         "other activations run through the pure-torch one (hf_moe.ops.reference.expert_act).")


def expert_act(h: torch.Tensor, row_scale: torch.Tensor | None, activation: str, glu: bool, blocks: dict | None = None):
    """`reference.expert_act`: [M, W] -> [M, I], act(gate) * up (GLU, I = W / 2) or act(h), times row_scale [M]."""
    _check(activation)
    device = check_device(h, row_scale)
    blocks = blocks or (INTERPRETER_BLOCKS if INTERPRETING else GPU_BLOCKS)
    m, width = h.shape[0], h.shape[1] // 2 if glu else h.shape[1]
    out = h.new_empty(m, width)
    if m and width:
        grid = (triton.cdiv(m, blocks["BLOCK_R"]), triton.cdiv(width, blocks["BLOCK_W"]))
        launch(
            _act_fwd_kernel, grid, device, h, row_scale if row_scale is not None else h, out, m, width,
            h.stride(0), h.stride(1), ACT=activation, GLU=glu, HAS_SCALE=row_scale is not None,
            COMPUTE=accumulator(h.dtype), **blocks,
        )
    return out


def expert_act_backward(
    grad: torch.Tensor, h: torch.Tensor, row_scale: torch.Tensor | None, activation: str, glu: bool,
    return_output: bool, blocks: dict | None = None,
):
    """`reference.expert_act_backward`: (grad_h [M, W], grad_row_scale [M] (or [0] without row_scale), and the
    forward output [M, I] when `return_output`, else [0, I])."""
    _check(activation)
    device = check_device(grad, h, row_scale)
    blocks = blocks or (INTERPRETER_BLOCKS if INTERPRETING else GPU_BLOCKS)
    m, width = h.shape[0], h.shape[1] // 2 if glu else h.shape[1]
    grad_h = torch.empty(h.shape, dtype=h.dtype, device=device)
    grad_scale = torch.empty(m if row_scale is not None else 0, dtype=(row_scale if row_scale is not None else h).dtype,
                             device=device)
    out = h.new_empty(m if return_output else 0, width)
    if m and width:
        launch(
            _act_bwd_kernel, (triton.cdiv(m, blocks["BLOCK_R"]),), device, grad, h,
            row_scale if row_scale is not None else h, grad_h, grad_scale if row_scale is not None else h, out,
            m, width, grad.stride(0), grad.stride(1), h.stride(0), h.stride(1), ACT=activation, GLU=glu,
            HAS_SCALE=row_scale is not None, RETURN_OUTPUT=return_output, COMPUTE=accumulator(h.dtype), **blocks,
        )
    elif row_scale is not None:
        grad_scale.zero_()
    return grad_h, grad_scale, out
