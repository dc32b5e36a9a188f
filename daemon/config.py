"""Settings: TOML into frozen, typed, documented dataclasses.

Every field has a default and a `doc`; the embedded default file (`config/escapement.toml`,
installed as `daemon/default_config.toml`) states the same values. An unknown key, a value of
the wrong type or an out-of-range value raises `ConfigError` naming the key and the value.
Relative paths are resolved against the working directory of the daemon.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from daemon.errors import ConfigError

LogLevel = Literal["debug", "info", "warning", "error"]
PolicyName = Literal["clockwork", "dynamic", "aimd"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(value: int | str, key: str) -> int:
    """Bytes from an int or a string such as "512MiB" or "2GB"."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size in bytes or a string like '512MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(value)
        if not m:
            raise ConfigError(f"{key}: cannot read {value!r} as a size; write bytes or e.g. '512MiB', '2GB'")
        n = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()])
    if n < 0:
        raise ConfigError(f"{key}: a size cannot be negative, got {value!r}")
    return n


def doc(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A field with its documentation kept beside it."""
    if "default_factory" in kw:
        return field(metadata={"doc": text}, **kw)
    return field(default=default, metadata={"doc": text}, **kw)


def _need(cond: bool, key: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(f"{key} = {value!r}: {why}")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Listeners and request limits."""

    http: str = doc("HOST:PORT of the HTTP (KServe v2) listener; empty disables it.", "127.0.0.1:8000")
    socket: str = doc("Path of the msgpack unix socket; empty disables it.", "run/escapement.sock")
    grpc: str = doc("HOST:PORT of the gRPC (KServe v2 grpc_service.proto) listener; empty disables it.", "")
    socket_mode: str = doc("Permissions of the unix socket file, in octal.", "0660")
    max_body_bytes: int = doc("Largest HTTP body or socket frame accepted (bytes or '64MiB').", 64 * 2**20)
    max_connections: int = doc("Most concurrent client connections per listener.", 1024)
    request_memory_bytes: int = doc("Bytes of client requests the daemon holds at once (bodies, frames, decoded "
                                    "tensors); past it new requests get 503 (HTTP) or reading pauses (socket).",
                                    1 << 30)
    connection_memory_bytes: int = doc("One connection's share of request_memory_bytes (at least max_body_bytes); "
                                       "past it the connection stops reading until its requests finish.",
                                       128 * 2**20)
    max_json_bytes: int = doc("Largest JSON document parsed (an HTTP body or inference header): parsing and "
                              "converting it hold the event loop, ~8 ms per MiB (under the 25 ms shedding "
                              "threshold at 2 MiB); larger tensors go as binary data.", 2 * 2**20)
    drain_timeout_s: float = doc("On shutdown, how long accepted requests may take to finish.", 10.0)
    shed_lag_ms: float = doc("Refuse new inference with 503 while the event loop runs this far behind "
                             "(requests are then waiting unseen in socket buffers); 0 disables.", 25.0)
    log_level: LogLevel = doc("Log level: debug, info, warning or error.", "info")
    admin_token: str = doc("Bearer token for management endpoints (prefer admin_token_file: this file may be "
                           "readable by socket users).", "")
    admin_token_file: str = doc("A file holding the bearer token for management endpoints; also read from "
                                "$CREDENTIALS_DIRECTORY/admin-token (systemd LoadCredential=) when that exists.",
                                "")
    admin_open_loopback: bool = doc("Let management endpoints be called without a token on a loopback listener "
                                    "(any local user could then load, unload and inject faults).", False)
    allow_faults: bool = doc("Offer fault injection at run time (POST /v2/admin/faults): tests and demos only.",
                             False)
    open_repository_sync: bool = doc("Let the repository's load and unload be called without a token when they only "
                                     "make the daemon follow its model repository: a load of what a model's "
                                     "directory holds, an unload of a model whose directory is gone (what KServe's "
                                     "model agent calls, which cannot send a token).", False)
    max_request_id_bytes: int = doc("Longest request `id` accepted (it is kept and echoed in the answer).", 256)
    max_inflight_per_connection: int = doc("Most requests one socket connection may have in flight; its next "
                                           "frames wait unread (HTTP connections answer one at a time).", 256)
    idle_timeout_s: float = doc("A connection with nothing in flight and no bytes for this long is closed "
                                "(HTTP keep-alive and socket alike).", 75.0)
    write_timeout_s: float = doc("A connection whose client has not read its answers for this long is closed "
                                 "(its requests are cancelled).", 30.0)
    request_timeout_s: float = doc("HTTP: a request whose headers and body have not arrived whole this long after "
                                   "its first byte is answered 408 and its connection closed (slow clients).", 60.0)
    frontend_workers: int = doc("Frontend worker processes that own the HTTP and socket listeners and do the "
                                "protocol work, handing tensors to this process through shared memory; 0 keeps "
                                "everything in one process; -1 chooses from the cores (0 on 1 core, else "
                                "a quarter of them and at least 1: bench/results/peers-gap).", -1)
    frontend_slots: int = doc("Per frontend worker: shared-memory slots of 16 KiB for requests' tensors (plus a "
                              "quarter as many of 1 MiB and a 128th as many of max_body_bytes); a request "
                              "finding none free gets 503.", 256)

    def __post_init__(self) -> None:
        if self.http:
            parse_hostport(self.http, "server.http")
        if self.grpc:
            parse_hostport(self.grpc, "server.grpc")
        _need(re.fullmatch(r"0?[0-7]{3}", self.socket_mode) is not None, "server.socket_mode",
              self.socket_mode, "expected an octal mode such as '0660'")
        _need(self.max_body_bytes >= 1024, "server.max_body_bytes", self.max_body_bytes,
              "must be at least 1024")
        _need(self.max_connections >= 1, "server.max_connections", self.max_connections, "must be >= 1")
        _need(self.request_memory_bytes >= self.connection_share, "server.request_memory_bytes",
              self.request_memory_bytes, "must be >= server.connection_memory_bytes and server.max_body_bytes")
        _need(self.max_json_bytes >= 4096, "server.max_json_bytes", self.max_json_bytes, "must be >= 4096")
        _need(self.drain_timeout_s >= 0, "server.drain_timeout_s", self.drain_timeout_s, "must be >= 0")
        _need(self.shed_lag_ms >= 0, "server.shed_lag_ms", self.shed_lag_ms, "must be >= 0")
        _need(16 <= self.max_request_id_bytes <= 65536, "server.max_request_id_bytes", self.max_request_id_bytes,
              "must be in 16..65536")
        _need(self.max_inflight_per_connection >= 1, "server.max_inflight_per_connection",
              self.max_inflight_per_connection, "must be >= 1")
        _need(self.idle_timeout_s > 0 and self.write_timeout_s > 0, "server.idle_timeout_s / write_timeout_s",
              (self.idle_timeout_s, self.write_timeout_s), "must be > 0")
        _need(self.request_timeout_s > 0, "server.request_timeout_s", self.request_timeout_s, "must be > 0")
        _need(-1 <= self.frontend_workers <= 64, "server.frontend_workers", self.frontend_workers,
              "must be -1 (auto), 0 (none) or up to 64")
        _need(1 <= self.frontend_slots <= 65536, "server.frontend_slots", self.frontend_slots, "must be in 1..65536")

    @property
    def connection_share(self) -> int:
        """A connection's share of the request memory: at least one body, so one always fits."""
        return max(self.connection_memory_bytes, self.max_body_bytes)


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """The model repository."""

    repository: str = doc("Directory holding <model>/config.toml and <model>/<version>/model.pt2|ts.",
                          "models")
    default_slo_ms: float = doc("SLO for models whose config gives none.", 100.0)

    def __post_init__(self) -> None:
        _need(self.default_slo_ms > 0, "models.default_slo_ms", self.default_slo_ms, "must be > 0")


DEVICE_NAME = re.compile(r"(cpu|cuda|emucuda):\d+")
EmuMode = Literal["eager", "lazy", "random"]


@dataclass(frozen=True, slots=True)
class EmuCudaSettings:
    """The CPU stand-in of a CUDA device (`emucuda:N`), for tests and for trying the CUDA path."""

    capacity: int = doc("Device memory of each stand-in device (or '1GiB').", 1 << 30)
    mode: EmuMode = doc("When queued device work runs: 'eager' (as soon as it may), 'lazy' (only when the "
                        "host waits for it), 'random' (seeded random moments and orders).", "eager")
    seed: int = doc("Seed of the 'random' mode.", 0)
    timed: bool = doc("The host waits until device work's modelled completion (copies at the modelled "
                      "bandwidths), so timings behave like a device's.", False)
    h2d_gbps: float = doc("Modelled host-to-device copy bandwidth, GB/s.", 25.0)
    d2h_gbps: float = doc("Modelled device-to-host copy bandwidth, GB/s.", 25.0)

    def __post_init__(self) -> None:
        _need(self.capacity >= 1 << 20, "runtime.emucuda.capacity", self.capacity, "must be at least 1MiB")
        _need(self.h2d_gbps > 0 and self.d2h_gbps > 0, "runtime.emucuda", (self.h2d_gbps, self.d2h_gbps),
              "bandwidths must be > 0")


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    """Devices and executors."""

    devices: tuple[str, ...] = doc(
        "Devices to run on: 'auto' (every CUDA device, else cpu:0), or names like cuda:0, cpu:1, emucuda:0 "
        "(the CUDA backend on a CPU stand-in of a GPU).", ("auto",))
    cpu_threads: int = doc("Intra-op torch threads per cpu device.", 1)
    weight_budget: int = doc("Device bytes each device may hold for models (or '1GiB'): weights, IO buffers and "
                             "the workspace reserve. 0 = 90% of what is free at start-up on CUDA, 1GiB on CPU; "
                             "a budget larger than a CUDA device's free memory stops the start-up.", 0)
    device_workspace: int = doc("CUDA: bytes of the budget kept for CUDA graphs, activations and library "
                                "workspaces (not for weights); 0 = a tenth of the budget, at least 256MiB, "
                                "at most half.", 0)
    host_pinned_budget: int = doc("CUDA: host bytes that may be page-locked for model weights and IO buffers; "
                                  "models beyond it load through a small pinned staging ring. 0 = half of the "
                                  "host's memory.", 0)
    cuda_graphs: bool = doc("CUDA: run each batch size as a CUDA graph captured at LOAD (a model that cannot be "
                            "captured runs eagerly, and says why).", True)
    hang_timeout_s: float = doc("CUDA: device work not finished this long past its expected end marks the device "
                                "failed (a hung kernel).", 2.0)
    warmup_timeout_s: float = doc("Longest a model's warm-up (its measurement on one device) may take; one that "
                                  "does not return by then is not served, and its device counts as hung.", 600.0)
    hung_action_s: float = doc("An action (INFER, LOAD, UNLOAD) not returned this long past its expected end: "
                               "its device's thread is stuck outside any device wait, and the device is lost "
                               "(its requests move to other devices).", 30.0)
    restart_on_hang: bool = doc("Under systemd's watchdog, stop the keep-alives once a device hangs (see "
                                "hung_action_s), so that systemd restarts the service: a stuck thread or "
                                "device comes back only in a new process.", True)
    emucuda: EmuCudaSettings = doc("The CUDA stand-in devices.", default_factory=EmuCudaSettings)
    warmup_reps: int = doc("Runs per batch size when a model without a stored profile for a device kind is "
                           "measured at start-up (its warm-up), before it is reported ready.", 5)
    pin_threads: bool = doc(
        "Give each CPU device's INFER thread a core of its own and the event loop the other cores, "
        "when there are more cores than CPU devices.", True)
    gil_switch_interval_us: int = doc(
        "Python's GIL switch interval. The default 5000 µs lets busy frontend code delay an "
        "executor thread by milliseconds; a shorter interval keeps action starts on time.", 200)
    share_weights: bool = doc("Count a weight tensor several models hold once in a device's budget (CPU devices); "
                              "off: every model is charged in full, as black-box serving (for comparisons).", True)
    detect_shared_prefix: bool = doc("Find a leading stage single-program (model.pt2) models share (the same ops over "
                                     "the same weights up to one tensor) when they load, and serve them split there "
                                     "as plans of stages (docs/models.md); with share_weights.", True)
    prefix_cache_entries: int = doc("Outputs of a shared leading stage kept per device, by input, so "
                                    "the same input sent to several models that share it runs it once; 0 disables.",
                                    4096)
    prefix_cache_bytes: int = doc("Bytes those kept outputs may hold per device (or '64MiB'; on CUDA at most a "
                                  "quarter of device_workspace).", 64 << 20)

    def __post_init__(self) -> None:
        _need(len(self.devices) > 0, "runtime.devices", self.devices, "list at least one device")
        for d in self.devices:
            _need(d == "auto" or DEVICE_NAME.fullmatch(d) is not None, "runtime.devices", d,
                  "expected 'auto' or a name like cpu:0, cuda:0, emucuda:0")
        _need(len(set(self.devices)) == len(self.devices), "runtime.devices", self.devices,
              "a device is listed twice")
        _need(1 <= self.cpu_threads <= 256, "runtime.cpu_threads", self.cpu_threads, "must be in 1..256")
        _need(1 <= self.warmup_reps <= 1000, "runtime.warmup_reps", self.warmup_reps, "must be in 1..1000")
        _need(50 <= self.gil_switch_interval_us <= 100_000, "runtime.gil_switch_interval_us",
              self.gil_switch_interval_us, "must be in 50..100000")
        _need(0 <= self.prefix_cache_entries <= 1 << 24, "runtime.prefix_cache_entries", self.prefix_cache_entries,
              "must be in 0..16777216")
        _need(0 <= self.prefix_cache_bytes <= 1 << 40, "runtime.prefix_cache_bytes", self.prefix_cache_bytes,
              "must be in 0..1TiB")
        _need(0.01 <= self.hang_timeout_s <= 3600, "runtime.hang_timeout_s", self.hang_timeout_s,
              "must be in [0.01, 3600]")
        _need(1 <= self.warmup_timeout_s <= 86_400, "runtime.warmup_timeout_s", self.warmup_timeout_s,
              "must be in [1, 86400]")
        _need(0.1 <= self.hung_action_s <= 86_400, "runtime.hung_action_s", self.hung_action_s,
              "must be in [0.1, 86400]")


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """The prediction cache (daemon/apps/cache.py): one byte budget for every model version that
    opts in with `[response_cache] enabled = true` in its config.toml."""

    bytes: int = doc("Bytes of cached answers, all models together (bytes or '256MiB'); 0 disables the cache.",
                     256 * 2**20)
    entries: int = doc("Most cached answers at once (each also costs a small fixed overhead).", 1_000_000)
    max_entry_bytes: int = doc("Largest answer kept, and largest request (its input bytes) looked up: hashing the "
                               "inputs holds the event loop, ~2 ms per MiB (bytes or '2MiB').", 2 * 2**20)

    def __post_init__(self) -> None:
        _need(self.entries >= 0, "cache.entries", self.entries, "must be >= 0")
        _need(self.max_entry_bytes >= 1024, "cache.max_entry_bytes", self.max_entry_bytes, "must be >= 1024")


@dataclass(frozen=True, slots=True)
class PersonalizationSettings:
    """Personalized models (daemon/apps/personal.py): where users' weights are stored, and how many
    users and answered queries are kept in memory."""

    db_path: str = doc("The users' weights: an SQLite file (WAL mode; created on first use). Empty: "
                       "$STATE_DIRECTORY/personalization.sqlite3 under systemd (StateDirectory=), else "
                       "state/personalization.sqlite3 under the working directory.", "")
    users_in_memory: int = doc("Most users' weights kept in memory (least recently used leave memory, not the "
                               "database).", 10_000)
    user_memory_bytes: int = doc("Bytes of users' weights kept in memory (bytes or '512MiB'; one user of a head "
                                 "of d features costs ~8 (d+1)^2 bytes).", 512 * 2**20)
    queries: int = doc("Most answered queries remembered for their feedback (oldest forgotten first).", 100_000)
    query_memory_bytes: int = doc("Bytes of remembered queries (their feature vectors; bytes or '64MiB').",
                                  64 * 2**20)
    query_ttl_s: float = doc("How long an answered query takes feedback (s).", 3600.0)

    def __post_init__(self) -> None:
        _need(self.users_in_memory >= 1, "personalization.users_in_memory", self.users_in_memory, "must be >= 1")
        _need(self.queries >= 1, "personalization.queries", self.queries, "must be >= 1")
        _need(self.user_memory_bytes >= 1, "personalization.user_memory_bytes", self.user_memory_bytes,
              "must be >= 1")
        _need(self.query_memory_bytes >= 1, "personalization.query_memory_bytes", self.query_memory_bytes,
              "must be >= 1")
        _need(0 < self.query_ttl_s <= 30 * 86_400, "personalization.query_ttl_s", self.query_ttl_s,
              "must be in (0, 2592000]")


@dataclass(frozen=True, slots=True)
class AppsSettings:
    """Applications (daemon/apps/router.py, docs/applications.md): where their policies' learned
    state is stored, and how many answered queries are remembered for feedback."""

    db_path: str = doc("The policies' state: an SQLite file (WAL mode; created by the first feedback). Empty: "
                       "$STATE_DIRECTORY/applications.sqlite3 under systemd (StateDirectory=), else "
                       "state/applications.sqlite3 under the working directory.", "")
    queries: int = doc("Most answered application queries remembered for their feedback (oldest forgotten first).",
                       100_000)
    query_memory_bytes: int = doc("Bytes of remembered queries (the members' outputs; bytes or '64MiB').", 64 * 2**20)
    query_ttl_s: float = doc("How long an answered query takes feedback (s).", 3600.0)

    def __post_init__(self) -> None:
        _need(self.queries >= 1, "apps.queries", self.queries, "must be >= 1")
        _need(self.query_memory_bytes >= 1, "apps.query_memory_bytes", self.query_memory_bytes, "must be >= 1")
        _need(0 < self.query_ttl_s <= 30 * 86_400, "apps.query_ttl_s", self.query_ttl_s, "must be in (0, 2592000]")


@dataclass(frozen=True, slots=True)
class ApplicationSettings:
    """One application: a name over models that take the same input, with a selection (exp3) or
    ensemble (exp4) policy that learns from feedback (docs/applications.md)."""

    name: str = doc("The application's name (letters, digits, '_', '.', '-').", "")
    models: tuple[str, ...] = doc("Its models, by name (each query uses each one's newest ready version).",
                                  default_factory=tuple)
    policy: Literal["exp3", "exp4"] = doc("exp3: one model per query (bandit selection); exp4: every model that "
                                          "can make the deadline, their outputs combined by learned weight.", "exp3")
    output: str = doc("The models' output it answers with; empty: each model's first output.", "")
    combine: Literal["softmax", "mean", "vote"] = doc("exp4: how outputs are combined: weighted mean of softmax "
                                                      "probabilities, of raw outputs, or weighted class votes.",
                                                      "softmax")
    slo_ms: float = doc("Its deadline (ms) for queries without a timeout; 0: its models' smallest SLO.", 0.0)
    default_output: tuple[float, ...] = doc("One sample's answer when no model can answer by the deadline "
                                            "(flagged default); empty: such a query gets the error (504).",
                                            default_factory=tuple)
    exploration: float = doc("exp3: the share of picks spread evenly over the models (gamma), in (0, 1].", 0.1)
    learning_rate: float = doc("exp4: how fast a wrong answer costs a model weight (eta).", 1.0)
    share: float = doc("The share of weight given back to every model after each update (fixed share): a model "
                       "that was bad can come back, one that was best can be overtaken.", 0.01)
    seed: int = doc("Seed of exp3's random picks.", 0)
    skip_late: bool = doc("Leave out models the controller expects to finish after the deadline (neither run nor "
                          "waited for) and run the others with the deadline as a hard one; false: every model "
                          "runs to completion and the answer takes those back by the deadline, as Clipper's.",
                          True)

    def __post_init__(self) -> None:
        try:
            self.definition()
        except ValueError as e:
            raise ConfigError(f"applications: {e}") from None

    def definition(self) -> Any:
        """The application (daemon/apps/application.py AppDefinition); ValueError if it is not valid."""
        from daemon.apps.application import AppDefinition

        return AppDefinition(self.name, self.models, self.policy, self.output, self.combine, self.slo_ms,
                             self.default_output, self.exploration, self.learning_rate, self.share, self.seed,
                             self.skip_late)


def application_from_dict(table: dict[str, Any], where: str = "applications") -> ApplicationSettings:
    """An application from a TOML table or a JSON object (the repository API); ConfigError if bad."""
    return typing.cast(ApplicationSettings, _build(ApplicationSettings, table, where))


@dataclass(frozen=True, slots=True)
class SharedMemorySettings:
    """Triton's system shared-memory extension (daemon/api/sharedmem.py): regions local clients
    register by the key of a POSIX shared-memory object in /dev/shm, then name in requests."""

    enabled: bool = doc("Serve /v2/systemsharedmemory (HTTP), the SystemSharedMemory RPCs (gRPC) and the "
                        "socket's shm ops; false refuses them with 501.", True)
    max_regions: int = doc("Most regions registered at once, all clients together.", 64)
    max_bytes: int = doc("Most bytes registered at once (the sum of the regions' byte_size; bytes or '1GiB'); "
                         "the daemon maps only what a region names.", 2**30)
    same_owner: bool = doc("Only objects owned by the daemon's own user may be registered: a client cannot "
                           "make the daemon read or write another user's shared memory.", True)

    def __post_init__(self) -> None:
        _need(1 <= self.max_regions <= 65536, "shared_memory.max_regions", self.max_regions, "must be in 1..65536")
        _need(self.max_bytes >= 1, "shared_memory.max_bytes", self.max_bytes, "must be >= 1")


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    """The controller and its scheduling policy."""

    policy: PolicyName = doc("Scheduling policy: 'clockwork' (deadline-aware, predictable), 'dynamic' "
                             "(Triton-style dynamic batching, the baseline) or 'aimd' (Clipper's adaptive "
                             "batching).", "clockwork")
    schedule_ahead_ms: float = doc("clockwork: how far ahead each device's work is planned; re-decided as it "
                                   "drains.", 5.0)
    batch_wait_ms: float = doc("clockwork: how long a batch may wait for more requests of a model arriving fast "
                               "enough to fill it (at most a tenth of its SLO, never past a deadline; 0 is "
                               "work-conserving).", 4.0)
    cross_model_batching: bool = doc("Every policy: run a leading stage that models declared as plans of stages share "
                                     "once for their queued requests together (docs/controller.md).", True)
    latency_path: bool = doc("Run a lone INFER on the controller's thread when nothing else is queued or running "
                             "and its estimate is at most latency_path_max_ms: no hand-off to the device's "
                             "thread and back (docs/controller.md); false: every INFER goes through the batch "
                             "engine.", True)
    latency_path_max_ms: float = doc("The longest estimated run the latency path takes (ms); it holds the event "
                                     "loop that long.", 2.0)
    keep_warm_ms: float = doc("After a request ran on the latency path, keep the event loop spinning and its "
                              "model's code and weights in cache (one run on scratch rows each keep_warm_touch_ms) "
                              "for this long (ms): at light load the next lone request then runs hot instead of "
                              "after the machine evicted it. Costs up to a core while it lasts; 0 disables "
                              "(docs/controller.md).", 0.0)
    keep_warm_touch_ms: float = doc("How often the kept-warm model runs on scratch rows (ms).", 1.0)
    keep_warm_spin: bool = doc("Keep-warm spins the event loop between those runs (the loop's core never idles: "
                               "the next request finds it awake); false: it sleeps between them (less CPU).", True)
    keep_warm_path: bool = doc("Keep-warm also replays the socket's request path with each run: it decodes the "
                               "last small request frame (at most 64 KiB) and encodes the last answer again, "
                               "dropping both, so the frontend's code is hot too. Only where the socket is served "
                               "by the controller's process (server.frontend_workers = 0).", True)
    default_priority: int = doc("The priority of requests that give none (or 0); smaller is more urgent.", 10)
    client_priorities: bool = doc("Honour a priority more urgent than default_priority when a client asks for it "
                                  "(off: a client may lower its own priority, never jump everyone else's).", False)
    trace_path: str = doc("Write every request and action as a JSON line to this file; empty disables.", "")
    max_queue_delay_ms: float = doc("dynamic: how long a batch may wait to fill before it runs.", 0.0)
    aimd_step: float = doc("aimd: samples added to a model's batch size after a full batch within its SLO.", 1.0)
    aimd_backoff: float = doc("aimd: factor on a model's batch size after a batch that took longer than its SLO "
                              "(Clipper's 0.9).", 0.9)
    max_pending: int = doc("Most requests queued in the daemon at once; more are refused with 503.",
                           10_000)
    max_pending_per_model: int = doc("Most requests queued for one model; more are refused with 503.",
                                     2_000)
    # Triton's queue policy, daemon-wide (docs/controller.md "Request classes").
    default_timeout_ms: float = doc("A request without a client timeout gets this one (Triton's "
                                    "default_timeout_microseconds); 0: none, the model's SLO is then a target "
                                    "and a request that cannot make it is answered late, not dropped.", 0.0)
    timeout_action: Literal["reject", "delay"] = doc("What a timeout does to a request that cannot make it: "
                                                     "'reject' (refused at arrival, 504 when hopeless) or 'delay' "
                                                     "(kept, answered late behind on-time work), as Triton's.",
                                                     "reject")
    allow_timeout_override: bool = doc("Whether a client's own timeout replaces default_timeout_ms.", True)
    best_effort_priority: int = doc("Requests whose priority number is at least this are best-effort from the "
                                    "start (served in device time no on-time work needs); 0: none.", 0)
    best_effort_max_wait_s: float = doc("Longest a best-effort or late request waits before it is answered 504.",
                                        30.0)
    best_effort_bytes: int = doc("Input bytes of the requests that may be answered late (all models; bytes or "
                                 "'256MiB'); more are refused with 503.", 256 * 2**20)

    def __post_init__(self) -> None:
        _need(self.max_queue_delay_ms >= 0, "controller.max_queue_delay_ms", self.max_queue_delay_ms,
              "must be >= 0")
        _need(0 <= self.batch_wait_ms <= 1000, "controller.batch_wait_ms", self.batch_wait_ms, "must be in [0, 1000]")
        _need(0 < self.schedule_ahead_ms <= 1000, "controller.schedule_ahead_ms", self.schedule_ahead_ms,
              "must be in (0, 1000]")
        _need(0 <= self.latency_path_max_ms <= 100, "controller.latency_path_max_ms", self.latency_path_max_ms,
              "must be in [0, 100]")
        _need(0 <= self.keep_warm_ms <= 10_000, "controller.keep_warm_ms", self.keep_warm_ms, "must be in [0, 10000]")
        _need(0.05 <= self.keep_warm_touch_ms <= 1000, "controller.keep_warm_touch_ms", self.keep_warm_touch_ms,
              "must be in [0.05, 1000]")
        _need(self.default_priority >= 1, "controller.default_priority", self.default_priority, "must be >= 1")
        _need(self.max_pending >= 1, "controller.max_pending", self.max_pending, "must be >= 1")
        _need(self.max_pending_per_model >= 1, "controller.max_pending_per_model",
              self.max_pending_per_model, "must be >= 1")
        _need(0 < self.aimd_step <= 4096, "controller.aimd_step", self.aimd_step, "must be in (0, 4096]")
        _need(0 < self.aimd_backoff < 1, "controller.aimd_backoff", self.aimd_backoff, "must be in (0, 1)")
        _need(self.default_timeout_ms >= 0, "controller.default_timeout_ms", self.default_timeout_ms, "must be >= 0")
        _need(self.timeout_action in ("reject", "delay"), "controller.timeout_action", self.timeout_action,
              "must be 'reject' or 'delay'")
        _need(self.best_effort_priority >= 0, "controller.best_effort_priority", self.best_effort_priority,
              "must be >= 0")
        _need(0 < self.best_effort_max_wait_s <= 3600, "controller.best_effort_max_wait_s",
              self.best_effort_max_wait_s, "must be in (0, 3600]")
        _need(self.best_effort_bytes >= 0, "controller.best_effort_bytes", self.best_effort_bytes, "must be >= 0")


@dataclass(frozen=True, slots=True)
class FaultSettings:
    """An injected fault on one device (tests, demos, benchmarks); see daemon/runtime/faults.py."""

    device: str = doc("The device, e.g. cpu:0.", "")
    slowdown: float = doc("Factor on INFER durations (>= 1).", 1.0)
    add_ms: float = doc("Milliseconds added to each INFER.", 0.0)
    mode: Literal["sustained", "periodic", "random"] = doc("When the slowdown applies.", "sustained")
    period_s: float = doc("periodic: the cycle, seconds.", 1.0)
    duty: float = doc("periodic: the slowed share of a cycle; random: the chance a window is slowed.", 0.5)
    burst_s: float = doc("random: the window length, seconds.", 0.1)
    fail_probability: float = doc("The chance an INFER fails.", 0.0)
    hang: bool = doc("INFER blocks until the fault is cleared.", False)
    seed: int = doc("Seed of the random choices.", 0)
    hang_load: bool = doc("LOADs block until the fault is cleared.", False)

    def __post_init__(self) -> None:
        _need(DEVICE_NAME.fullmatch(self.device) is not None, "faults.device", self.device,
              "expected a device name such as cpu:0")
        try:
            self.spec()
        except ValueError as e:
            raise ConfigError(f"faults for {self.device}: {e}") from None

    def spec(self) -> Any:
        from daemon.runtime.faults import FaultSpec

        return FaultSpec(self.slowdown, self.add_ms, self.mode, self.period_s, self.duty, self.burst_s,
                         self.fail_probability, self.hang, self.seed, self.hang_load)


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the daemon reads at start-up."""

    server: ServerSettings = doc("Listeners and limits.", default_factory=ServerSettings)
    models: ModelSettings = doc("The model repository.", default_factory=ModelSettings)
    runtime: RuntimeSettings = doc("Devices and executors.", default_factory=RuntimeSettings)
    controller: ControllerSettings = doc("Scheduling.", default_factory=ControllerSettings)
    cache: CacheSettings = doc("The prediction cache.", default_factory=CacheSettings)
    personalization: PersonalizationSettings = doc("Personalized models' users and feedback.",
                                                   default_factory=PersonalizationSettings)
    shared_memory: SharedMemorySettings = doc("Shared-memory tensors for local clients.",
                                              default_factory=SharedMemorySettings)
    faults: tuple[FaultSettings, ...] = doc("Injected faults, one [[faults]] table each; none by default.",
                                            default_factory=tuple)
    apps: AppsSettings = doc("Applications' learned state and feedback.", default_factory=AppsSettings)
    applications: tuple[ApplicationSettings, ...] = doc("Applications, one [[applications]] table each; none by "
                                                        "default.", default_factory=tuple)


def parse_hostport(value: str, key: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{key} = {value!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    return host.strip("[]"), int(port)


# ---------------------------------------------------------------- reading TOML into dataclasses

_SIZE_FIELDS = {("server", "max_body_bytes"), ("server", "request_memory_bytes"),
                ("server", "connection_memory_bytes"), ("server", "max_json_bytes"),
                ("runtime", "weight_budget"), ("runtime", "device_workspace"),
                ("runtime", "host_pinned_budget"), ("runtime.emucuda", "capacity"),
                ("runtime", "prefix_cache_bytes"),
                ("controller", "best_effort_bytes"), ("cache", "bytes"), ("cache", "max_entry_bytes"),
                ("personalization", "user_memory_bytes"), ("personalization", "query_memory_bytes"),
                ("apps", "query_memory_bytes"),
                ("shared_memory", "max_bytes")}


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        return _build(tp, value, key)
    if origin is Literal:
        if value not in typing.get_args(tp):
            choices = ", ".join(repr(a) for a in typing.get_args(tp))
            raise ConfigError(f"{key} = {value!r}: expected one of {choices}")
        return value
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r}: expected a list")
        if dataclasses.is_dataclass(item_tp):
            return tuple(_convert(v, item_tp, key) for v in value)
        return tuple(_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _convert(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key} = {value!r}: expected {tp}")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} = {value!r}: expected a number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {value!r}: expected an integer")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r}: expected true or false")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r}: expected a string")
        return value
    raise ConfigError(f"{key}: unsupported setting type {tp}")  # a bug in this module, not the file


def _build(cls: Any, table: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in table:
        if k not in names:
            where = f"[{prefix}]" if prefix else "the top level"
            raise ConfigError(f"unknown setting {prefix + '.' if prefix else ''}{k!s} in {where}; "
                              f"known: {', '.join(sorted(names))}")
    kwargs: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}.{k}" if prefix else k
        if (prefix, k) in _SIZE_FIELDS:
            kwargs[k] = parse_size(v, key)
        else:
            kwargs[k] = _convert(v, hints[k], key)
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - guarded by the key check above
        raise ConfigError(f"[{prefix}]: {e}") from e


def settings_from_dict(data: dict[str, Any]) -> Settings:
    return typing.cast(Settings, _build(Settings, data, ""))


def default_config_text() -> str:
    return resources.files("daemon").joinpath("default_config.toml").read_text(encoding="utf-8")


def load_settings(path: str | Path | None = None) -> Settings:
    """Settings from a TOML file, or from the embedded default when `path` is None."""
    if path is None:
        text, name = default_config_text(), "<embedded default>"
    else:
        try:
            text, name = Path(path).read_text(encoding="utf-8"), str(path)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{name}: not valid TOML: {e}") from e
    try:
        return settings_from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{name}: {e}") from e


def with_overrides(
    settings: Settings,
    *,
    http: str | None = None,
    grpc: str | None = None,
    socket: str | None = None,
    models: str | None = None,
    devices: list[str] | None = None,
    policy: str | None = None,
    log_level: str | None = None,
) -> Settings:
    """Apply command-line flags over the file's settings, validating them the same way."""
    server = dataclasses.asdict(settings.server)
    runtime = dataclasses.asdict(settings.runtime)
    model_s = dataclasses.asdict(settings.models)
    ctrl = dataclasses.asdict(settings.controller)
    if http is not None:
        server["http"] = http
    if grpc is not None:
        server["grpc"] = grpc
    if socket is not None:
        server["socket"] = socket
    if log_level is not None:
        server["log_level"] = log_level
    if models is not None:
        model_s["repository"] = models
    if devices is not None:
        runtime["devices"] = [d.strip() for item in devices for d in item.split(",") if d.strip()]
    if policy is not None:
        ctrl["policy"] = policy
    runtime["devices"] = list(runtime["devices"])
    faults = [dataclasses.asdict(f) for f in settings.faults]
    return settings_from_dict({"server": server, "runtime": runtime, "models": model_s, "controller": ctrl,
                               "cache": dataclasses.asdict(settings.cache),
                               "personalization": dataclasses.asdict(settings.personalization),
                               "shared_memory": dataclasses.asdict(settings.shared_memory), "faults": faults,
                               "apps": dataclasses.asdict(settings.apps),
                               "applications": [{k: list(v) if isinstance(v, tuple) else v
                                                 for k, v in dataclasses.asdict(a).items()}
                                                for a in settings.applications]})


def describe(cls: Any = Settings, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(key, default, doc) for every setting; used by tests and `escapement config`."""
    out: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if f.name in ("faults", "applications"):
            continue  # an array of tables, none by default
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Settings")):
            sub = typing.get_type_hints(cls)[f.name]
            out.extend(describe(sub, key))
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
            out.append((key, default, f.metadata.get("doc", "")))
    return out
