"""What the `hf-moe` commands do, once `hf_moe_cli` (standard library only, so `--help` is instant) has parsed them."""

from __future__ import annotations

import os
import sys
import time


_OPTION_FLAGS = (
    "capacity_factor", "every", "dtype", "num_shared_experts", "router_weights", "noise", "reinit_fraction",
    "partition", "calibration_data", "calibration_tokens", "rank", "lora_alpha", "target_modules", "lora_dropout",
    "adapter_act",
)
_ADAPTER_METHODS = ("lora", "pesc")  # (hf_moe/layers/adapter_experts.py; named here so `--help` stays light)


def _convert(args) -> None:
    from .checkpoint import same_directory, save_checkpoint
    from .checkpoint.commit import nested_directories
    from .convert.api import convert_to_moe
    from .convert.estimate import check_disk
    from .convert.stream import StreamingUnsupported, convert_checkpoint
    from .model_card import block_diff_text

    start = time.perf_counter()
    options = {"seed": args.seed, "router_type": args.router}
    options.update({k: getattr(args, k) for k in _OPTION_FLAGS if getattr(args, k) is not None})
    if same_directory(args.src, args.out):
        raise ValueError(
            f"OUT {args.out} is SRC {args.src}: converting would replace the dense model. Choose another OUT."
        )
    if args.method in _ADAPTER_METHODS and os.path.isdir(args.src) and nested_directories(args.src, args.out):
        raise ValueError(
            f"OUT {args.out} lies inside SRC {args.src} or holds it: adapter experts refer to SRC, their base, for "
            "every other weight, and nothing is written into the directory a checkpoint depends on. Choose another OUT."
        )
    tokenizer = _tokenizer_writer(args.src)  # into OUT's staging directory: OUT appears with it, atomically
    model = None
    streamable = args.method not in _ADAPTER_METHODS  # (adapter experts save a few MB: nothing to stream)
    if streamable and not args.in_memory and os.path.isdir(args.src):
        try:
            model = convert_checkpoint(
                args.src, args.out, args.num_experts, args.top_k, method=args.method, layers=args.layers,
                max_shard_size=args.max_shard_size, extra=tokenizer, **options,
            )
            print(f"Streamed {args.src} tensor by tensor (the model was never loaded whole).")
        except StreamingUnsupported as why:
            print(f"Converting in memory: streaming is not possible here ({why}).", file=sys.stderr)
    if model is None:
        model = convert_to_moe(
            args.src, args.num_experts, args.top_k, method=args.method, layers=args.layers, **options
        )
        saved = (p for p in model.parameters() if p.requires_grad or args.method not in _ADAPTER_METHODS)
        check_disk(args.out, sum(p.numel() * p.element_size() for p in saved))  # before writing (adapters: trained)
        save_checkpoint(model, args.out, max_shard_size=args.max_shard_size, extra=tokenizer)
    if args.method in _ADAPTER_METHODS:
        _report_adapters(args, model, time.perf_counter() - start)
        return
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


def _report_adapters(args, model, seconds: float) -> None:
    spec = model.config.adapter_experts
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    what = f"lora on {', '.join(spec['target_modules'])}" if spec["method"] == "lora" else f"pesc ({spec['adapter_act']})"
    print(
        f"Converted {args.src} -> {args.out} in {seconds:.1f}s: {len(model.config.moe_layers)} MoE layers x "
        f"{args.num_experts} adapter experts (top-{args.top_k}), {what}, r={spec['r']}, lora_alpha={spec['lora_alpha']}; "
        f"{trainable / 1e6:.2f}M trainable parameters (routers and adapters) on {frozen / 1e6:.1f}M frozen ones. "
        f"{args.out} holds only the trained tensors; it loads onto {spec['base_model']['name_or_path']} (checked by "
        "fingerprint)."
    )
    conv = model.config.moe_conversion
    if "max_abs_logit_diff" in conv:
        print(f"Max |logit difference| to the dense model on a random probe: {conv['max_abs_logit_diff']:.2e}.")


def _materialize(args) -> None:
    """`hf-moe materialize SRC OUT`: adapter experts -> plain experts (hf_moe/convert/materialize.py)."""
    from .checkpoint import save_checkpoint
    from .convert.estimate import check_disk
    from .convert.materialize import check_output_directory, materialize

    start = time.perf_counter()
    check_output_directory(args.src, args.out, args.base)  # (not SRC, not its base: nothing written there)
    model = materialize(args.src, base=args.base)
    tokenizer = _tokenizer_writer(args.src) if _has_tokenizer(args.src) else None
    check_disk(args.out, sum(p.numel() * p.element_size() for p in model.parameters()))  # before writing
    save_checkpoint(model, args.out, max_shard_size=args.max_shard_size, extra=tokenizer)
    counts = model.parameter_counts()
    print(
        f"Materialized {args.src} -> {args.out} in {time.perf_counter() - start:.1f}s: "
        f"{len(model.config.moe_layers)} MoE layers x {model.config.num_experts} plain experts, "
        f"{counts['total'] / 1e6:.1f}M parameters ({counts['active'] / 1e6:.1f}M active per token). It is an ordinary "
        "hf_moe checkpoint: hf-moe export, int8, offload and merge take it."
    )


def _has_tokenizer(directory: str) -> bool:
    from .checkpoint import TOKENIZER_FILES

    return any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES)


def _tokenizer_writer(src: str):
    """A function that writes the base model's tokenizer into a directory (OUT's staging directory, so that OUT is
    self-contained and appears with its tokenizer in one step), or None. From a local directory the tokenizer files
    are copied byte for byte through the guarded opener (a link out of SRC, a FIFO, an oversized file is left out,
    with a note); from the Hub, transformers' tokenizer is saved."""
    from .checkpoint import TOKENIZER_FILES, copy_files

    if os.path.isdir(src):
        def write(staging) -> None:
            copied, refused = copy_files(src, TOKENIZER_FILES, staging, f"the source {src}")
            for line in refused:
                print(f"Note: a tokenizer file was not copied: {line}", file=sys.stderr)
            if not copied:
                print(f"Note: no tokenizer copied: {src} has none.", file=sys.stderr)

        return write
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except Exception as err:  # a model without a tokenizer is still a model
        print(f"Note: no tokenizer copied from {src} ({type(err).__name__}).", file=sys.stderr)
        return None
    return tokenizer.save_pretrained


def _inspect(args) -> None:
    from .checkpoint import is_hub_id, resolve_checkpoint
    from .inspect import format_routing, format_summary, routing_summary, save_heatmap, summarize_checkpoint

    directory = resolve_checkpoint(args.dir)  # a Hub id: its snapshot in the cache
    print(format_summary(summarize_checkpoint(directory), args.dir))
    if not args.routing:
        return
    if not args.data:
        raise ValueError("--routing needs --data FILE, a text file to run the model over.")
    config, summary, tokens = routing_summary(directory, args.data, max_tokens=args.max_tokens)
    print()
    print(format_routing(config, summary, tokens))
    if len(args.data) > 1:  # several domains (merged models): which expert each domain's tokens go to
        from .inspect import domain_routing, format_domain_routing

        print()
        print(format_domain_routing(*domain_routing(directory, args.data, max_tokens=args.max_tokens)))
    heatmap = args.heatmap or os.path.join("." if is_hub_id(args.dir) else args.dir, "routing.png")  # (not the cache)
    try:
        save_heatmap(config, summary, heatmap)
        print(f"heatmap: {heatmap}")
    except ImportError as err:
        print(f"(no heatmap: {err})", file=sys.stderr)


def _merge(args) -> None:
    """`hf-moe merge CONFIG OUT` (docs/merging.md): the work is hf_moe/convert/merge.py's."""
    from .convert.merge import merge_to_moe

    start = time.perf_counter()
    model = merge_to_moe(args.config, args.out, max_shard_size=args.max_shard_size)
    c, counts, conv = model.config, model.parameter_counts(), model.config.moe_conversion
    print(
        f"Merged {c.num_experts} models into {args.out} in {time.perf_counter() - start:.1f}s: {len(c.moe_layers)} "
        f"MoE layers x {c.num_experts} experts (top-{c.num_experts_per_tok})"
        f"{', 1 shared' if c.num_shared_experts else ''}, gates {conv['options']['gate_mode']}, non-expert weights "
        f"{conv['options']['non_expert_weights']}; {counts['total'] / 1e6:.1f}M parameters, "
        f"{counts['active'] / 1e6:.1f}M active per token."
    )
    if "max_abs_expert_diff" in conv:
        print(f"Every expert, as written, reproduces its source model's MLP within {conv['max_abs_expert_diff']:.2e} "
              f"(outputs up to {conv['max_abs_mlp_output']:.2g}) on a random probe.")


def _shrink(args) -> None:
    """`hf-moe shrink MODEL OUT --keep N` (docs/shrinking.md): the work is hf_moe/shrink/'s."""
    import warnings

    from .shrink import shrink

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        result = shrink(args.model, args.out, args.keep, args.method, args.data, scope=args.scope, seed=args.seed,
                        calibration_tokens=args.calibration_tokens, seq_len=args.seq_len,
                        max_shard_size=args.max_shard_size, search_candidates=args.search_candidates)
    for warning in caught:
        print(f"Note: {warning.message}", file=sys.stderr)
    errors = [c.error for c in result.layers.values() if c.error is not None]
    merged = sum(len(c.groups) for c in result.layers.values())
    print(
        f"Shrunk {args.model} -> {args.out} in {result.seconds:.1f}s ({result.method}, {result.scope} scope): "
        f"{len(result.layers)} MoE layers x {result.num_experts} -> {result.keep} experts, top-{result.new_top_k}"
        + (f", {merged} expert groups merged" if result.method == "merge" else "")
        + (f"; calibration {result.calibration_tokens} tokens" if result.calibration_tokens else "") + "."
    )
    if errors:
        print(f"Relative reconstruction error per layer on the calibration text: mean {sum(errors) / len(errors):.4f}, "
              f"max {max(errors):.4f} (what was kept: {args.out}/shrink.json).")
    if result.search:
        found = result.search
        print(f"Calibration loss (nats per token): full model {found.full_loss:.4f}, reconstruction's choice "
              f"{found.reconstruction_loss:.4f}, kept {found.loss:.4f} ({found.evaluations} evaluations).")


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


def _generate(args) -> None:
    import torch

    from .checkpoint import checkpoint_config, load_tokenizer, reading, resolve_checkpoint
    from .layers.quantized import CONFIG_FIELD as QUANTIZATION_FIELD
    from .modeling import MoEForCausalLM
    from .offload import GenerationTimer, describe, expert_cache, peak_rss_bytes
    from .quantize import load_quantized, quantize_experts

    offload = args.offload_experts is not None or args.max_expert_memory is not None
    options = dict(offload_experts=args.offload_experts, max_expert_memory=args.max_expert_memory) if offload else {}
    options["dtype"] = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    start = time.perf_counter()
    if args.quantize and offload:
        raise ValueError("--quantize quantizes experts held in memory; to offload int8 experts, save the model "
                           "with hf_moe.save_quantized and pass that directory with --offload-experts.")
    if not args.prompt and not args.chat:
        raise ValueError("The prompt is empty: give the text to continue, e.g. hf-moe generate MODEL \"Once upon a "
                         "time\".")
    directory = resolve_checkpoint(args.model)  # a Hub id: its snapshot in the cache
    with reading(directory):  # the model and its tokenizer from one checkpoint, through the guarded opener
        if getattr(checkpoint_config(directory), QUANTIZATION_FIELD, None) is not None and not offload:
            model = load_quantized(directory, dtype=options["dtype"]).eval()  # saved with int8 experts
        else:
            model = MoEForCausalLM.from_pretrained(directory, **options).eval()
        tokenizer = load_tokenizer(directory)
    if args.quantize:
        quantize_experts(model, "int8", linears=args.quantize == "int8-all")
    load_s = time.perf_counter() - start
    if args.chat:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
    else:
        inputs = tokenizer(args.prompt, return_tensors="pt")
    if inputs["input_ids"].shape[-1] == 0:
        raise ValueError(f"The prompt {args.prompt!r} gives no tokens: give text the tokenizer encodes.")
    timer = GenerationTimer(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        cache = {"cache_implementation": "static"} if args.cache_implementation == "static" else {}
        model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, streamer=timer, pad_token_id=pad,
                       **cache)
    prompt_tokens = inputs["input_ids"].shape[1]
    print(
        f"{timer.new_tokens} tokens: prefill {prompt_tokens / timer.prefill_s:.1f} tok/s ({prompt_tokens} prompt "
        f"tokens), decode {timer.decode_tokens_per_s:.2f} tok/s; peak RSS {peak_rss_bytes() / 2**30:.2f} GiB; "
        f"loaded in {load_s:.1f}s",
        file=sys.stderr,
    )
    if offload:
        print(f"{describe(model)}\n{expert_cache(model).stats.summary()}", file=sys.stderr)




def _verify(args) -> int:
    from .checkpoint import is_hub_id, record_config_files, resolve_checkpoint, verify_checkpoint

    directory = resolve_checkpoint(args.dir)  # a Hub id: its snapshot in the cache
    if getattr(args, "update", False):
        if is_hub_id(args.dir):
            raise ValueError(f"--update records edited config files in a checkpoint of your own; {args.dir} is a "
                             "snapshot in the Hugging Face cache. Copy it first (`hf download REPO --local-dir DIR`).")
        changed = record_config_files(directory)
        print(f"{args.dir}: recorded the checksums of {', '.join(changed) if changed else 'no changed file'}; "
              "verifying.")
    report = verify_checkpoint(directory)
    if report.problems:
        print(f"{args.dir}: {len(report.problems)} problem(s):", file=sys.stderr)
        for problem in report.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    size = f"{report.num_bytes / 1e9:.2f} GB" if report.num_bytes >= 1e9 else f"{report.num_bytes / 1e6:.1f} MB"
    print(
        f"{args.dir}: {report.files} files, {size}: every checksum ({report.algorithm}) matches the save, and the "
        f"checks before load pass ({report.seconds:.2f}s)."
    )
    return 0


def _plan_config(args):
    """(MoE config, meta-device MoE model, description) of MODEL_OR_CONFIG; a dense config is upcycled on meta."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .checkpoint import CheckpointError, read_json
    from .configuration import MoEConfig
    from .convert.api import convert_to_moe
    from .modeling import MoEForCausalLM

    path = args.model
    local = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if os.path.isfile(local):
        real = os.path.realpath(local) if local == path else local  # (a file named on the command line, or a model's)
        try:  # with the guarded opener's checks and bounds
            fields = read_json(os.path.dirname(real), os.path.basename(real), "the command line")
        except CheckpointError as err:
            raise ValueError(f"{local} is not a JSON config file ({err}).") from None
        if "model_type" not in fields:
            raise ValueError(f"{path} is not a transformers config.json (it has no model_type).")
        model_type = fields.pop("model_type")
        config = MoEConfig.from_dict(fields) if model_type == "hf_moe" else AutoConfig.for_model(model_type, **fields)
    else:
        config = AutoConfig.from_pretrained(path)
    if isinstance(config, MoEConfig):
        if args.num_experts is not None or args.top_k is not None:
            raise ValueError(f"{path} is already an MoE model: drop --num-experts / --top-k.")
        with torch.device("meta"):
            return config, MoEForCausalLM(config), f"{path}"
    if args.num_experts is None or args.top_k is None:
        raise ValueError(
            f"{path} is a dense `{config.model_type}` model: pass --num-experts and --top-k to plan it upcycled."
        )
    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(config)
    moe = convert_to_moe(dense, args.num_experts, args.top_k, verify=False)
    return moe.config, moe, f"{path} upcycled to {args.num_experts} experts, top-{args.top_k}"


def _plan(args) -> None:
    """`hf-moe plan`: memory per GPU of every (EP, FSDP) layout, and which fit."""
    import torch

    from .compat import convert_file_size_to_int
    from .parallel.sizing import candidate_layouts, estimate

    for name in ("gpus", "nodes", "micro_batch", "seq_len", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}.")
    try:
        memory = convert_file_size_to_int(args.gpu_memory)
    except ValueError:
        raise ValueError(f"--gpu-memory takes a size like 80GB or 80GiB, got {args.gpu_memory!r}.") from None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    config, model, what = _plan_config(args)
    gpus = args.gpus * args.nodes
    layouts = candidate_layouts(config.num_experts, gpus, args.gpus)
    if not layouts:
        raise ValueError(f"No expert-parallel size divides both num_experts={config.num_experts} and {gpus} GPUs.")
    counts = model.parameter_counts()
    gb = 1e9
    print(
        f"{what}: {counts['total'] / 1e9:.2f}B parameters ({counts['expert'] / 1e9:.2f}B in experts, "
        f"{config.num_experts} per MoE layer x {len(config.moe_layers)} layers, top-{config.num_experts_per_tok})\n"
        f"{gpus} GPUs ({args.nodes} node(s) x {args.gpus}), {memory / gb:.1f} GB each; {args.dtype} weights and "
        f"gradients, AdamW with fp32 exp_avg and exp_avg_sq"
        + (" and an fp32 master copy" if dtype != torch.float32 else "")
        + f"; micro-batch {args.micro_batch} x {args.seq_len} tokens, {args.gradient_accumulation_steps} "
        "accumulation step(s)\n"
    )
    header = (f"{'EP':>4} {'FSDP':>5} {'experts/GPU':>11} {'weights':>9} {'grads':>9} {'optimizer':>10} "
              f"{'gathered':>9} {'activ.~':>9} {'total':>9} {'all-to-all/step':>16}  fits")
    print(header)
    print("-" * len(header))
    for layout in layouts:
        e = estimate(model, layout, dtype=dtype, micro_batch=args.micro_batch, seq_len=args.seq_len,
                     gradient_accumulation_steps=args.gradient_accumulation_steps)
        r = e.per_rank
        fits = "yes" if e.total <= memory else "no"
        where = " (EP across nodes)" if layout.ep > args.gpus else ""
        print(f"{layout.ep:>4} {layout.dp:>5} {e.experts_per_rank:>11.4g} {r['weights'] / gb:>8.1f}G "
              f"{r['gradients'] / gb:>8.1f}G {r['optimizer'] / gb:>9.1f}G {e.gathered / gb:>8.1f}G "
              f"{e.activations / gb:>8.1f}G {e.total / gb:>8.1f}G {e.all_to_all_per_step / gb:>15.2f}G  {fits}{where}")
    print(
        "\nEP: processes per expert-parallel group (tokens travel between them); FSDP: groups, over which each block "
        "of experts is sharded. Non-expert parameters are sharded over EP and replicated over FSDP "
        "(hf_moe.parallelize)."
        "\nweights, grads, optimizer: the largest rank's shards (exact, as FSDP2 chunks them). gathered: the root "
        "unit and the largest layer, unsharded for compute, with their gradients. activ.~: rough (+-30%), one "
        "micro-batch, no activation checkpointing (which cuts it to about one layer's). all-to-all: bytes each GPU "
        "sends per optimizer step (dispatch and combine, forward and backward). Keep ~10% for the CUDA context and "
        "allocator fragmentation."
    )


COMMANDS = {
    "convert": _convert, "merge": _merge, "inspect": _inspect, "export": _export, "verify": _verify, "plan": _plan,
    "generate": _generate, "materialize": _materialize,
    "shrink": _shrink,
}


def run(args) -> int:
    """Run the parsed command (see `hf_moe_cli`, which parses). Returns the exit status: 0, the command's own (1
    when `verify` finds damage), or 2 for bad input."""
    try:
        status = COMMANDS[args.command](args)
    except (ValueError, TypeError, OSError) as err:  # bad input and missing or unwritable paths
        print(f"hf-moe {args.command}: error: {err}", file=sys.stderr)
        return 2
    return status or 0
