"""The decode step's own ops, inference only: `hf_moe::linear_infer` and `hf_moe::decode_attention_block` (CPU
kernels in csrc/cpu/decode_cpu.cpp), their pure-torch references (the oracle of the tests, and what runs without the
extension) and their shape functions.

    linear_infer(x [N, K], weight [O, K], weight_scale, bias) -> [N, O]
        F.linear with fp32, bf16 or int8 weights (weight-only int8: fp32 scales [O] per output row, or [O, G] per
        group of K / G inputs; the reference dequantizes, then multiplies, as for int8 experts, int8.py).

    decode_attention_block(hidden [B, H], ..., k_cache [B, Hkv, L, D], v_cache, position, mask [B, L], ...)
        -> (hidden [B, H], normed [B, H])
        one token's attention sub-block of a Llama-style decoder layer (transformers' LlamaDecoderLayer up to its
        MLP), on a static KV cache: RMSNorm, q/k/v projections, per-head q/k RMSNorm (Qwen3), rotary embedding,
        k and v written into the caches at `position` (in place), attention over the positions `mask` allows
        (None: every position up to `position`), o projection, residual add; `normed` is the post-attention RMSNorm
        of the result (the MLP's input).

Both run without autograd; hf_moe calls them only when no gradient is needed (`hf_moe.decode`,
`hf_moe.layers.quantized_linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .int8 import dequantize_int8

SCHEMAS = {
    "linear_infer": "(Tensor x, Tensor weight, Tensor? weight_scale, Tensor? bias, str kernels=\"auto\") -> Tensor",
    "decode_attention_block": (
        "(Tensor hidden, Tensor input_norm, float eps, Tensor wq, Tensor? wq_scale, Tensor? bq, Tensor wk, "
        "Tensor? wk_scale, Tensor? bk, Tensor wv, Tensor? wv_scale, Tensor? bv, Tensor wo, Tensor? wo_scale, "
        "Tensor? bo, Tensor? q_norm, Tensor? k_norm, float qk_eps, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor position, Tensor? mask, float scaling, Tensor post_norm, float post_eps, "
        "str kernels=\"auto\") -> (Tensor, Tensor)"
    ),
}


def _weight(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_int8(w, scale, dtype) if w.dtype == torch.int8 else w


def linear_infer_reference(x, weight, weight_scale, bias, kernels="auto"):
    """F.linear on the dequantized weight: [N, K] -> [N, O] in x's dtype."""
    return F.linear(x, _weight(weight, weight_scale, x.dtype), None if bias is None else bias.to(x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: weight * dtype(x * rsqrt(mean(x^2) + eps)), the mean in fp32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def decode_attention_block_reference(hidden, input_norm, eps, wq, wq_scale, bq, wk, wk_scale, bk, wv, wv_scale, bv,
                                     wo, wo_scale, bo, q_norm, k_norm, qk_eps, cos, sin, k_cache, v_cache, position,
                                     mask, scaling, post_norm, post_eps, kernels="auto"):
    """The transformers ops the kernel fuses, in their order (module docstring). Traceable with symbolic sizes (no
    host read of `position`): it is also the op's decomposition (decompositions.py)."""
    b, _ = hidden.shape
    _, kv_heads, length, d = k_cache.shape
    x = rms_norm(hidden, input_norm, eps)
    q = linear_infer_reference(x, wq, wq_scale, bq).view(b, -1, d)
    k = linear_infer_reference(x, wk, wk_scale, bk).view(b, kv_heads, d)
    v = linear_infer_reference(x, wv, wv_scale, bv).view(b, kv_heads, d)
    if q_norm is not None:
        q = rms_norm(q, q_norm, qk_eps)
    if k_norm is not None:
        k = rms_norm(k, k_norm, qk_eps)
    q, k = rotary(q, cos[:, None], sin[:, None]), rotary(k, cos[:, None], sin[:, None])
    at = position.reshape(1)  # [1] int64
    k_cache.index_copy_(2, at, k[:, :, None].to(k_cache.dtype))
    v_cache.index_copy_(2, at, v[:, :, None].to(v_cache.dtype))
    if mask is None:
        mask = (torch.arange(length, device=hidden.device) <= at).expand(b, length)
    attn = F.scaled_dot_product_attention(q[:, :, None], k_cache, v_cache, attn_mask=mask[:, None, None, :],
                                          scale=scaling, enable_gqa=True)  # [B, Hq, 1, D]
    out = hidden + linear_infer_reference(attn.reshape(b, -1), wo, wo_scale, bo)
    return out, rms_norm(out, post_norm, post_eps)


def linear_infer_fake(x, weight, weight_scale, bias, kernels="auto"):
    return x.new_empty(x.shape[0], weight.shape[0])


def decode_attention_block_fake(hidden, *args, **kwargs):
    return torch.empty_like(hidden), torch.empty_like(hidden)


TORCH_KERNELS = {"linear_infer": linear_infer_reference, "decode_attention_block": decode_attention_block_reference}
FAKE_KERNELS = {"linear_infer": linear_infer_fake, "decode_attention_block": decode_attention_block_fake}
