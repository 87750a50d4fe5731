"""The whole decode step in one call: a plan of the model (`DecodePlan`), built once from named fields and kept
while the weights stay the same, whose step (`torch.classes.hf_moe.DecodePlan`, csrc/cpu/decode_step_cpu.cpp) runs
every layer's kernels in C++ with nothing compiled.

`hf_moe.decode.DecodeStep` compiles its attention-block step with inductor's C++ wrapper: the program still runs,
per layer, a dozen small kernels, allocations and dispatcher calls between the attention sub-block and the experts
(the router's cast, GEMM, softmax, top-k, weights and the residual add), and the call itself goes through Dynamo.
That overhead runs on the main thread alone while the other threads wait (perf profile and share of the step:
docs/serving-cpu.md, "The whole decode step as one op"). The plan's step calls one op instead, which runs the same
kernels layer by layer in C++, and needs no compilation (the compiled step's first call is long, longest with
inductor's cache cold).

Which models it serves (`one_op_reason`, asked by `hf_moe.decode.choose_decode` after the attention-block step's
own checks):

  * every decoder layer's MLP either an MoE block or a dense MLP. An MoE block is an hf_moe `SparseMoeBlock` with the
    plain `topk` router (softmax, top-k, optionally renormalised; no dynamic skipping, capacity or unit weights) and
    no output bias, or one of transformers' own (`NATIVE_BLOCKS`: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, whose
    routers take the softmax of logits computed in the activations' dtype), with experts the compiled kernel
    computes as the eager model does (int8 `QuantizedExperts`; fp32 or bf16 experts on a CPU with AVX-512 BF16 or
    AVX2, `infer.serves`; a native model's under `experts_implementation="hf_moe"`), all MoE layers with one top-k,
    renormalisation, activation and GLU; its shared experts (Qwen2-MoE's, gated or not), if any, and
  * a dense MLP of Llama's kind (a layer the conversion left dense) are computed with the kernels their eager modules
    call (`nn.Linear`: ATen's; int8 `QuantizedLinear`: hf_moe's), activations silu, gelu, gelu_pytorch_tanh or relu;
  * a rotary embedding whose values depend on the position alone (rope types default, linear, llama3, yarn): its
    values for every position of the cache are computed once per cache length, by the model's own module.

The plan names each layer's tensors once (`layer_fields`: the one place in Python a layer's inputs are listed); the
C++ side reads them by name. `plan_for(model)` keeps one plan per model and rebuilds it when anything it read has
changed (`fingerprint`: each tensor's identity, storage address, dtype, shape and version counter, and the numbers
it read), so quantizing, loading weights (`load_state_dict` copies in place: the versions change), `model.to(...)`,
replaced modules and in-place edits of the weights (`weight.mul_(2)`, `copy_`) between two `generate` calls are
all seen. Writes that torch does not count (through `.data`, or to the memory behind a tensor from outside torch)
are not; the plan reads the experts, embeddings and LM head in place, so only its copies can go stale that way: the
layers' small weights, copied onto huge pages (`DecodePlan`'s `huge_pages`), and its converted ones (a bf16
router's fp32 copy, biases cast to the activations' dtype). `drop_plan(model)` discards the plan.

The router's logits run on hf_moe's dot kernels and its softmax in a loop (ATen's kernels, as the eager router calls
them, cost several times their work there: a step's weights evict their code from the caches), and every other kernel
is the compiled step's, so the scores differ from the eager model's by the order of fp32 sums and the same bf16
roundings as the compiled step's; the tests
(tests/test_decode_one_op.py, tests/test_decode_families.py) check the eager greedy tokens, where a near-tie of
bf16 logits could go either way for either step.
"""

from __future__ import annotations

import threading

import torch

from .huge_pages import copies_on_huge_pages
from .layers.block import SharedExperts, SparseMoeBlock
from .layers.experts import Experts
from .layers.quantized import QuantizedExperts
from .layers.quantized_linear import QuantizedLinear, linear_weights
from .layers.router import TopKRouter
from .ops import backend_setting, experts_interface, infer, load_extension, reference
from .ops.activations import activation_key
from .ops.backend import _activation_of, expert_weights, kernel_activation

# Rope types whose cos/sin depend on the position alone (transformers' dynamic and longrope types change with the
# sequence's length).
ROPE_TYPES = {"default", "linear", "llama3", "yarn"}
# down(act(gate(x)) * up(x)): dense layers' MLPs, and Qwen2-MoE's shared expert
DENSE_MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen2MoeMLP", "Qwen3MoeMLP", "OlmoeMLP"}
# transformers' MoE blocks (their class name: their router's): a router giving softmax(logits in the activations'
# dtype, computed in fp32) top-k, renormalised where `norm_topk_prob` says (Mixtral's always), then the experts;
# Qwen2-MoE's adds its shared expert, scaled by the sigmoid of its gate.
NATIVE_BLOCKS = {"MixtralSparseMoeBlock": "MixtralTopKRouter", "Qwen2MoeSparseMoeBlock": "Qwen2MoeTopKRouter",
                 "Qwen3MoeSparseMoeBlock": "Qwen3MoeTopKRouter", "OlmoeSparseMoeBlock": "OlmoeTopKRouter"}
ACTIVATIONS = {"silu", "gelu", "gelu_pytorch_tanh", "relu"}  # of dense MLPs and shared experts (ATen's kernels)
PLAN = "_hf_moe_decode_plan"  # the model's plan, in its __dict__ (not a module attribute: never saved or moved)
_BUILDING = threading.Lock()  # one thread builds a model's plan; the others use it


def is_moe_block(block) -> bool:
    """Whether a decoder layer's MLP is an MoE block the step may serve: hf_moe's, or one of `NATIVE_BLOCKS`."""
    return type(block) is SparseMoeBlock or type(block).__name__ in NATIVE_BLOCKS


def _native_experts(experts) -> bool:
    """A transformers experts module on hf_moe's experts function (`experts_implementation="hf_moe"`), fused layout."""
    config = getattr(experts, "config", None)
    return (getattr(config, "_experts_implementation", None) == experts_interface.NAME
            and experts_interface._supported(experts) and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


def _experts_fields(experts, dtype: torch.dtype) -> tuple[dict, str, bool] | None:
    """({w1, w1_scale, b1, w2, w2_scale, b2}: the experts' tensors as the eager experts give them to
    `hf_moe::moe_experts_infer`, None where absent; biases not yet cast), activation, glu; or None where the eager
    experts would run another kernel for activations of `dtype`."""
    if type(experts) is QuantizedExperts:
        w1, s1, _, w2, s2, _, activation, glu = experts.kernel_args(dtype)
        b1, b2 = getattr(experts, f"{experts.up_name}_bias"), experts.down_proj_bias
        return dict(w1=w1, w1_scale=s1, b1=b1, w2=w2, w2_scale=s2, b2=b2), activation, glu
    if type(experts) is Experts:
        if experts.num_local_experts != experts.num_experts:
            return None
    elif not _native_experts(experts):
        return None
    w1, b1, w2, b2 = expert_weights(experts)
    if not infer.serves(w1.dtype):
        return None
    activation = kernel_activation(_activation_of(experts))
    return dict(w1=w1, w1_scale=None, b1=b1, w2=w2, w2_scale=None, b2=b2), activation, experts.has_gate


def _dense_reason(what: str, mlp) -> str | None:
    """Why `mlp` (a dense layer's MLP or shared experts) is not one the op computes as its modules do, or None."""
    glu = getattr(mlp, "glu", True)
    names = ("gate_proj", "up_proj", "down_proj") if glu else ("up_proj", "down_proj")
    if not all(type(getattr(mlp, n, None)) in (torch.nn.Linear, QuantizedLinear) for n in names):
        return f"{what}'s projections are not linear layers"
    if activation_key(getattr(mlp, "act_fn", None)) not in ACTIVATIONS:
        return f"{what}'s activation is not one of {', '.join(sorted(ACTIVATIONS))}"
    return None


def shared_experts(block) -> tuple:
    """(shared experts, their gate) of an MoE block, None where it has none: hf_moe's `shared_experts` and
    `shared_expert_gate`, Qwen2-MoE's `shared_expert` and `shared_expert_gate`."""
    if type(block) is SparseMoeBlock:
        return block.shared_experts, block.shared_expert_gate
    return getattr(block, "shared_expert", None), getattr(block, "shared_expert_gate", None)


def routing(block) -> tuple[int, bool, bool]:
    """(top_k, renormalised, logits in the activations' dtype) of an MoE block's router: hf_moe's TopKRouter computes
    its logits in fp32, transformers' routers in the activations' dtype (softmax in fp32 either way); Mixtral's
    router always renormalises."""
    gate = block.gate
    if type(block) is SparseMoeBlock:
        return gate.top_k, bool(gate.norm_topk_prob), False
    return gate.top_k, type(gate).__name__ == "MixtralTopKRouter" or bool(gate.norm_topk_prob), True


def _router_reason(i: int, block) -> str | None:
    gate = block.gate
    if type(block) is SparseMoeBlock:
        if type(gate) is not TopKRouter or gate.skip_threshold or gate.unit_weights or gate.capacity(1) is not None:
            return f"layer {i}'s router is not a plain top-k router ({gate.extra_repr()})"
        if block.bias is not None or (block.dropout is not None and block.training):
            return f"layer {i}'s MoE block has an output bias or dropout"
        return None
    if type(gate).__name__ != NATIVE_BLOCKS[type(block).__name__] or not isinstance(gate.weight, torch.Tensor):
        return f"layer {i}'s router is a {type(gate).__name__}, not {NATIVE_BLOCKS[type(block).__name__]}"
    return None


def _block_reason(i: int, block, experts: tuple | None, dtype: torch.dtype) -> str | None:
    """Why layer i's MLP `block` (its `_experts_fields`: `experts`) is not one the op computes, or None."""
    if type(block).__name__ in DENSE_MLPS:
        return _dense_reason(f"layer {i}'s MLP", block)
    if not is_moe_block(block):
        return (f"layer {i}'s MLP is a {type(block).__name__}, not an hf_moe SparseMoeBlock, one of transformers' "
                f"{', '.join(sorted(NATIVE_BLOCKS))} or a dense MLP")
    reason = _router_reason(i, block)
    if reason is not None:
        return reason
    shared, gate = shared_experts(block)
    if shared is not None:
        reason = (f"layer {i}'s shared experts are a {type(shared).__name__}, not an hf_moe SharedExperts or a "
                  "dense MLP" if type(shared) is not SharedExperts and type(shared).__name__ not in DENSE_MLPS
                  else _dense_reason(f"layer {i}'s shared experts", shared))
        if reason is None and gate is not None and (type(gate) is not torch.nn.Linear or gate.bias is not None):
            reason = f"layer {i}'s shared expert gate is not a linear layer without bias"
        if reason is not None:
            return reason
    if (type(block.gate).__name__ == "MixtralTopKRouter" and dtype != torch.float32
            and type(block.experts) is not QuantizedExperts):
        # Mixtral's router hands its fp32 weights to the experts as they are; the step rounds them to the activations'
        return f"layer {i}'s Mixtral router gives fp32 weights to {dtype} experts, which the step would round"
    if experts is None or experts[1] not in reference.KERNEL_ACTIVATIONS:
        return (f"layer {i}'s experts ({type(block.experts).__name__}) do not run the compiled inference kernel "
                f"(fp32 and bf16 experts: on CPUs with AVX-512 BF16 or AVX2; int8 experts everywhere)")
    return None


def one_op_reason(model) -> str | None:
    """Why the plan's one-op step cannot run `model`'s decode step (None: it can), beyond what
    `hf_moe.decode.choose_decode` checks first (the attention-block step's layers, dtype and device)."""
    if backend_setting() == "torch" or load_extension()[0] is None:
        return "the compiled extension is not loaded (`python -m hf_moe.env` says why)"
    backbone = model.model
    if getattr(backbone.rotary_emb, "rope_type", None) not in ROPE_TYPES:
        return f"its rotary embedding ({getattr(backbone.rotary_emb, 'rope_type', None)}) is not one of {ROPE_TYPES}"
    shared, dtype = set(), backbone.embed_tokens.weight.dtype
    for i, layer in enumerate(backbone.layers):
        experts = _experts_fields(getattr(layer.mlp, "experts", None), dtype)
        reason = _block_reason(i, layer.mlp, experts, dtype)
        if reason is not None:
            return reason
        if is_moe_block(layer.mlp):
            top_k, renormalised, _ = routing(layer.mlp)
            shared.add((top_k, renormalised, experts[1], experts[2]))
    if len(shared) != 1:
        return ("it has no MoE layer" if not shared
                else "its MoE layers differ in top-k, renormalisation, activation or GLU")
    return None


native_reason = one_op_reason  # the former name (deprecated): "native" names transformers' own models


def moe_layers(model) -> list:
    """The decoder layers whose MLP is an MoE block (`is_moe_block`)."""
    return [layer for layer in model.model.layers if is_moe_block(layer.mlp)]


def max_batch(model) -> int | None:
    """The most rows one step may decode (None: any): what the experts' kernel takes in eager mode too, any rows for
    int8 experts, `infer.max_tokens` of the dtype otherwise."""
    if all(type(layer.mlp.experts) is QuantizedExperts for layer in moe_layers(model)):
        return None
    return infer.max_tokens(model.model.embed_tokens.weight.dtype)


def _linear(prefix: str, module) -> dict:
    weight, scale, bias = linear_weights(module)
    return {f"{prefix}.weight": weight, f"{prefix}.scale": scale, f"{prefix}.bias": bias}


def _dense_fields(prefix: str, mlp) -> tuple[dict, dict, dict]:
    glu = getattr(mlp, "glu", True)
    tensors = {**(_linear(f"{prefix}.gate", mlp.gate_proj) if glu else {}), **_linear(f"{prefix}.up", mlp.up_proj),
               **_linear(f"{prefix}.down", mlp.down_proj)}
    return tensors, {f"{prefix}.glu": float(glu)}, {f"{prefix}.activation": activation_key(mlp.act_fn)}


def layer_fields(layer, dtype: torch.dtype) -> tuple[dict, dict, dict]:
    """({name: tensor or None}, {name: number}, {name: str}) of one decoder layer, as the op reads them by name
    (csrc/cpu/decode_step_cpu.cpp, `LayerPlan`). Adding a tensor to a layer is one entry here and one read there."""
    attention, block = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    tensors = {
        "input_norm": layer.input_layernorm.weight,
        **_linear("q", attention.q_proj), **_linear("k", attention.k_proj), **_linear("v", attention.v_proj),
        **_linear("o", attention.o_proj),
        "q_norm": None if q_norm is None else q_norm.weight, "k_norm": None if k_norm is None else k_norm.weight,
        "post_norm": layer.post_attention_layernorm.weight,
    }
    numbers = {"head_dim": attention.head_dim, "eps": layer.input_layernorm.variance_epsilon,
               "qk_eps": 1e-6 if q_norm is None else q_norm.variance_epsilon, "scaling": attention.scaling,
               "post_eps": layer.post_attention_layernorm.variance_epsilon}
    names = {}
    if not is_moe_block(block):  # a dense MLP
        more = _dense_fields("mlp", block)
    else:
        experts, _, _ = _experts_fields(block.experts, dtype)
        more = ({"router": block.gate.weight, **experts}, {"router_in_dtype": float(routing(block)[2])}, {})
        shared, gate = shared_experts(block)
        if shared is not None:
            t, n, a = _dense_fields("shared", shared)
            more = ({**more[0], **t, "shared_gate": None if gate is None else gate.weight}, {**more[1], **n}, a)
    tensors.update(more[0])
    numbers.update(more[1])
    names.update(more[2])
    return tensors, numbers, names


def model_fields(model) -> tuple[dict, dict]:
    """({name: tensor or None}, {name: number, str or bool}) of what the step reads outside the layers."""
    backbone = model.model
    block = moe_layers(model)[0].mlp
    top_k, renormalised, _ = routing(block)
    _, activation, glu = _experts_fields(block.experts, backbone.embed_tokens.weight.dtype)
    tensors = {"embed": backbone.embed_tokens.weight, "final_norm": backbone.norm.weight,
               **_linear("lm_head", model.lm_head), "inv_freq": getattr(backbone.rotary_emb, "inv_freq", None)}
    settings = {"final_eps": backbone.norm.variance_epsilon, "top_k": top_k, "norm_topk_prob": renormalised,
                "activation": activation, "glu": glu}
    return tensors, settings


def _fields(model) -> list[tuple]:
    dtype = model.model.embed_tokens.weight.dtype
    return [model_fields(model), *(layer_fields(layer, dtype) for layer in model.model.layers)]


def fingerprint(fields: list[tuple]) -> tuple:
    """What the plan read, as it was: each tensor's identity, address, dtype, shape and version counter, and every
    number (module docstring: what a change of it detects)."""
    key = []
    for tensors, *settings in fields:
        for name, t in tensors.items():
            key.append(None if t is None else (name, id(t), t.data_ptr(), t.dtype, tuple(t.shape), t._version))
        for values in settings:
            key.extend(values.items())
    return tuple(key)


class DecodePlan:
    """The one-op decode step of `model` (`one_op_reason(model)` must be None): its fields read and validated once,
    the workspace reused across steps. Call it as `DecodeStep.forward`: (input_ids [B, 1], position_ids
    [B, 1], mask [B, L] bool or None, cache `static_cache_layers`'s list) -> logits [B, 1, V].

    With `huge_pages` (the default; `decode_compile_config(huge_pages=False)` says no), the layers' small weights are
    read from copies on huge pages (`copies`: the buffer holding them, or None): the attention sub-block read its
    weights through 4 KiB pages otherwise (docs/serving-cpu.md, "Small weights on huge pages")."""

    def __init__(self, model, fields: list[tuple] | None = None, huge_pages: bool = True):
        if load_extension()[0] is None:  # registers torch.classes.hf_moe.DecodePlan
            raise RuntimeError("the one-op decode step needs hf_moe's compiled extension (`python -m hf_moe.env` "
                               "says why it is not loaded)")
        fields = _fields(model) if fields is None else fields
        self.key = fingerprint(fields)
        backbone = model.model
        # The rotary module and the device, not the model: the model keeps its plan (`plan_for`), and a plan that
        # kept the model would make a cycle, which holds the weights after the user's `del model` until the
        # garbage collector runs.
        self.rotary_emb, self.device = backbone.rotary_emb, backbone.embed_tokens.weight.device
        self.dtype = backbone.embed_tokens.weight.dtype
        (tensors, settings), layers = fields[0], fields[1:]
        self.settings, self.huge_pages, self.copies = settings, huge_pages, None
        if huge_pages:
            # The layers' small weights (the attention sub-block's, the routers', the norms') as copies on huge
            # pages (hf_moe.huge_pages.copies_on_huge_pages): in their own storages most of their bytes stay on 4
            # KiB pages, and a step streams them all. At most an eighth of the weights is copied.
            weights = sum(t.numel() * t.element_size() for group, *_ in fields for t in group.values()
                          if t is not None)
            copied, self.copies = copies_on_huge_pages([group for group, *_ in layers], budget=weights // 8)
            layers = [(group, *rest) for group, (_, *rest) in zip(copied, layers)]
        self.rotary = None  # (cache length, cos [L, D], sin [L, D])
        self.op = torch.classes.hf_moe.DecodePlan(
            _present(tensors), {"final_eps": float(settings["final_eps"])}, settings["top_k"],
            settings["norm_topk_prob"], settings["activation"], settings["glu"])
        for layer_tensors, numbers, names in layers:  # checked once here, by name (decode_step_cpu.cpp, LayerPlan)
            self.op.add_layer(_present(layer_tensors), {k: float(v) for k, v in numbers.items()}, names)

    def _rotary(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, D] of positions 0 .. length - 1, from the model's rotary module (what it gives for
        each position alone: each value is one product and its cos or sin)."""
        if self.rotary is None or self.rotary[0] != length:
            positions = torch.arange(length, device=self.device)[None]
            probe = torch.empty(1, length, 1, dtype=self.dtype)
            cos, sin = self.rotary_emb(probe, positions)  # [1, L, D] each
            self.rotary = (length, cos[0].contiguous(), sin[0].contiguous())
        return self.rotary[1], self.rotary[2]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                 cache: list) -> torch.Tensor:
        keys, values, lengths = zip(*cache)
        cos, sin = self._rotary(keys[0].shape[2])
        with torch.no_grad():  # inference only: the step writes into its own buffers (out= kernels)
            return self.op.step(input_ids, position_ids, mask, cos, sin, list(keys), list(values), list(lengths))


def _present(tensors: dict) -> dict:
    """The tensors the layer has (the op's dicts leave out what a layer does not have)."""
    return {name: t for name, t in tensors.items() if t is not None}


def plan_for(model, huge_pages: bool = True) -> DecodePlan:
    """The model's plan, built on first use and again whenever what it read has changed (`fingerprint`) or
    `huge_pages` differs from the plan's (`DecodePlan`)."""
    fields = _fields(model)

    def current(plan) -> bool:
        return plan is not None and plan.huge_pages == huge_pages and plan.key == fingerprint(fields)

    plan = model.__dict__.get(PLAN)
    if not current(plan):
        with _BUILDING:
            plan = model.__dict__.get(PLAN)
            if not current(plan):
                model.__dict__.pop(PLAN, None)  # the old plan's weights go before the new plan is built
                plan = DecodePlan(model, fields, huge_pages)
                model.__dict__[PLAN] = plan
    return plan


def drop_plan(model) -> None:
    """Discard `model`'s plan and its references to the weights (hf_moe.quantize does, after replacing experts)."""
    model.__dict__.pop(PLAN, None)
