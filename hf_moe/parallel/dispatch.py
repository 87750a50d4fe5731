"""Expert-parallel dispatch: send each (token, slot) pair to the rank that holds its expert, compute, send back.

Per MoE layer, on each rank of an EP group of P ranks (N local tokens, k slots, H hidden, E experts, E/P per rank):

    1. sort the N*k pairs by expert (so by destination rank: experts are placed in contiguous blocks);
    2. exchange the per-expert counts (all_to_all of P * E/P integers); the split sizes are read on the host;
    3. all_to_all the rows (uneven splits); each rank receives, from every source rank, rows grouped by its
       local experts;
    4. run the local experts on the received rows (hf_moe.ops, compiled when available), each row's routing weight
       (sent with it) folded in as on one process;
    5. all_to_all the results back, and sum each token's k rows.

Backward runs the reverse exchanges through autograd. A rank that receives no rows still takes part in every
exchange, so nothing hangs. Bytes moved per layer and rank, forward (T local tokens, b bytes per element: the
autocast dtype's under autocast): dispatch (rows and their weights) + combine = T * k * (2H + 1) * b * (P - 1) / P
with uniform routing; the backward moves the same again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

from ..layers import Experts
from ..ops import dispatch_ops, kernel_activation, reference, run_experts
from .mesh import ExpertParallelPlan


class _AllToAll(Function):
    """rows [sum(send), H] -> [sum(recv), H]: chunk i of `send` goes to rank i; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, rows, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = rows.new_empty(sum(recv), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send), grad.shape[1])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def _exchange_counts(send_counts: torch.Tensor, plan: ExpertParallelPlan) -> torch.Tensor:
    """[P, E/P] rows this rank sends to each rank's experts -> [P, E/P] rows each rank sends to this rank's."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv.view(-1), send_counts.contiguous().view(-1), group=plan.ep_group)
    return recv


def expert_parallel_forward(
    experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """[N, H] -> [N, H] through each token's k experts, wherever they are (see the module docstring).

    `experts` holds experts [expert_offset, expert_offset + num_local_experts) of `num_experts`, and `ep_plan`.
    The arithmetic is that of one process (`hf_moe.ops.experts_forward`): under autocast the tokens and the local
    weights are cast to the autocast dtype and the experts run in it (so the rows travel in it too); each row's
    routing weight, in the tokens' dtype, travels with it and is folded in before the down projection; each
    token's k rows are summed in fp32 and rounded once. Returns [N, H] in the (cast) tokens' dtype.
    """
    plan: ExpertParallelPlan = experts.ep_plan
    local = experts.num_local_experts
    activation = kernel_activation(experts.activation)
    w1 = experts.gate_up_proj if experts.has_gate else experts.up_proj
    b1 = experts.gate_up_proj_bias if experts.has_gate else experts.up_proj_bias
    # The local block [E / P, ...] of each DTensor weight (FSDP2 has gathered it over "dp" for the forward); its
    # gradient flows back into the DTensor, and FSDP2 reduces it (shard.py).
    params = [None if p is None else p.to_local() for p in (w1, b1, experts.down_proj, experts.down_proj_bias)]
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):  # as experts_forward does: autocast's cast of nn.Linear
        dtype = torch.get_autocast_dtype(device_type)
        hidden_states, *params = (None if t is None else t.to(dtype) for t in (hidden_states, *params))
        with torch.autocast(device_type, enabled=False):
            return _exchange_and_compute(plan, hidden_states, top_k_index, top_k_weights, params, local, activation,
                                         experts.has_gate, experts.num_experts)
    return _exchange_and_compute(plan, hidden_states, top_k_index, top_k_weights, params, local, activation,
                                 experts.has_gate, experts.num_experts)


def _exchange_and_compute(plan: ExpertParallelPlan, hidden_states, top_k_index, top_k_weights, params, local: int,
                          activation: str, glu: bool, num_experts: int) -> torch.Tensor:
    """Steps 1-5 of the module docstring with the local weights `params` (w1, b1, w2, b2) [E / P, ...]."""
    k = top_k_index.shape[1]
    sorted_slots, slot_to_row, counts = reference.sort_by_expert(top_k_index, num_experts)
    send_counts = counts.view(plan.ep_size, local)
    recv_counts = _exchange_counts(send_counts, plan)
    send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()  # host reads: all_to_all needs them
    sent = sum(send)

    # Each row carries its routing weight as one more column (in the tokens' dtype, as on one process): one exchange.
    rows = hidden_states.index_select(0, torch.div(sorted_slots[:sent], k, rounding_mode="floor"))
    row_weight = top_k_weights.reshape(-1).index_select(0, sorted_slots[:sent]).to(rows.dtype)
    received = _AllToAll.apply(torch.cat([rows, row_weight.unsqueeze(1)], 1), send, recv, plan.ep_group)
    received, received_weight = received[:, :-1], received[:, -1:]  # [R, H], [R, 1]: by source rank, local expert
    local_ids = torch.repeat_interleave(
        torch.arange(local, device=received.device).repeat(plan.ep_size), recv_counts.reshape(-1),
        output_size=received.shape[0],
    )
    computed = run_experts(
        dispatch_ops(received.device, activation, received.dtype), received, local_ids.unsqueeze(1), received_weight,
        *params, activation, glu,
    )
    returned = _AllToAll.apply(computed, recv, send, plan.ep_group)  # [sent, H], in our sorted order, weighted

    dropped = top_k_index.numel() - sent  # their rows are zero, as the grouped GEMM leaves them on one process
    return reference.unpermute(torch.cat([returned, returned.new_zeros(dropped, returned.shape[1])]), slot_to_row,
                               None, k)


class ExpertParallelExperts(Experts):
    """`Experts` holding one process's block of experts, whose forward sends each (token, slot) pair to the process
    that holds its expert (`expert_parallel_forward`).

    `shard.shard_experts` gives an `Experts` module this class, from outside, as `fully_shard` gives it its FSDP
    class: the model's own code never asks how it is sharded.
    """

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights)

    def expert_choice(self, hidden_states, expert_index, expert_weights) -> torch.Tensor:
        raise NotImplementedError(
            "Expert-choice routing is not supported with expert parallelism: each expert would need every rank's "
            "tokens to pick from. Use a token-choice router, or train without expert parallelism."
        )
