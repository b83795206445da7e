"""Prometheus metrics (`--metrics-listen HOST:PORT`, plaintext HTTP, path /metrics).

Counters and histograms are updated where things happen (the update session,
the interceptor, the supervisor); gauges are read from the server's state at
scrape time (StateCollector), so they can never drift from what
GetServerInfo says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from weightsync.v1 import weight_sync_service_pb2 as pb

disable_created_metrics()  # no *_created series: they double every counter for no use here
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BYTES = tuple(float(1 << e) for e in range(10, 42, 2))  # 1 KiB .. 2 TiB


class Metrics:
    """Every metric of one server, in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.update_seconds = Histogram(
            "weightsync_update_duration_seconds", "From BeginUpdate received to commit or abort.",
            ["transport", "mode", "outcome"], buckets=SECONDS, registry=r)
        self.update_bytes = Histogram(
            "weightsync_update_bytes", "Bytes the node received per committed update.",
            ["transport", "mode"], buckets=BYTES, registry=r)
        self.buckets = Counter("weightsync_buckets_applied_total", "Buckets every worker applied.",
                               ["transport"], registry=r)
        self.failures = Counter("weightsync_update_failures_total", "Updates that failed, by ErrorInfo reason.",
                                ["reason", "code"], registry=r)
        self.rpcs = Counter("weightsync_rpcs_total", "Finished RPCs by method and status code.",
                            ["method", "code"], registry=r)
        self.worker_restarts = Counter("weightsync_worker_restarts_total", "Worker processes restarted.",
                                       ["worker"], registry=r)
        self._server = None

    def record_update(self, *, transport: int, mode: int, seconds: float, buckets: int, size_bytes: int,
                      failure: tuple[str, str] | None) -> None:
        """One update's end: committed (failure None) or failed with (reason, code name)."""
        labels = {"transport": pb.Transport.Name(transport).removeprefix("TRANSPORT_").lower(),
                  "mode": pb.UpdateMode.Name(mode).removeprefix("UPDATE_MODE_").lower()}
        self.update_seconds.labels(outcome="failed" if failure else "committed", **labels).observe(seconds)
        self.buckets.labels(transport=labels["transport"]).inc(buckets)
        if failure is None:
            self.update_bytes.labels(**labels).observe(size_bytes)
        else:
            self.failures.labels(reason=failure[0], code=failure[1]).inc()

    def watch(self, collector: Collector) -> None:
        self.registry.register(collector)

    def serve(self, host: str, port: int) -> int:
        """Start /metrics on a thread of its own; returns the bound port."""
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_address[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _label(enum, value: int) -> str:
    name = enum.Name(value) if value in enum.values() else str(value)
    return name.split("_STATE_", 1)[-1].lower()


class StateCollector(Collector):
    """Gauges read at scrape time: store states, versions, groups, engines."""

    def __init__(self, snapshot: Callable[[], pb.GetServerInfoResponse], groups: Callable[[], list[pb.TransferGroup]]):
        self._snapshot = snapshot
        self._groups = groups

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info = self._snapshot()
        store = GaugeMetricFamily("weightsync_store_state", "1 for the store's current state.", labels=["state"])
        store.add_metric([_label(pb.StoreState, info.store.state)], 1)
        tensors = GaugeMetricFamily("weightsync_store_tensors", "Tensors in the node's store.")
        tensors.add_metric([], info.store.tensor_count)
        live = GaugeMetricFamily("weightsync_store_bytes", "Live bytes of the node's store.")
        live.add_metric([], info.store.live_bytes)
        held = GaugeMetricFamily("weightsync_store_held_bytes", "Host memory the store holds, shadows included.")
        held.add_metric([], info.store.held_bytes)
        yield from (store, tensors, live, held)
        up = GaugeMetricFamily("weightsync_worker_up", "1 while the worker is running.", labels=["worker", "device"])
        staging = GaugeMetricFamily("weightsync_worker_staging_bytes", "Staging each worker holds.",
                                    labels=["worker", "memory"])
        received = GaugeMetricFamily("weightsync_worker_received_bytes",
                                     "Bytes each worker received into the store since it started.", labels=["worker"])
        for w in info.workers:
            up.add_metric([str(w.index), w.device], 1 if w.state == pb.WORKER_STATE_RUNNING else 0)
            staging.add_metric([str(w.index), "device" if w.staging_on_device else "host"], w.staging_bytes)
            received.add_metric([str(w.index)], w.received_bytes)
        yield from (up, staging, received)
        generation = GaugeMetricFamily("weightsync_committed_generation", "Generation of the published version.")
        generation.add_metric([], info.current_version.generation)
        yield generation
        engines = GaugeMetricFamily("weightsync_engine_applied_generation",
                                    "Generation each engine serves (0 before its first apply).",
                                    labels=["engine", "kind", "state"])
        lag = GaugeMetricFamily("weightsync_engine_commit_to_serving_seconds",
                                "From the commit of the version an engine serves to it serving it.", labels=["engine"])
        for e in info.engines:
            engines.add_metric([e.name, e.kind, _label(pb.EngineState, e.state)], e.applied_version.generation)
            if e.HasField("commit_to_serving"):
                lag.add_metric([e.name], e.commit_to_serving.ToTimedelta().total_seconds())
        yield from (engines, lag)
        groups = GaugeMetricFamily("weightsync_groups", "Transfer groups by state.", labels=["state"])
        counts = {name: 0 for name in ("joining", "ready", "broken")}
        for g in self._groups():
            counts[_label(pb.GroupState, g.state)] = counts.get(_label(pb.GroupState, g.state), 0) + 1
        for state, count in counts.items():
            groups.add_metric([state], count)
        yield groups
