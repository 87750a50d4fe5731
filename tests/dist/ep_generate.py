"""`generate` under expert parallelism with unequal lengths, run under torchrun on CPU (gloo) by tests/test_hostile.py.

    torchrun --nproc_per_node 2 tests/dist/ep_generate.py OUT_DIR

Each rank generates from its own prompt (different lengths) for its own number of new tokens (3 and 9), greedy and
then sampled with its own seed: every forward exchanges tokens with the other rank, so a rank that stops early must
keep taking part (synced_gpus) or the other one waits forever. Each rank's tokens must equal what one process
generates from the same prompt with the same model (greedy) or the same seed (sampling). Rank r writes its tokens
to OUT_DIR/rank{r}.pt; rank 0 prints "OK <check>" for each check that passed.
"""

from __future__ import annotations

import copy
import datetime
import faulthandler
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import VOCAB, tiny_dense  # noqa: E402

from hf_moe import convert_to_moe, expert_parallel  # noqa: E402


def main(out: str) -> None:
    faulthandler.dump_traceback_later(180, exit=True)  # a hang ends this rank, with the stack that hung
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=150))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, noise=0.1).eval()
    single = copy.deepcopy(model)
    ep = expert_parallel(model)

    prompt = torch.randint(3, VOCAB, (1, 4 + 5 * rank), generator=torch.Generator().manual_seed(rank))
    new_tokens = 3 + 6 * rank
    common = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    results = {}
    with torch.no_grad():
        results["greedy"] = ep.generate(prompt, do_sample=False, **common)
        torch.manual_seed(100 + rank)
        results["sampled"] = ep.generate(prompt, do_sample=True, top_k=0, **common)
        expected = {"greedy": single.generate(prompt, do_sample=False, **common)}
        torch.manual_seed(100 + rank)
        expected["sampled"] = single.generate(prompt, do_sample=True, top_k=0, **common)
    for name, tokens in results.items():
        assert tokens.shape == (1, prompt.shape[1] + new_tokens), (name, tokens.shape)
        assert torch.equal(tokens, expected[name]), (name, tokens, expected[name])
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        print("OK generate under EP=2 with 3 and 9 new tokens equals single-process generation", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
