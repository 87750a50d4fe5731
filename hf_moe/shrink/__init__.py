"""Shrinking an MoE after training: fewer experts per layer, by pruning or merging, on hf_moe checkpoints and on
transformers' own MoE checkpoints (docs/shrinking.md).

    layout.py       where a checkpoint keeps its routers and experts, in memory and on disk (hf_moe, native)
    calibration.py  the calibration text: read, tokenized, checked
    layer.py        one layer's routing, expert outputs, and routers and blocks built with fewer experts
    select.py       random, frequency and reconstruction choices, per layer and global
    search.py       method loss: a coordinate search over the layers scored by the model's loss on the text
    merge.py        merging the experts left out into the ones kept (grouped, aligned, weighted, router refitted)
    output.py       the shrunk checkpoint's files, in the input's kind
    passes.py       the passes over the layers: the layer-by-layer forward (meta model, one layer read at a time), or
                    each layer read, cut and written
    methods.py      the methods, one class each behind one interface (`ShrinkMethod`), by name in `SHRINK_METHODS`
    api.py          `shrink`: the request checked, the checkpoint and the output opened, the method applied

Dynamic skipping, the inference-time counterpart, is a router option (`router_skip_threshold`, layers/router.py).
"""

from .api import SCOPES, ShrinkResult, shrink
from .layout import ShrinkError
from .methods import METHODS

__all__ = ["METHODS", "SCOPES", "ShrinkError", "ShrinkResult", "shrink"]
