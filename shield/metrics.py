"""Prometheus text-format endpoint for `sim2real serve --metrics-port P` (optional extra `metrics`).

The counters and the latency histogram are read from `ServeStats` when Prometheus
scrapes (a collector, in the HTTP server's own thread), so the serving loop pays
nothing for them. `prometheus-client` is imported only here, only when asked for:
`import shield` and the edge base install stay light.

Exposed (all counters of the status reply, docs/reference/protocol.md, "Status request"):
    s2r_serve_<counter>_total          counter, one per COUNTER_NAMES entry
    s2r_serve_latency_seconds          histogram of act replies (kernel receive -> reply built),
                                       buckets at the status reply's log2 µs bin edges
    s2r_serve_bundle_version           gauge
    s2r_serve_plants                   gauge: plant sessions held now
    s2r_serve_blind_horizon_steps      gauge: blind steps in a row the shield's guarantee covers (contract reply)
    s2r_serve_plant_estimate           gauge per plant session and parameter (labels plant, parameter): what an
                                       adaptive policy believes the plant is (the estimate reply's values)
    s2r_serve_plant_estimate_steps     gauge per plant session: steps its policy state has seen since it started
"""

from __future__ import annotations

from typing import Any

from shield.protocol import COUNTER_NAMES, LATENCY_BINS


class MetricsError(RuntimeError):
    """The metrics endpoint cannot start (extra not installed, port taken)."""


def _collector(server: Any):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class ServeCollector:
        def collect(self):
            stats = server.stats
            for name in COUNTER_NAMES:
                family = CounterMetricFamily(
                    f"s2r_serve_{name}", f"serve counter {name} (docs/reference/protocol.md, Status request)"
                )
                family.add_metric([], getattr(stats, name))
                yield family
            hist = list(stats.histogram)
            buckets, acc = [], 0
            for i in range(LATENCY_BINS - 1):  # bin i counts latencies below 2**i µs (bin 0: below 1 µs)
                acc += hist[i]
                buckets.append((repr(2.0**i / 1e6), acc))
            acc += hist[-1]
            buckets.append(("+Inf", acc))
            latency = HistogramMetricFamily(
                "s2r_serve_latency_seconds", "act replies: kernel receive to reply built (s)"
            )
            latency.add_metric([], buckets, sum_value=stats.latency_sum_us / 1e6)
            yield latency
            version = GaugeMetricFamily("s2r_serve_bundle_version", "bundle version being served")
            version.add_metric([], server.served.version)
            yield version
            plants = GaugeMetricFamily("s2r_serve_plants", "plant sessions held")
            plants.add_metric([], len(server.plants))
            yield plants
            horizon = GaugeMetricFamily(
                "s2r_serve_blind_horizon_steps", "blind steps (OBS_MISSING) in a row the shield's guarantee covers"
            )
            horizon.add_metric([], server.served.blind_horizon)
            yield horizon
            names = server.served.estimate_names
            if names:
                estimate = GaugeMetricFamily(
                    "s2r_serve_plant_estimate",
                    "the plant parameters the policy infers from each plant's history (manifest contract "
                    "plant_estimate: scales of nominal, latency in control periods)",
                    labels=["plant", "parameter"],
                )
                steps = GaugeMetricFamily(
                    "s2r_serve_plant_estimate_steps",
                    "steps each plant's policy state has seen since it last started",
                    labels=["plant"],
                )
                for client, session in list(server.plants.sessions.items()):  # a copy: the loop may admit one
                    values, seen = server.live_estimate(session)
                    if values is None:  # none yet, or a silent plant's (reset at its next request)
                        continue
                    plant = plant_label(client)
                    for name, value in zip(names, values.tolist(), strict=True):
                        estimate.add_metric([plant, name], value)
                    steps.add_metric([plant], seen)
                yield estimate
                yield steps

    return ServeCollector()


def plant_label(client: Any) -> str:
    """A plant session's label: its client id (with a key), or address:port/client id (without)."""
    if isinstance(client, tuple) and len(client) == 2 and isinstance(client[0], tuple):
        (host, port), client_id = client[0][:2], client[1]
        return f"{host}:{port}/{client_id}"
    return str(client)


def start_metrics_server(server: Any, port: int, host: str = "127.0.0.1") -> tuple[str, int]:
    """Serve /metrics for `server` on host:port in a daemon thread; returns the bound (host, port)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise MetricsError("--metrics-port needs prometheus-client: pip install 'sim2real[metrics]'") from None
    registry = CollectorRegistry()
    registry.register(_collector(server))
    try:
        httpd, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        raise MetricsError(f"cannot serve metrics on {host}:{port}: {err.strerror}") from None
    except (TypeError, ValueError):  # prometheus-client < 0.20 returns nothing
        raise MetricsError("--metrics-port needs prometheus-client >= 0.20") from None
    bound = httpd.server_address
    return str(bound[0]), int(bound[1])
