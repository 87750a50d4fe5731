"""Deprecated: the one-op decode step's module is `hf_moe.decode_one_op` ("native" names transformers' own models).
This name stays for one release and warns when imported."""

import warnings

from .decode_one_op import *  # noqa: F401,F403
from .decode_one_op import DecodePlan, drop_plan, layer_fields, model_fields, one_op_reason, plan_for  # noqa: F401

native_reason = one_op_reason

warnings.warn("hf_moe.decode_native is deprecated: import hf_moe.decode_one_op (native_reason is one_op_reason there)",
              DeprecationWarning, stacklevel=2)
