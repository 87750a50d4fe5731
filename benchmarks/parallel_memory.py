"""Memory per process of expert parallelism x FSDP2 (`hf_moe.parallelize`), measured on CPU with gloo.

    python benchmarks/parallel_memory.py [--processes 1 2 4] [--repeats 3]

The MoE (Llama layout, hidden 256, 4 layers, 16 experts top-2, expert intermediate 1024) is converted and saved
once. For each P, P processes launched with torchrun (EP = P, so "dp" = 1: every parameter sharded over all P)
load it with `from_pretrained(expert_parallel=True)` (each reads only its experts), parallelize it, and run 3 AdamW
steps on 4 sequences of 128 tokens. Each reports:

  * bytes of its local shards of the weights, of the gradients (after a backward) and of AdamW's state;
  * `hf-moe plan`'s arithmetic for the same layout (hf_moe.parallel.sizing.estimate), which must be equal;
  * its peak RSS (ru_maxrss), its RSS before the model (after the imports: the part that does not shard) and its
    RSS after the last step.

Printed: the largest rank's bytes, and the ratio to P = 1 (1/P is perfect); peak RSS, median over repeats and
ranks, with its spread (min-max), and the same less the import baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HIDDEN, LAYERS, EXPERTS, TOP_K, INTERMEDIATE, VOCAB = 256, 4, 16, 2, 1024, 1024
BATCH, LENGTH, STEPS = 4, 128, 3


def rss_mb() -> float:
    """Peak resident set size of this process so far, MB (Linux reports ru_maxrss in KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def save_model(directory: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_moe

    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB,
    ))
    hf_moe.convert_to_moe(dense, EXPERTS, TOP_K, noise=0.01, verify=False).save_pretrained(directory)


def worker(model_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import hf_moe
    from hf_moe.parallel.sizing import Layout, estimate, measured_bytes

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    baseline = current_rss_mb()
    model = hf_moe.MoEForCausalLM.from_pretrained(model_dir, expert_parallel=True).train()
    with torch.device("meta"):  # every expert, as the arithmetic counts them (this rank's model holds its block)
        whole = hf_moe.MoEForCausalLM(hf_moe.MoEConfig.from_pretrained(model_dir))
    expected = estimate(whole, Layout(ep=world, dp=1), dtype=torch.float32, optimizer_dtype=torch.float32)
    expected = expected.by_rank[rank]
    model = hf_moe.parallelize(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    measured = {}
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step == STEPS - 1:
            measured = measured_bytes(model, optimizer)
        optimizer.zero_grad()
    result = {"rank": rank, "measured": measured, "expected": expected, "peak_rss_mb": rss_mb(),
              "baseline_rss_mb": baseline, "end_rss_mb": current_rss_mb()}
    everyone = [None] * world
    dist.all_gather_object(everyone, result)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


def launch(processes: int, model_dir: Path, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
           __file__, "--worker", str(model_dir), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_MOE_BACKEND": "torch"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)

    runs: dict[int, list[list[dict]]] = {p: [] for p in args.processes}
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp) / "moe")
        for repeat in range(args.repeats):  # interleaved, so load on a shared machine hits every P alike
            for p in args.processes:
                runs[p].append(launch(p, Path(tmp) / "moe", Path(tmp) / f"p{p}-{repeat}.json"))
    print(f"Llama layout, hidden {HIDDEN}, {LAYERS} layers, {EXPERTS} experts top-{TOP_K}, expert intermediate "
          f"{INTERMEDIATE}, vocab {VOCAB}; fp32, AdamW; {STEPS} steps of {BATCH} x {LENGTH} tokens; EP = P, gloo.")
    print("Bytes: the largest rank's local shards (plan = hf-moe plan's arithmetic for the same layout). "
          f"RSS: median over {args.repeats} repeat(s) x P ranks (min-max).\n")
    header = (f"{'P':>2} {'weights MB':>11} {'grads MB':>9} {'optim MB':>9} {'x P / P=1':>10} {'plan = measured':>16} "
              f"{'peak RSS MB':>20} {'peak - start MB':>20} {'end - start MB':>20}")
    print(header)
    print("-" * len(header))
    first = None
    for p in args.processes:
        ranks = [r for run in runs[p] for r in run]
        biggest = {k: max(r["measured"][k] for r in ranks) for k in ("weights", "gradients", "optimizer")}
        same = all(r["measured"] == r["expected"] for r in ranks)
        first = first or biggest
        scaled = (biggest["weights"] + biggest["optimizer"]) * p / (first["weights"] + first["optimizer"])
        peak = [r["peak_rss_mb"] for r in ranks]
        less = [r["peak_rss_mb"] - r["baseline_rss_mb"] for r in ranks]
        end = [r["end_rss_mb"] - r["baseline_rss_mb"] for r in ranks]
        print(
            f"{p:>2} {biggest['weights'] / 2**20:>11.1f} {biggest['gradients'] / 2**20:>9.1f} "
            f"{biggest['optimizer'] / 2**20:>9.1f} {scaled:>10.3f} {'yes' if same else 'NO':>16} "
            f"{statistics.median(peak):>8.0f} ({min(peak):.0f}-{max(peak):.0f}) "
            f"{statistics.median(less):>8.0f} ({min(less):.0f}-{max(less):.0f}) "
            f"{statistics.median(end):>8.0f} ({min(end):.0f}-{max(end):.0f})"
        )
    print("\nx P / P=1: (weights + optimizer bytes) x P over P = 1's; 1.000 means they fall exactly as 1/P (FSDP2's "
          "uneven chunks of small tensors and AdamW's per-tensor step counters show only past the third decimal). "
          "start: RSS after torch, transformers and hf_moe are imported and the process group is up, before the "
          "model (about the same for every P); peak: includes the non-expert weights loaded whole before FSDP2 "
          "shards them, and the activations of one step; end: after the last step.")


if __name__ == "__main__":
    main()
