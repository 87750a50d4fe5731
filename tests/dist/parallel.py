"""Expert parallelism x FSDP2 checks, run by tests/test_distributed.py (CPU, gloo):

    torchrun --nproc_per_node 4 tests/dist/parallel.py four OUT      # EP 4; EP 2 x "dp" 2 (2 "nodes" x 2); by hand
    torchrun --nproc_per_node 2 tests/dist/parallel.py two OUT       # EP 2; resume OUT/state-4 on 2; Accelerate FSDP2
    torchrun --nproc_per_node 2 tests/dist/parallel.py trainer OUT   # MoETrainer and the plain Trainer
    python tests/dist/parallel.py one OUT                            # resume on 1 process, no process group

The reference is always one process computing the mean loss over every rank's micro-batch. Every check raises on
failure; rank 0 prints "OK <check>" for each one that passed.
"""

from __future__ import annotations

import copy
import json
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
NUM_EXPERTS, ROWS, LENGTH = 8, 8, 12
MAX_NORM, LR = 0.5, 2e-3
# The elastic run: steps 0-1 on 4 processes, 2-3 on 2, 4-5 on 1; each step's global batch is the same 8 rows,
# split into one micro-batch per process.
ELASTIC = {4: (0, 2), 2: (2, 4), 1: (4, 6)}
# Tolerances of the multi-step comparisons. The processes sum in another order than one process does (reduce-scatter,
# all-reduce, per-rank matmuls): gradients agree to ~1e-7 relative. AdamW then moves every element by about lr
# whatever the size of its gradient, so an element whose gradient is a near-cancelling sum (~1e-7 of the largest)
# can step differently. Measured after 3 steps: losses within 1e-6 relative, weights within 4.4e-6 (of a largest
# possible move of 3 x lr = 6e-3). Asserted: losses 1e-5 relative, weights 2e-5 absolute (0.3% of 3 x lr).
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 2e-5


def ok(name: str) -> None:
    if dist.is_initialized():
        dist.barrier()
    if RANK == 0:
        print("OK", name, flush=True)


def make_model(seed: int = 0, num_experts: int = NUM_EXPERTS) -> MoEForCausalLM:
    """The same tiny MoE on every process: 8 experts (noised so they differ), top-2, aux and z losses on."""
    moe = convert_to_moe(tiny_dense(seed=seed), num_experts=num_experts, top_k=2, noise=0.05,
                         router_aux_loss_coef=1.0, router_z_loss_coef=0.1)
    return moe.train()


def micro_batches(step: int, parts: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return list(torch.randint(3, VOCAB, (ROWS, LENGTH), generator=g).chunk(parts))


def mean_loss(model, batches) -> torch.Tensor:
    return sum(model(input_ids=ids, labels=ids).loss for ids in batches) / len(batches)


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def reference_step(model, step: int, parts: int):
    """One process: mean loss over the `parts` micro-batches of `step`, gradients, clipped norm. Returns the
    gradients before clipping and the norm."""
    model.zero_grad()
    loss = mean_loss(model, micro_batches(step, parts))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def assert_close(actual, expected, what: str, rtol: float = 1e-5) -> None:
    """Equal within `rtol` relative to the tensor's largest entry."""
    actual, expected = full(actual).detach(), expected.detach()
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale, msg=what)


def check_grads(model, grads: dict[str, torch.Tensor], tag: str) -> None:
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(grads), f"{tag}: parameter names differ"
    for name, param in model.named_parameters():
        assert_close(param.grad, grads[name], f"{tag}: gradient of {name}")


def sharded_step(model, step: int) -> torch.Tensor:
    """This process's micro-batch of `step`; returns the global mean loss (the mean over processes)."""
    loss = model(input_ids=micro_batches(step, WORLD)[RANK], labels=micro_batches(step, WORLD)[RANK]).loss
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean / WORLD


def train(model, optimizer, steps, parts: int | None = None) -> list[float]:
    """AdamW steps with torch's clip_grad_norm_ at MAX_NORM; sharded (parts None) or one process over `parts`."""
    losses = []
    for step in steps:
        if parts is None:
            loss = sharded_step(model, step)
        else:
            loss = mean_loss(model, micro_batches(step, parts))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR)


# ------------------------------------------------------------------------------------------------------------------
# Gradients, clipping and steps against one process
# ------------------------------------------------------------------------------------------------------------------
def gradients_and_clip(model, ep: int, tag: str):
    ref = copy.deepcopy(model)
    _, grads, ref_norm = reference_step(ref, 0, WORLD)
    sharded = hf_moe.parallelize(copy.deepcopy(model), expert_parallel_size=ep)
    sharded_step(sharded, 0)
    check_grads(sharded, grads, tag)
    ok(f"every gradient equals single-process ({tag})")
    norm = torch.nn.utils.clip_grad_norm_(sharded.parameters(), MAX_NORM)
    assert_close(norm, ref_norm, f"{tag}: clip_grad_norm_")
    check_grads(sharded, {n: p.grad for n, p in ref.named_parameters()}, f"{tag} clipped")
    ok(f"torch.nn.utils.clip_grad_norm_ returns the single-process norm ({tag})")
    return sharded


def three_steps(model, ep: int, tag: str) -> None:
    ref = copy.deepcopy(model)
    ref_losses = train(ref, adamw(ref), range(3), parts=WORLD)
    sharded = hf_moe.parallelize(copy.deepcopy(model), expert_parallel_size=ep)
    losses = train(sharded, adamw(sharded), range(3))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    for (name, p), q in zip(sharded.named_parameters(), ref.parameters()):
        torch.testing.assert_close(full(p).detach(), q.detach(), rtol=0, atol=WEIGHT_ATOL, msg=f"{tag}: {name}")
    ok(f"3 training steps equal single process ({tag})")


def autocast_matches_one_process(model, tag: str) -> None:
    """Under CPU autocast (bf16, fp32 weights: what Trainer(bf16=True) runs) the experts of an expert-parallel model
    compute as on one process: in bf16, each row's routing weight rounded to bf16 and folded in before the down
    projection, the k rows summed in fp32. The logits and loss of this process's micro-batch equal one process's,
    and so do the gradients (each process's micro-batch, their mean). On ffb5e1a the experts ran in fp32 under
    autocast (the dispatch bypassed its cast), and the logits differed from one process's."""
    ref = copy.deepcopy(model)
    sharded = hf_moe.parallelize(copy.deepcopy(model))
    ids = micro_batches(0, WORLD)
    ref.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = [ref(input_ids=i, labels=i) for i in ids]
        got = sharded(input_ids=ids[RANK], labels=ids[RANK])
    (sum(w.loss for w in want) / WORLD).backward()
    got.loss.backward()
    assert got.logits.dtype == want[RANK].logits.dtype == torch.bfloat16
    torch.testing.assert_close(got.logits, want[RANK].logits, rtol=0, atol=0, msg=f"{tag}: logits")
    torch.testing.assert_close(got.loss, want[RANK].loss, rtol=0, atol=0, msg=f"{tag}: loss")
    for name, param in sharded.named_parameters():
        expected = dict(ref.named_parameters())[name].grad
        assert_close(param.grad, expected, f"{tag}: gradient of {name}", rtol=1e-2)
    ok(f"under bf16 autocast the experts compute as on one process: logits and loss equal, gradients close ({tag})")


def expert_layout(model) -> None:
    """EP 2 x "dp" 2, 8 experts: process (d, p) stores experts 4p + 2d, 4p + 2d + 1, whole; the rest is HSDP."""
    from torch.distributed.tensor import Replicate, Shard

    from hf_moe.checkpoint.layout import whole_local_experts

    sharded = hf_moe.parallelize(copy.deepcopy(model), expert_parallel_size=2)
    plan = sharded.expert_parallel_plan
    assert (plan.dp_size, plan.ep_size, plan.dp_rank, plan.ep_rank) == (2, 2, RANK // 2, RANK % 2), plan
    experts = sharded.model.layers[1].mlp.experts
    local, ids = whole_local_experts(experts, experts.down_proj)
    first = 4 * plan.ep_rank + 2 * plan.dp_rank
    assert ids == [first, first + 1] and experts.down_proj.to_local().shape[0] == 2, (ids, local.shape)
    torch.testing.assert_close(local, model.model.layers[1].mlp.experts.down_proj[first : first + 2], rtol=0, atol=0)
    owned: list = [None] * WORLD
    dist.all_gather_object(owned, ids)
    assert sorted(e for ids in owned for e in ids) == list(range(NUM_EXPERTS)), owned
    assert sharded.model.layers[0].self_attn.q_proj.weight.placements == (Replicate(), Shard(0))
    meshes = {p.device_mesh for p in sharded.parameters()}
    assert meshes == {plan.mesh}, meshes
    ok("EP inside a node, FSDP across nodes: each expert stored whole on one process, one mesh for all parameters")


def sliced_experts(out: Path) -> None:
    """6 experts, EP 2 x "dp" 2: a block of 3 experts does not divide over 2 processes, so FSDP2 shards the experts on
    dim 1 (each process a slice of all 3). Gradients, memory (exactly half a block each) and the save still hold."""
    model = make_model(num_experts=6)
    ref = copy.deepcopy(model)
    _, grads, _ = reference_step(ref, 0, WORLD)
    sharded = hf_moe.parallelize(copy.deepcopy(model), expert_parallel_size=2)
    experts = sharded.model.layers[0].mlp.experts
    assert experts.down_proj.placements[0].dim == 1 and experts.down_proj.to_local().shape == (3, 32, 96)
    sharded_step(sharded, 0)
    check_grads(sharded, grads, "6 experts sliced on dim 1")
    weights = {n: full(p).detach().clone() for n, p in sharded.named_parameters()}
    sharded.save_pretrained(out / "sliced")
    if RANK == 0:
        loaded = MoEForCausalLM.from_pretrained(out / "sliced")
        for name, param in loaded.named_parameters():
            torch.testing.assert_close(param.detach(), weights[name], rtol=0, atol=0, msg=name)
    ok("3 experts per block over 2 processes: sliced on dim 1, gradients and save equal single-process")


# ------------------------------------------------------------------------------------------------------------------
# The user's recipe: hf_moe.expert_parallel, then fully_shard by hand
# ------------------------------------------------------------------------------------------------------------------
def by_hand(model) -> None:
    from accelerate import Accelerator
    from torch.distributed.fsdp import fully_shard

    ref = copy.deepcopy(model)
    _, grads, ref_norm = reference_step(ref, 0, WORLD)
    sharded = hf_moe.expert_parallel(copy.deepcopy(model), expert_parallel_size=2)
    for layer in sharded.model.layers:
        fully_shard(layer)  # FSDP2's default mesh: all processes, 1-D
    fully_shard(sharded)
    sharded_step(sharded, 0)
    check_grads(sharded, grads, "expert_parallel + fully_shard by hand")
    try:
        torch.nn.utils.clip_grad_norm_(sharded.parameters(), MAX_NORM)
    except RuntimeError as err:
        assert "mesh" in str(err), err
    else:
        raise AssertionError("torch's clip_grad_norm_ accepted gradients on two meshes")
    norm = Accelerator(cpu=True).clip_grad_norm_(sharded.parameters(), MAX_NORM)  # what Trainer calls
    assert_close(norm, ref_norm, "by hand: Accelerator.clip_grad_norm_")
    ok("expert_parallel + fully_shard by hand: gradients equal single-process; torch's clip refuses two meshes, "
       "Accelerate's returns the global norm")
    with_mesh = hf_moe.expert_parallel(copy.deepcopy(model), expert_parallel_size=2)
    mesh = hf_moe.parallel.device_mesh(with_mesh)
    for layer in with_mesh.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(with_mesh, mesh=mesh)
    sharded_step(with_mesh, 0)
    assert_close(torch.nn.utils.clip_grad_norm_(with_mesh.parameters(), MAX_NORM), ref_norm, "by hand on the mesh")
    ok("fully_shard by hand with mesh=hf_moe.parallel.device_mesh(model): torch's clip returns the global norm")


# ------------------------------------------------------------------------------------------------------------------
# save_pretrained from a sharded model
# ------------------------------------------------------------------------------------------------------------------
def save_sharded(model, out: Path) -> None:
    sharded = hf_moe.parallelize(copy.deepcopy(model), expert_parallel_size=2)
    train(sharded, adamw(sharded), range(2))
    weights = {n: full(p).detach().clone() for n, p in sharded.named_parameters()}
    sharded.save_pretrained(out / "saved")
    if RANK == 0:
        files = sorted(p.name for p in (out / "saved").glob("model-expert-*.safetensors"))
        assert files == [f"model-expert-{e:05d}.safetensors" for e in range(NUM_EXPERTS)], files
        config = json.loads((out / "saved" / "config.json").read_text())
        assert config["architectures"] == ["MoELlamaForCausalLM"], config["architectures"]
        loaded = MoEForCausalLM.from_pretrained(out / "saved")
        for name, param in loaded.named_parameters():
            torch.testing.assert_close(param.detach(), weights[name], rtol=0, atol=0, msg=name)
    ok("save_pretrained from EP 2 x FSDP 2 writes the per-expert layout; it reloads on one process bit for bit")
    loaded = MoEForCausalLM.from_pretrained(out / "saved", expert_parallel=True, expert_parallel_size=4)
    loaded = hf_moe.parallelize(loaded)
    for name, param in loaded.named_parameters():
        torch.testing.assert_close(full(param).detach(), weights[name], rtol=0, atol=0, msg=name)
    ok("the EP 2 x FSDP 2 save loads with EP 4 (each process reading its own experts) and parallelizes")


# ------------------------------------------------------------------------------------------------------------------
# Memory: hf-moe plan's arithmetic against the local tensors
# ------------------------------------------------------------------------------------------------------------------
def plan_arithmetic(model, ep: int) -> None:
    from hf_moe.parallel.sizing import Layout, estimate, measured_bytes

    sharded = hf_moe.parallelize(copy.deepcopy(model), expert_parallel_size=ep)
    optimizer = adamw(sharded)
    train(sharded, optimizer, range(1))
    sharded_step(sharded, 1)  # gradients present
    measured = measured_bytes(sharded, optimizer)
    expected = estimate(model, Layout(ep=ep, dp=WORLD // ep), dtype=torch.float32, optimizer_dtype=torch.float32)
    for key in ("weights", "gradients", "optimizer"):
        assert measured[key] == expected.per_rank[key], (RANK, key, measured[key], expected.per_rank[key])
    ok(f"hf-moe plan's bytes per rank equal the local tensors ({model.config.num_experts} experts, EP {ep} x dp "
       f"{WORLD // ep})")


# ------------------------------------------------------------------------------------------------------------------
# Elastic: DCP training state saved on 4 processes, resumed on 2, then on 1
# ------------------------------------------------------------------------------------------------------------------
def elastic(model, out: Path, resume_from: str | None, save_to: str) -> None:
    start, end = ELASTIC[WORLD]
    if WORLD > 1:
        sharded = hf_moe.parallelize(model, expert_parallel_size=2 if WORLD == 4 else None)
    else:
        sharded = model
    optimizer = adamw(sharded)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    if resume_from is not None:
        position = hf_moe.parallel.load_training_state(out / resume_from, sharded, optimizer, scheduler=scheduler)
        assert position == {"step": start, "samples": start * ROWS}, position
    losses = []
    for step in range(start, end):
        losses += train(sharded, optimizer, [step], parts=None if WORLD > 1 else 1)
        scheduler.step()
    hf_moe.parallel.save_training_state(out / save_to, sharded, optimizer, scheduler=scheduler,
                                        data_position={"step": end, "samples": end * ROWS})
    if RANK == 0:
        (out / f"losses-{WORLD}.json").write_text(json.dumps(losses))
    ok(f"elastic: steps {start}-{end - 1} on {WORLD} process(es), training state saved")


def elastic_reference() -> list[float]:
    """One process, uninterrupted: each step's mean over the same micro-batches as the elastic run."""
    model = make_model()
    optimizer = adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    losses = []
    for world, (start, end) in sorted(ELASTIC.items(), reverse=True):
        for step in range(start, end):
            losses += train(model, optimizer, [step], parts=world)
            scheduler.step()
    return losses


# ------------------------------------------------------------------------------------------------------------------
# Accelerate's FSDP2 code path, forced on CPU (Accelerate only sets DistributedType.FSDP with accelerators)
# ------------------------------------------------------------------------------------------------------------------
def accelerate_fsdp2(model, out: Path) -> None:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    ref = copy.deepcopy(model)
    _, grads, ref_norm = reference_step(ref, 0, WORLD)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type="FULL_STATE_DICT",
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    accelerator.state.distributed_type, accelerator.state.fsdp_plugin = DistributedType.FSDP, plugin
    PartialState().distributed_type = DistributedType.FSDP  # AcceleratorState() copies it back from here
    sharded = hf_moe.expert_parallel(copy.deepcopy(model))
    optimizer = adamw(sharded)
    sharded, optimizer = accelerator.prepare(sharded, optimizer)  # fsdp2_prepare_model: fully_shard per layer, root
    ids = micro_batches(0, WORLD)[RANK]
    accelerator.backward(sharded(input_ids=ids, labels=ids).loss)
    check_grads(sharded, grads, "Accelerate FSDP2")
    assert_close(accelerator.clip_grad_norm_(sharded.parameters(), MAX_NORM), ref_norm, "Accelerate FSDP2: clip")
    optimizer.step()
    state = accelerator.get_state_dict(sharded)  # FULL_STATE_DICT: what Trainer.save_model passes on rank 0
    weights = {n: full(p).detach().clone() for n, p in sharded.named_parameters()}
    if RANK == 0:
        sharded.save_pretrained(out / "accelerate", state_dict=state)
        loaded = MoEForCausalLM.from_pretrained(out / "accelerate")
        for name, param in loaded.named_parameters():
            torch.testing.assert_close(param.detach(), weights[name], rtol=0, atol=0, msg=name)
    ok("Accelerate's FSDP2 plugin (forced) on an expert_parallel model: gradients, clipping and the full-state "
       "save are single-process's")
    AcceleratorState._reset_state(True)  # (Accelerate's DDP with expert parallelism: tests/dist/accelerate_ddp.py)


# ------------------------------------------------------------------------------------------------------------------
# Trainers
# ------------------------------------------------------------------------------------------------------------------
def trainer_data():
    from datasets import Dataset

    rows = torch.cat([torch.cat(micro_batches(step, 1)) for step in range(6)])
    return Dataset.from_dict({"input_ids": rows.tolist(), "labels": rows.tolist()})


def trainer_args(out: Path, run: str, steps: int, per_device: int, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(
        str(out / run), per_device_train_batch_size=per_device, max_steps=steps, learning_rate=LR, max_grad_norm=MAX_NORM,
        logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=True, seed=0, data_seed=0,
        ddp_backend="gloo" if dist.is_initialized() else None,
        lr_scheduler_type="linear", save_strategy="steps", save_steps=2, train_sampling_strategy="sequential",
        average_tokens_across_devices=False, **kw,
    )


def losses_of(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def trainers(out: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from hf_moe.compat import TRANSFORMERS_VERSION, trainer_supports_sharded_models

    data = trainer_data()
    per_device = ROWS // WORLD
    if not trainer_supports_sharded_models():  # transformers < 5.23 would wrap the model in DDP
        try:
            hf_moe.MoETrainer(model=hf_moe.parallelize(make_model()), args=trainer_args(out, "old", 4, per_device),
                              train_dataset=data)
        except RuntimeError as err:
            assert "Upgrade transformers" in str(err), err
        else:
            raise AssertionError(f"MoETrainer accepted a parallelized model on transformers {TRANSFORMERS_VERSION}")
        ok(f"MoETrainer refuses a parallelized model on transformers {TRANSFORMERS_VERSION}, naming the upgrade")
        return
    run = hf_moe.MoETrainer(model=hf_moe.parallelize(make_model()), args=trainer_args(out, "run", 4, per_device),
                            train_dataset=data)
    run.train()
    weights = {n: full(p).detach().clone() for n, p in run.model.named_parameters()}
    checkpoint = out / "run" / "checkpoint-2"
    assert (checkpoint / "training_state" / "dcp" / ".metadata").is_file()
    assert len(list(checkpoint.glob("model-expert-*.safetensors"))) == NUM_EXPERTS
    if RANK == 0:
        torch.save({"weights": weights, "losses": losses_of(run)}, out / "trainer-run.pt")
    resumed = hf_moe.MoETrainer(model=hf_moe.parallelize(make_model(seed=3)),  # other weights: all from the checkpoint
                                args=trainer_args(out, "resumed", 4, per_device), train_dataset=data)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(full(param).detach(), weights[name], rtol=0, atol=WEIGHT_ATOL, msg=name)
    assert losses_of(resumed) == losses_of(run), (losses_of(resumed), losses_of(run))  # steps 1-2 from the checkpoint
    ok("MoETrainer on a parallelized model: DCP checkpoint, resume continues exactly")

    # The plain Trainer: correct with weight-only checkpoints, refused (before training) with optimizer checkpoints.
    try:
        Trainer(model=hf_moe.parallelize(make_model()), args=trainer_args(out, "plain", 4, per_device),
                train_dataset=data)
    except ValueError as err:
        assert "save_only_model" in str(err), err
    else:
        raise AssertionError("the plain Trainer accepted to checkpoint a sharded optimizer from rank 0")
    plain = Trainer(model=hf_moe.parallelize(make_model()),
                    args=trainer_args(out, "plain", 4, per_device, save_only_model=True), train_dataset=data)
    plain.train()
    for name, param in plain.model.named_parameters():
        torch.testing.assert_close(full(param).detach(), weights[name], rtol=0, atol=WEIGHT_ATOL, msg=name)
    assert len(list((out / "plain" / "checkpoint-4").glob("model-expert-*.safetensors"))) == NUM_EXPERTS
    ok("plain Trainer on a parallelized model: refuses optimizer checkpoints at construction; with "
       "save_only_model trains like MoETrainer and writes every expert")

    try:
        hf_moe.MoETrainer(model=hf_moe.expert_parallel(make_model()), args=trainer_args(out, "half", 1, per_device),
                          train_dataset=data)
    except ValueError as err:
        assert "hf_moe.parallelize" in str(err), err
    else:
        raise AssertionError("MoETrainer accepted sharded experts with unsharded other parameters and no FSDP")
    ok("MoETrainer refuses expert_parallel without FSDP for the other parameters, naming parallelize")

    args = TrainingArguments(str(out / "single"), max_steps=1, report_to=[], disable_tqdm=True)
    assert args.world_size == 1
    try:
        hf_moe.MoETrainer(model=hf_moe.parallelize(make_model()), args=args, train_dataset=data)
    except ValueError as err:
        assert "use_cpu=True" in str(err), err
    else:
        raise AssertionError("MoETrainer accepted TrainingArguments that see one of two processes")
    ok("MoETrainer refuses TrainingArguments that do not see every process")


def trainer_resumed_on_one(out: Path) -> None:
    """The 2-process MoETrainer checkpoint resumes on 1 process: 2 accumulation steps of the 2 processes'
    micro-batches keep the global batch, and the load-balancing loss (a product of per-micro-batch means) the same."""
    reference = torch.load(out / "trainer-run.pt")
    data = trainer_data()
    bad = hf_moe.MoETrainer(model=make_model(seed=3), args=trainer_args(out, "one-bad", 4, ROWS // 2),
                            train_dataset=data)
    try:
        bad.train(resume_from_checkpoint=str(out / "run" / "checkpoint-2"))
    except ValueError as err:
        assert "global batch of 8" in str(err), err
    else:
        raise AssertionError("resumed with another global batch size")
    resumed = hf_moe.MoETrainer(model=make_model(seed=3), train_dataset=data,
                                args=trainer_args(out, "one", 4, ROWS // 2, gradient_accumulation_steps=2))
    resumed.train(resume_from_checkpoint=str(out / "run" / "checkpoint-2"))
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param.detach(), reference["weights"][name], rtol=0, atol=WEIGHT_ATOL, msg=name)
    torch.testing.assert_close(torch.tensor(losses_of(resumed)), torch.tensor(reference["losses"]),
                               rtol=LOSS_RTOL, atol=0)
    ok("MoETrainer: the 2-process checkpoint resumes on 1 process and continues the run; another global batch is "
       "refused")


def main(mode: str, out: str) -> None:
    global RANK, WORLD
    out = Path(out)
    if mode != "one":
        dist.init_process_group("gloo")
        RANK, WORLD = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = make_model()
    if mode == "four":
        gradients_and_clip(model, 4, "world 4, EP 4")
        gradients_and_clip(model, 2, "world 4, EP 2 x dp 2")
        three_steps(model, 2, "world 4, EP 2 x dp 2")
        expert_layout(model)
        sliced_experts(out)
        by_hand(model)
        save_sharded(model, out)
        plan_arithmetic(model, 2)
        plan_arithmetic(make_model(num_experts=6), 2)
        elastic(make_model(), out, None, "state-4")
    elif mode == "two":
        gradients_and_clip(model, 2, "world 2, EP 2")
        autocast_matches_one_process(model, "world 2, EP 2")
        three_steps(model, 2, "world 2, EP 2")
        plan_arithmetic(model, 2)
        elastic(make_model(seed=7), out, "state-4", "state-2")  # other weights: all must come from the state
        accelerate_fsdp2(model, out)
    elif mode == "trainer":
        trainers(out)
    elif mode == "one":
        elastic(make_model(seed=7), out, "state-2", "state-1")
        losses = [x for world in (4, 2, 1) for x in json.loads((out / f"losses-{world}.json").read_text())]
        reference = elastic_reference()
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=LOSS_RTOL, atol=0)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        ok(f"elastic resume 4 -> 2 -> 1: the loss curve equals the uninterrupted single-process run ({len(losses)} "
           f"steps, largest relative difference {worst:.1e})")
        if (out / "trainer-run.pt").is_file():  # not with transformers < 5.23 (the trainer launch is refused)
            trainer_resumed_on_one(out)
    else:
        raise SystemExit(f"unknown mode {mode}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2])
