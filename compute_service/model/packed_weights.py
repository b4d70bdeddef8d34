"""weight_quantization="gguf": after a GGUF model has loaded, put its 4-bit layers and its LM head on
torch's packed CPU int4 product (layers/qlinear.py, docs/cpu-decode.md)."""

from __future__ import annotations

import logging

from nanokv.compute_service.model.gguf_loader import _reader, lm_head_int4
from nanokv.compute_service.model.layers.linear import LinearBase
from nanokv.compute_service.model.layers.qlinear import Int4LMHead
from nanokv.compute_service.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def pack_gguf_weights(model: LlamaForCausalLM, path: str) -> dict[str, int]:
    """Give every linear layer whose shards all came as Q4_0/Q4_1 rows, and the LM head (Q4_0/Q4_1/Q8_0),
    a packed int4 product for small batches (layers.linear.int4_rows). Returns the counts."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    packed = sum(m.pack_weights() for m in layers)
    head = lm_head_int4(_reader(path))
    if head is not None:
        # the float head stays for large batches and Int4LMHead's fp32 re-scoring
        model.lm_head = Int4LMHead(head, model.lm_head)  # type: ignore[assignment]
    if packed:
        # a packed v/o projection cannot take an int4 KV layer's value rotation into its weights
        # (LlamaAttention.fold_value_rotation rewrites float weights); without this method the KV
        # pool rotates values itself (ModelRunner.fold_value_rotations skips the model)
        model.fold_value_rotation = None  # type: ignore[assignment,method-assign]
    log.info("weight_quantization gguf: %d of %d linear layers packed int4, LM head %s", packed, len(layers),
             "packed int4" if head is not None else "float")
    return {"layers": len(layers), "packed": packed, "lm_head_packed": int(head is not None)}
