"""The `hf-moe` command: parsing only, with the standard library.

Every command's work lives in `hf_moe.commands` and is imported when the command runs, so `hf-moe --help` (and a typo)
answers at once instead of after importing torch and transformers (several seconds). This module sits outside the
`hf_moe` package on purpose: importing anything inside it runs `hf_moe/__init__.py`, which registers the model with
transformers.
"""

from __future__ import annotations

import argparse
import sys


def _layers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes comma-separated integers like 0,2,4, got {text!r}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer of at least 1")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-moe", description="Mixture-of-Experts for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="convert a dense causal LM to MoE and save it per expert")
    convert.add_argument("src", help="dense model: a local directory or a Hub id")
    convert.add_argument("out", help="output directory")
    convert.add_argument("--num-experts", type=int, required=True)
    convert.add_argument("--top-k", type=int, required=True)
    convert.add_argument("--method", default="upcycle", choices=["upcycle", "split", "lora", "pesc"],
                         help="upcycle: every expert a copy of the MLP; split: the MLP's neurons cut into experts; "
                         "lora / pesc: adapter experts, the frozen MLP plus a small trainable adapter per expert "
                         "(saves only the adapters and routers; docs/adapter-experts.md)")
    which = convert.add_mutually_exclusive_group()
    which.add_argument("--layers", type=_layers, help="decoder layers to convert, e.g. 0,2,4 (default: all)")
    which.add_argument("--every", type=int, help="convert layers i with (i + 1) %% N == 0")
    convert.add_argument("--dtype", help="e.g. bfloat16 (default: the checkpoint's)")
    convert.add_argument("--seed", type=int, default=0)
    convert.add_argument("--num-shared-experts", type=int, help="always-active shared experts (default 0)")
    convert.add_argument("--router", default="topk", help="router type: topk, noisy_topk, switch, gshard, "
                         "prototype, expert_choice, aux_free (or a registered one)")
    convert.add_argument("--router-weights", choices=["softmax", "unit"],
                         help="how chosen experts are weighted (default: softmax for upcycle, unit for split)")
    convert.add_argument("--capacity-factor", type=float, help="expert capacity factor (default: dropless)")
    up = convert.add_argument_group("upcycle")
    up.add_argument("--noise", type=float, help="relative std of noise on each expert copy")
    up.add_argument("--reinit-fraction", type=float, help="Drop-Upcycling: fraction of each expert's neurons redrawn")
    split = convert.add_argument_group("split")
    split.add_argument("--partition", choices=["random", "kmeans", "coactivation"], help="default: kmeans")
    split.add_argument("--calibration-data", help="coactivation: a local .txt/.json/.jsonl file with a text field")
    split.add_argument("--calibration-tokens", type=int)
    adapter = convert.add_argument_group("lora, pesc (adapter experts)")
    adapter.add_argument("--rank", type=int, help="the adapters' rank r (default 16)")
    adapter.add_argument("--lora-alpha", type=float, help="scaling lora_alpha / r (default: 2 * rank)")
    adapter.add_argument("--target-modules", help="lora: comma-separated projections among gate_proj,up_proj,"
                         "down_proj (default: all the MLP has)")
    adapter.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input in training (default 0)")
    adapter.add_argument("--adapter-act", help="pesc: the bottleneck's activation (default gelu)")
    convert.add_argument("--in-memory", action="store_true", help="load the whole model and check the converted "
                         "logits against the dense model's (default: stream a local safetensors checkpoint tensor "
                         "by tensor and check every MoE block against its MLP)")
    convert.add_argument("--max-shard-size", default="5GB")

    # merge: several dense fine-tunes of one base -> one MoE; hf_moe/convert/merge.py
    merge = sub.add_parser("merge", help="merge dense fine-tunes of one base model into one MoE (a mergekit-moe "
                           "YAML, with hf_moe's fields beside mergekit's; see docs/merging.md)")
    merge.add_argument("config", help="the merge recipe (YAML)")
    merge.add_argument("out", help="output directory")
    merge.add_argument("--max-shard-size", default="5GB")

    # shrink: fewer experts after training; hf_moe/shrink/
    shrink = sub.add_parser("shrink", help="keep fewer experts per MoE layer (pruning or merging, with calibration "
                            "text), for hf_moe and transformers' own MoE checkpoints; see docs/shrinking.md")
    shrink.add_argument("model", help="an hf_moe checkpoint, or a Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE directory")
    shrink.add_argument("out", help="output directory (the same kind of checkpoint)")
    shrink.add_argument("--keep", type=int, required=True, help="experts kept in every MoE layer")
    shrink.add_argument("--method", default="reconstruction",
                        choices=["reconstruction", "loss", "merge", "frequency", "random"],
                        help="reconstruction: the subset that reproduces each layer's output best (default); loss: "
                        "one of reconstruction's best few per layer, chosen by the model's loss on the text (loads "
                        "the model whole); merge: the others merged into it where that helps; frequency: the most "
                        "routed; random: the baseline")
    shrink.add_argument("--data", help="calibration text: .txt, or .json/.jsonl with a text field (all methods but "
                        "random)")
    shrink.add_argument("--scope", default="layer", choices=["layer", "global"],
                        help="layer: each layer keeps its own experts; global: the same expert ids in every layer")
    shrink.add_argument("--seed", type=int, default=0, help="for --method random (and the token sample of long texts)")
    shrink.add_argument("--calibration-tokens", type=int, default=4096)
    shrink.add_argument("--seq-len", type=int, default=256, help="calibration tokens per row")
    shrink.add_argument("--max-shard-size", default="5GB")
    shrink.add_argument("--search-candidates", type=int, default=8,  # hf_moe.shrink.search.SEARCH_CANDIDATES
                        help="--method loss: subsets tried per layer (reconstruction's best first)")

    materialize = sub.add_parser("materialize", help="turn a checkpoint of LoRA adapter experts into an ordinary "
                                 "MoE checkpoint (expert e = W + B_e A_e): exportable, quantizable, mergeable")
    materialize.add_argument("src", help="a directory saved by hf_moe with adapter experts (method lora)")
    materialize.add_argument("out", help="output directory")
    materialize.add_argument("--base", help="the dense base model (default: the one the checkpoint records)")
    materialize.add_argument("--max-shard-size", default="5GB")

    inspect = sub.add_parser("inspect", help="describe a saved MoE checkpoint (without loading its weights)")
    inspect.add_argument("dir")
    inspect.add_argument("--routing", action="store_true", help="run the model over --data and show the routing")
    inspect.add_argument("--data", nargs="+", help="text file(s) for --routing; several files = several domains: "
                         "which expert each domain's tokens go to, per layer")
    inspect.add_argument("--max-tokens", type=int, default=4096)
    inspect.add_argument("--heatmap", help="PNG path for the layers x experts load heatmap (default: DIR/routing.png)")

    export = sub.add_parser("export", help="write a saved MoE model as transformers' native MoE architecture "
                            "(llama, mistral -> Mixtral; qwen3 -> Qwen3-MoE; olmo2 -> FlexOlmo)")
    export.add_argument("dir", help="a directory saved by hf_moe")
    export.add_argument("out", help="output directory")
    export.add_argument("--no-verify", action="store_true",
                        help="skip loading the export back to compare its logits (saves memory on huge models)")
    export.add_argument("--max-shard-size", default="5GB")

    verify = sub.add_parser("verify", help="hash every file of a saved MoE checkpoint and compare with the checksums "
                            "recorded when it was saved; exits 1 naming each damaged file and tensor")
    verify.add_argument("dir", help="a directory saved by hf_moe")
    verify.add_argument("--update", action="store_true", help="first record the config files as they are now "
                        "(config.json, generation_config.json, modeling_hf_moe.py changed on purpose), then verify")
    generate = sub.add_parser("generate", help="generate text with a saved MoE model, streaming the tokens; with "
                              "--offload-experts, past memory (experts read on demand into a bounded cache)")
    generate.add_argument("model", help="a directory saved by hf_moe (with its tokenizer)")
    generate.add_argument("prompt")
    generate.add_argument("--offload-experts", choices=["disk", "cpu"],
                          help="disk: experts stay in their files and are read when routed to (CPU machines); "
                          "cpu: experts in host memory, a cache on the GPU")
    generate.add_argument("--max-expert-memory", help="bytes the resident experts may take, e.g. 1GiB or 500MB "
                          "(with --offload-experts)")
    generate.add_argument("--max-new-tokens", type=_positive_int, default=64,
                          help="tokens to generate at most (default 64); with --cache-implementation static, a cache "
                          "larger than the memory free is refused before anything is allocated")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    generate.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                          help="weights' dtype: auto (as saved), fp32, or bf16 (half the bytes per decoded token; "
                          "docs/serving-cpu.md)")
    generate.add_argument("--quantize", choices=["int8", "int8-all"], help="int8: weight-only int8 experts "
                          "(hf_moe.quantize_experts; docs/serving.md); int8-all: the attention projections, dense "
                          "MLPs and the LM head too; a checkpoint saved with save_quantized is loaded as int8 "
                          "without it")
    generate.add_argument("--cache-implementation", choices=["dynamic", "static"], default="dynamic",
                          help="static: a static KV cache and the fast decode step: one op call for hf_moe "
                          "Llama-layer models with top-k MoE blocks, else compiled once (the first call compiles); "
                          "docs/serving-cpu.md")
    plan = sub.add_parser("plan", help="memory per GPU of the expert-parallel x FSDP2 layouts: will it fit?")
    plan.add_argument("model", metavar="MODEL_OR_CONFIG", help="a saved model directory, a config.json, or a Hub id; "
                      "an hf_moe model, or a dense one with --num-experts and --top-k (planned as if upcycled)")
    plan.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    plan.add_argument("--gpu-memory", required=True, help="memory of one GPU, e.g. 80GB or 80GiB")
    plan.add_argument("--nodes", type=int, default=1)
    plan.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                      help="weights and gradients (with bf16/fp16, AdamW keeps an fp32 master copy)")
    plan.add_argument("--num-experts", type=int, help="for a dense model: experts per MoE layer")
    plan.add_argument("--top-k", type=int, help="for a dense model: experts per token")
    plan.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per forward (default 1)")
    plan.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    plan.add_argument("--gradient-accumulation-steps", type=int, default=1)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv) and run the command. Returns the exit status: 0, 1 when `verify` finds
    damage, or 2 for bad input."""
    args = _parser().parse_args(argv)
    from hf_moe.commands import run  # the heavy imports start here

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
