"""Service settings (services/common/config.py): the flags and ECHOSPEC_* variables of
`python -m echospec.services.<name>` (as Compose and k8s run them).

A setting out of range, malformed (not a number, not a boolean, a list with no item, a target with
a space) or unusable (TLS files that hold no usable PEM, an API key gRPC metadata cannot carry) is
refused at load, with exit 2 naming the option and its variable, before a model is loaded or a
port bound; the valid edges and every default load. Defaults: a standalone coordinator names no
draft target; the engine's threads leave a core to the service, and the verifier reports the
count it resolved."""
from __future__ import annotations

import pytest


# -- flags and variables out of range or malformed: exit 2 naming the option -----------------------

@pytest.mark.parametrize("cls, argv, env, message", [
    # was: gRPC bound port 99999 as 34463 (99999 mod 65536) and the service ran there
    ("VerifierConfig", ["--port", "99999"], {}, "--port / ECHOSPEC_PORT 99999"),
    ("DraftConfig", [], {"ECHOSPEC_PORT": "70000"}, "--port / ECHOSPEC_PORT 70000"),
    ("CoordinatorConfig", ["--port", "-1"], {}, "a port is in [0, 65535]"),
    ("CoordinatorConfig", ["--metrics-port", "65536"], {}, "--metrics-port"),
    # was: an OverflowError traceback from socket.bind
    ("GatewayConfig", ["--port", "99999"], {}, "--port / ECHOSPEC_PORT 99999"),
    # was: a gateway that answered every generation with 504 (a deadline already past)
    ("GatewayConfig", ["--request-timeout-s", "-1"], {}, "--request-timeout-s"),
    ("GatewayConfig", ["--request-timeout-s", "nan"], {}, "--request-timeout-s"),
    ("CoordinatorConfig", ["--verifier-poll-s", "0"], {}, "--verifier-poll-s"),
    ("CoordinatorConfig", ["--stall-floor-s", "-1"], {}, "--stall-floor-s / ECHOSPEC_STALL_FLOOR_S -1.0"),
    ("CoordinatorConfig", [], {"ECHOSPEC_STALL_FLOOR_S": "inf"}, "ECHOSPEC_STALL_FLOOR_S inf"),
    # was: a gateway (or coordinator) that started and dialled a port nothing can listen on,
    # answering 503 (or "no healthy verifier") to every request
    ("GatewayConfig", ["--coordinator-target", "127.0.0.1:99999"], {}, "--coordinator-target"),
    ("CoordinatorConfig", ["--verifier", "10.0.0.1:50053", "--verifier", "10.0.0.2:0"], {},
     "--verifier / ECHOSPEC_VERIFIER '10.0.0.2:0': the port '0' is not a number in [1, 65535]"),
    ("VerifierConfig", [], {"ECHOSPEC_DRAFT_TARGET": "draft:"}, "ECHOSPEC_DRAFT_TARGET 'draft:'"),
    # was: exit 1 from the verifier pool's ValueError ("empty verifier target"), not a usage error
    ("CoordinatorConfig", ["--verifier", ""], {},
     "--verifier / ECHOSPEC_VERIFIER '': an empty target: each is host:port or dns:///name:port"),
    # was: services that started and dialled port 443, reporting nothing reachable
    ("CoordinatorConfig", ["--verifier", "localhost"], {},
     "--verifier / ECHOSPEC_VERIFIER 'localhost': no port (the target is host:port)"),
    ("CoordinatorConfig", ["--verifier-target", "::1"], {}, "'::1': an IPv6 address goes in brackets"),
    ("CoordinatorConfig", ["--verifier-target", "[::1]"], {}, "'[::1]': no port"),
    # was: exit 1 after binding, not naming the setting
    ("CoordinatorConfig", ["--verifier", "dns:///localhost"], {},
     "--verifier / ECHOSPEC_VERIFIER 'dns:///localhost': a dns:/// target is dns:///name:port"),
    ("VerifierConfig", ["--draft-target", "draft"], {}, "--draft-target / ECHOSPEC_DRAFT_TARGET 'draft': no port"),
    ("GatewayConfig", [], {"ECHOSPEC_COORDINATOR_TARGET": "coordinator"}, "'coordinator': no port"),
])
def test_service_entry_points_refuse_bad_ports_and_durations(cls, argv, env, message, capsys):
    from echospec.services.common import config as cfg
    with pytest.raises(SystemExit) as ei:
        cfg.load(getattr(cfg, cls), argv, environ=env, prog="svc")
    assert ei.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("cls, argv, message", [
    # was: a gateway that started and answered every request 413 "larger than 0 bytes"
    ("GatewayConfig", ["--max-body-bytes", "0"], "--max-body-bytes / ECHOSPEC_MAX_BODY_BYTES 0"),
    ("CoordinatorConfig", ["--max-message-bytes", "-1"], "--max-message-bytes"),
    # was: a coordinator that refused every request with a stop string ("at most -1")
    ("CoordinatorConfig", ["--max-stop", "-1"], "--max-stop / ECHOSPEC_MAX_STOP -1"),
    # was: exit 1 with "k = -1: ..." from the servicer, not naming the option
    ("CoordinatorConfig", ["--k", "-1"], "--k / ECHOSPEC_K -1: drafts per round must be in [1, 32]"),
    ("CoordinatorConfig", ["--k-max", "8", "--k", "9"], "--k / ECHOSPEC_K 9"),
    ("CoordinatorConfig", ["--k-max", "0"], "--k-max / ECHOSPEC_K_MAX 0"),
    ("CoordinatorConfig", ["--max-tokens-limit", "0"], "--max-tokens-limit"),
    ("CoordinatorConfig", ["--max-moves", "-1"], "--max-moves / ECHOSPEC_MAX_MOVES -1"),
    # was: verifiers that started with these settings
    ("VerifierConfig", ["--max-k", "0"], "--max-k / ECHOSPEC_MAX_K 0"),
    ("VerifierConfig", ["--prefix-cache-sessions", "-1"], "--prefix-cache-sessions"),
    # was: exit 1 with "0 sessions already open (max_sessions 0)"
    ("VerifierConfig", ["--max-sessions", "0"], "--max-sessions / ECHOSPEC_MAX_SESSIONS 0"),
    ("DraftConfig", ["--max-workers", "8", "--max-concurrent-rpcs", "8"],
     "--max-concurrent-rpcs / ECHOSPEC_MAX_CONCURRENT_RPCS 8: RPCs at once (below max_workers) "
     "must be in [1, 7]"),
])
def test_service_entry_points_refuse_integer_settings_out_of_range(cls, argv, message, capsys):
    from echospec.services.common import config as cfg
    with pytest.raises(SystemExit) as ei:
        cfg.load(getattr(cfg, cls), argv, environ={}, prog="svc")
    assert ei.value.code == 2
    assert message in capsys.readouterr().err


def test_service_entry_points_keep_valid_edges():
    from echospec.services.common import config as cfg
    assert cfg.load(cfg.CoordinatorConfig, ["--port", "0", "--metrics-port", "-1"], environ={}).port == 0
    # 0 turns stall detection (and resuming) off
    off = cfg.load(cfg.CoordinatorConfig, ["--stall-floor-s", "0", "--max-moves", "0"], environ={})
    assert (off.stall_floor_s, off.max_moves) == (0.0, 0)
    assert cfg.load(cfg.GatewayConfig, ["--port", "65535"], environ={}).port == 65535
    assert cfg.load(cfg.DraftConfig, ["--grace-s", "0"], environ={}).grace_s == 0.0
    assert cfg.load(cfg.CoordinatorConfig, ["--verifier", "dns:///echospec-verifier:50053",
                                            "--verifier", "[::1]:50053"], environ={}).verifier
    assert cfg.load(cfg.VerifierConfig, [], environ={"ECHOSPEC_DRAFT_TARGET": ""}).draft_target == ""
    for cls in (cfg.DraftConfig, cfg.VerifierConfig, cfg.CoordinatorConfig, cfg.GatewayConfig):
        assert cfg.load(cls, [], environ={}) == cls()      # every default is in range
    c = cfg.load(cfg.CoordinatorConfig, ["--k-max", "8", "--k", "8", "--max-stop", "0"], environ={})
    assert (c.k, c.k_max, c.max_stop) == (8, 8, 0)
    assert cfg.load(cfg.VerifierConfig, ["--prefix-cache-sessions", "0", "--max-k", "1"],
                    environ={}).prefix_cache_sessions == 0


@pytest.mark.parametrize("field,value,want", [
    ("decode_steps", "abc", "greedy steps per engine call must be a whole number in [1, 1024]"),
    ("batch_max", "1e3", "sessions per iteration must be a whole number in [1, 256]"),
    ("max_concurrent_rpcs", "", "RPCs at once (below max_workers) must be a whole number in [1, --max-workers -1]"),
])
def test_a_non_integer_env_setting_names_the_range(field, value, want):
    # was: "ECHOSPEC_DECODE_STEPS='abc': invalid literal for int() with base 10: 'abc'"
    from echospec.services.common import config
    key = f"ECHOSPEC_{field.upper()}"
    with pytest.raises(ValueError) as e:
        config.from_env(config.VerifierConfig, {key: value})
    assert str(e.value) == f"{key}={value!r}: {want}"


@pytest.mark.parametrize("env, message", [
    ({"ECHOSPEC_PREFIX_CACHE": ""}, "ECHOSPEC_PREFIX_CACHE='': not a boolean (on/off, true/false, "
                                    "yes/no, 1/0)"),
    ({"ECHOSPEC_PREFIX_CACHE": "maybe"}, "ECHOSPEC_PREFIX_CACHE='maybe': not a boolean"),
])
def test_an_empty_or_unknown_boolean_setting_is_refused(env, message):
    # was: an empty ECHOSPEC_PREFIX_CACHE quietly turned the prefix cache off
    from echospec.services.common import config
    with pytest.raises(ValueError) as e:
        config.from_env(config.VerifierConfig, env)
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("cls, fields, message", [
    ("GatewayConfig", {"coordinator_target": ""},
     "--coordinator-target / ECHOSPEC_COORDINATOR_TARGET is empty"),
    ("CoordinatorConfig", {"verifier_target": ""},
     "--verifier-target / ECHOSPEC_VERIFIER_TARGET is empty (and --verifier names none)"),
    ("DraftConfig", {"host": ""}, "--host / ECHOSPEC_HOST is empty"),
    ("DraftConfig", {"log_level": "bogus"},
     "--log-level / ECHOSPEC_LOG_LEVEL 'bogus': one of DEBUG, INFO, WARNING, ERROR (any case)"),
    ("DraftConfig", {"log_format": "xml"}, "--log-format / ECHOSPEC_LOG_FORMAT 'xml': one of text, json"),
])
def test_settings_no_service_can_run_with_name_the_setting(cls, fields, message):
    # was: the gateway started and answered 500 to everything; the coordinator bound its port
    # and then exited 1; an empty host failed in gRPC's words; log settings named no option
    import dataclasses

    from echospec.services.common import config
    cfg = dataclasses.replace(getattr(config, cls)(), **fields)
    with pytest.raises(ValueError) as e:
        config.check_ranges(cfg)
    assert str(e.value).startswith(message), str(e.value)


def test_a_verifier_list_with_no_item_is_refused_and_log_format_takes_any_case():
    from echospec.services.common import config
    with pytest.raises(ValueError, match="a comma-separated list with no item in it"):
        config.from_env(config.CoordinatorConfig, {"ECHOSPEC_VERIFIER": " , "})
    assert config.from_env(config.CoordinatorConfig, {"ECHOSPEC_VERIFIER": ""}).verifier == ()
    config.check_ranges(config.DraftConfig(log_format="JSON", log_level="info"))


@pytest.mark.parametrize("env, message", [
    ({"ECHOSPEC_MIN_N": "abc"}, "ECHOSPEC_MIN_N"),
    # was: exit 1 (a startup failure) for a setting that parses but is out of range
    ({"ECHOSPEC_MIN_N": "0"}, "--min-n / ECHOSPEC_MIN_N: min_n must be in [1, 64], got 0"),
    ({"ECHOSPEC_MIN_N": "65"}, "min_n must be in [1, 64], got 65"),
])
def test_draft_entry_point_exits_2_for_every_bad_setting(env, message, monkeypatch, capsys):
    from echospec.services.draft.__main__ import main
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        code = main(["--port", "0"])
    except SystemExit as exc:   # argparse's exit for a setting that does not parse
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err


def test_a_service_on_a_busy_port_says_so_without_grpcs_own_log_lines():
    # was: gRPC's "E... add_port.cc:83] Failed to add port" and "set GRPC_VERBOSITY=debug" lines
    # before the service's own message
    import socket
    import subprocess
    import sys
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "echospec.services.draft", "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"draft: port 127.0.0.1:{port} is already in use (--port / ECHOSPEC_PORT)" in r.stderr, r.stderr
    assert "add_port" not in r.stderr and "GRPC_VERBOSITY" not in r.stderr, r.stderr


def test_a_target_with_spaces_stops_a_service_at_startup(tmp_path):
    # was: the gateway started and answered every request 503; the coordinator waited 120 s
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "echospec.services.gateway", "--port", "0",
                        "--coordinator-target", "not a target"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--coordinator-target / ECHOSPEC_COORDINATOR_TARGET 'not a target': it holds a space" \
        in r.stderr, r.stderr


# -- TLS files and the API key ---------------------------------------------------------------------

@pytest.mark.parametrize("cls", ["DraftConfig", "VerifierConfig", "CoordinatorConfig",
                                 "GatewayConfig"])
@pytest.mark.parametrize("which, message", [
    (lambda p: ["--tls-cert", p["junk"], "--tls-key", p["junk"]], "not a PEM certificate chain"),
    (lambda p: ["--tls-cert", p["a"]["cert"], "--tls-key", p["b"]["key"]], "KEY_VALUES_MISMATCH"),
    (lambda p: ["--tls-cert", p["a"]["cert"], "--tls-key", p["a"]["key"], "--tls-ca", p["junk"]],
     "--tls-ca / ECHOSPEC_TLS_CA"),
    (lambda p: ["--tls-cert", p["a"]["cert"], "--tls-key", p["a"]["key"],
                "--tls-client-ca", p["a"]["key"]], "--tls-client-ca / ECHOSPEC_TLS_CLIENT_CA"),
], ids=["junk", "key-mismatch", "junk-ca", "key-as-ca"])
def test_service_refuses_unusable_pem_at_startup(pki, cls, which, message, capsys):
    # was: the verifier and the coordinator loaded the model, then exited 1 with "cannot bind
    # 127.0.0.1:0: Failed to bind to address" (gRPC's TSI_INVALID_ARGUMENT); the gateway died
    # with an ssl.SSLError "[SSL] PEM lib" traceback from uvicorn
    from echospec.services.common import config as cfg
    with pytest.raises(SystemExit) as ei:
        cfg.load(getattr(cfg, cls), ["--port", "0", *which(pki)], environ={}, prog="svc")
    err = capsys.readouterr().err
    assert ei.value.code == 2 and message in err, err


def test_service_keeps_usable_pem(pki):
    from echospec.services.common import config as cfg
    c = cfg.load(cfg.VerifierConfig, ["--tls-cert", pki["a"]["cert"], "--tls-key", pki["a"]["key"],
                                      "--tls-ca", pki["a"]["ca"], "--tls-client-ca", pki["a"]["ca"]],
                 environ={})
    assert c.tls_cert == pki["a"]["cert"]


def test_tls_setting_messages_name_the_option_and_variable(tmp_path):
    # was: "tls_cert and tls_key go together", in neither spelling a user types
    from echospec.services.rpc.grpc_util import Tls
    with pytest.raises(ValueError) as e:
        Tls(str(tmp_path / "c.pem"), "", "", "").validate()
    assert str(e.value) == ("--tls-cert / ECHOSPEC_TLS_CERT and --tls-key / ECHOSPEC_TLS_KEY go "
                            "together (give both or neither)")


def test_service_refuses_an_api_key_from_the_environment(capsys):
    from echospec.services.common import config as cfg
    with pytest.raises(SystemExit) as ei:
        cfg.load(cfg.GatewayConfig, [], environ={"ECHOSPEC_API_KEY": "clé"}, prog="svc")
    assert ei.value.code == 2 and "ECHOSPEC_API_KEY" in capsys.readouterr().err
    assert cfg.load(cfg.GatewayConfig, [], environ={"ECHOSPEC_API_KEY": "sk-A_b.9~! x"}).api_key


@pytest.mark.parametrize("cls, argv, message", [
    # was: accepted, then the stall-watch thread died on its first wait (time_t overflow)
    ("CoordinatorConfig", ["--stall-floor-s", "1e10"], "--stall-floor-s / ECHOSPEC_STALL_FLOOR_S "
                                                       "10000000000.0: seconds must be a finite"),
    # was: accepted, then every call failed on gRPC's metadata limit
    ("VerifierConfig", ["--internal-key", "k" * 20000], "the internal key is 20000 characters long"),
    ("CoordinatorConfig", ["--api-key", "k" * 5000], "the API key is 5000 characters long"),
    # was: an empty key on a service's own command line started it with no check
    ("VerifierConfig", ["--internal-key", ""], '--internal-key "": an empty key turns the check off'),
    ("DraftConfig", ["--internal-key="], '--internal-key "": an empty key turns the check off'),
    ("CoordinatorConfig", ["--api-key", ""], '--api-key "": an empty key turns the check off'),
])
def test_service_refuses_settings_it_cannot_keep(cls, argv, message, capsys):
    from echospec.services.common import config as cfg
    with pytest.raises(SystemExit) as ei:
        cfg.load(getattr(cfg, cls), argv, environ={}, prog="svc")
    err = capsys.readouterr().err
    assert ei.value.code == 2 and message in err, err


def test_service_keeps_an_empty_key_from_the_environment():
    # an empty variable means no key (compose passes ${VAR:-}); only the command line is refused
    from echospec.services.common import config as cfg
    assert cfg.load(cfg.VerifierConfig, [], environ={"ECHOSPEC_INTERNAL_KEY": ""}).internal_key == ""
    assert cfg.load(cfg.CoordinatorConfig, ["--stall-floor-s", "1e6"], environ={}).stall_floor_s == 1e6


# -- defaults --------------------------------------------------------------------------------------

def test_standalone_coordinator_reports_no_draft_target_it_was_not_given():
    # was: GetInfo's draft_target said 127.0.0.1:50052, the coordinator's own unused default, while
    # its verifier used another draft service
    from echospec.services.common import config as cfg

    assert cfg.load(cfg.CoordinatorConfig, [], environ={}).draft_target == ""
    assert cfg.load(cfg.CoordinatorConfig, ["--draft-target", "draft:50052"],
                    environ={}).draft_target == "draft:50052"


def test_engine_threads_default_leaves_a_core_to_the_service(monkeypatch):
    from echospec.services.common import config as cfg

    monkeypatch.setattr(cfg.os, "sched_getaffinity", lambda pid: {0, 1})
    assert cfg.default_engine_threads() == 1
    monkeypatch.setattr(cfg.os, "sched_getaffinity", lambda pid: {0})
    assert cfg.default_engine_threads() == 1
    monkeypatch.setattr(cfg.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cfg.default_engine_threads() == 7


def test_verifier_reports_its_resolved_engine_threads(tiny_model):
    from echospec.services.common.config import VerifierConfig, default_engine_threads
    from echospec.services.verifier.sessions import VerifierCore

    for set_threads, want in ((0, default_engine_threads()), (2, 2)):
        core = VerifierCore(VerifierConfig(model=tiny_model(), n_ctx=64, n_threads=set_threads))
        try:
            assert core.config.n_threads == want >= 1
        finally:
            core.close()


def test_the_draft_service_admits_a_draft_stream_for_every_verifier_session():
    """Each speculative generation holds one draft stream: a draft service admitting fewer streams
    than a verifier's sessions would turn the last generations of a full verifier plain."""
    from echospec.services.common.config import DraftConfig, VerifierConfig
    assert DraftConfig().max_concurrent_rpcs >= VerifierConfig().max_sessions
    assert DraftConfig().max_concurrent_rpcs < DraftConfig().max_workers
