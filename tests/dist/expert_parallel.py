"""Expert-parallel checks, run under torchrun on CPU (gloo) by tests/test_distributed.py.

    torchrun --nproc_per_node 2 tests/dist/expert_parallel.py core OUT_DIR      # EP=2
    torchrun --nproc_per_node 4 tests/dist/expert_parallel.py wide OUT_DIR      # EP=2 x DP=2, load with EP=4
    torchrun --nproc_per_node 2 tests/dist/expert_parallel.py trainer OUT_DIR   # MoETrainer: clip, save, resume

Every check raises on failure; rank 0 prints "OK <check>" for each one that passed.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import VOCAB, tiny_dense  # noqa: E402

import hf_moe  # noqa: E402
from hf_moe import MoEForCausalLM, convert_to_moe, expert_parallel  # noqa: E402
from hf_moe.parallel.clip import clip_grad_norm_  # noqa: E402

RANK = WORLD = 0


def ok(name: str) -> None:
    dist.barrier()
    if RANK == 0:
        print("OK", name, flush=True)


def make_model(seed: int = 0) -> MoEForCausalLM:
    """The same tiny MoE on every rank: 4 experts (noised so they differ), top-2, aux and z losses on."""
    moe = convert_to_moe(tiny_dense(seed=seed), num_experts=4, top_k=2, noise=0.05, router_aux_loss_coef=1.0,
                         router_z_loss_coef=0.1)
    return moe.train()


def batches(world: int, per_rank: int = 3, length: int = 10, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (world * per_rank, length), generator=g)
    labels = ids.clone()
    labels[::4, :3] = -100
    return [(ids[r * per_rank : (r + 1) * per_rank], labels[r * per_rank : (r + 1) * per_rank]) for r in range(world)]


def reference_grads(model, data) -> dict[str, torch.Tensor]:
    """One process, every rank's batch, the mean of the per-batch losses."""
    ref = copy.deepcopy(model)
    ref.zero_grad()
    loss = sum(ref(input_ids=i, labels=l).loss for i, l in data) / len(data)
    loss.backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def check_grads(model_ep, ref: dict[str, torch.Tensor], tag: str, tol=1e-5) -> None:
    for name, param in model_ep.named_parameters():
        want = ref[name]
        experts = model_ep.get_submodule(name.rpartition(".")[0])
        if getattr(experts, "ep_plan", None) is not None:
            want = want[experts.expert_offset : experts.expert_offset + experts.num_local_experts]
        torch.testing.assert_close(param.grad, want, rtol=tol, atol=1e-7, msg=f"{tag}: {name}")


def ep_step(model, data, ep_size=None):
    """accelerator.prepare + one backward of this rank's batch; returns the prepared model."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = expert_parallel(copy.deepcopy(model), expert_parallel_size=ep_size)
    prepared = accelerator.prepare(model)
    ids, labels = data[RANK]
    accelerator.backward(prepared(input_ids=ids, labels=labels).loss)
    return model


def gradients(ep_size=None) -> None:
    model = make_model()
    data = batches(WORLD)
    ref = reference_grads(model, data)
    ep = ep_step(model, data, ep_size)
    check_grads(ep, ref, "gradients")
    ok(f"gradients equal single-process (world {WORLD}, EP {ep_size or WORLD})")

    # Clipping with the global norm: the same coefficient, hence the same gradients, as one process.
    ref_model = copy.deepcopy(model)
    ref_model.zero_grad()
    (sum(ref_model(input_ids=i, labels=l).loss for i, l in data) / len(data)).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
    norm = clip_grad_norm_(ep.parameters(), 0.05)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7)
    check_grads(ep, {n: p.grad for n, p in ref_model.named_parameters()}, "clipped")
    ok("clip_grad_norm_ uses the global norm")


@hf_moe.register_router("test_first_two")
class FirstTwoRouter(hf_moe.Router):
    """Every token to experts 0 and 1 (rank 0's), weighted by the softmax of their two logits."""

    def route(self, hidden_states):
        logits = self.logits(hidden_states)
        index = torch.tensor([[0, 1]]).expand(hidden_states.shape[0], 2)
        return hf_moe.RouterOutput(logits, logits.softmax(-1), index, logits[:, :2].softmax(-1))


def idle_rank() -> None:
    """Every token routed to rank 0's experts: rank 1 receives nothing, and nothing hangs or breaks."""
    model = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, noise=0.05, router_type="test_first_two").train()
    data = batches(WORLD)
    ref = reference_grads(model, data)
    ep = ep_step(model, data)
    check_grads(ep, ref, "idle rank")
    if RANK == 1:
        assert all(layer.mlp.experts.down_proj.grad.abs().sum() == 0 for layer in ep.model.layers)
    ok("a rank whose experts get no tokens")


def bad_sizes() -> None:
    model = convert_to_moe(tiny_dense(), num_experts=3, top_k=2)
    try:
        expert_parallel(model)
    except ValueError as err:
        assert "num_experts=3 does not divide by the expert-parallel size 2" in str(err), err
    else:
        raise AssertionError("E % P != 0 was accepted")
    ok("num_experts not divisible by the group size is an error")


def save_and_reload(out: Path) -> None:
    model = make_model().eval()
    ep = expert_parallel(copy.deepcopy(model))
    ids = batches(1)[0][0]
    with torch.no_grad():
        logits = ep(input_ids=ids).logits
        torch.testing.assert_close(logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    ep.save_pretrained(out / "saved")  # every rank writes its experts
    if RANK == 0:
        files = sorted(p.name for p in (out / "saved").glob("model-expert-*.safetensors"))
        assert files == [f"model-expert-{e:05d}.safetensors" for e in range(4)], files
        single = MoEForCausalLM.from_pretrained(out / "saved").eval()  # EP = 1
        with torch.no_grad():
            torch.testing.assert_close(single(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-5)
        torch.save({"ids": ids, "logits": logits}, out / "reference.pt")
    ok("saved under EP=2, reloaded with EP=1: equal logits")


def reload_wider(out: Path) -> None:
    """Load the EP=2 checkpoint with EP=4 (4 ranks): each rank builds and reads only its own expert."""
    loaded = MoEForCausalLM.from_pretrained(out / "saved", expert_parallel=True).eval()
    experts = loaded.model.layers[0].mlp.experts
    assert (experts.num_local_experts, experts.expert_offset) == (1, RANK), (experts.num_local_experts, RANK)
    ref = torch.load(out / "reference.pt")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ref["ids"]).logits, ref["logits"], rtol=1e-5, atol=1e-5)
    ok("saved under EP=2, reloaded with EP=4: equal logits")


def trainer(out: Path) -> None:
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, VOCAB, (32, 12), generator=g)
    data = Dataset.from_dict({"input_ids": rows.tolist(), "labels": rows.tolist()})

    def args(run, steps, **kw):
        return TrainingArguments(
            str(out / run), per_device_train_batch_size=2, max_steps=steps, learning_rate=5e-3, max_grad_norm=0.1,
            logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=True, ddp_backend="gloo", seed=0,
            data_seed=0, lr_scheduler_type="constant", save_strategy="steps", save_steps=2, **kw,
        )

    # The plain Trainer refuses an expert-parallel model before training.
    try:
        Trainer(model=expert_parallel(make_model()), args=args("plain", 1), train_dataset=data).train()
    except RuntimeError as err:
        assert "hf_moe.MoETrainer" in str(err), err
    else:
        raise AssertionError("transformers.Trainer accepted an expert-parallel model")
    ok("plain Trainer refuses an expert-parallel model")

    full = hf_moe.MoETrainer(model=expert_parallel(make_model()), args=args("run", 4), train_dataset=data)
    full.train()
    # Non-expert parameters are replicated: with the global clipping norm they stay identical across ranks.
    model = full.model
    for name, param in model.named_parameters():
        if getattr(param, "_hf_moe_ep_plan", None) is None:
            gathered = [torch.empty_like(param) for _ in range(WORLD)]
            dist.all_gather(gathered, param.detach().contiguous())
            assert all(torch.equal(gathered[0], t) for t in gathered), f"{name} differs across ranks"
    ok("non-expert parameters identical across ranks after 4 clipped steps")

    checkpoint = out / "run" / "checkpoint-2"
    assert (checkpoint / f"optimizer-rank{RANK:05d}-of-{WORLD:05d}.pt").is_file()
    other = expert_parallel(make_model(seed=3))  # different weights: everything must come from the checkpoint
    resumed = hf_moe.MoETrainer(model=other, args=args("resumed", 4), train_dataset=data)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h][-2:]  # noqa: E731
    assert losses(resumed) == losses(full) or torch.allclose(torch.tensor(losses(resumed)), torch.tensor(losses(full)))
    ok("MoETrainer checkpoint and resume under EP")


def misconfigured(out: Path) -> None:
    """Under torchrun on CPU, TrainingArguments without use_cpu=True sees one process: MoETrainer must refuse."""
    from datasets import Dataset
    from transformers import TrainingArguments

    data = Dataset.from_dict({"input_ids": [[3, 4, 5]] * 4, "labels": [[3, 4, 5]] * 4})
    args = TrainingArguments(str(out / "single"), max_steps=1, report_to=[], disable_tqdm=True)
    assert args.world_size == 1
    try:
        hf_moe.MoETrainer(model=expert_parallel(make_model()), args=args, train_dataset=data)
    except ValueError as err:
        assert "use_cpu=True" in str(err), err
    else:
        raise AssertionError("MoETrainer accepted TrainingArguments that see one of two processes")
    ok("MoETrainer refuses TrainingArguments that do not see every process")


def main(mode: str, out: str) -> None:
    global RANK, WORLD
    dist.init_process_group("gloo")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    out = Path(out)
    if mode == "core":
        gradients()
        idle_rank()
        bad_sizes()
        save_and_reload(out)
    elif mode == "wide":
        gradients(ep_size=2)
        reload_wider(out)
    elif mode == "trainer":
        trainer(out)
    elif mode == "misconfigured":
        misconfigured(out)
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2])
