"""Expert parallelism as a wrapper around the experts' own forward: dispatch before it, combine after it.

Per MoE layer, on each rank of an EP group of P ranks (N local tokens, k slots, H hidden, E experts, E/P per rank),
as torchtitan's `ExpertParallel` does around its `GroupedExperts`:

    dispatch  1. sort the N*k pairs by expert (so by destination rank: experts are placed in contiguous blocks);
              2. exchange the per-expert counts (all_to_all of P * E/P integers); the split sizes are read on the host;
              3. all_to_all the rows (uneven splits), each with its routing weight; each rank receives, from every
                 source rank, rows grouped by its local experts;
    experts   4. the experts' forward (`hf_moe.ops.experts_forward`, the one a single process runs) on the received
                 rows, each with one slot (its local expert and routing weight), with this rank's block of the weights;
    combine   5. all_to_all the results back, and sum each token's k rows.

Backward runs the reverse exchanges through autograd. A rank that receives no rows still takes part in every
exchange, so nothing hangs. Bytes moved per layer and rank, forward (T local tokens, b bytes per element: the
autocast dtype's under autocast, `autocast_cast`): dispatch (rows and their weights) + combine
= T * k * (2H + 1) * b * (P - 1) / P with uniform routing; the backward moves the same again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.autograd import Function

from ..layers import Experts
from ..ops import autocast_cast, expert_weights, experts_forward, reference
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


class Dispatched(NamedTuple):
    """What `dispatch` sends to this rank's experts, and what `combine` needs to bring their outputs back."""

    rows: torch.Tensor  # [R, H] the received rows, by source rank, then local expert
    local_index: torch.Tensor  # [R, 1] each row's expert among this rank's
    weights: torch.Tensor  # [R, 1] each row's routing weight, in the rows' dtype (as one process casts it)
    send: list[int]  # rows sent to each rank
    recv: list[int]  # rows received from each rank
    slot_to_row: torch.Tensor  # [N * k] where each (token, slot) pair's row is in the sorted order
    dropped: int  # pairs of no expert (capacity), sorted last and never sent
    top_k: int


def dispatch(plan: ExpertParallelPlan, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor, num_experts: int) -> Dispatched:
    """Steps 1-3 of the module docstring: send each (token, slot) pair's row to the rank that holds its expert.

    Args:
        hidden_states: [N, H]; top_k_index: [N, k] ids in [0, `num_experts`); top_k_weights: [N, k].
    """
    k, local = top_k_index.shape[1], num_experts // plan.ep_size
    sorted_slots, slot_to_row, counts = reference.sort_by_expert(top_k_index, num_experts)
    send_counts = counts.view(plan.ep_size, local)
    recv_counts = _exchange_counts(send_counts, plan)
    send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()  # host reads: all_to_all needs them
    sent = sum(send)

    # Each row carries its routing weight as one more column: one exchange.
    rows = hidden_states.index_select(0, torch.div(sorted_slots[:sent], k, rounding_mode="floor"))
    row_weight = top_k_weights.reshape(-1).index_select(0, sorted_slots[:sent]).to(rows.dtype)
    received = _AllToAll.apply(torch.cat([rows, row_weight.unsqueeze(1)], 1), send, recv, plan.ep_group)
    local_index = torch.repeat_interleave(
        torch.arange(local, device=received.device).repeat(plan.ep_size), recv_counts.reshape(-1),
        output_size=received.shape[0],
    )
    return Dispatched(received[:, :-1], local_index.unsqueeze(1), received[:, -1:], send, recv, slot_to_row,
                      top_k_index.numel() - sent, k)


def combine(plan: ExpertParallelPlan, computed: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
    """Step 5: [R, H] weighted expert outputs -> [N, H], each token's k rows summed in fp32 and rounded once."""
    returned = _AllToAll.apply(computed, dispatched.recv, dispatched.send, plan.ep_group)  # [sent, H], sorted order
    # Dropped pairs' rows are zero, as the grouped GEMM leaves them on one process.
    rows = torch.cat([returned, returned.new_zeros(dispatched.dropped, returned.shape[1])])
    return reference.unpermute(rows, dispatched.slot_to_row, None, dispatched.top_k)


class ExpertParallelExperts(Experts):
    """`Experts` holding one process's block of experts, whose forward is the experts' own between a dispatch of each
    (token, slot) pair to the process that holds its expert and a combine of the results (module docstring).

    `shard.shard_experts` gives an `Experts` module this class, from outside, as `fully_shard` gives it its FSDP
    class: the model's own code never asks how it is sharded.
    """

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """[N, H] -> [N, H] through each token's k experts, wherever they are: the arithmetic of one process, the
        rows sent in the dtype the experts compute in (`autocast_cast`). Returns the (cast) tokens' dtype."""
        (hidden_states,) = autocast_cast(hidden_states)
        dispatched = dispatch(self.ep_plan, hidden_states, top_k_index, top_k_weights, self.num_experts)
        # The local block [E / P, ...] of each DTensor weight (FSDP2 has gathered it over "dp" for the forward); its
        # gradient flows back into the DTensor, and FSDP2 reduces it (shard.py).
        local = tuple(None if w is None else w.to_local() for w in expert_weights(self))
        computed = experts_forward(self, dispatched.rows, dispatched.local_index, dispatched.weights, local)
        return combine(self.ep_plan, computed, dispatched)

    def expert_choice(self, hidden_states, expert_index, expert_weights) -> torch.Tensor:
        raise NotImplementedError(
            "Expert-choice routing is not supported with expert parallelism: each expert would need every rank's "
            "tokens to pick from. Use a token-choice router, or train without expert parallelism."
        )
