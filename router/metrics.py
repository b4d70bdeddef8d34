"""The router's /metrics: requests routed per replica, prefix-hit tokens it predicted, replica health."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from nanokv.router.replica import Replica

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _ReplicaCollector(Collector):
    def __init__(self, replicas: Callable[[], list[Replica]]):
        self.replicas = replicas

    def collect(self):  # type: ignore[no-untyped-def]  # (prometheus_client's own signature)
        up = GaugeMetricFamily("nanokv_router_replica_healthy", "1 while the replica passes its checks.",
                               labels=["replica"])
        idx = GaugeMetricFamily("nanokv_router_index_blocks", "Blocks the router's index holds for the replica.",
                                labels=["replica"])
        load = GaugeMetricFamily("nanokv_router_replica_inflight", "Requests this router has in flight there.",
                                 labels=["replica"])
        for r in self.replicas():
            up.add_metric([r.name], 1.0 if r.healthy else 0.0)
            idx.add_metric([r.name], float(r.num_blocks_indexed()))
            load.add_metric([r.name], float(r.inflight))
        yield from (up, idx, load)


class RouterMetrics:
    def __init__(self, replicas: Callable[[], list[Replica]]):
        self.registry = r = CollectorRegistry()
        self.routed = Counter("nanokv_router_requests", "Requests routed, by replica and API.",
                              ["replica", "api"], registry=r)
        self.predicted_hit = Counter("nanokv_router_predicted_hit_tokens",
                                     "Prompt tokens the index predicted cached where the request went.",
                                     ["replica"], registry=r)
        self.prompt_tokens = Counter("nanokv_router_prompt_tokens", "Prompt tokens of routed requests.",
                                     ["replica"], registry=r)
        self.failed = Counter("nanokv_router_upstream_failures", "Calls that could not reach a replica or broke.",
                              ["replica"], registry=r)
        self.no_replica = Counter("nanokv_router_no_replica", "Requests refused: no healthy replica.", registry=r)
        self.healthy = Gauge("nanokv_router_healthy_replicas", "Replicas passing their checks.", registry=r)
        r.register(_ReplicaCollector(replicas))

    def routed_to(self, replica: str, api: str, prompt_tokens: int, predicted_hit: int) -> None:
        self.routed.labels(replica, api).inc()
        self.prompt_tokens.labels(replica).inc(prompt_tokens)
        self.predicted_hit.labels(replica).inc(predicted_hit)

    def render(self) -> bytes:
        return generate_latest(self.registry)
