"""deploy/k8s: render the kustomizations, validate every object against the Kubernetes
schemas, lint the security settings and check the wiring. Offline.

Renderer: no kustomize is installable here (no PyPI package renders kustomization.yaml,
and Debian's kubernetes-client is kubectl 1.20 with the 2019 kustomize v2.0.3). So this
file carries a minimal renderer for exactly the features deploy/k8s uses (resources,
namespace, labels, images, patches with strategic merge by name) and refuses any other
kustomization key, so a manifest that needs more fails here instead of passing unchecked.
A real `kubectl kustomize` gives the same objects (deploy/README.md).

Schemas: kubernetes-validate (PyPI) bundles the OpenAPI schemas of Kubernetes 1.25-1.37;
the objects are checked strictly (unknown fields are errors) against 1.27 (the first with
native gRPC probes GA; k3s releases from then on) and the newest bundled version.

Lint: a focused check of what checkov / kube-linter would flag for these workloads
(non-root, no privilege escalation, read-only root, all capabilities dropped, seccomp,
resource requests and limits, probes, no host namespaces, no service account token),
instead of checkov's few hundred MB of dependencies for the same dozen rules.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echospec.services.common import config as cfg  # noqa: E402

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAY = K8S / "overlays" / "k3s-rk3588"
KUSTOMIZE_KEYS = {"apiVersion", "kind", "namespace", "labels", "resources", "images", "patches"}
CLUSTER_SCOPED = {"Namespace"}
SCHEMA_VERSIONS = ("1.27.0", "1.37.0")


# -- the minimal renderer ------------------------------------------------------------------------
def _merge(base, patch):
    """Strategic merge: maps recursively, lists of named maps by name, other lists replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and base and patch and \
            all(isinstance(x, dict) and "name" in x for x in base + patch):
        out = [copy.deepcopy(x) for x in base]
        index = {x["name"]: i for i, x in enumerate(out)}
        for x in patch:
            if x["name"] in index:
                out[index[x["name"]]] = _merge(out[index[x["name"]]], x)
            else:
                out.append(copy.deepcopy(x))
        return out
    return copy.deepcopy(patch)


def _pod_specs(obj):
    spec = obj.get("spec", {})
    if "template" in spec:
        yield spec["template"]["spec"]


def _containers(obj):
    for pod in _pod_specs(obj):
        yield from pod.get("initContainers", [])
        yield from pod.get("containers", [])


def render(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` gives, for the features listed above."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZE_KEYS
    assert not unknown, f"{directory}: kustomization keys {unknown} are not handled by this renderer"
    objs: list[dict] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        if path.is_dir():
            objs += render(path)
        else:
            objs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for p in k.get("patches", []):
        assert set(p) == {"path"}, f"patch {p}: only file patches are handled"
        patch = yaml.safe_load((directory / p["path"]).read_text())
        hits = [i for i, o in enumerate(objs) if o["kind"] == patch["kind"]
                and o["metadata"]["name"] == patch["metadata"]["name"]]
        assert len(hits) == 1, f"patch {p['path']} matches {len(hits)} objects"
        objs[hits[0]] = _merge(objs[hits[0]], patch)
    for img in k.get("images", []):
        for o in objs:
            for c in _containers(o):
                name, _, tag = c["image"].partition(":")
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    if "namespace" in k:
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
    for lab in k.get("labels", []):
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(lab["pairs"])
    return objs


@pytest.fixture(scope="module", params=["base", "k3s-rk3588"])
def rendered(request):
    return request.param, render(BASE if request.param == "base" else OVERLAY)


def _one(objs, kind, name):
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} objects"
    return hits[0]


# -- the checks ----------------------------------------------------------------------------------
def test_renderer_merges_by_name_and_refuses_unknown_keys(tmp_path):
    base = {"spec": {"containers": [{"name": "a", "image": "x", "command": ["p", "q"]},
                                    {"name": "b", "image": "y"}]}}
    patch = {"spec": {"containers": [{"name": "a", "command": ["r"]}]}}
    assert _merge(base, patch) == {"spec": {"containers": [
        {"name": "a", "image": "x", "command": ["r"]}, {"name": "b", "image": "y"}]}}
    (tmp_path / "kustomization.yaml").write_text("resources: []\nconfigMapGenerator: []\n")
    with pytest.raises(AssertionError, match="configMapGenerator"):
        render(tmp_path)


def test_objects_pass_the_kubernetes_schemas(rendered):
    import kubernetes_validate
    _, objs = rendered
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["ConfigMap"] * 4 + ["DaemonSet", "Deployment", "Namespace",
                                         "PodDisruptionBudget", "Service", "Service"]
    for version in SCHEMA_VERSIONS:
        for o in objs:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{o['kind']}/{o['metadata']['name']} against {version}: {exc}")
    # the validator does reject a wrong object (a field of the wrong type, an unknown field)
    bad = copy.deepcopy(_one(objs, "Deployment", "echospec-coordinator"))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, SCHEMA_VERSIONS[0], strict=True)
    bad = copy.deepcopy(_one(objs, "DaemonSet", "echospec-verifier"))
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, SCHEMA_VERSIONS[0], strict=True)


def test_security_lint(rendered):
    name, objs = rendered
    workloads = [o for o in objs if o["kind"] in ("DaemonSet", "Deployment")]
    assert len(workloads) == 2
    for w in workloads:
        where = f"{name} {w['kind']}/{w['metadata']['name']}"
        pod = w["spec"]["template"]["spec"]
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0 and psc["runAsGroup"] != 0, where
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", where
        assert pod["automountServiceAccountToken"] is False, where
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(host), f"{where}: {host}"
        host_paths = {v["name"] for v in pod["volumes"] if "hostPath" in v}
        assert host_paths == {"models"}, where
        for c in pod.get("initContainers", []) + pod["containers"]:
            cw = f"{where} container {c['name']}"
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, cw
            assert sc["readOnlyRootFilesystem"] is True, cw
            assert not sc.get("privileged"), cw
            assert "ALL" in sc["capabilities"]["drop"] and not sc["capabilities"].get("add"), cw
            assert sc.get("runAsUser", psc["runAsUser"]) != 0, cw
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{cw}: {kind}"
            for m in c.get("volumeMounts", []):
                if m["name"] == "models" and c not in pod.get("initContainers", []):
                    assert m.get("readOnly") is True, f"{cw}: the model cache is read-only"
            if c not in pod.get("initContainers", []):
                assert "livenessProbe" in c, cw
            if name != "base":
                assert not c["image"].endswith(":latest"), f"{cw}: pin the image tag"


def test_probes_are_native_grpc_health_checks(rendered):
    _, objs = rendered
    ds = _one(objs, "DaemonSet", "echospec-verifier")
    dep = _one(objs, "Deployment", "echospec-coordinator")
    by = {c["name"]: c for w in (ds, dep) for c in w["spec"]["template"]["spec"]["containers"]}
    for cname, port, service in (("verifier", 50053, "echospec.v1.VerifierService"),
                                 ("coordinator", 50051, "echospec.v1.CoordinatorService")):
        c = by[cname]
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["grpc"] == {"port": port, "service": service}, (cname, probe)
        assert c["livenessProbe"]["grpc"]["port"] == port
    assert by["draft"]["livenessProbe"]["grpc"]["port"] == 50052
    assert "readinessProbe" not in by["draft"]   # a board serves (plainly) without its draft


def test_wiring(rendered):
    name, objs = rendered
    ds = _one(objs, "DaemonSet", "echospec-verifier")
    dep = _one(objs, "Deployment", "echospec-coordinator")
    headless = _one(objs, "Service", "echospec-verifier")
    public = _one(objs, "Service", "echospec")
    pdb = _one(objs, "PodDisruptionBudget", "echospec-coordinator")
    cms = {o["metadata"]["name"]: o["data"] for o in objs if o["kind"] == "ConfigMap"}
    assert all(o["metadata"].get("namespace") == "echospec" for o in objs if o["kind"] != "Namespace")
    assert ds["spec"]["template"]["spec"]["nodeSelector"]["echospec.io/board"] == "true"
    assert dep["spec"]["replicas"] == 2
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["ports"][0]["port"] == 50053
    assert headless["spec"]["selector"] == ds["spec"]["template"]["metadata"]["labels"]
    assert public["spec"]["type"] == "ClusterIP"
    assert public["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]
    # the coordinator balances over the headless Service's addresses
    assert cms["echospec-coordinator"]["ECHOSPEC_VERIFIER"] == "dns:///echospec-verifier:50053"
    # each verifier consults the draft service of its own pod
    assert cms["echospec-verifier"]["ECHOSPEC_DRAFT_TARGET"] == "127.0.0.1:50052"
    # every ConfigMap key is a setting the service reads, and parses
    for cm, kind in (("echospec-verifier", cfg.VerifierConfig), ("echospec-draft", cfg.DraftConfig),
                     ("echospec-coordinator", cfg.CoordinatorConfig)):
        fields = {f"ECHOSPEC_{f.upper()}" for f in kind.__dataclass_fields__}
        assert set(cms[cm]) <= fields, f"{cm}: unknown settings {set(cms[cm]) - fields}"
        parsed = cfg.from_env(kind, cms[cm])
        assert parsed.host == "0.0.0.0"
    coord = cfg.from_env(cfg.CoordinatorConfig, cms["echospec-coordinator"])
    assert coord.verifier == ("dns:///echospec-verifier:50053",)
    # the model: filled by an init container into the node's cache, read by both
    for w in (ds, dep):
        pod = w["spec"]["template"]["spec"]
        assert [c["name"] for c in pod["initContainers"]] == ["model-init"]
        assert pod["initContainers"][0]["command"][-1] == "/app/deploy/model_init.py"
        models = [v for v in pod["volumes"] if v["name"] == "models"][0]
        assert models["hostPath"]["path"] == "/var/lib/echospec/models"
    if name == "k3s-rk3588":
        by = {c["name"]: c for c in ds["spec"]["template"]["spec"]["containers"]}
        assert by["verifier"]["command"][:3] == ["taskset", "-c", "4-7"]   # the A76 cores
        assert by["draft"]["command"][:3] == ["taskset", "-c", "0-3"]
        assert cfg.from_env(cfg.VerifierConfig, cms["echospec-verifier"]).n_threads == 4
        assert by["verifier"]["resources"]["limits"]["cpu"] == "4"
        assert ds["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/arch"] == "arm64"


def test_renderer_matches_kubectl_kustomize_when_installed():
    """Cross-check of the minimal renderer against the real kustomize, where a kubectl is on
    PATH (not installable from this project's registries, so CI machines may lack it; the
    other tests here do not depend on it)."""
    import shutil
    import subprocess
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl on PATH: the renderer is not cross-checked on this machine")
    for d in (BASE, OVERLAY):
        out = subprocess.run([kubectl, "kustomize", str(d)], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        real = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out.stdout) if o}
        mine = {(o["kind"], o["metadata"]["name"]): o for o in render(d)}
        assert mine == real, d
