"""KV eviction (StreamingLLM's attention sinks plus a recent window), opt-in.

Engine (es_session_params kv_sinks S, kv_window W): every layer's query at position p attends
[0, S) U (p - W, p], positions absolute. Checked on a tiny model:
  * a greedy generation four times longer than S + W, past n_ctx, completes; the KV bytes the
    engine reports stay the sinks plus the ring at every step (a plain session of that n_ctx
    stops with ES_ERR_CAPACITY);
  * every logits row matches the numpy reference (tests/reference.py) run with the same
    eviction rule (the tight tolerance of test_engine_long_context.py), and the reference
    without eviction does not match the rows past S + W (so the rule is what is compared);
  * es_decode past n_ctx gives the same tokens; a rollback as deep as the ring holds works,
    one deeper is refused naming eviction; bad parameters are refused.
Services: see the tests below the engine's.
"""
from __future__ import annotations

import numpy as np
import pytest

from reference import Reference, align_rounding
from echospec.services.verifier.engine import (ES_ERR_CAPACITY, ES_ERR_INVALID_ARG, EngineError,
                                               Model)

S, W, SLACK = 4, 28, 16
N_CTX = 64
PROMPT = [11, 200, 37, 5, 91, 150, 64, 3, 250, 18]
N_GEN = 4 * (S + W)                          # 128 tokens: 138 positions, past n_ctx 64
SPEC = dict(arch="llama", matrix_type="Q8_0", n_head=6, n_head_kv=2, n_embd=96, n_ff=256)


def _kv_bytes(info, positions_per_layer: int) -> int:
    return 2 * info.n_layer * positions_per_layer * info.n_head_kv * info.head_dim * 2


@pytest.fixture(scope="module")
def run(tiny_spec):
    """The evicting greedy run: (spec, tokens fed, logits rows [positions, n_vocab], model)."""
    spec = tiny_spec(**SPEC)
    m = Model(spec.path)
    with m.new_session(n_ctx=N_CTX, n_threads=2, swa_slack=SLACK, kv_sinks=S, kv_window=W) as s:
        bound = _kv_bytes(m.info, 64 + (W + SLACK + 63) // 64 * 64)   # one sink block, a ring of 64
        assert s.kv_bytes == bound
        am, lg = s.forward(PROMPT, logits="all")
        rows, fed = [lg], list(PROMPT)
        tok = int(am[-1])
        for _ in range(N_GEN):
            fed.append(tok)
            am, lg = s.forward([tok], logits="all")
            rows.append(lg)
            tok = int(am[-1])
            assert s.kv_bytes == bound
        assert s.n_past == len(PROMPT) + N_GEN > N_CTX
        yield spec, fed, np.concatenate(rows), m
    m.close()


def test_generation_runs_past_n_ctx_in_bounded_memory(run):
    spec, fed, rows, m = run
    with m.new_session(n_ctx=N_CTX, n_threads=1) as plain:
        plain.prefill(fed[:N_CTX])
        with pytest.raises(EngineError) as e:
            plain.forward([fed[N_CTX]])
        assert e.value.status == ES_ERR_CAPACITY
        assert plain.kv_bytes == _kv_bytes(m.info, N_CTX)
    # the evicting session's memory does not grow with the generation: at 1024 positions as at 0
    with m.new_session(n_ctx=N_CTX, n_threads=1, swa_slack=SLACK, kv_sinks=S, kv_window=W) as s:
        before = s.kv_bytes
        s.prefill((fed * 8)[:1024])
        assert s.n_past == 1024 and s.kv_bytes == before
    assert rows.shape == (len(fed), m.info.n_vocab)


def test_logits_match_the_reference_with_the_same_eviction_rule(run):
    spec, fed, rows, m = run
    R = Reference(spec.path, act_quant=True, kv_sinks=S, kv_window=W)
    tol = 1e-4 * float(R.forward(fed).std())
    ref, flips = align_rounding(R, fed, rows, tol, near=1e-4, max_flips=8, near_f16=64 * 2.0 ** -13,
                                max_tries=150)
    err = np.abs(rows - ref).max()
    print(f"{len(fed)} positions: max |engine - ref| {err:.3g} ({err / ref.std():.2e} of std); flips {flips}")
    assert err <= tol, np.abs(rows - ref).max(axis=1)
    # greedy: the engine's tokens are the reference's argmax wherever its margin is clear
    top = np.sort(ref, axis=1)
    clear = (top[:, -1] - top[:, -2]) > 4 * tol
    assert np.array_equal(rows.argmax(axis=1)[clear], ref.argmax(axis=1)[clear])
    assert clear.mean() > 0.9
    # without eviction the reference agrees only before position S + W
    full = Reference(spec.path, act_quant=True).forward(fed)
    dev = np.abs(rows - full).max(axis=1)
    assert dev[:S + W].max() <= 4 * tol
    assert dev[S + W:].min() > 10 * tol, dev[S + W:].min()


def test_decode_rollback_and_bad_parameters(run):
    spec, fed, rows, m = run
    with m.new_session(n_ctx=N_CTX, n_threads=2, swa_slack=SLACK, kv_sinks=S, kv_window=W) as s:
        s.prefill(PROMPT)
        toks, _ = s.decode(fed[len(PROMPT)], N_GEN)        # in the engine, past n_ctx
        assert toks == [int(t) for t in rows[len(PROMPT):].argmax(axis=1)]
        n = s.n_past
        reach = s.min_rollback
        ring = (W + SLACK + 63) // 64 * 64
        assert reach == n - (ring - W + 1)
        with pytest.raises(EngineError, match="out of reach.*KV eviction"):
            s.rollback(reach - 1)
        assert s.n_past == n
        s.rollback(reach)
        a, lg = s.forward(fed[reach:], logits="all")
        assert np.array_equal(lg, rows[reach:])
        s.rollback(0)                                       # a reset always works
        assert s.min_rollback == 0
    for sinks, window in [(4, 0), (-1, 16), (0, -1), (4, 1 << 20)]:
        with pytest.raises(EngineError) as e:
            m.new_session(n_ctx=N_CTX, kv_sinks=sinks, kv_window=window)
        assert e.value.status == ES_ERR_INVALID_ARG and "kv_window" in e.value.message


# -- services: `--kv-sinks 4 --kv-window 64` on the verifier (echospec serve passes them on) -----

SV_S, SV_W, SV_CTX = 4, 64, 64
SV_PROMPT = [21, 22, 23, 24, 25, 26, 27, 28]
# 544 output tokens, past n_ctx 64 and past the 384 positions a session keeps (a sink block and a
# ring of round_up(64 + the verifier's slack 256, 64)): the early positions are overwritten
SV_MAX = 8 * (SV_S + SV_W)


@pytest.fixture(scope="module")
def evict_stack(tiny_spec):
    from echospec.stack import start_stack
    path = tiny_spec(**SPEC).path
    st = start_stack(path, spec=False, n_ctx=SV_CTX, n_threads=1, k=4, kv_sinks=SV_S, kv_window=SV_W)
    yield st, path
    st.stop()


def test_services_report_eviction_and_refuse_speculation(evict_stack):
    import grpc
    from echospec.v1 import (common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc,
                             verifier_pb2 as vpb, verifier_pb2_grpc)
    st, path = evict_stack
    vch, cch = grpc.insecure_channel(st.verifier_target), grpc.insecure_channel(st.target)
    try:
        vstub = verifier_pb2_grpc.VerifierServiceStub(vch)
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(cch)
        cfg = vstub.GetConfig(vpb.GetConfigRequest(), timeout=30)
        assert cfg.kv_eviction == "sinks 4, window 64" and cfg.n_ctx == SV_CTX
        info = stub.GetInfo(cpb.GetInfoRequest(), timeout=30)   # was: GetInfo did not say
        assert info.kv_eviction == cfg.kv_eviction
        assert [v.kv_eviction for v in info.verifiers] == [cfg.kv_eviction]

        def complete(spec):
            return stub.Complete(cpb.CompleteRequest(token_ids=SV_PROMPT, max_tokens=SV_MAX, spec=spec,
                                                     k=4), timeout=120).result

        off = complete(common_pb2.SPEC_MODE_OFF)
        on = complete(common_pb2.SPEC_MODE_ON)
        # the coordinator's gating rule (gating.py) fires on what GetConfig reports
        assert not on.spec_enabled and on.stats.tries == 0
        assert "KV eviction is 'sinks 4, window 64'" in on.spec_reason, on.spec_reason
        assert list(on.token_ids) == list(off.token_ids) and on.text == off.text
        # the generation ran past n_ctx, and is the engine's evicting greedy run
        n_out = len(off.token_ids)
        assert len(SV_PROMPT) + n_out > 384, (n_out, off.finish_reason)
        with Model(path) as m, m.new_session(n_ctx=SV_CTX, n_threads=1, kv_sinks=SV_S,
                                             kv_window=SV_W) as s:
            first = s.prefill(SV_PROMPT)[0]
            rest, _ = s.decode(first, n_out - 1)
        assert [first] + rest == list(off.token_ids)

        # straight to the verifier: it refuses speculation itself, the output unchanged
        def tokens(**kw):
            msgs = list(vstub.GenerateTokens(vpb.GenerateTokensRequest(
                prompt=SV_PROMPT, max_tokens=SV_MAX, **kw), timeout=120))
            return [t for m in msgs for r in m.rounds for t in r.result.tokens], msgs

        plain, _ = tokens()
        spec, msgs = tokens(spec=True, k=4)
        assert spec == plain == list(off.token_ids)
        assert "verifier KV eviction is 'sinks 4, window 64'" in msgs[0].spec_reason, msgs[0].spec_reason
        assert all(r.result.k == 0 for m in msgs for r in m.rounds)
        # a kept session whose early positions were evicted is not reused for them ...
        assert msgs[0].cached_prompt_tokens == 0
        # ... one that evicted nothing is
        short = [31, 32, 33, 34]
        list(vstub.GenerateTokens(vpb.GenerateTokensRequest(prompt=short, max_tokens=4), timeout=60))
        again = list(vstub.GenerateTokens(vpb.GenerateTokensRequest(prompt=short + [35], max_tokens=4),
                                          timeout=60))
        assert again[0].cached_prompt_tokens >= len(short)
    finally:
        vch.close()
        cch.close()


def test_a_resumed_generation_past_n_ctx_continues_exactly(evict_stack):
    # a generation that moves from another evicting verifier after running past n_ctx arrives
    # with prompt + output so far longer than n_ctx (resumed_tokens: the output part); only the
    # prompt's own part is bounded by n_ctx, and the continuation is the uninterrupted run's
    import grpc
    from echospec.v1 import verifier_pb2 as vpb, verifier_pb2_grpc
    st, _ = evict_stack
    with grpc.insecure_channel(st.verifier_target) as ch:
        vstub = verifier_pb2_grpc.VerifierServiceStub(ch)

        def tokens(prompt, n, resumed=0):
            msgs = vstub.GenerateTokens(vpb.GenerateTokensRequest(
                prompt=prompt, max_tokens=n, resumed_tokens=resumed), timeout=120)
            return [t for m in msgs for r in m.rounds for t in r.result.tokens]

        whole = tokens(SV_PROMPT, 300)
        cut = 200                          # 208 positions: past n_ctx 64 and past S + W
        assert len(SV_PROMPT) + cut > SV_CTX and len(whole) == 300
        rest = tokens(SV_PROMPT + whole[:cut], 300 - cut, resumed=cut)
        assert rest == whole[cut:]
        # the prompt's own part is still bounded by n_ctx
        with pytest.raises(grpc.RpcError) as e:
            tokens(list(range(3, 3 + SV_CTX)) + whole[:4], 4, resumed=4)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not fit the context of 64 tokens" in e.value.details()


@pytest.mark.parametrize("argv, env, fragment", [
    (["--kv-window", "64"], {}, "--kv-window / ECHOSPEC_KV_WINDOW 64 needs --kv-sinks"),
    ([], {"ECHOSPEC_KV_WINDOW": "64"}, "needs --kv-sinks / ECHOSPEC_KV_SINKS"),
    (["--kv-sinks", "4"], {}, "--kv-sinks / ECHOSPEC_KV_SINKS 4 needs --kv-window"),
    (["--kv-sinks", "4", "--kv-window", "0"], {}, "ECHOSPEC_KV_WINDOW >= 1"),
    (["--kv-sinks", "-2", "--kv-window", "64"], {}, "the sinks are >= 0 positions"),
    (["--kv-sinks", "4", "--kv-window", "-1"], {}, "the window >= 1"),
    (["--kv-sinks", "4", "--kv-window", str(1 << 20)], {}, "at most 1048576 positions"),
])
def test_bad_eviction_settings_exit_with_a_message(argv, env, fragment, capsys):
    from echospec.services.common.config import VerifierConfig, load
    with pytest.raises(SystemExit) as e:
        load(VerifierConfig, ["--model", "m.gguf", *argv], environ=env, prog="verifier")
    assert e.value.code == 2
    assert fragment in capsys.readouterr().err


def test_eviction_settings_parse_and_serve_refuses_a_window_alone(tmp_path):
    import subprocess
    import sys
    from echospec.services.common.config import VerifierConfig, load
    cfg = load(VerifierConfig, ["--kv-sinks", "4", "--kv-window", "64"], environ={})
    assert (cfg.kv_sinks, cfg.kv_window) == (4, 64)
    cfg = load(VerifierConfig, [], environ={"ECHOSPEC_KV_SINKS": "0", "ECHOSPEC_KV_WINDOW": "128"})
    assert (cfg.kv_sinks, cfg.kv_window) == (0, 128)
    assert (VerifierConfig().kv_sinks, VerifierConfig().kv_window) == (-1, 0)   # off by default
    r = subprocess.run([sys.executable, "-m", "echospec.cli", "serve", "--model", str(tmp_path / "x.gguf"),
                        "--kv-window", "64"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--kv-window 64 needs --kv-sinks" in r.stderr, r.stderr
