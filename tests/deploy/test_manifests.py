"""deploy/: the llm-d manifests and helm values lint against real schemas and
agree with each other, and the Containerfile builds from files that exist.

Core kinds (Deployment, Service, and the Pod the modelservice chart renders
from our values) are checked with ``kubernetes-validate`` (the Kubernetes
OpenAPI schemas, strict: unknown fields fail) for the oldest Kubernetes llm-d
supports and the newest the package knows.  The Inference Extension and
Gateway API kinds and the two charts' values have no published package
schema: deploy/schemas/ holds our own, written from their API references.
No container runtime here: the image itself is not built (docs/llm-d.md).
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate  # the test extra (pyproject.toml): a missing validator fails
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSIONS = ("1.30.0", "1.37.0")
OWN_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.schema.json",
    (
        "inference.networking.x-k8s.io/v1alpha2",
        "InferenceObjective",
    ): "inferenceobjective-v1alpha2.schema.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.schema.json",
}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifests() -> list[dict]:
    out: list[dict] = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        out += _docs(path)
    return out


def _schema(name: str) -> dict:
    return json.loads((DEPLOY / "schemas" / name).read_text())


def _lint(doc: dict) -> None:
    """Raise if ``doc`` does not validate (kubernetes-validate or our schema)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in OWN_SCHEMAS:
        schema = _schema(OWN_SCHEMAS[key])
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.Draft202012Validator(schema).validate(doc)
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def _one(kind: str) -> dict:
    (doc,) = [d for d in _manifests() if d["kind"] == kind]
    return doc


def _container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def _port(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


# ------------------------------------------------------------------ schemas
@pytest.mark.parametrize(
    "doc", _manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}"
)  # fmt: skip
def test_every_manifest_validates(doc):
    _lint(doc)


def test_every_kind_has_a_validator():
    kinds = {(d["apiVersion"], d["kind"]) for d in _manifests()}
    assert kinds == {("apps/v1", "Deployment"), ("v1", "Service"), *OWN_SCHEMAS}


def _broken(kind: str, edit) -> dict:
    doc = copy.deepcopy(_one(kind))
    edit(doc)
    return doc


@pytest.mark.parametrize(
    "kind,edit,error",
    [
        # a port number as a string: the Kubernetes schema wants an integer
        ("Deployment", lambda d: _container(d)["ports"][0].update(containerPort="8000"),
         kubernetes_validate.ValidationError),
        # a misspelt probe field (strict: unknown fields fail)
        ("Deployment", lambda d: _container(d)["readinessProbe"].update(periodSecond=5),
         kubernetes_validate.ValidationError),
        ("Service", lambda d: d["spec"]["ports"][0].pop("port"), kubernetes_validate.ValidationError),
        ("InferencePool", lambda d: d["spec"].pop("targetPorts"), jsonschema.ValidationError),
        # the picker is a Service: its port must be given
        ("InferencePool", lambda d: d["spec"]["endpointPickerRef"].pop("port"),
         jsonschema.ValidationError),
        ("InferencePool", lambda d: d["spec"]["endpointPickerRef"].update(failureMode="Open"),
         jsonschema.ValidationError),
        # the pre-v1 field name
        ("InferencePool", lambda d: d["spec"].update(targetPortNumber=8000),
         jsonschema.ValidationError),
        ("HTTPRoute", lambda d: d["spec"]["rules"][0]["timeouts"].update(request="10 minutes"),
         jsonschema.ValidationError),
    ],
    ids=["port-string", "probe-typo", "service-port", "pool-ports", "picker-port",
         "failure-mode", "old-field", "route-timeout"],
)  # fmt: skip
def test_a_broken_manifest_fails_its_validator(kind, edit, error):
    with pytest.raises(error):
        _lint(_broken(kind, edit))


def test_objective_with_a_wrong_pool_kind_fails():
    doc = copy.deepcopy(next(d for d in _manifests() if d["kind"] == "InferenceObjective"))
    doc["spec"]["poolRef"]["kind"] = "Service"
    with pytest.raises(jsonschema.ValidationError):
        _lint(doc)


# --------------------------------------------------- what llm-d relies on
def test_the_pool_selects_the_model_server_pods_on_the_vllm_port():
    dep, pool = _one("Deployment"), _one("InferencePool")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    want = pool["spec"]["selector"]["matchLabels"]
    assert want.items() <= pod_labels.items()
    c = _container(dep)
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [_port(c, "http")]
    assert _env(c)["SPYRE_PORT"] == str(_port(c, "http"))
    assert _env(c)["TORCH_SPYRE_VLLM_METRICS_PORT"] == str(_port(c, "spyre-metrics"))
    objectives = [d for d in _manifests() if d["kind"] == "InferenceObjective"]
    assert objectives and {o["spec"]["poolRef"]["name"] for o in objectives} == {
        pool["metadata"]["name"]
    }
    route = _one("HTTPRoute")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])


def test_the_service_reaches_the_pods_ports():
    dep, svc = _one("Deployment"), _one("Service")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    names = {p["name"] for p in _container(dep)["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names


def _shutdown_timeout_s() -> int:
    m = re.search(r"SPYRE_SHUTDOWN_TIMEOUT_S:-(\d+)", (DEPLOY / "entrypoint.sh").read_text())
    assert m
    return int(m.group(1))


def test_probes_wait_for_warm_up_and_drain_on_stop():
    dep = _one("Deployment")
    c = _container(dep)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    start = c["startupProbe"]
    # warm-up compiles every bucket before /health is 200: minutes, cold
    assert start["periodSeconds"] * start["failureThreshold"] >= 20 * 60
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > _shutdown_timeout_s()
    env = _env(c)
    assert env["TORCH_SPYRE_VLLM_WARMUP"] == "all"
    card = {"TORCH_SPYRE_NUM_CARDS", "TORCH_SPYRE_DEVICE_MEMORY", "TORCH_SPYRE_FALLBACK"}
    assert card <= set(env)
    assert c["resources"]["requests"]["cpu"] == env["OMP_NUM_THREADS"]


# ------------------------------------------------------------ helm values
def _values(name: str) -> dict:
    return yaml.safe_load((DEPLOY / "helm" / name).read_text())


@pytest.mark.parametrize(
    "values,schema",
    [("inferencepool-values.yaml", "inferencepool-chart-values.schema.json"),
     ("modelservice-values.yaml", "modelservice-chart-values.schema.json")],
)  # fmt: skip
def test_helm_values_validate(values, schema):
    s = _schema(schema)
    jsonschema.Draft202012Validator.check_schema(s)
    jsonschema.Draft202012Validator(s).validate(_values(values))
    broken = _values(values)
    broken.pop(next(iter(s["required"])))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(s).validate(broken)


# keys of the modelservice chart's container entries that are not Kubernetes'
_CHART_KEYS = ("modelCommand", "mountModelVolume")


def test_modelservice_container_is_a_valid_pod_container():
    """What the chart renders from our container entry (its own keys dropped,
    the args it adds in front) is a valid Pod for Kubernetes."""
    vals = _values("modelservice-values.yaml")
    (c,) = vals["decode"]["containers"]
    c = {k: v for k, v in c.items() if k not in _CHART_KEYS}
    port = str(vals["routing"]["servicePort"])
    name = vals["modelArtifacts"]["name"]
    c["args"] = ["--model", "/models/x", "--port", port, "--served-model-name", name, *c["args"]]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "decode"},
           "spec": {"containers": [c]}}  # fmt: skip
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)


def test_helm_values_agree_with_the_manifests():
    pool_vals, ms = _values("inferencepool-values.yaml"), _values("modelservice-values.yaml")
    pool, dep = _one("InferencePool"), _one("Deployment")
    labels = pool_vals["inferencePool"]["modelServers"]["matchLabels"]
    assert labels == pool["spec"]["selector"]["matchLabels"]
    assert labels.items() <= ms["modelArtifacts"]["labels"].items()
    ports = [p["number"] for p in pool_vals["inferencePool"]["targetPorts"]]
    assert ports == [p["number"] for p in pool["spec"]["targetPorts"]]
    assert ports == [ms["routing"]["servicePort"]]
    objectives = {o["name"]: o["priority"] for o in pool_vals["inferenceObjectives"]}
    assert objectives == {
        d["metadata"]["name"]: d["spec"]["priority"]
        for d in _manifests()
        if d["kind"] == "InferenceObjective"
    }
    picker = pool["spec"]["endpointPickerRef"]
    assert pool_vals["inferenceExtension"]["extProcPort"] == picker["port"]["number"]
    (c,) = ms["decode"]["containers"]
    dc = _container(dep)
    # same image, settings and probes; the Deployment names the model itself
    assert c["image"] == dc["image"]
    assert c["args"] == dc["args"][1:]
    assert _env(c).items() <= _env(dc).items()
    assert {k for k in _env(dc) if k.startswith("TORCH_SPYRE_")} == {
        k for k in _env(c) if k.startswith("TORCH_SPYRE_")
    }
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe] == dc[probe], probe
    assert c["resources"] == dc["resources"]
    assert ms["accelerator"]["type"] == "cpu"  # no GPU resource added by the chart
    assert ms["routing"]["proxy"]["enabled"] is False


# ------------------------------------------------------------ Containerfile
def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Containerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Containerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_containerfile_copies_and_runs_files_that_exist():
    ins = _instructions()
    copies = [shlex.split(a) for w, a in ins if w == "COPY"]
    assert copies
    for *srcs, _dest in copies:
        for src in srcs:
            assert not src.startswith("--"), src  # no multi-stage copies to check elsewhere
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository (the build context)"
    copied = {s.rstrip("/") for *srcs, _ in copies for s in srcs}
    runs = " ".join(a for w, a in ins if w == "RUN")
    for script in re.findall(r"\b(scripts/[\w./-]+|deploy/[\w./-]+)", runs):
        assert (ROOT / script).exists(), script
        assert any(script == c or script.startswith(c + "/") for c in copied), (
            f"RUN uses {script}, which no COPY brings into the image"
        )
    # installed the way CI installs it: install.sh with the vllm and models extras
    m = re.search(r"bash scripts/install\.sh (\S+)", runs)
    assert m and {"vllm", "models"} <= set(m.group(1).split(","))
    assert (ROOT / "scripts" / "install.sh").read_text().count('"torch==2.13.0"') == 1
    for pin in re.findall(r"torch==[\d.]+", runs):
        assert pin == "torch==2.13.0"
    base = next(a for w, a in ins if w == "FROM")
    assert base.startswith("python:3.11")


def test_containerfile_entrypoint_is_deploy_entrypoint():
    ins = _instructions()
    entry = json.loads(next(a for w, a in ins if w == "ENTRYPOINT"))
    (target,) = entry
    copies = [shlex.split(a) for w, a in ins if w == "COPY"]
    assert ["deploy/entrypoint.sh", target] in copies
    exposed = {int(p) for w, a in ins if w == "EXPOSE" for p in a.split()}
    c = _container(_one("Deployment"))
    assert {p["containerPort"] for p in c["ports"]} == exposed
    env = " ".join(a for w, a in ins if w == "ENV")
    assert f"TORCH_SPYRE_VLLM_METRICS_PORT={_port(c, 'spyre-metrics')}" in env
    # the default command serves the model the image ships
    cmd = json.loads(next(a for w, a in ins if w == "CMD"))
    assert cmd[0] == "offline:smollm2"
