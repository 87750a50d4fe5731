"""Merging experts instead of dropping them (after MC-SMoE, Li et al. 2024, "Merge, then compress").

For one layer, given the `keep` experts that stay (the centres: the reconstruction subset):

1. group: every other expert joins the centre whose router logits correlate best with its own over the calibration
   tokens (MC-SMoE groups by router-logit similarity);
2. align: the other expert's intermediate neurons are permuted to match the centre's (each neuron described by its
   gate and up rows and its down column; matched by cosine similarity, mutual best pairs first, then greedily), so
   that averaging adds like to like (experts trained apart number their neurons arbitrarily);
3. merge: the group's aligned weights averaged, each weighted by the routing weight it carried on the calibration
   text (MC-SMoE weights by frequency);
4. route: the merged expert's router row is fitted by least squares so that its logit is the log-sum-exp of the
   group's logits (its softmax probability is then the group's summed probability, where MC-SMoE keeps the centre's
   row); for a sigmoid router, the logit of the group's summed score;
5. check: a group is merged only if the layer's reconstruction error on the calibration tokens goes down (with the
   fitted row or the centre's own, whichever is better); otherwise the others are dropped, as in pruning. So a
   merge never reconstructs worse than reconstruction pruning with the same centres.
"""

from __future__ import annotations

import torch

from .layer import expert_outputs, select_rows
from .select import Choice, Reconstruction

MUTUAL_ROUNDS = 8  # rounds of mutual-best neuron matching before the rest is matched greedily


def logit_correlation(logits: torch.Tensor) -> torch.Tensor:
    """[E, E] correlation of the router logits' columns over the tokens (logits [N, E])."""
    centred = logits.double() - logits.double().mean(0)
    centred = centred / centred.norm(dim=0).clamp_min(1e-12)
    return centred.t() @ centred


def groups_for(centres: list[int], similarity: torch.Tensor) -> dict[int, list[int]]:
    """{centre: the other experts closest to it} (each non-centre to its most similar centre)."""
    groups = {c: [] for c in centres}
    index = torch.tensor(centres)
    for j in range(similarity.shape[0]):
        if j not in groups:
            groups[centres[int(similarity[j, index].argmax())]].append(j)
    return groups


def neuron_features(params: dict[str, torch.Tensor], e: int, glu: bool) -> torch.Tensor:
    """[I, ...] what each intermediate neuron of expert e reads and writes: (gate row, up row, down column)."""
    up = params["gate_up_proj" if glu else "up_proj"][e]
    down = params["down_proj"][e]
    parts = list(up.chunk(2, dim=0)) if glu else [up]
    return torch.cat([*parts, down.t()], dim=1)


def match_neurons(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """[I] permutation p with other[p[i]] the neuron matched to reference[i] (features [I, D] each)."""
    a = reference / reference.norm(dim=1, keepdim=True).clamp_min(1e-12)
    b = other / other.norm(dim=1, keepdim=True).clamp_min(1e-12)
    sim = a @ b.t()
    n = sim.shape[0]
    perm = torch.full((n,), -1, dtype=torch.long)
    rows, cols = torch.arange(n), torch.arange(n)
    for _ in range(MUTUAL_ROUNDS):
        if rows.numel() == 0:
            break
        sub = sim[rows][:, cols]
        best_col, best_row = sub.argmax(1), sub.argmax(0)
        mutual = best_row[best_col] == torch.arange(rows.numel())
        if not mutual.any():
            break
        perm[rows[mutual]] = cols[best_col[mutual]]
        taken = torch.zeros(cols.numel(), dtype=torch.bool)
        taken[best_col[mutual]] = True
        rows, cols = rows[~mutual], cols[~taken]
    free = torch.ones(n, dtype=torch.bool)
    free[perm[perm >= 0]] = False
    for r in rows[sim[rows].max(1).values.argsort(descending=True)].tolist():  # the rest, surest first
        c = int(torch.where(free, sim[r], -torch.inf).argmax())
        perm[r], free[c] = c, False
    return perm


def permuted(params: dict[str, torch.Tensor], e: int, perm: torch.Tensor, glu: bool) -> dict[str, torch.Tensor]:
    """Expert e's tensors with its intermediate neurons in the order `perm`."""
    out = {}
    for name, tensor in params.items():
        t = tensor[e]
        if name in ("gate_up_proj", "gate_up_proj_bias") and glu:
            gate, up = t.chunk(2, dim=0)
            t = torch.cat([gate[perm], up[perm]], dim=0)
        elif name in ("up_proj", "up_proj_bias"):
            t = t[perm]
        elif name == "down_proj":
            t = t[:, perm]
        out[name] = t
    return out


def merge_group(params: dict[str, torch.Tensor], members: list[int], weights: torch.Tensor,
                glu: bool) -> dict[str, torch.Tensor]:
    """The weighted average of experts `members` (the first is the centre the others are aligned to); weights [m]
    summing to one. Returns {name: [1, ...]}."""
    centre = members[0]
    reference = neuron_features(params, centre, glu)
    merged = {name: weights[0] * t[centre] for name, t in params.items()}
    for w, j in zip(weights[1:].tolist(), members[1:]):
        perm = match_neurons(reference, neuron_features(params, j, glu))
        for name, t in permuted(params, j, perm, glu).items():
            merged[name] = merged[name] + w * t
    return {name: t.unsqueeze(0) for name, t in merged.items()}


def fit_row(x: torch.Tensor, logits: torch.Tensor, members: list[int], sigmoid: bool) -> torch.Tensor:
    """[H] router row whose logit best matches (least squares, a little ridge) the group's combined logit: the
    log-sum-exp of the members' logits (softmax routers), or the logit of their summed scores (sigmoid)."""
    group = logits[:, members].double()
    if sigmoid:
        target = torch.logit(group.sigmoid().sum(1).clamp(max=1 - 1e-4))
    else:
        target = torch.logsumexp(group, dim=1)
    xd = x.double()
    gram = xd.t() @ xd
    ridge = 1e-6 * gram.diagonal().mean().clamp_min(1e-12)
    return torch.linalg.solve(gram + ridge * torch.eye(gram.shape[0], dtype=gram.dtype), xd.t() @ target).float()


def merge_layer(rec: Reconstruction, experts, params: dict[str, torch.Tensor], centres: list[int],
                groups: dict[int, list[int]], sigmoid: bool) -> tuple[Choice, dict[str, torch.Tensor], dict]:
    """Merge each group into its centre where that lowers the layer's error (see the module docstring).

    Returns (the choice: kept centres and the groups merged, with the error), the router state of the kept rows,
    and {name: [keep, ...]} expert tensors.
    """
    data = rec.data
    e = data.num_experts
    glu = getattr(experts, "has_gate", True)
    _, mass = data.usage()
    state = select_rows(rec.state, centres, e)
    kept = {name: t[centres].clone() for name, t in params.items()}
    outputs = data.outputs[centres].clone()
    error = rec.error(centres, state, outputs)
    merged_groups = {}
    for slot, c in enumerate(centres):
        members = [c, *groups.get(c, [])]
        if len(members) == 1:
            continue
        share = mass[members]
        weights = share / share.sum() if share.sum() > 0 else torch.full((len(members),), 1 / len(members))
        merged = merge_group(params, members, weights.float(), glu)
        merged_out = expert_outputs(experts, merged, data.x)[0]
        trial_out = outputs.clone()
        trial_out[slot] = merged_out
        best = None
        for row in (fit_row(data.x, data.logits, members, sigmoid), state["weight"][slot]):
            trial_state = dict(state, weight=state["weight"].clone())
            trial_state["weight"][slot] = row
            trial = rec.error(centres, trial_state, trial_out)
            if trial < error and (best is None or trial < best[0]):
                best = (trial, trial_state)
        if best is not None:
            error, state, outputs = best[0], best[1], trial_out
            for name, t in merged.items():
                kept[name][slot] = t[0]
            merged_groups[c] = members[1:]
    return Choice(list(centres), merged_groups, error), state, kept
