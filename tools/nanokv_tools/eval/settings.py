"""KV settings the eval compares: a per-layer bit plan, the key rotation, or a simulated format.

Every setting runs on its own ModelRunner (own KV tensors) sharing the one model and the one
cache manager's block tables, so all settings see identical tokens, positions and block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from nanokv.config import parse_bitwidth
from nanokv.errors import NanoKVError
from nanokv.kv.cache import bytes_per_block
from nanokv.kv.fakequant import FakeQuant
from nanokv.sparsity import SparsityParams


@dataclass
class Setting:
    name: str
    bitwidth: dict[str, Any] | None  # parsed quantization_bitwidth; None = full precision
    rotate: bool | None = None  # None: the format default (nanokv.kv.rotation.DEFAULT_ROTATE_BITS)
    fake_quant: FakeQuant | None = None  # measurement only: simulate a format on a full-precision cache
    sparsity: SparsityParams | None = None  # block sparsity on top of the format (nanokv.compute_service.sparsity)
    # simulation only: the 16-bit cache stores values rotated (v R) and rotates the output back, exactly
    # as the int4 format does (nanokv.compute_service.kv_hooks), so a FakeQuant sees the very values int4 quantizes
    rotate_v: bool = False
    # a full-precision cache whose full blocks are served from a lower tier of this format (8, 4): each
    # block round-trips through the tier format once it fills (nanokv_tools.eval.sparse, SparseView)
    tier_bits: int | None = None

    def with_sparsity(self, params: SparsityParams) -> Setting:
        """The same format with block sparsity, named e.g. 'int8 attention@0.5'."""
        return replace(self, name=f"{self.name} {params.policy}@{params.sparsity:g}", sparsity=params)

    def engine_kwargs(self) -> dict[str, Any]:
        if self.bitwidth is None:
            return {"enable_compression": False}
        return {"enable_compression": True, "quantization_bitwidth": self.bitwidth}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "quantization_bitwidth": self.bitwidth, "rotate": self.rotate,
                "rotate_v": self.rotate_v, "lower_tier_bits": self.tier_bits,
                "fake_quant": None if self.fake_quant is None else vars(self.fake_quant),
                "sparsity": None if self.sparsity is None else vars(self.sparsity)}


def plan_bits(bitwidth: dict[str, Any] | None, num_layers: int) -> list[int]:
    if bitwidth is None:
        return [16] * num_layers
    bits = [int(bitwidth["default"])] * num_layers
    for key, b in bitwidth["layers"].items():
        bits[int(key)] = int(b)
    return bits


def bytes_per_token(s: Setting, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int) -> float:
    """KV bytes one token takes over all layers, scales and zero points included; 16-bit = bf16.
    A lower-tier setting: the bytes in its tier (L1 holds them at full precision)."""
    if s.tier_bits is not None:
        per_block = bytes_per_block(s.tier_bits, num_kv_heads, block_size, head_dim, torch.bfloat16)
        return num_layers * per_block / block_size
    if s.fake_quant is not None:
        bits = s.fake_quant.bits_per_value(head_dim, block_size)
        return num_layers * 2 * num_kv_heads * head_dim * bits / 8
    return sum(bytes_per_block(b, num_kv_heads, block_size, head_dim, torch.bfloat16)
               for b in plan_bits(s.bitwidth, num_layers)) / block_size


_MIXED = {"default": 4, "layers": {"0": 8, "-1": 8}}

PRESETS: dict[str, Setting] = {
    "fp": Setting("fp", None),
    "fp-self": Setting("fp-self", parse_bitwidth(16)),  # a second full-precision cache: must score 0
    "int8": Setting("int8", parse_bitwidth(8)),  # the format default: keys rotated
    "int8-plain": Setting("int8-plain", parse_bitwidth(8), rotate=False),
    # a full-precision cache whose prefix blocks come from an int8 / int4 lower tier (--lower-tier-format)
    "tier-int8": Setting("tier-int8", None, tier_bits=8),
    "tier-int4": Setting("tier-int4", None, tier_bits=4),
    "int4": Setting("int4", parse_bitwidth(4)),  # the format default: keys rotated
    "int4-plain": Setting("int4-plain", parse_bitwidth(4), rotate=False),
    "int4-mixed": Setting("int4-mixed", parse_bitwidth(_MIXED)),
    "int4-plain-mixed": Setting("int4-plain-mixed", parse_bitwidth(_MIXED), rotate=False),
    # simulated formats (fake quantization on a full-precision cache), to choose a granularity
    "sim-int4": Setting("sim-int4", None, rotate=False, fake_quant=FakeQuant(4, 4)),
    "sim-int4-rot": Setting("sim-int4-rot", None, rotate=True, fake_quant=FakeQuant(4, 4)),
    "sim-int4-g32": Setting("sim-int4-g32", None, rotate=False, fake_quant=FakeQuant(4, 4, group=32)),
    "sim-int4-kchan": Setting("sim-int4-kchan", None, rotate=False,
                              fake_quant=FakeQuant(4, 4, k_per_channel=True)),
    "sim-int4-sink": Setting("sim-int4-sink", None, rotate=False, fake_quant=FakeQuant(4, 4, sink_tokens=16)),
    "sim-int4-rot-sink": Setting("sim-int4-rot-sink", None, rotate=True,
                                 fake_quant=FakeQuant(4, 4, sink_tokens=16)),
    "sim-int4-rot-rotv": Setting("sim-int4-rot-rotv", None, rotate=True,
                                 fake_quant=FakeQuant(4, 4, rotate_v=True)),
    "sim-k8v4": Setting("sim-k8v4", None, rotate=False, fake_quant=FakeQuant(8, 4)),
    "sim-int8-rot-rotv": Setting("sim-int8-rot-rotv", None, rotate=True,
                                 fake_quant=FakeQuant(8, 8, rotate_v=True)),
    "sim-int4-rot-rotv-sink": Setting("sim-int4-rot-rotv-sink", None, rotate=True,
                                      fake_quant=FakeQuant(4, 4, rotate_v=True, sink_tokens=16)),
    "sim-int4-kchan-rotv": Setting("sim-int4-kchan-rotv", None, rotate=False,
                                   fake_quant=FakeQuant(4, 4, k_per_channel=True, rotate_v=True)),
    "sim-k3chan-v4-rotv": Setting("sim-k3chan-v4-rotv", None, rotate=False,
                                  fake_quant=FakeQuant(3, 4, k_per_channel=True, rotate_v=True)),
    "sim-int4-kchan-rotv-sink": Setting("sim-int4-kchan-rotv-sink", None, rotate=False,
                                        fake_quant=FakeQuant(4, 4, k_per_channel=True, rotate_v=True,
                                                             sink_tokens=16)),
    # quantize-on-fill (FakeQuant.on_fill): the open block and the step's own tokens stay full precision
    "sim-fill-k4v4": Setting("sim-fill-k4v4", None, rotate=False,
                             fake_quant=FakeQuant(4, 4, k_per_channel=True, rotate_v=True, on_fill=True)),
    "sim-fill-k4v4-sink": Setting("sim-fill-k4v4-sink", None, rotate=False,
                                  fake_quant=FakeQuant(4, 4, k_per_channel=True, rotate_v=True, on_fill=True,
                                                       sink_tokens=1)),
    "sim-fill-k4v4-rotk": Setting("sim-fill-k4v4-rotk", None, rotate=True,
                                  fake_quant=FakeQuant(4, 4, k_per_channel=True, rotate_v=True, on_fill=True)),
    # the shipped int4 format simulated with the real format's V rotation (must score as `int4`)
    "sim-int4-format": Setting("sim-int4-format", None, rotate=True, rotate_v=True,
                               fake_quant=FakeQuant(4, 4, k_per_channel=True, on_fill=True)),
    "sim-fill-k4v4-rotk-sink": Setting("sim-fill-k4v4-rotk-sink", None, rotate=True,
                                       fake_quant=FakeQuant(4, 4, k_per_channel=True, rotate_v=True,
                                                            on_fill=True, sink_tokens=1)),
    "sim-fill-tok4-rot": Setting("sim-fill-tok4-rot", None, rotate=True,
                                 fake_quant=FakeQuant(4, 4, rotate_v=True, on_fill=True)),
}


def from_args(bitwidth: Any, layer_bits: str | None, rotation: str) -> Setting:
    """The setting named by --quantization-bitwidth / --layer-bits / --rotation.

    --layer-bits takes either a full plan {"default": 4, "layers": {"0": 8}} or just the layer map
    {"0": 8, "-1": 8} (the default then comes from --quantization-bitwidth).
    """
    spec: Any = bitwidth
    if layer_bits is not None:
        import json
        try:
            lb = json.loads(layer_bits)
        except json.JSONDecodeError as e:
            raise NanoKVError("layer_bits", f"invalid JSON: {e}") from None
        if not isinstance(lb, dict):
            raise NanoKVError("layer_bits", 'must be a JSON object, e.g. {"0": 8, "-1": 8}')
        spec = lb if "default" in lb or "layers" in lb else {"default": bitwidth, "layers": lb}
    plan = parse_bitwidth(spec)
    rotate = {"auto": None, "on": True, "off": False}.get(rotation, "bad")
    if rotate == "bad":
        raise NanoKVError("rotation", f"got {rotation!r}; allowed: auto, on, off")
    name = f"int{plan['default']}" if not plan["layers"] else "plan" + json_compact(plan)
    if rotation != "auto":
        name += f"-rot{rotation}"
    if plan["default"] == 16 and not plan["layers"]:
        name = "fp-self"
    return Setting(name, plan, rotate=rotate)  # type: ignore[arg-type]


def json_compact(obj: Any) -> str:
    import json
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


def lower_tiers(value: str) -> list[Setting]:
    """--lower-tier-format: a comma list of int8, int4 -> the tier-int8 / tier-int4 settings."""
    names = [x.strip() for x in value.split(",") if x.strip()]
    for n in names:
        if n not in ("int8", "int4"):
            raise NanoKVError("lower_tier_format", f"got {n!r}; allowed: int8, int4 (a comma list)")
    return [PRESETS[f"tier-{n}"] for n in names]


def preset(name: str) -> Setting:
    if name not in PRESETS:
        raise NanoKVError("setting", f"unknown setting {name!r}; allowed: {', '.join(PRESETS)}")
    return PRESETS[name]
