"""The compute service's span for one step's forward pass and sampling (nanokv.tracing).

Named by what the batch holds: "nanokv.compute.prefill", "nanokv.compute.decode" or
"nanokv.compute.mixed" (chunked prefill rows next to decode rows); a child of the gateway's step
span (through the Step call's gRPC metadata, or directly in process). Attributes: rows and tokens
per kind, rows sampled, the KV format, the device. Off, launch() pays one global test.
"""

from __future__ import annotations

import contextlib
from typing import Any

from nanokv import tracing
from nanokv.kv.formats import kv_format
from nanokv.messages import StepRequest


def forward_span(svc: Any, req: StepRequest) -> contextlib.AbstractContextManager:
    if not tracing.on() or not req.seq_ids:
        return tracing._NULL
    p = req.num_prefills
    decodes = len(req.seq_ids) - p
    kind = "mixed" if p and decodes else ("prefill" if p else "decode")
    runner = svc.runner
    dtype = str(svc.dtype).removeprefix("torch.")
    return tracing.span(f"nanokv.compute.{kind}", {
        "nanokv.step_id": req.step_id,
        "nanokv.num_prefills": p,
        "nanokv.num_decodes": decodes,
        "nanokv.prefill_tokens": sum(req.num_new[:p]),
        "nanokv.num_tokens": len(req.tokens),
        "nanokv.sample_rows": len(req.sample_rows),
        "nanokv.kv_format": kv_format(list(getattr(runner, "layer_bits", [16])), dtype),
        "nanokv.device": svc.device.type,
        "gen_ai.request.model": svc.model_name,
    })
