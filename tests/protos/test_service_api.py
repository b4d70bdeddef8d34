"""Both sides of each seam are one API: CacheService (in process) and CacheClient (gRPC) have exactly
the methods of nanokv.service_api.CacheAPI, ComputeService and ComputeClient exactly those of
ComputeAPI, with the very same signatures (parameter names, kinds, defaults, annotations, return
annotation), so the engine never has to ask which transport it holds. The services' extra methods
are the ones listed here, which serve the other service or their own server, not the gateway."""

from __future__ import annotations

import inspect

import pytest

from nanokv.cache_service.service import CacheService
from nanokv.compute_service.service import ComputeService
from nanokv.gateway.clients import CacheClient, ComputeClient
from nanokv.service_api import CacheAPI, ComputeAPI

# the pool's attach protocol (the compute service calls it) and a server's lease reaper
# (close_disk: an in-process engine lets its disk tier's directory go when it shuts down)
SERVICE_ONLY = {CacheService: {"attach", "detach", "free_storage", "close_disk"}, ComputeService: {"drop_sequences"}}


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")}


def mismatches(proto: type, impl: type, extra: set[str] = frozenset()) -> list[str]:
    """What keeps `impl` from being exactly `proto` (besides the `extra` methods it must also have)."""
    want, have = public_methods(proto), public_methods(impl)
    problems = [f"{impl.__name__} lacks {name}" for name in sorted((set(want) | extra) - set(have))]
    problems += [f"{impl.__name__}.{name} is not in {proto.__name__}" for name in sorted(set(have) - set(want) - extra)]
    problems += [f"{impl.__name__}.{name}{have[name]} != {proto.__name__}.{name}{want[name]}"
                 for name in sorted(set(want) & set(have)) if have[name] != want[name]]
    attrs = [a for a in vars(proto).get("__annotations__", {}) if not a.startswith("_")]
    problems += [f"{impl.__name__} lacks the attribute {a}" for a in attrs if not hasattr(impl, a)]
    return problems


@pytest.mark.parametrize(("proto", "impl"), [(CacheAPI, CacheService), (CacheAPI, CacheClient),
                                             (ComputeAPI, ComputeService), (ComputeAPI, ComputeClient)],
                         ids=lambda c: c.__name__)
def test_each_side_has_exactly_the_protocols_methods(proto: type, impl: type) -> None:
    assert public_methods(proto), proto  # (the protocols are not empty)
    assert mismatches(proto, impl, SERVICE_ONLY.get(impl, set())) == []


def test_the_check_sees_a_missing_method_an_extra_one_and_a_changed_signature() -> None:
    class Proto:
        rtt_s: float

        def plan(self, request: int) -> str: ...

        def stats(self) -> dict[str, int]: ...

    class Lacking:
        rtt_s = 0.0

        def plan(self, request: int) -> str:
            return ""

    class Changed:
        def plan(self, request: int, timeout: float = 1.0) -> str:
            return ""

        def stats(self) -> dict[str, float]:
            return {}

        def probe(self) -> None: ...

    assert mismatches(Proto, Lacking) == ["Lacking lacks stats"]
    changed = mismatches(Proto, Changed)
    assert changed[0] == "Changed.probe is not in Proto"
    assert [p.split("(")[0] for p in changed[1:3]] == ["Changed.plan", "Changed.stats"]
    assert changed[3] == "Changed lacks the attribute rtt_s"
    assert mismatches(Proto, Changed, {"probe"})[0].startswith("Changed.plan")
