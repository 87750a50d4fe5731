"""The plain Accelerate loop with expert parallelism (DDP for the other parameters), run by tests/test_distributed.py
on CPU (gloo):

    torchrun --nproc_per_node 2 tests/dist/accelerate_ddp.py OUT     # EP 2; saves OUT/state-2
    torchrun --nproc_per_node 4 tests/dist/accelerate_ddp.py OUT     # EP 4, and EP 2 x "dp" 2; loads OUT/state-2

What a user writes: `Accelerator(cpu=True)` (on CPU; the process group is gloo),
`MoEForCausalLM.from_pretrained(path, expert_parallel=True)`, `accelerator.prepare(model, optimizer)`,
`accelerator.backward`, `accelerator.clip_grad_norm_`, and `accelerator.save_state` / `load_state` after
`hf_moe.parallel.register_for_checkpointing`. The reference is one process computing the mean loss over every
process's micro-batches. Every check raises on failure; rank 0 prints "OK <check>" for each one that passed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import VOCAB, tiny_dense  # noqa: E402

import hf_moe  # noqa: E402
from hf_moe import MoEForCausalLM, convert_to_moe  # noqa: E402

RANK, WORLD = 0, 1
NUM_EXPERTS, ROWS, LENGTH, MAX_NORM, LR = 8, 8, 10, 0.5, 2e-3


def ok(name: str) -> None:
    dist.barrier()
    if RANK == 0:
        print("OK", name, flush=True)


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def batch(step: int, micro: int, parts: int) -> torch.Tensor:
    """Micro-batch `micro` of the `parts` that `step`'s global batch of ROWS rows splits into."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(3, VOCAB, (ROWS, LENGTH), generator=g).chunk(parts)[micro]


def assert_close(actual, expected, what: str, rtol: float = 1e-5) -> float:
    """Equal within `rtol` relative to the tensor's largest entry; returns the largest difference relative to it."""
    actual, scale = full(actual), expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual, expected.detach(), rtol=rtol, atol=rtol * scale, msg=what)
    return (actual - expected).abs().max().item() / scale


def reference(path: Path, step: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One process, 2 micro-batches per process: the gradients of the mean loss, and the total norm."""
    model = MoEForCausalLM.from_pretrained(path).train()
    parts = 2 * WORLD
    loss = sum(model(input_ids=batch(step, i, parts), labels=batch(step, i, parts)).loss for i in range(parts))
    (loss / parts).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))


def prepared(path: Path, ep: int):
    """The user's code: an Accelerator, this process's experts, AdamW, prepare (DDP), register for save_state."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # on GPUs: Accelerator() (see docs/scale.md for what Accelerate allows there)
    model = MoEForCausalLM.from_pretrained(path, expert_parallel=True, expert_parallel_size=ep).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    hf_moe.parallel.register_for_checkpointing(accelerator, model, optimizer)
    return accelerator, model, optimizer


def step(accelerator, model, optimizer, index: int) -> None:
    """Two micro-batches, the first without DDP's gradient sync (gradient accumulation). Between forward and
    backward each process holds only its 1 / WORLD of the experts (FSDP2 reshards them after forward)."""
    parts = 2 * WORLD
    for micro in (0, 1):
        ids = batch(index, 2 * RANK + micro, parts)
        context = accelerator.no_sync(model) if micro == 0 else torch.enable_grad()
        with context:
            loss = model(input_ids=ids, labels=ids).loss / 2
            for layer in model.module.model.layers:
                held = layer.mlp.experts.gate_up_proj.to_local().shape[0]
                assert held == NUM_EXPERTS // WORLD, f"{held} experts held between forward and backward"
            accelerator.backward(loss)


def gradients_and_clipping(path: Path, ep: int, tag: str) -> None:
    grads, norm = reference(path)
    accelerator, model, optimizer = prepared(path, ep)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    step(accelerator, model, optimizer, 0)
    names = [n for n, _ in model.module.named_parameters()]
    assert sorted(names) == sorted(grads), f"{tag}: parameter names differ"
    worst = max(assert_close(p.grad, grads[n], f"{tag}: gradient of {n}") for n, p in model.module.named_parameters())
    ok(f"every gradient equals single-process, accumulation included ({tag}; largest relative difference "
       f"{worst:.1e}); 1 / {WORLD} of the experts held through the step")
    total = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert_close(total, norm, f"{tag}: clip_grad_norm_")
    coefficient = min(1.0, MAX_NORM / (norm.item() + 1e-6))
    for name, param in model.module.named_parameters():
        assert_close(param.grad, grads[name] * coefficient, f"{tag}: clipped gradient of {name}")
    ok(f"accelerator.clip_grad_norm_ returns the single-process norm and clips alike ({tag})")


def snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    """Every weight and AdamW state, whole (a collective: every process calls it)."""
    out = {}
    for name, param in model.module.named_parameters():
        out[name] = full(param).clone()
        for key, value in optimizer.optimizer.state[param].items():
            out[f"{name}:{key}"] = full(value).clone()
    return out


def save_state(path: Path, out: Path) -> None:
    accelerator, model, optimizer = prepared(path, WORLD)
    step(accelerator, model, optimizer, 0)
    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.save_state(out / f"state-{WORLD}")
    expected = snapshot(model, optimizer)
    if RANK == 0:
        torch.save(expected, out / f"expected-{WORLD}.pt")
        assert (out / f"state-{WORLD}" / "expert_parallel" / "dcp" / ".metadata").is_file()
    accelerator, loaded_model, loaded_optimizer = prepared(path, WORLD)  # the weights before the step
    accelerator.load_state(out / f"state-{WORLD}")
    got = snapshot(loaded_model, loaded_optimizer)
    assert got.keys() == expected.keys() and any(":exp_avg" in k and "experts" in k for k in got), sorted(got)[:4]
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)
    ok(f"accelerator.save_state / load_state restore every expert and its AdamW state (world {WORLD})")


def load_other_layout(path: Path, out: Path, ep: int, saved_world: int) -> None:
    expected = torch.load(out / f"expected-{saved_world}.pt")
    accelerator, model, optimizer = prepared(path, ep)
    accelerator.load_state(out / f"state-{saved_world}")
    got = snapshot(model, optimizer)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)
    ok(f"a save_state of {saved_world} processes loads with EP {ep} on {WORLD}")


def main(out: str) -> None:
    global RANK, WORLD
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    out = Path(out)
    accelerator = Accelerator(cpu=True)  # creates the process group (gloo)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    path = out / "moe"
    if RANK == 0 and not path.exists():
        torch.manual_seed(0)
        convert_to_moe(tiny_dense(), num_experts=NUM_EXPERTS, top_k=2, noise=0.05, router_aux_loss_coef=1.0,
                       router_z_loss_coef=0.1).save_pretrained(path)
    dist.barrier()
    if WORLD == 2:
        gradients_and_clipping(path, 2, "world 2, EP 2")
        save_state(path, out)
    else:
        gradients_and_clipping(path, 4, "world 4, EP 4")
        gradients_and_clipping(path, 2, "world 4, EP 2 x dp 2")
        load_other_layout(path, out, 4, saved_world=2)
        load_other_layout(path, out, 2, saved_world=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
