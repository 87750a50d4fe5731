"""The main job's training steps of `python -m hf_moe.gpu_check.bench`: models built from configs (no weights travel),
trained with `transformers.Trainer(bf16=True)` at sequence 2048, beside the dense model of the same shape.

  * step_llama: a Llama with SmolLM2-1.7B's layer shape, cut to N layers, trained dense; then converted in place with
    `convert_to_moe` (8 experts, top-2: it upcycles the trained dense model) and trained again; saved with
    `save_pretrained` (bf16, one file per expert) for the decode step (decode_bench.py), with the logits of a probe
    to hold the reload against.
  * step_qwen3: a Qwen3-MoE with Qwen3-30B-A3B's layer shape, cut to N layers, with experts_implementation="hf_moe"
    and "grouped_mm" (same seed, same weights), and the dense Qwen3 of the same active FLOPs (intermediate k x I).

N, the layers one GPU trains with AdamW (`layers_that_fit`): the parameters of the model at 1 and 2 layers, counted
on the meta device, give the bytes a layer adds and the bytes of the rest (embeddings, head, final norm); every
parameter costs 18 bytes in training (fp32 weight 4, fp32 gradient 4, AdamW's two moments 8, the bf16 copy autocast
keeps for the backward 2), a layer's activations ACT_PER_TOKEN bytes per token, and the loss's logits 12 bytes per
token and vocabulary entry (bf16 logits, their fp32 copy and its gradient); N is what fits in 90% of the GPU's free
memory. Each model reports tokens/s (median step time after the warm-up steps), TF/s on its active FLOPs (6 x the
active parameters, head included, + the attention scores 12 x layers x heads x head_dim x sequence, non-causal
count as in PaLM's MFU), peak memory against the prediction, and its losses (first and last steps).

With --smoke the same code runs tiny configs on CPU on hf_moe's torch backend (the Triton kernels run under the
interpreter in the layer step), with N capped at 2: the figures mean nothing.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from .record import FAILED, PASSED, table

WORK_ENV = "HF_MOE_BENCH_WORK"  # the run's scratch directory (checkpoints), set by bench.main for every step
SEQ, BATCH, WARMUP_STEPS, TIMED_STEPS = 2048, 4, 3, 20
SMOKE_SEQ, SMOKE_BATCH, SMOKE_WARMUP, SMOKE_STEPS = 32, 2, 1, 2
LEARNING_RATE, SMOKE_LEARNING_RATE = 3e-4, 1e-2  # --smoke: few steps on a tiny model
SMOKE_MEMORY, SMOKE_MAX_LAYERS = 256 * 2**20, 2
BYTES_PER_PARAM = 18
LOGIT_BYTES = 12
MEMORY_SHARE = 0.9
DATASHEET_TFLOPS = 989.0  # dense bf16, H100/H200 SXM
EXPERTS, TOP_K = 8, 2

# SmolLM2-1.7B's layer shape (HuggingFaceTB/SmolLM2-1.7B's config) and Qwen3-30B-A3B's (Qwen/Qwen3-30B-A3B's).
SMOLLM2 = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
               num_key_value_heads=32, tie_word_embeddings=True, rope_theta=130000.0, rms_norm_eps=1e-5,
               max_position_embeddings=8192)
QWEN3_30B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                 num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
                 max_position_embeddings=40960)
TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                  tie_word_embeddings=True, max_position_embeddings=256)
TINY_QWEN3 = dict(vocab_size=256, hidden_size=64, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                  num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, norm_topk_prob=True,
                  tie_word_embeddings=False, max_position_embeddings=256)


def act_per_token(hidden: int, inter: int, active: int) -> int:
    """Bytes one decoder layer keeps per token for its backward under bf16 autocast (an estimate, held against the
    measured peak): the attention block's and the norms' ~24 H (the fp32 residual stream and its bf16 casts), and
    8 bytes per active intermediate unit (the gate and up outputs, the activation, in bf16)."""
    return 24 * hidden + 8 * inter * active


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def layers_that_fit(build_meta, free_bytes: int, tokens: int, vocab: int, act_bytes: int) -> tuple[int, dict]:
    """(N, how): the decoder layers whose training with AdamW fits MEMORY_SHARE of `free_bytes` (see the module
    docstring). `build_meta(n)` builds the model with n layers (on the meta device). Refuses, with the sizes, when not
    even one layer fits."""
    one, two = parameters(build_meta(1)), parameters(build_meta(2))
    per_layer, rest = two - one, 2 * one - two
    layer_bytes = BYTES_PER_PARAM * per_layer + tokens * act_bytes
    fixed_bytes = BYTES_PER_PARAM * rest + LOGIT_BYTES * tokens * vocab
    usable = MEMORY_SHARE * free_bytes
    n = int((usable - fixed_bytes) // layer_bytes)
    how = dict(params_per_layer=per_layer, params_rest=rest, bytes_per_param=BYTES_PER_PARAM,
               act_bytes_per_token_layer=act_bytes, tokens_per_step=tokens, layer_bytes=layer_bytes,
               fixed_bytes=fixed_bytes, free_bytes=free_bytes, usable_bytes=usable, layers=n)
    if n < 1:
        raise MemoryError(f"not one layer fits: {usable / 1e9:.1f} GB usable of {free_bytes / 1e9:.1f} GB free; the "
                          f"embeddings, head and logits take {fixed_bytes / 1e9:.1f} GB, a layer "
                          f"{layer_bytes / 1e9:.1f} GB: use a GPU with more memory or fewer tokens per step")
    how["predicted_bytes"] = fixed_bytes + n * layer_bytes
    return n, how


def learnable_ids(count: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """[count, length] token ids a model can learn in a few steps: each sequence follows one fixed random successor
    table over a subset of the vocabulary, with one token in ten drawn at random instead."""
    g = torch.Generator().manual_seed(seed)
    subset = torch.randperm(vocab, generator=g)[:min(vocab, 4096)]
    successor = torch.randperm(len(subset), generator=g)
    ids = torch.empty(count, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, len(subset), (count,), generator=g)
    noise = torch.rand(count, length, generator=g) < 0.1
    drawn = torch.randint(0, len(subset), (count, length), generator=g)
    for t in range(1, length):
        ids[:, t] = torch.where(noise[:, t], drawn[:, t], successor[ids[:, t - 1]])
    return subset[ids]


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _clock():
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        """Each optimizer step's wall time (forward, backward, AdamW; the device synchronised at both ends) and each
        logged loss."""

        def __init__(self):
            self.times, self.losses, self.start = [], [], None

        def _sync(self):
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def on_step_begin(self, args, state, control, **kwargs):
            self._sync()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self._sync()
            self.times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    return Clock()


def shape(smoke: bool) -> tuple[int, int, int, int]:
    """(sequence, batch, warm-up steps, timed steps)."""
    return (SMOKE_SEQ, SMOKE_BATCH, SMOKE_WARMUP, SMOKE_STEPS) if smoke else (SEQ, BATCH, WARMUP_STEPS, TIMED_STEPS)


def flops_per_token(config, layers: int, inter: int, active: int, seq: int, router: int = 0) -> float:
    """Training FLOPs per token on active parameters: 6 x (attention projections, `active` MLPs of `inter`, the
    router's H x `router`, per layer; the head) + 12 x layers x heads x head_dim x seq (attention scores)."""
    h = config.hidden_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    attention = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    per_layer = attention + 3 * h * inter * active + h * router
    return 6.0 * (layers * per_layer + config.vocab_size * h) + 12.0 * layers * heads * head_dim * seq


def train(model, ids: torch.Tensor, smoke: bool, work: Path, label: str, flops: float) -> dict:
    """`transformers.Trainer(bf16=True)` on `ids` for warm-up + timed steps: tokens/s and TF/s (median step after the
    warm-up), peak memory, losses."""
    from transformers import Trainer, TrainingArguments

    seq, batch, warm, timed = shape(smoke)
    cuda = torch.cuda.is_available() and not smoke
    args = TrainingArguments(output_dir=str(work / f"trainer-{label}"), per_device_train_batch_size=batch,
                             max_steps=warm + timed,
                             learning_rate=SMOKE_LEARNING_RATE if smoke else LEARNING_RATE,
                             lr_scheduler_type="constant", warmup_steps=0,
                             bf16=True, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                             optim="adamw_torch_fused" if cuda else "adamw_torch", dataloader_num_workers=0, seed=0,
                             use_cpu=not cuda, remove_unused_columns=False)
    clock = _clock()
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(ids), callbacks=[clock])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    # accelerate left `model.forward` wrapped in bf16 autocast: later forwards (the probe before saving) run unwrapped
    from accelerate.utils import extract_model_from_parallel

    extract_model_from_parallel(model, keep_fp32_wrapper=False)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    trainer.optimizer = None  # AdamW's state goes with the trainer
    del trainer
    step = statistics.median(clock.times[warm:]) if len(clock.times) > warm else float("nan")
    tokens_per_s = seq * batch / step
    losses = clock.losses
    third = max(1, len(losses) // 3)
    return dict(model=label, params=parameters(model), step_s=step, tokens_per_s=tokens_per_s,
                tflops=flops * tokens_per_s / 1e12, mfu=flops * tokens_per_s / 1e12 / DATASHEET_TFLOPS,
                peak_bytes=peak, train_s=seconds, losses=losses, first_loss=losses[0] if losses else None,
                last_loss=losses[-1] if losses else None,
                loss_went_down=bool(losses) and statistics.mean(losses[-third:]) < statistics.mean(losses[:third]))


def free_memory(smoke: bool) -> int:
    if smoke or not torch.cuda.is_available():
        return SMOKE_MEMORY
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def work_dir() -> Path:
    path = Path(os.environ.get(WORK_ENV) or Path.cwd() / "gpu_bench_work")
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def job_backend(smoke: bool):
    """--smoke: hf_moe's torch backend (the interpreter would take minutes per step); on a GPU: what the run set
    (HF_MOE_BACKEND)."""
    if not smoke:
        yield
        return
    from ..ops import use_backend

    with use_backend("torch"):
        yield


def _device(smoke: bool) -> torch.device:
    return torch.device("cpu") if smoke else torch.device("cuda", 0)


def _fit(build_meta, smoke, tokens, vocab, act) -> tuple[int, dict]:
    n, how = layers_that_fit(build_meta, free_memory(smoke), tokens, vocab, act)
    if smoke and n > SMOKE_MAX_LAYERS:
        n, how["layers"], how["capped"] = SMOKE_MAX_LAYERS, SMOKE_MAX_LAYERS, "--smoke: at most 2 layers"
    return n, how


def result_table(results: list[dict]) -> str:
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["model"], r["error"], "", "", "", "", "", ""])
            continue
        peak = f"{r['peak_bytes'] / 1e9:.1f}" if r.get("peak_bytes") else "n/a"
        rows.append([r["model"], f"{r['params'] / 1e9:.2f}B", f"{r['tokens_per_s']:.0f}", f"{r['tflops']:.0f}",
                     f"{r['mfu']:.2f}", peak, f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}",
                     f"{r['step_s'] * 1e3:.0f}"])
    return table(["model", "params", "tokens/s", "TF/s", "MFU", "peak GB", "loss first -> last", "step ms"], rows)


def _ratio(results, a, b, key="tflops"):
    found = {r["model"]: r for r in results if key in r}
    return found[a][key] / found[b][key] if a in found and b in found and found[b][key] else None


def _finish(step, results, how, n, extra: list[str], smoke: bool, failures: list[str] = ()) -> None:
    problems = [f"{r['model']}: {r['error']}" for r in results if "error" in r] + list(failures)
    flat = [r for r in results if "error" not in r and not r["loss_went_down"]]
    if smoke:  # a few steps of a tiny model: its loss is noise, said, not failed
        extra += [f"{r['model']}: loss {r['first_loss']:.3f} -> {r['last_loss']:.3f} (--smoke: not checked)"
                  for r in flat]
    else:
        problems += [f"{r['model']}: the loss did not go down ({r['first_loss']:.3f} -> {r['last_loss']:.3f})"
                     for r in flat]
    problems += [f"{r['model']}: loss not finite" for r in results
                 if "error" not in r and not all(math.isfinite(v) for v in r["losses"])]
    seq, batch, warm, timed = shape(smoke)
    step.data.update(layers=n, sizing=how, results=results, seq=seq, batch=batch, warmup_steps=warm,
                     timed_steps=timed)
    predicted = how.get("predicted_bytes")
    step.detail = (f"{n} layers ({'; '.join(f'{k} {v}' for k, v in how.items())}); sequence {seq}, batch {batch}, "
                   f"{warm} warm-up + {timed} timed steps, Trainer(bf16=True), AdamW; TF/s on active FLOPs (6 x active "
                   f"parameters + attention scores, non-causal count); MFU against the datasheet's "
                   f"{DATASHEET_TFLOPS:.0f} TF/s" + ("; --smoke: tiny configs on CPU, the torch backend: the figures "
                                                      "mean nothing" if smoke else "")
                   + f".\n\n{result_table(results)}\n\n" + "\n".join(f"- {line}" for line in extra)
                   + (f"\n- predicted peak {predicted / 1e9:.1f} GB" if predicted else ""))
    step.status = FAILED if problems else PASSED
    step.summary = "; ".join(problems) if problems else f"{n} layers; " + "; ".join(extra)
    step.flush()


def _guarded(label: str, results: list, run) -> dict | None:
    """run() -> its result dict, appended to `results`; an exception (out of memory included) is a row of its own."""
    try:
        result = run()
    except Exception as err:  # a model that fails is a result; the others still run
        result = dict(model=label, error=f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}")
    results.append(result)
    release()
    return result


def step_llama(step, smoke: bool, limit: float) -> None:
    """SmolLM2-1.7B's layer shape: dense, then converted to 8 experts top-2 and trained; saved for the decode step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..configuration import MoEConfig
    from ..convert.api import convert_to_moe
    from ..modeling import MoEForCausalLM
    from ..ops import warmup

    shape_kwargs = TINY_LLAMA if smoke else SMOLLM2
    seq, batch, warm, timed = shape(smoke)
    device, work = _device(smoke), work_dir()

    def config(n):
        return LlamaConfig(num_hidden_layers=n, **shape_kwargs)

    def meta_moe(n):
        with torch.device("meta"):
            return MoEForCausalLM(MoEConfig.from_base(config(n), num_experts=EXPERTS, num_experts_per_tok=TOP_K))

    hidden, inter = shape_kwargs["hidden_size"], shape_kwargs["intermediate_size"]
    n, how = _fit(meta_moe, smoke, seq * batch, shape_kwargs["vocab_size"], act_per_token(hidden, inter, TOP_K))
    step.data = dict(sizing=how)
    step.flush()
    ids = learnable_ids((warm + timed) * batch, seq, shape_kwargs["vocab_size"])
    results, extra, failures = [], [], []
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config(n))
    dense_flops = flops_per_token(model.config, n, inter, 1, seq)
    with job_backend(smoke):
        _guarded("dense Llama", results,
                 lambda: dict(train(model, ids, smoke, work, "dense", dense_flops), model="dense Llama"))
        step.data["results"] = results
        step.flush()

        trained = {}

        def moe_job():
            moe = trained["moe"] = convert_to_moe(model, num_experts=EXPERTS, top_k=TOP_K, inplace=True).to(device)
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                warmup(moe, tokens=seq * batch)
            extra.append(f"hf_moe.ops.warmup: {time.perf_counter() - start:.1f} s")
            flops = flops_per_token(moe.config, n, inter, TOP_K, seq, router=EXPERTS)
            label = f"Llama converted, {EXPERTS} experts top-{TOP_K}"
            return dict(train(moe, ids, smoke, work, "moe", flops), model=label)

        _guarded(f"Llama converted, {EXPERTS} experts top-{TOP_K}", results, moe_job)
        step.data["results"] = results
        step.flush()  # the training figures are kept if the save below runs out of time
        model = None  # the converted model holds its modules now (inplace)
        if "moe" in trained and "error" not in results[-1]:
            try:
                save(trained.pop("moe"), work / "llama-moe", ids[:1, : min(seq, 64)].to(device), extra)
            except Exception as err:  # the step fails, saying why; the decode step then says it has no checkpoint
                failures.append(f"save_pretrained: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
        trained.clear()
    release()
    ratio = _ratio(results, f"Llama converted, {EXPERTS} experts top-{TOP_K}", "dense Llama")
    if ratio is not None:
        extra.insert(0, f"MoE TF/s / dense TF/s = {ratio:.2f} (goal >= 0.9)")
    (work / "llama.json").write_text(json.dumps(dict(layers=n, config=shape_kwargs)))
    _finish(step, results, how, n, extra, smoke, failures)


def save(moe, path: Path, probe: torch.Tensor, extra: list[str]) -> None:
    """The trained MoE in bf16, one file per expert, and the logits of `probe` [1, P] to hold the reload against."""
    with torch.no_grad():  # parameters only: `.to(bf16)` would cast the fp32 RoPE buffers that a bf16 load keeps
        for param in moe.parameters():
            param.data = param.data.to(torch.bfloat16)
    moe.eval()
    with torch.no_grad():
        logits = moe(probe).logits.float().cpu()
    start = time.perf_counter()
    moe.save_pretrained(path)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    torch.save(dict(probe=probe.cpu(), logits=logits), path / "probe.pt")
    extra.append(f"save_pretrained (bf16): {len(files)} safetensors files ({size / 1e9:.2f} GB) in "
                 f"{time.perf_counter() - start:.1f} s")


def dense_qwen3_config(shape_kwargs: dict, layers: int):
    """The dense Qwen3 beside a Qwen3-MoE of `shape_kwargs`: the same attention, vocabulary and layers, and one MLP of
    intermediate k x I (the MoE's active FLOPs, less the router's)."""
    from transformers import Qwen3Config

    moe_only = ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob", "intermediate_size")
    inter = shape_kwargs["num_experts_per_tok"] * shape_kwargs["moe_intermediate_size"]
    return Qwen3Config(num_hidden_layers=layers, intermediate_size=inter,
                       **{key: v for key, v in shape_kwargs.items() if key not in moe_only})


def step_qwen3(step, smoke: bool, limit: float) -> None:
    """Qwen3-30B-A3B's layer shape: experts_implementation "hf_moe" and "grouped_mm", and the dense Qwen3 of the same
    active FLOPs."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from ..ops import warmup

    shape_kwargs = TINY_QWEN3 if smoke else QWEN3_30B
    seq, batch, warm, timed = shape(smoke)
    device, work = _device(smoke), work_dir()
    k, inter = shape_kwargs["num_experts_per_tok"], shape_kwargs["moe_intermediate_size"]

    def config(n):
        return Qwen3MoeConfig(num_hidden_layers=n, **shape_kwargs)

    def meta(n):
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config(n))

    hidden = shape_kwargs["hidden_size"]
    n, how = _fit(meta, smoke, seq * batch, shape_kwargs["vocab_size"], act_per_token(hidden, inter, k))
    step.data = dict(sizing=how)
    step.flush()
    ids = learnable_ids((warm + timed) * batch, seq, shape_kwargs["vocab_size"])
    results, extra = [], []
    flops = flops_per_token(config(n), n, inter, k, seq, router=shape_kwargs["num_experts"])
    with job_backend(smoke):
        for impl in ("hf_moe", "grouped_mm"):
            def job(impl=impl):
                torch.manual_seed(0)
                with torch.device(device):
                    model = AutoModelForCausalLM.from_config(config(n), experts_implementation=impl)
                if impl == "hf_moe":
                    start = time.perf_counter()
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        warmup(model, tokens=seq * batch)
                    extra.append(f"hf_moe.ops.warmup: {time.perf_counter() - start:.1f} s")
                return dict(train(model, ids, smoke, work, impl, flops), model=f"Qwen3-MoE {impl}")

            _guarded(f"Qwen3-MoE {impl}", results, job)
            step.data["results"] = results
            step.flush()

        def dense_job():
            dense_config = dense_qwen3_config(shape_kwargs, n)
            torch.manual_seed(0)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(dense_config)
            return dict(train(model, ids, smoke, work, "dense", flops_per_token(dense_config, n, k * inter, 1, seq)),
                        model=f"dense Qwen3 (intermediate {k * inter})")

        _guarded(f"dense Qwen3 (intermediate {k * inter})", results, dense_job)
    extra.append("transformers' grouped_mm casts its input to the experts' dtype: under Trainer(bf16=True), with fp32 "
                 "weights, its experts compute in fp32 (hf_moe's, as autocast does for nn.Linear, in bf16)")
    ours = _ratio(results, "Qwen3-MoE hf_moe", "Qwen3-MoE grouped_mm")
    if ours is not None:
        extra.append(f"hf_moe TF/s / grouped_mm TF/s = {ours:.2f} (goal >= 1.5)")
    dense = _ratio(results, "Qwen3-MoE hf_moe", f"dense Qwen3 (intermediate {k * inter})")
    if dense is not None:
        extra.append(f"hf_moe TF/s / dense TF/s = {dense:.2f} (goal >= 0.9)")
    _finish(step, results, how, n, extra, smoke)
