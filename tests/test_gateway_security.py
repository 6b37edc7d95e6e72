"""TLS and API keys: a stack with a throwaway CA (made here with `cryptography`), mTLS on the
internal ports and an API key on the public ones (coordinator gRPC and the HTTPS gateway)."""
from __future__ import annotations

import datetime
import ipaddress
import ssl

import grpc
import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from echospec.services.common import auth
from echospec.stack import start_stack
from echospec.v1 import coordinator_pb2 as cpb, coordinator_pb2_grpc, verifier_pb2 as vpb
from echospec.v1 import verifier_pb2_grpc

KEY = "test-key-3f9a"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_pki(d) -> dict[str, str]:
    """A CA and one certificate for 127.0.0.1 / localhost (server and client use), as PEM files."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("echospec test CA")).issuer_name(_name("echospec test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    files = {"ca": ca.public_bytes(pem), "cert": cert.public_bytes(pem),
             "key": key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())}
    out = {}
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
        out[name] = str(d / f"{name}.pem")
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stack(tiny_model, pki):
    st = start_stack(tiny_model(), n_ctx=256, n_threads=1, http_port=0, api_key=KEY,
                     tls_cert=pki["cert"], tls_key=pki["key"], tls_ca=pki["ca"],
                     tls_client_ca=pki["ca"], model_name="m")
    yield st
    st.stop(0.5)


def tls_channel(target: str, pki, client_cert: bool = False) -> grpc.Channel:
    read = lambda k: open(pki[k], "rb").read()  # noqa: E731
    creds = grpc.ssl_channel_credentials(read("ca"), read("key") if client_cert else None,
                                         read("cert") if client_cert else None)
    return grpc.secure_channel(target, creds)


def test_grpc_api_key(stack, pki):
    req = cpb.CompleteRequest(text="the cat", max_tokens=4)
    with tls_channel(stack.target, pki) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        r = stub.Complete(req, timeout=30, metadata=[("authorization", auth.bearer(KEY))])
        assert r.result.completion_tokens == 4
        for md in ([], [("authorization", "Bearer wrong")], [("authorization", KEY)]):
            with pytest.raises(grpc.RpcError) as ei:
                stub.Complete(req, timeout=30, metadata=md)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(cpb.GenerateRequest(text="the cat", max_tokens=4), timeout=30))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # health and reflection stay open for probes
        h = health_pb2_grpc.HealthStub(ch)
        assert h.Check(health_pb2.HealthCheckRequest(service="echospec.v1.CoordinatorService"),
                       timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
            ProtoReflectionDescriptorDatabase
        assert "echospec.v1.CoordinatorService" in ProtoReflectionDescriptorDatabase(ch).get_services()


def test_refused_calls_give_their_slot_back(stack, pki):
    """More unauthenticated calls than the coordinator admits at once (max_concurrent_rpcs, 56),
    then an authenticated one: it is served, and each refusal was counted as UNAUTHENTICATED."""
    coord = stack._servers["coordinator"]
    limit = coord.handle.limit
    req = cpb.CompleteRequest(text="the cat", max_tokens=2)
    with tls_channel(stack.target, pki) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        for _ in range(limit.limit + 8):
            with pytest.raises(grpc.RpcError) as ei:
                stub.Complete(req, timeout=10, metadata=[("authorization", "Bearer nope")])
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Complete(req, timeout=30, metadata=[("authorization", auth.bearer(KEY))]
                             ).result.completion_tokens == 2
    assert limit.active == 0
    n = coord.handle.rpc_metrics.registry.get_sample_value(
        "echospec_rpc_finished_total",
        {"method": "/echospec.v1.CoordinatorService/Complete", "code": "UNAUTHENTICATED"})
    assert n >= limit.limit + 8


def test_plain_text_client_fails(stack):
    with grpc.insecure_channel(stack.target) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            h.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx.HTTPError):
        httpx.get(stack.http_url.replace("https://", "http://") + "/health", timeout=5)


def test_internal_port_demands_a_client_certificate(stack, pki):
    with tls_channel(stack.verifier_target, pki) as ch:           # CA, no client certificate
        with pytest.raises(grpc.RpcError) as ei:
            verifier_pb2_grpc.VerifierServiceStub(ch).GetConfig(vpb.GetConfigRequest(), timeout=5)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    with tls_channel(stack.verifier_target, pki, client_cert=True) as ch:
        cfg = verifier_pb2_grpc.VerifierServiceStub(ch).GetConfig(vpb.GetConfigRequest(), timeout=5)
        assert cfg.n_ctx == 256


def test_https_gateway_with_key(stack, pki):
    assert stack.http_url.startswith("https://")
    http = httpx.Client(verify=ssl.create_default_context(cafile=pki["ca"]), timeout=60)
    try:
        c = openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0, http_client=http)
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=4)
        assert r.usage.completion_tokens == 4
        assert [m.id for m in c.models.list().data]
        bad = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="wrong", max_retries=0,
                            http_client=http)
        with pytest.raises(openai.AuthenticationError) as ei:
            bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert ei.value.status_code == 401 and ei.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = http.post(stack.http_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["message"].startswith("no API key")
        # health needs no key
        r = http.get(stack.http_url + "/health")
        assert r.status_code == 200 and r.json()["status"] == "SERVING"
    finally:
        http.close()
    # a client without the CA refuses the server's certificate
    with pytest.raises(httpx.ConnectError):
        httpx.get(stack.http_url + "/health", timeout=5)


def test_authorized_rule():
    assert auth.authorized(None, "")
    assert auth.authorized("Bearer k", "k") and auth.authorized("bearer k", "k")
    assert not auth.authorized(None, "k") and not auth.authorized("Bearer k2", "k")
    assert not auth.authorized("Basic k", "k") and not auth.authorized("k", "k")


@pytest.mark.parametrize("argv, message", [
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "ca.pem"], "need --tls-cert and --tls-key"),
    (["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"], "no such file"),
    (["--http-port", "70000"], "--http-port 70000"),
])
def test_serve_refuses_bad_security_options(argv, message, capsys):
    from echospec import cli
    args = cli.parse_args(["serve", "--port", "0", *argv])
    with pytest.raises(SystemExit) as ei:
        cli.cmd_serve(args)
    assert ei.value.code == 2 and message in capsys.readouterr().err
