"""Step 6b of gpu_check, one process per GPU: `torchrun --nproc-per-node=N -m hf_moe.gpu_check.ep_step`.

Every process builds the same converted model, applies `hf_moe.parallelize` (expert parallelism x FSDP2 on one
("dp", "ep") mesh over NCCL) and runs one training step on its own micro-batch, then a clip and an AdamW step. Rank 0
also runs an unsharded copy on all the micro-batches (their mean loss): the losses and gradients must agree.
Rank 0 prints `EP_STEP <summary>` when they do, and the process exits non-zero when they do not.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from ..parallel import parallelize
from .correctness import rel_error
from .steps import _tiny_model


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    model = _tiny_model(device, smoke=False)
    reference = copy.deepcopy(model) if rank == 0 else None
    ids = torch.randint(3, 512, (2 * world, 256), generator=torch.Generator().manual_seed(0)).to(device)
    parallelize(model)
    loss = model(input_ids=ids.chunk(world)[rank], labels=ids.chunk(world)[rank]).loss
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = g
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.AdamW(model.parameters(), lr=1e-4).step()
    problems = []
    if rank == 0:
        want = sum(reference(input_ids=c, labels=c).loss for c in ids.chunk(world)) / world
        want.backward()
        if abs(float(mean_loss - want)) > 1e-3 * abs(float(want)):
            problems.append(f"loss {float(mean_loss):.6f} vs one process {float(want):.6f}")
        want_grads = dict(reference.named_parameters())
        errors = {n: rel_error(g, want_grads[n].grad) for n, g in grads.items()}
        worst = max(errors, key=errors.get)
        if errors[worst] > 1e-3:
            problems.append(f"gradient of {worst} off by {errors[worst]:.2e}")
        print("EP_STEP " + ("; ".join(problems) if problems else
                            f"{world} processes: loss {float(mean_loss):.5f} = one process's; largest gradient error "
                            f"{errors[worst]:.1e}"), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
