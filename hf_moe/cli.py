"""`hf-moe convert | inspect | export`."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _layers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes comma-separated integers like 0,2,4, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-moe", description="Mixture-of-Experts for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="convert a dense causal LM to MoE and save it per expert")
    convert.add_argument("src", help="dense model: a local directory or a Hub id")
    convert.add_argument("out", help="output directory")
    convert.add_argument("--num-experts", type=int, required=True)
    convert.add_argument("--top-k", type=int, required=True)
    convert.add_argument("--method", default="upcycle", choices=["upcycle", "split"],
                         help="upcycle: every expert a copy of the MLP; split: the MLP's neurons cut into experts")
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
    convert.add_argument("--in-memory", action="store_true", help="load the whole model and check the converted "
                         "logits against the dense model's (default: stream a local safetensors checkpoint tensor "
                         "by tensor and check every MoE block against its MLP)")
    convert.add_argument("--max-shard-size", default="5GB")

    inspect = sub.add_parser("inspect", help="describe a saved MoE checkpoint (without loading its weights)")
    inspect.add_argument("dir")
    inspect.add_argument("--routing", action="store_true", help="run the model over --data and show the routing")
    inspect.add_argument("--data", help="text file for --routing")
    inspect.add_argument("--max-tokens", type=int, default=4096)
    inspect.add_argument("--heatmap", help="PNG path for the layers x experts load heatmap (default: DIR/routing.png)")

    export = sub.add_parser("export", help="write a saved MoE model as transformers' native MoE architecture "
                            "(llama, mistral -> Mixtral; qwen3 -> Qwen3-MoE; olmo2 -> FlexOlmo)")
    export.add_argument("dir", help="a directory saved by hf_moe")
    export.add_argument("out", help="output directory")
    export.add_argument("--no-verify", action="store_true",
                        help="skip loading the export back to compare its logits (saves memory on huge models)")
    export.add_argument("--max-shard-size", default="5GB")
    return parser


_OPTION_FLAGS = (
    "capacity_factor", "every", "dtype", "num_shared_experts", "router_weights", "noise", "reinit_fraction",
    "partition", "calibration_data", "calibration_tokens",
)


def _convert(args) -> None:
    from .convert.api import convert_to_moe
    from .convert.stream import StreamingUnsupported, convert_checkpoint
    from .model_card import block_diff_text

    start = time.perf_counter()
    options = {"seed": args.seed, "router_type": args.router}
    options.update({k: getattr(args, k) for k in _OPTION_FLAGS if getattr(args, k) is not None})
    model = None
    if not args.in_memory and os.path.isdir(args.src):
        try:
            model = convert_checkpoint(
                args.src, args.out, args.num_experts, args.top_k, method=args.method, layers=args.layers,
                max_shard_size=args.max_shard_size, **options,
            )
            print(f"Streamed {args.src} tensor by tensor (the model was never loaded whole).")
        except StreamingUnsupported as why:
            print(f"Converting in memory: streaming is not possible here ({why}).", file=sys.stderr)
    if model is None:
        model = convert_to_moe(args.src, args.num_experts, args.top_k, method=args.method, layers=args.layers, **options)
        model.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    _copy_tokenizer(args.src, args.out)
    counts = model.parameter_counts()
    conv = model.config.moe_conversion
    print(
        f"Converted {args.src} -> {args.out} in {time.perf_counter() - start:.1f}s ({args.method}): "
        f"{len(model.config.moe_layers)} MoE layers x {args.num_experts} experts (top-{args.top_k})"
        f"{f', {model.config.num_shared_experts} shared' if model.config.num_shared_experts else ''}, "
        f"{counts['total'] / 1e6:.1f}M parameters, {counts['active'] / 1e6:.1f}M active per token."
    )
    if "max_abs_logit_diff" in conv:
        print(
            f"Max |logit difference| to the dense model on a random probe: {conv['max_abs_logit_diff']:.2e} "
            f"(greedy tokens {'equal' if conv['same_argmax'] else 'differ'})."
        )
    if "max_abs_block_diff" in conv:
        print(f"Max |MoE block - dense MLP| over the MoE layers on a random probe: {block_diff_text(conv)}.")


def _copy_tokenizer(src: str, out: str) -> None:
    """Save the base model's tokenizer beside the MoE weights, so OUT is self-contained."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except Exception as err:  # a model without a tokenizer is still a model
        print(f"Note: no tokenizer copied from {src} ({type(err).__name__}).", file=sys.stderr)
        return
    tokenizer.save_pretrained(out)


def _inspect(args) -> None:
    from .inspect import format_routing, format_summary, routing_summary, save_heatmap, summarize_checkpoint

    print(format_summary(summarize_checkpoint(args.dir), args.dir))
    if not args.routing:
        return
    if not args.data:
        raise ValueError("--routing needs --data FILE, a text file to run the model over.")
    config, summary, tokens = routing_summary(args.dir, args.data, max_tokens=args.max_tokens)
    print()
    print(format_routing(config, summary, tokens))
    heatmap = args.heatmap or os.path.join(args.dir, "routing.png")
    try:
        save_heatmap(config, summary, heatmap)
        print(f"heatmap: {heatmap}")
    except ImportError as err:
        print(f"(no heatmap: {err})", file=sys.stderr)


def _export(args) -> None:
    from .export import export_native

    result = export_native(args.dir, args.out, verify=not args.no_verify, max_shard_size=args.max_shard_size)
    print(f"Exported {args.dir} -> {args.out} as {result.architecture} (model_type {result.model_type!r}).")
    if result.max_abs_logit_diff is not None:
        print(
            f"Max |logit difference| to the hf_moe model on a random probe: {result.max_abs_logit_diff:.2e} "
            f"(greedy tokens {'equal' if result.same_argmax else 'differ'})."
        )
    print(f"Load it with plain transformers: AutoModelForCausalLM.from_pretrained({str(args.out)!r})")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        {"convert": _convert, "inspect": _inspect, "export": _export}[args.command](args)
    except (ValueError, TypeError, OSError) as err:  # bad input and missing or unwritable paths
        print(f"hf-moe {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
