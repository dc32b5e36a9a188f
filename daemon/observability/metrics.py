"""Metrics over HTTP: Prometheus's /metrics and Triton's statistics extension.

`GET /metrics` is the text exposition of the daemon's own registry, read by a collector from the
controller's state when it is scraped. `GET /v2/models[/{model}[/versions/{version}]]/stats`
answers in the shape of Triton's statistics extension, which `tritonclient`'s
`get_inference_statistics` and perf_analyzer read; without a version, every ready version of the
model is reported, as Triton does. Both are rendered by the gateway, on the event loop, where the
controller's state is consistent.

Nothing is instrumented on the hot path for Prometheus: the scheduler already counts every
event (`Scheduler.counters`, and the per-model and per-device records of `Telemetry`), and
`collect()` turns that state into metric families at scrape time. It must run on the event
loop thread, which owns that state: it then reads it consistently, with no locks.

Each daemon has a registry of its own (`make_registry`), not the process-wide default, so
that several daemons in one process (tests) do not share or clash.

Names follow Triton's where the meaning is the same. Triton's counters carry no `_total`
suffix, which prometheus-client always adds to a counter; to keep Triton's exact names (and
so its dashboards) they are exposed untyped. Everything escapement adds is `escapement_*`,
typed, counters ending in `_total`. docs/http-api.md lists every metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.utils import floatToGoString

from daemon.api.httpserver import Request, Response, Router
from daemon.observability.stats import Buckets, ModelStats
from daemon.observability.threads import thread_cpu
from daemon.overload import LagTracker

if TYPE_CHECKING:  # (types only: a frontend worker renders nothing here, and loads no controller or torch)
    from daemon.apps.cache import PredictionCache
    from daemon.apps.personal import Personalizer
    from daemon.apps.router import Applications
    from daemon.controller.scheduler import Scheduler
    from daemon.gateway import Gateway  # a type only: the gateway renders through this module
    from daemon.runtime.prefixcache import PrefixCacheStats

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # text/plain; version=0.0.4; charset=utf-8

# Every reason a request may fail with (stats.failure_reason), all exposed from the start
# so that a rate over a reason never begins with a missing series.
FAILURE_REASONS = ("REJECTED", "DEADLINE", "CANCELED", "BACKEND", "UNAVAILABLE", "OTHER")
MODEL = ["model", "version"]

# Scheduler.counters behind the named ParM metrics (all counters also appear, unnamed, in
# escapement_controller_events_total).
PARITY_OUTCOMES = {"issued": "parities_issued", "completed": "parities_run", "lost": "parities_lost",
                   "unavailable": "parity_unavailable"}


# Triton's per-model counters: name, help, and how to read it off a model's statistics.
US = 1e6
TRITON_COUNTERS: tuple[tuple[str, str, Callable[[ModelStats], float]], ...] = (
    ("nv_inference_request_success", "Requests answered successfully", lambda m: m.success.count),
    ("nv_inference_count", "Samples (batch elements) of successful requests", lambda m: m.inference_count),
    ("nv_inference_exec_count", "Model executions (INFER actions that ran)", lambda m: m.execution_count),
    ("nv_inference_request_duration_us", "Arrival to answer of successful requests, microseconds",
     lambda m: m.success.seconds * US),
    ("nv_inference_queue_duration_us", "Arrival to dispatch of successful requests, microseconds",
     lambda m: m.queue.seconds * US),
    ("nv_inference_compute_input_duration_us", "Always 0: input copies are counted in the output duration",
     lambda m: m.compute_input.seconds * US),
    ("nv_inference_compute_infer_duration_us",
     "Model run time of the execution that answered each successful request, microseconds",
     lambda m: m.compute_infer.seconds * US),
    ("nv_inference_compute_output_duration_us",
     "Input and output copies and host work of the execution that answered each successful request, microseconds",
     lambda m: m.compute_output.seconds * US),
)
MODEL_HISTOGRAMS: tuple[tuple[str, str, Callable[[ModelStats], Buckets]], ...] = (
    ("escapement_request_duration_seconds", "Arrival to answer of successful requests", lambda m: m.latency),
    ("escapement_queue_duration_seconds", "Arrival to dispatch of successful requests", lambda m: m.queue_time),
    ("escapement_compute_duration_seconds", "Model run time of each execution", lambda m: m.compute_time),
)


def _labels(m: ModelStats) -> dict[str, str]:
    return {"model": m.spec.name, "version": str(m.spec.version)}


def _values(m: ModelStats) -> list[str]:
    return [m.spec.name, str(m.spec.version)]


def _untyped(name: str, doc: str) -> Metric:
    """A family whose samples carry its own name exactly (Triton's counters; see the docstring)."""
    return Metric(name, doc, "unknown")


def _buckets(b: Buckets, scale: float = 1.0) -> list[tuple[str, float]]:
    return [(floatToGoString(bound * scale), n) for bound, n in b.cumulative()]


def _batch_buckets(m: ModelStats) -> tuple[list[tuple[str, float]], float]:
    """Executions by samples run as a histogram with power-of-two bounds up to the model's largest batch."""
    bounds: list[int] = []
    b = 1
    while b < m.spec.max_batch_size:
        bounds.append(b)
        b *= 2
    bounds.append(max(m.spec.max_batch_size, 1))
    out: list[tuple[str, float]] = []
    for bound in bounds:
        out.append((floatToGoString(bound), sum(s.count for size, s in m.batches.items() if size <= bound)))
    out.append(("+Inf", m.execution_count))
    return out, float(sum(size * s.count for size, s in m.batches.items()))


class EscapementCollector:
    """Reads a scheduler (and the event loop's lag tracker) into metric families on each scrape."""

    def __init__(self, scheduler: Callable[[], Scheduler], overload: LagTracker | None = None,
                 cache: PredictionCache | None = None, apps: Applications | None = None,
                 personal: Personalizer | None = None,
                 prefix_caches: Callable[[], Mapping[str, PrefixCacheStats]] | None = None) -> None:
        self._scheduler = scheduler  # a getter: the frontend is wired before or after the controller
        self._overload = overload
        self._cache = cache
        self._apps = apps
        self._personal = personal
        self._prefix_caches = prefix_caches

    def collect(self) -> Iterator[Metric]:
        sched = self._scheduler()
        yield from self._models(sched)
        yield from self._devices(sched)
        yield from self._controller(sched)
        if self._cache is not None:
            yield from _cache_metrics(self._cache)
        if self._apps is not None:
            yield from _app_metrics(self._apps)
        if self._personal is not None:
            yield from _personal_metrics(self._personal)
        if self._prefix_caches is not None:
            yield from _prefix_cache_metrics(self._prefix_caches())
        cpu = CounterMetricFamily("escapement_thread_cpu_seconds",
                                  "CPU seconds of the daemon's threads by name (other: library threads such as "
                                  "CUDA's and torch's, and ended ones)", labels=["thread"])
        for name, seconds in sorted(thread_cpu().items()):
            cpu.add_metric([name], seconds)
        yield cpu
        if self._overload is not None:
            o = self._overload
            yield GaugeMetricFamily("escapement_event_loop_lag_seconds",
                                    "How far the event loop runs behind its timers (smoothed)", value=o.lag_s)
            yield GaugeMetricFamily("escapement_event_loop_max_lag_seconds",
                                    "The largest event loop lag seen since start", value=o.max_s)
            yield CounterMetricFamily("escapement_requests_shed",
                                      "Inference requests refused at once (503) while the event loop lagged",
                                      value=o.shed)

    # ---------------------------------------------------------------- per model

    @staticmethod
    def _records(sched: Scheduler) -> list[ModelStats]:
        """Every model served (zeros until it sees a request) and every model that ever had statistics."""
        tel = sched.telemetry.models
        out = {k: tel.get(k) or ModelStats(e.spec) for k, e in sched.models.items()}
        for k, m in tel.items():
            out.setdefault(k, m)
        return [out[k] for k in sorted(out)]

    def _models(self, sched: Scheduler) -> Iterator[Metric]:
        records = self._records(sched)
        for name, doc, read in TRITON_COUNTERS:
            family = _untyped(name, doc + " (counter)")
            for m in records:
                family.add_sample(name, _labels(m), read(m))
            yield family
        failure = _untyped("nv_inference_request_failure",
                           "Requests that reached the controller and failed, by reason (counter)")
        pending = GaugeMetricFamily("nv_inference_pending_request_count",
                                    "Requests queued, waiting for an execution", labels=MODEL)
        batch = HistogramMetricFamily("escapement_batch_size", "Samples run per execution", labels=MODEL)
        for m in records:
            for reason in FAILURE_REASONS:
                failure.add_sample(failure.name, {**_labels(m), "reason": reason}, m.failures.get(reason, 0))
            entry = sched.models.get(m.spec.key)
            # (on time and in the best-effort lane: every request the model owes an answer not yet running)
            pending.add_metric(_values(m), entry.queue.requests + entry.late.requests if entry is not None else 0)
            batch.add_metric(_values(m), *_batch_buckets(m))
        yield from (failure, pending, batch)
        for name, doc, get in MODEL_HISTOGRAMS:
            hist = HistogramMetricFamily(name, doc, labels=MODEL)
            for m in records:
                b = get(m)
                hist.add_metric(_values(m), _buckets(b), b.total)
            yield hist
        yield from self._placement(sched, records)

    @staticmethod
    def _placement(sched: Scheduler, records: list[ModelStats]) -> Iterator[Metric]:
        met = CounterMetricFamily("escapement_slo_met", "Requests answered successfully by their deadline",
                                  labels=MODEL)
        missed = CounterMetricFamily("escapement_slo_missed",
                                     "Requests answered after their deadline, failed, or refused at admission "
                                     "(cancelled ones are neither met nor missed)", labels=MODEL)
        per_device = [*MODEL, "device"]
        loads = CounterMetricFamily("escapement_model_loads", "Weight loads completed", labels=per_device)
        load_failures = CounterMetricFamily("escapement_model_load_failures", "Weight loads that failed",
                                            labels=per_device)
        unloads = CounterMetricFamily("escapement_model_unloads",
                                      "Weights unloaded (evictions, and unloads of removed models)", labels=per_device)
        resident = GaugeMetricFamily("escapement_model_resident", "1 where a model's weights are ready on a device",
                                     labels=per_device)
        classes = CounterMetricFamily("escapement_requests_by_class",
                                      "Requests by class (hard: a timeout that rejects; target: no timeout, answered "
                                      "late rather than dropped; best_effort) and outcome (on_time, late, refused, "
                                      "dropped, expired, failed, cancelled)", labels=[*MODEL, "class", "outcome"])
        for m in records:
            values = _values(m)
            met.add_metric(values, m.slo_met)
            missed.add_metric(values, m.slo_missed)
            for (klass, what), n in sorted(m.classes.items()):
                classes.add_metric([*values, klass, what], n)
            for family, by_device in ((loads, m.loads), (load_failures, m.load_failures), (unloads, m.unloads)):
                for device, n in sorted(by_device.items()):
                    family.add_metric([*values, device], n)
            for name, dev in sorted(sched.devices.items()):
                if dev.memory.is_ready(m.spec.key):
                    resident.add_metric([*values, name], 1)
        yield from (met, missed, classes, loads, load_failures, unloads, resident)

    # ---------------------------------------------------------------- per device

    @staticmethod
    def _devices(sched: Scheduler) -> Iterator[Metric]:
        used = GaugeMetricFamily("escapement_device_weight_used_bytes",
                                 "Device memory charged: models held or loading (weights and IO buffers) plus "
                                 "the workspace reserve on CUDA devices; never above the budget",
                                 labels=["device"])
        budget = GaugeMetricFamily("escapement_device_weight_budget_bytes",
                                   "Device memory models may hold (runtime.weight_budget)", labels=["device"])
        up = GaugeMetricFamily("escapement_device_up", "1 while a device serves, 0 once it is lost (the log "
                               "and /v2/health/ready say why)", labels=["device"])
        inflight = GaugeMetricFamily("escapement_device_inflight_actions",
                                     "Actions sent to a device and not yet answered, by lane",
                                     labels=["device", "lane"])
        lateness = HistogramMetricFamily("escapement_action_start_lateness_seconds",
                                         "How long after it could start an executor started an action",
                                         labels=["device", "kind"])
        error = HistogramMetricFamily("escapement_infer_duration_error_ratio",
                                      "INFER prediction error: measured duration / expected duration - 1",
                                      labels=["device"])
        load_time = HistogramMetricFamily("escapement_load_duration_seconds", "Duration of completed weight loads",
                                          labels=["device"])
        stats = sched.telemetry.devices
        for name, dev in sorted(sched.devices.items()):
            used.add_metric([name], dev.memory.used + (0 if dev.failed else dev.device.workspace))
            budget.add_metric([name], dev.device.weight_budget)
            up.add_metric([name], 0 if dev.failed else 1)
            inflight.add_metric([name, "infer"], dev.infer_inflight)
            inflight.add_metric([name, "load"], dev.load_inflight)
            d = stats.get(name)
            if d is None:
                continue
            for kind, b in sorted(d.lateness.items()):
                lateness.add_metric([name, kind], _buckets(b), b.total)
            error.add_metric([name], _buckets(d.duration_error), d.duration_error.total)
            load_time.add_metric([name], _buckets(d.load_time), d.load_time.total)
        yield from (used, budget, up, inflight, lateness, error, load_time)

    # ---------------------------------------------------------------- controller and ParM

    @staticmethod
    def _controller(sched: Scheduler) -> Iterator[Metric]:
        c = sched.counters
        yield GaugeMetricFamily("escapement_pending_requests", "Requests accepted and not yet answered",
                                value=sched.pending)
        events = CounterMetricFamily("escapement_controller_events",
                                     "Every event the controller counts (Scheduler.counters), by name",
                                     labels=["event"])
        for event, n in sorted(c.items()):
            events.add_metric([event], n)
        yield events
        # (reads with get: the counts are a defaultdict, where a subscript would add the name at 0)
        yield CounterMetricFamily("escapement_coding_groups", "ParM coding groups formed",
                                  value=c.get("coding_groups", 0))
        yield CounterMetricFamily("escapement_coding_groups_flushed",
                                  "ParM coding groups that did not fill in time", value=c.get("groups_flushed", 0))
        yield GaugeMetricFamily("escapement_coding_groups_live", "ParM coding groups not yet finished",
                                value=len(sched.coding.groups))
        parities = CounterMetricFamily("escapement_parity_batches", "ParM parity batches, by outcome",
                                       labels=["outcome"])
        for outcome, counter in PARITY_OUTCOMES.items():
            parities.add_metric([outcome], c.get(counter, 0))
        yield parities
        yield CounterMetricFamily("escapement_reconstructions",
                                  "Requests answered with outputs decoded from a parity batch",
                                  value=c.get("reconstructions", 0))
        yield CounterMetricFamily("escapement_replicas", "ParM replicas of a partial group's members issued",
                                  value=c.get("replicas", 0))
        yield CounterMetricFamily("escapement_replica_answers", "Requests answered by a replica",
                                  value=c.get("replica_answers", 0))


def _cache_metrics(cache: PredictionCache) -> Iterator[Metric]:
    """The prediction cache (daemon/apps/cache.py): per version hits and misses, and its bounds."""
    hits = CounterMetricFamily("escapement_cache_hits", "Requests answered from the prediction cache", labels=MODEL)
    misses = CounterMetricFamily("escapement_cache_misses",
                                 "Requests for a caching model that the cache could not answer", labels=MODEL)
    for v in cache.versions():
        labels = [v.spec.name, str(v.spec.version)]
        hits.add_metric(labels, v.hits)
        misses.add_metric(labels, v.misses)
    yield hits
    yield misses
    st = cache.stats()
    yield CounterMetricFamily("escapement_cache_evictions",
                              "Cached answers pushed out by the byte or entry bound (least recently used first)",
                              value=st.evictions)
    yield GaugeMetricFamily("escapement_cache_bytes", "Bytes the prediction cache holds", value=st.bytes)
    yield GaugeMetricFamily("escapement_cache_limit_bytes", "The prediction cache's byte budget (cache.bytes)",
                            value=st.limit_bytes)
    yield GaugeMetricFamily("escapement_cache_entries", "Answers the prediction cache holds", value=st.entries)


def _app_metrics(apps: Applications) -> Iterator[Metric]:
    """Applications (daemon/apps/router.py): queries and how they were answered, per application."""
    app = ["application"]
    fams = {
        "queries": CounterMetricFamily("escapement_app_queries", "Queries an application took", labels=app),
        "defaults": CounterMetricFamily("escapement_app_default_answers",
                                        "Queries answered with the application's default output (no model in time)",
                                        labels=app),
        "partial": CounterMetricFamily("escapement_app_partial_answers",
                                       "Ensemble queries answered by the models back by the deadline, some missing",
                                       labels=app),
        "skipped": CounterMetricFamily("escapement_app_models_skipped",
                                       "Models left out of a query: the controller expected them past its deadline",
                                       labels=app),
        "late": CounterMetricFamily("escapement_app_models_late",
                                    "Models run for a query but not back by its deadline (or refused, or failed)",
                                    labels=app),
        "failed": CounterMetricFamily("escapement_app_failed", "Queries answered with an error", labels=app),
        "feedback": CounterMetricFamily("escapement_app_feedback", "Feedback items learned from", labels=app),
    }
    answered = CounterMetricFamily("escapement_app_model_answers", "Queries a model answered for an application",
                                   labels=["application", "model"])
    weight = GaugeMetricFamily("escapement_app_model_weight", "A model's learned weight in its application",
                               labels=["application", "model"])
    for name, dep in sorted(apps.apps.items()):
        c = dep.counters
        for key, fam in fams.items():
            fam.add_metric([name], getattr(c, key))
        for i, m in enumerate(dep.definition.models):
            answered.add_metric([name, m], c.answered_by.get(m, 0))
            weight.add_metric([name, m], dep.state.weights[i])
    yield from fams.values()
    yield answered
    yield weight
    yield GaugeMetricFamily("escapement_app_queries_remembered", "Answered application queries awaiting feedback",
                            value=len(apps.queries))


def _personal_metrics(personal: Personalizer) -> Iterator[Metric]:
    """Personalized models (daemon/apps/personal.py): predictions, feedback, users in memory."""
    st = personal.stats()
    yield CounterMetricFamily("escapement_personal_predictions", "Personalized answers", value=st.predictions)
    yield CounterMetricFamily("escapement_personal_feedback", "Feedback items applied to users' weights",
                              value=st.feedback)
    yield GaugeMetricFamily("escapement_personal_users_in_memory", "Users whose weights are in memory",
                            value=st.users_in_memory)
    yield CounterMetricFamily("escapement_personal_db_writes", "Users' weights committed to the database",
                              value=st.db_writes)
    yield CounterMetricFamily("escapement_personal_db_failures", "Failed transactions of the user database",
                              value=st.db_failures)


def _prefix_cache_metrics(caches: Mapping[str, PrefixCacheStats]) -> Iterator[Metric]:
    """Each CPU device's cache of shared stages' outputs by input (runtime/prefixcache.py)."""
    dev = ["device"]
    hits = CounterMetricFamily("escapement_prefix_cache_hits",
                               "Requests whose shared leading stage's output came from the device's prefix cache",
                               labels=dev)
    misses = CounterMetricFamily("escapement_prefix_cache_misses",
                                 "Requests whose shared leading stage's output was not in the prefix cache",
                                 labels=dev)
    evictions = CounterMetricFamily("escapement_prefix_cache_evictions",
                                    "Prefix cache entries dropped to make room (runtime.prefix_cache_entries, "
                                    "runtime.prefix_cache_bytes)", labels=dev)
    unseen = CounterMetricFamily("escapement_prefix_cache_unseen",
                                 "Large inputs seen for the first time: sketched, not hashed whole, looked up or kept",
                                 labels=dev)
    entries = GaugeMetricFamily("escapement_prefix_cache_entries", "Outputs the prefix cache holds", labels=dev)
    nbytes = GaugeMetricFamily("escapement_prefix_cache_bytes", "Bytes of outputs the prefix cache holds",
                               labels=dev)
    for name, st in sorted(caches.items()):
        hits.add_metric([name], st.hits)
        misses.add_metric([name], st.misses)
        evictions.add_metric([name], st.evictions)
        unseen.add_metric([name], st.unseen)
        entries.add_metric([name], st.entries)
        nbytes.add_metric([name], st.bytes)
    yield from (hits, misses, evictions, unseen, entries, nbytes)


def make_registry(scheduler: Callable[[], Scheduler], overload: LagTracker | None = None,
                  cache: PredictionCache | None = None, apps: Applications | None = None,
                  personal: Personalizer | None = None,
                  prefix_caches: Callable[[], Mapping[str, PrefixCacheStats]] | None = None) -> CollectorRegistry:
    """A registry of one daemon's own (not prometheus-client's global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EscapementCollector(scheduler, overload, cache, apps, personal, prefix_caches))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition (format 0.0.4, `CONTENT_TYPE`); call it on the event loop thread."""
    return generate_latest(registry)


def add_routes(router: Router, gateway: Gateway) -> None:
    """Add /metrics and the statistics routes. Call it before the routes of `/v2/models/{model}`:
    routes are tried in order, and `{model}` would match `stats`."""
    handlers = MetricsHandlers(gateway)
    router.add("GET", "/metrics", handlers.metrics)
    router.add("GET", "/v2/models/stats", handlers.stats)
    router.add("GET", "/v2/models/{model}/stats", handlers.stats)
    router.add("GET", "/v2/models/{model}/versions/{version:[0-9]+}/stats", handlers.stats)


class MetricsHandlers:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def metrics(self, request: Request) -> Response:
        return Response(self.gateway.metrics(), 200, CONTENT_TYPE)

    async def stats(self, request: Request) -> Response:
        """Raises NotFound for an unknown model or version, Unavailable for one that is not ready."""
        stats = self.gateway.model_statistics(request.params.get("model"), request.params.get("version"))
        return Response(orjson.dumps({"model_stats": stats}))
