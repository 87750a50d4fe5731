"""The decode step of `python -m hf_moe.gpu_check.bench`: the converted Llama that step_llama trained and saved (bf16,
one file per expert) reloaded with `MoEForCausalLM.from_pretrained`, held against the logits it had before saving,
and its greedy decode with a static cache (`generate(..., cache_implementation="static")`) timed against the dense
Llama of the same layers (random bf16 weights: only its speed is read).

Decode tokens/s: (new - 1) tokens / (time of a call making `new` tokens - time of a call making 1), each the median
of the timed calls after one untimed call (which compiles the decode step: transformers' own for both models on a
GPU, where hf_moe's attention-block step, a CPU step, does not run); the first call's time is reported too. With
--smoke, tiny and on CPU, nothing is compiled (`disable_compile=True`): the figures mean nothing.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from .main_job import job_backend, release, work_dir
from .record import FAILED, PASSED, SKIPPED, table

PROMPT, NEW, REPEATS = 128, 128, 3
SMOKE_PROMPT, SMOKE_NEW, SMOKE_REPEATS = 8, 4, 1


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_speed(model, prompt: torch.Tensor, new: int, repeats: int, smoke: bool) -> dict:
    """{first_call_s, tokens_per_s, tokens}: greedy static-cache decode of `prompt` [1, P]."""
    extra = dict(disable_compile=True) if smoke else {}

    def call(n):
        _sync()
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             cache_implementation="static", **extra)
        _sync()
        return time.perf_counter() - start, out

    first, out = call(new)
    long = [call(new)[0] for _ in range(repeats)]
    short = [call(1)[0] for _ in range(repeats)]
    seconds = statistics.median(long) - statistics.median(short)
    return dict(first_call_s=first, tokens_per_s=(new - 1) / seconds if seconds > 0 else float("nan"),
                tokens=out[0, prompt.shape[1]:].tolist())


def compile_config(model, prompt: torch.Tensor, new: int, ours: bool) -> str:
    """What `generate` compiles the decode step with, for `model` and a static cache: an hf_moe model (`ours`) its own
    (`MoEForCausalLM.generate` passes its arguments through `hf_moe.generation.prepare_generate_kwargs`), any other
    the model's or transformers' default `CompileConfig`."""
    from transformers import CompileConfig

    from ..generation import prepare_generate_kwargs

    kwargs = {"cache_implementation": "static", "max_new_tokens": new}
    config = (prepare_generate_kwargs(model, (prompt,), kwargs).get("compile_config") if ours else None) or \
        getattr(model.generation_config, "compile_config", None) or CompileConfig()
    return f"{type(config).__name__}(backend={config.backend}, mode={config.mode}, options={config.options})"


def step_decode(step, smoke: bool, limit: float) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..modeling import MoEForCausalLM

    work = work_dir()
    saved, meta = work / "llama-moe", work / "llama.json"
    if not (saved / "probe.pt").is_file() or not meta.is_file():
        step.status = SKIPPED
        step.summary = f"skipped: no checkpoint from the Llama step in {work} (it failed or did not run)"
        return
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    prompt_len, new, repeats = (SMOKE_PROMPT, SMOKE_NEW, SMOKE_REPEATS) if smoke else (PROMPT, NEW, REPEATS)
    info = json.loads(meta.read_text())
    probe = torch.load(saved / "probe.pt")
    files = sorted(p.name for p in saved.glob("*.safetensors"))
    start = time.perf_counter()
    moe = MoEForCausalLM.from_pretrained(saved, dtype=torch.bfloat16).to(device).eval()
    load_s = time.perf_counter() - start
    problems, rows, results = [], [], {}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, info["config"]["vocab_size"], (1, prompt_len), generator=g).to(device)
    with job_backend(smoke):  # the backend the saved logits were computed on
        with torch.no_grad():
            logits = moe(probe["probe"].to(device)).logits.float().cpu()
        equal = torch.equal(logits, probe["logits"])
        if not equal:
            problems.append(f"reloaded logits differ from the saved model's by up to "
                            f"{(logits - probe['logits']).abs().max().item():.3e}")
        try:
            compiled = compile_config(moe, prompt, new, ours=True)
            results["MoE (reloaded)"] = dict(decode_speed(moe, prompt, new, repeats, smoke), compile_config=compiled)
        except Exception as err:  # the dense model's figures still come
            problems.append(f"MoE decode: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
        del moe
        release()
        step.flush()
        try:
            torch.manual_seed(0)
            with torch.device(device):
                dense = LlamaForCausalLM(LlamaConfig(num_hidden_layers=info["layers"], **info["config"]))
            dense = dense.to(torch.bfloat16).eval()
            compiled = compile_config(dense, prompt, new, ours=False)
            results["dense"] = dict(decode_speed(dense, prompt, new, repeats, smoke), compile_config=compiled)
            del dense
        except Exception as err:
            problems.append(f"dense decode: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
    release()
    for name, r in results.items():
        rows.append([name, f"{r['first_call_s']:.1f}", f"{r['tokens_per_s']:.1f}", r["compile_config"]])
    ratio = (results["MoE (reloaded)"]["tokens_per_s"] / results["dense"]["tokens_per_s"]
             if len(results) == 2 else None)
    step.data = dict(files=files, load_s=load_s, reload_logits_equal=equal, layers=info["layers"],
                     prompt=prompt_len, new_tokens=new, results=results, moe_vs_dense=ratio)
    step.detail = (f"{info['layers']} layers; reloaded from {len(files)} safetensors files in {load_s:.1f} s; logits "
                   f"after reload {'equal' if equal else 'NOT equal'} to the saved model's; prompt {prompt_len}, "
                   f"{new} new tokens, greedy, static cache, median of {repeats}"
                   + ("; --smoke: nothing compiled, the figures mean nothing" if smoke else "") + ".\n\n"
                   + table(["model", "first call s (compiles)", "decode tokens/s", "compiled with (each model's "
                            "default)"], rows)
                   + (f"\n\nMoE / dense decode speed: {ratio:.2f}" if ratio is not None else ""))
    step.status = FAILED if problems else PASSED
    step.summary = "; ".join(problems) if problems else (
        f"reload exact ({len(files)} files); decode {results['MoE (reloaded)']['tokens_per_s']:.0f} tokens/s vs "
        f"dense {results['dense']['tokens_per_s']:.0f} ({ratio:.2f}x)")
