"""deploy/kserve/ against KServe's own CRD schemas (tests/data/kserve/, kserve/kserve at aaac4e29),
offline, and against what KServe's controllers and escapement's KServe config expect of them.

Validation is what `kubectl apply` does with its default `--validate=strict`: the CRD's
openAPIV3Schema, plus unknown fields refused (the API server would drop them silently, so a typo
such as `contianers` would deploy a runtime without containers). ObjectMeta is not in a CRD's
schema: names are checked as the API server and KServe's webhooks check them.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from daemon.config import load_settings, parse_hostport
from daemon.kserve import parse_quantity

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kserve"
CRDS = ROOT / "tests" / "data" / "kserve"
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
TRAINED_MODEL_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")  # KServe's TrainedModel webhook (TmNameFmt)
PROTOCOLS = {"v1", "v2", "grpc-v1", "grpc-v2"}  # KServe's InferenceServiceProtocol values
STORAGE_PREFIXES = ("gs://", "s3://", "pvc://", "file://", "https://", "http://", "hdfs://", "webhdfs://", "oci://",
                    "hf://")


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever Kubernetes would prune them."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the strict openAPIV3Schema of every served version of the vendored CRDs."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                out[(f"{group}/{version['name']}", kind)] = _strict(version["schema"]["openAPIV3Schema"])
    return out


def problems(doc: dict[str, Any]) -> list[str]:
    """Why the API server would refuse (or silently change) one object; [] when it would not."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    schema = schemas().get(key)  # type: ignore[arg-type]
    if schema is None:
        return [f"no CRD serves {key}"]
    validator = jsonschema.Draft7Validator(schema)
    found = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]
    name = doc.get("metadata", {}).get("name", "")
    if not isinstance(name, str) or len(name) > 253 or not DNS1123_SUBDOMAIN.fullmatch(name):
        found.append(f"metadata.name {name!r} is not a DNS-1123 subdomain")
    if doc["kind"] == "TrainedModel" and not TRAINED_MODEL_NAME.fullmatch(name):
        found.append(f"metadata.name {name!r} does not match KServe's TrainedModel name format")
    return found


def manifests() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(DEPLOY.glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                yield f"{path.name}#{i}", doc


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def the_runtime() -> dict[str, Any]:
    (runtime,) = by_kind("ClusterServingRuntime")
    return runtime


# ---------------------------------------------------------------- the schemas


def test_the_vendored_crds_are_kserves() -> None:
    for name in ("clusterservingruntimes", "trainedmodels"):
        vendored = CRDS / f"serving.kserve.io_{name}.yaml"
        reference = ROOT.parent / "shared" / "reference" / "kserve" / vendored.name
        if reference.exists():  # the shared reference beside the checkout, when there is one
            assert vendored.read_bytes() == reference.read_bytes(), name
    assert {k for _, k in schemas()} == {"ClusterServingRuntime", "InferenceService", "TrainedModel"}


@pytest.mark.parametrize(("where", "doc"), list(manifests()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_manifest_validates_against_kserves_crds(where: str, doc: dict[str, Any]) -> None:
    assert problems(doc) == [], where


def test_every_kind_we_ship_is_there() -> None:
    kinds = [doc["kind"] for _, doc in manifests()]
    assert kinds.count("ClusterServingRuntime") == 1
    assert kinds.count("InferenceService") == 2  # single-model and multi-model
    assert kinds.count("TrainedModel") >= 2


# A broken manifest must fail: each mutation is a mistake a user (or we) could make.
def _set(path: str, value: Any) -> Any:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        if value is KeyError:
            del node[int(last) if last.isdigit() else last]
        else:
            node[int(last) if last.isdigit() else last] = value
    return mutate


@pytest.mark.parametrize(("kind", "mutate", "needle"), [
    ("ClusterServingRuntime", _set("spec.protocolVersions", "v2"), "is not of type 'array'"),
    ("ClusterServingRuntime", _set("spec.contianers", []), "Additional properties are not allowed"),
    ("ClusterServingRuntime", _set("spec.containers", KeyError), "'containers' is a required property"),
    ("ClusterServingRuntime", _set("spec.supportedModelFormats.0.name", KeyError), "'name' is a required property"),
    ("ClusterServingRuntime", _set("spec.supportedModelFormats.0.priority", 0), "less than the minimum of 1"),
    ("ClusterServingRuntime", _set("spec.containers.0.ports.0.containerPort", "8080"), "is not of type 'integer'"),
    ("ClusterServingRuntime", _set("spec.containers.0.readinessProbe.httpGet.port", KeyError),
     "'port' is a required property"),
    ("ClusterServingRuntime", _set("metadata.name", "Escapement"), "not a DNS-1123 subdomain"),
    ("InferenceService", _set("spec.predictor.model.modelFormat", "escapement"), "is not of type 'object'"),
    ("InferenceService", _set("spec.predictor.model.storageURI", "s3://x"), "Additional properties are not allowed"),
    ("TrainedModel", _set("spec.model.memory", "1GB"), "does not match"),
    ("TrainedModel", _set("spec.model.storageUri", KeyError), "'storageUri' is a required property"),
    ("TrainedModel", _set("spec.inferenceService", KeyError), "'inferenceService' is a required property"),
])
def test_a_broken_manifest_fails(kind: str, mutate: Any, needle: str) -> None:
    doc = copy.deepcopy(by_kind(kind)[0])
    assert problems(doc) == []
    mutate(doc)
    found = problems(doc)
    assert any(needle in p for p in found), found


# ---------------------------------------------------------------- what KServe and escapement expect


def test_the_runtime_is_what_kserve_and_the_image_expect() -> None:
    runtime = the_runtime()
    spec = runtime["spec"]
    assert set(spec["protocolVersions"]) == {"v2", "grpc-v2"} <= PROTOCOLS
    assert not spec.get("multiModel", False)  # true would be ModelMesh's
    (container,) = spec["containers"]
    assert container["name"] == "kserve-container"
    # The image's config (Dockerfile) is the one the runtime starts with, and its ports are the container's.
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "COPY config/escapement.kserve.toml /etc/escapement/escapement.toml" in dockerfile
    assert "-c constraints.txt" in dockerfile
    assert container["args"] == ["serve", "--config", "/etc/escapement/escapement.toml"]
    config = load_settings(ROOT / "config" / "escapement.kserve.toml")
    assert config.models.repository == "/mnt/models" and config.server.open_repository_sync
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["ports"][0]["containerPort"] == 8080  # KServe's HTTP port, which its agent calls
    http, grpc = (parse_hostport(a, "")[1] for a in (config.server.http, config.server.grpc))
    assert ports == {"http1": http, "h2c": grpc}
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8080}
    assert container["startupProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8080}
    assert "nvidia.com/gpu" in container["resources"]["limits"]
    # The token's Secret is optional, and where the daemon looks for it.
    env = {e["name"]: e["value"] for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["escapement-admin-token"] == env["CREDENTIALS_DIRECTORY"]
    assert volumes["escapement-admin-token"]["secret"]["optional"] is True


def test_the_inference_services_select_the_runtime() -> None:
    runtime = the_runtime()
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    isvcs = by_kind("InferenceService")
    single, multi = sorted(isvcs, key=lambda d: "storageUri" not in d["spec"]["predictor"]["model"])
    for isvc in (single, multi):
        model = isvc["spec"]["predictor"]["model"]
        assert model["runtime"] == runtime["metadata"]["name"]
        assert model["modelFormat"]["name"] in formats
        assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert single["spec"]["predictor"]["model"]["storageUri"].startswith(STORAGE_PREFIXES)
    # KServe takes a predictor with no storage URI for its multi-model (agent) path.
    assert not {"storageUri", "storage"} & set(multi["spec"]["predictor"]["model"])
    # The TrainedModel controller admits models while their declared memory fits the predictor's limit.
    limit = parse_quantity(multi["spec"]["predictor"]["model"]["resources"]["limits"]["memory"])
    declared = 0
    for tm in by_kind("TrainedModel"):
        assert tm["spec"]["inferenceService"] == multi["metadata"]["name"]
        assert tm["spec"]["model"]["storageUri"].startswith(STORAGE_PREFIXES)
        declared += parse_quantity(tm["spec"]["model"]["memory"])
    assert declared <= limit
