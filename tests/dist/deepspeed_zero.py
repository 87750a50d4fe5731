"""A few DeepSpeed training steps of a converted tiny model under ZeRO-2, then ZeRO-3, in the same processes; rank 0
writes the losses to OUT (JSON).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/dist/deepspeed_zero.py OUT

Plain `deepspeed.initialize` on gloo (DeepSpeed's CPU accelerator uses gloo without oneCCL), fp32, torch's AdamW, no
gradient clipping. Both stages see the same model, batches and seeds, so their losses must agree (to fp32 rounding:
see tests/test_tools.py). ZeRO-3 used to fail on the first backward, because its hooks did not look inside the
router's dataclass output. Prints "SKIP <reason>" and exits 0 when deepspeed cannot be imported. Launched
by tests/test_tools.py.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at import

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import VOCAB, tiny_dense  # noqa: E402

from hf_moe import convert_to_moe  # noqa: E402

STEPS, MICRO_BATCH = 4, 2


def train(deepspeed, stage: int) -> dict:
    torch.manual_seed(0)
    # Non-zero aux and z coefficients: the backward goes through every tensor the routers returned.
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        # Every parameter partitioned under ZeRO-3, however small (the default keeps those under 1e5 elements whole).
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "gradient_clipping": 0.0,
        "zero_force_ds_cpu_optimizer": False,  # DeepSpeedCPUAdam is a compiled op; DS_BUILD_OPS=0 installs none
        "steps_per_print": 10**6,
    }
    engine, *_ = deepspeed.initialize(model=moe.train(), model_parameters=moe.parameters(), config=config)
    rank = torch.distributed.get_rank()
    # Each rank trains on its own fixed micro-batch, so the loss must fall step after step.
    rows = torch.randint(3, VOCAB, (2 * MICRO_BATCH, 12), generator=torch.Generator().manual_seed(1))
    ids = rows[rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH]
    # Under ZeRO-3 each rank holds a shard of every parameter between forwards: the module's own tensors are empty.
    local = sum(p.numel() for p in engine.module.parameters())
    full = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    losses, aux = [], []
    for _ in range(STEPS):
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        both = torch.stack([out.loss.detach(), out.aux_loss.detach()])
        torch.distributed.all_reduce(both)  # a sum of two fp32 values: the same on every rank and in every stage
        losses.append(both[0].item() / 2)
        aux.append(both[1].item() / 2)
    engine.destroy()
    return {"loss": losses, "aux_loss": aux, "local_numel": local, "numel": full}


def main(out: str) -> None:
    try:
        import deepspeed
    except Exception as err:  # not installed, or installed without a usable build
        print(f"SKIP deepspeed cannot be imported: {type(err).__name__}: {err}")
        return
    deepspeed.init_distributed(dist_backend="gloo")
    result = {"deepspeed": deepspeed.__version__, "zero2": train(deepspeed, 2), "zero3": train(deepspeed, 3)}
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
