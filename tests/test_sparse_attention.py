"""Sparse attention (es_session_params sparse_topk K; the verifier's --sparse-attention), opt-in.

Engine: a call of up to 8 tokens attends, per global layer and KV head, block 0, the two recent
blocks and the K other blocks of the largest key bound (engine_c/src/sparse.c); longer calls and
contexts of at most K + 3 blocks are dense. Checked here through the Python wrapper:
  * a greedy single-step generation past K + 3 blocks is the same on 1 and 2 threads, equal to
    a dense session's rows while the context has at most K + 3 blocks and different after;
  * every step's blocks (es_session_sparse_blocks) are the ones the numpy reference
    (tests/reference.py, sparse_topk) chooses by the rule from its own queries and keys, and its
    logits, attending only those, match the engine's (the dense reference's do not);
  * bad parameters are refused with a message, and so is sparse attention with KV eviction.
Services (`--sparse-attention 1` on the verifier): GetConfig reports it, a speculative request
is refused with the reason naming it (by the coordinator's gating, and by the verifier itself
when asked directly), and the output is the non-speculative output, which is the engine's
sparse greedy run; the setting parses from the flag and the environment and bad values exit 2.
"""
from __future__ import annotations

import numpy as np
import pytest

from echospec.services.verifier.engine import (ES_ERR_INVALID_ARG, ES_ERR_UNSUPPORTED, EngineError,
                                               Model, ffi, lib, sample)

SPEC = dict(arch="llama", matrix_type="Q8_0", n_head=6, n_head_kv=2, n_embd=96, n_ff=256)
K = 1                                   # keeps 4 blocks: sparse from 257 positions on
PROMPT = [11, 200, 37, 5, 91, 150, 64, 3, 250, 18]
N_GEN = 400                             # 410 positions: 7 blocks
N_CTX = 512


def _greedy_rows(m: Model, topk: int, threads: int) -> tuple[list[int], np.ndarray]:
    with m.new_session(n_ctx=N_CTX, n_threads=threads, sparse_topk=topk) as s:
        am, lg = s.forward(PROMPT, logits="all")
        rows, fed = [lg], list(PROMPT)
        tok = int(am[-1])
        for _ in range(N_GEN):
            fed.append(tok)
            am, lg = s.forward([tok], logits="all")
            rows.append(lg)
            tok = int(am[-1])
        return fed, np.concatenate(rows)


def test_engine_sparse_steps_are_deterministic_and_dense_while_short(tiny_spec):
    with Model(tiny_spec(**SPEC).path) as m:
        fed, rows = _greedy_rows(m, K, 1)
        fed2, rows2 = _greedy_rows(m, K, 2)
        assert fed2 == fed and np.array_equal(rows2, rows)
        with m.new_session(n_ctx=N_CTX, n_threads=1) as d:
            _, dense = d.forward(fed, logits="all")
        short = (K + 3) * 64                 # rows whose context has at most K + 3 blocks
        assert np.array_equal(rows[:short], dense[:short])
        differ = sum(not np.array_equal(rows[r], dense[r]) for r in range(short, len(fed)))
        assert differ == len(fed) - short, differ
        # es_decode steps are the same single steps
        with m.new_session(n_ctx=N_CTX, n_threads=2, sparse_topk=K) as s:
            first = s.prefill(PROMPT)[0]
            rest, _ = s.decode(first, N_GEN - 1)
        assert [first] + rest == fed[len(PROMPT):]


def _sampled(m: Model, topk: int, n: int, seed: int, prompt: list[int] = PROMPT) -> list[int]:
    """The engine's sampled run of ``prompt`` (temperature 1, the request's seed): the prompt in
    one call, then single steps."""
    with m.new_session(n_ctx=N_CTX, n_threads=1, sparse_topk=topk) as s:
        _, lg = s.forward(prompt, logits="last")
        out, rng = [], seed
        for _ in range(n):
            tok, rng = sample(lg[-1], temperature=1.0, rng=rng)
            out.append(tok)
            if len(out) < n:
                _, lg = s.forward([tok], logits="last")
        return out


def _engine_blocks(s, layer: int, kv_head: int) -> list[int]:
    """es_session_sparse_blocks: the blocks the session's last call attended there ([]: dense)."""
    buf, n = ffi.new("int32_t[64]"), ffi.new("int32_t *")
    assert lib.es_session_sparse_blocks(s._ptr, layer, kv_head, buf, 64, n) == 0
    return [buf[j] for j in range(n[0])]


def test_engine_matches_the_reference_with_the_same_choice(tiny_spec):
    # the numpy reference (tests/reference.py, sparse_topk) chooses the blocks by the rule itself,
    # from its own queries and F16 keys, and attends only those: every step's choice is the
    # engine's, in every layer and KV head, and every row's logits agree within 1e-4 of their
    # std, which the dense reference's are far from once the context is sparse. F32 weights: the
    # activations are not quantized, so no int8 rounding boundary (reference.py) blurs the check.
    from reference import Reference
    path = tiny_spec(**{**SPEC, "matrix_type": "F32"}).path
    R, R0 = Reference(path, sparse_topk=K), Reference(path)
    with Model(path) as m, m.new_session(n_ctx=N_CTX, n_threads=2, sparse_topk=K) as s:
        c, c0 = R.new_cache(), R0.new_cache()
        _, lg = s.forward(PROMPT, logits="all")
        R.forward(PROMPT, c)
        R0.forward(PROMPT, c0)
        tok, errs, errs0, chosen = int(lg[-1].argmax()), [], [], 0
        for _ in range(N_GEN):
            _, lg = s.forward([tok], logits="all")
            ref, ref0 = R.forward([tok], c)[0], R0.forward([tok], c0)[0]
            for il in range(m.info.n_layer):
                for g in range(m.info.n_head_kv):
                    want = R.last_sparse[il][g] if R.last_sparse[il] else []
                    assert _engine_blocks(s, il, g) == want, (c.n_past, il, g)
                    chosen += bool(want)
            errs.append(np.abs(lg[0] - ref).max() / ref.std())
            if c.n_past > (K + 3) * 64:
                errs0.append(np.abs(lg[0] - ref0).max() / ref0.std())
            tok = int(lg[0].argmax())
    errs, errs0 = np.array(errs), np.array(errs0)
    print(f"{len(errs0)} sparse rows of {len(errs)}, {chosen} choices: max |engine - ref| {errs.max():.2e} of "
          f"std; the dense reference's, on the sparse rows, at least {errs0.min():.2e}")
    assert chosen == len(errs0) * m.info.n_layer * m.info.n_head_kv > 0
    assert errs.max() < 1e-4
    assert errs0.min() > 1e-3


def test_engine_refuses_bad_sparse_parameters(tiny_spec):
    with Model(tiny_spec(**SPEC).path) as m:
        for bad in (-1, 16385):
            with pytest.raises(EngineError) as e:
                m.new_session(n_ctx=N_CTX, sparse_topk=bad)
            assert e.value.status == ES_ERR_INVALID_ARG and "sparse_topk" in e.value.message
        with pytest.raises(EngineError) as e:
            m.new_session(n_ctx=N_CTX, sparse_topk=4, kv_sinks=4, kv_window=64)
        assert e.value.status == ES_ERR_UNSUPPORTED and "KV eviction" in e.value.message


@pytest.fixture(scope="module")
def sparse_stack(tiny_spec):
    from echospec.stack import start_stack
    path = tiny_spec(**SPEC).path
    st = start_stack(path, spec=False, n_ctx=N_CTX, n_threads=1, k=4, sparse_attention=K)
    yield st, path
    st.stop()


def test_services_report_sparse_attention_and_refuse_speculation(sparse_stack):
    import grpc
    from echospec.v1 import (common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc,
                             verifier_pb2 as vpb, verifier_pb2_grpc)
    st, path = sparse_stack
    vch, cch = grpc.insecure_channel(st.verifier_target), grpc.insecure_channel(st.target)
    try:
        vstub = verifier_pb2_grpc.VerifierServiceStub(vch)
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(cch)
        cfg = vstub.GetConfig(vpb.GetConfigRequest(), timeout=30)
        assert cfg.sparse_attention and cfg.kv_eviction == "none"
        assert not cfg.prefix_cache   # no prefix is reused (was: reported true; routing followed it)
        info = stub.GetInfo(cpb.GetInfoRequest(), timeout=30)   # was: GetInfo did not say
        assert info.sparse_attention and [v.sparse_attention for v in info.verifiers] == [True]
        assert info.kv_type == "f16"

        def complete(spec):
            return stub.Complete(cpb.CompleteRequest(token_ids=PROMPT, max_tokens=N_GEN, spec=spec, k=4),
                                 timeout=120).result

        off = complete(common_pb2.SPEC_MODE_OFF)
        on = complete(common_pb2.SPEC_MODE_ON)
        assert not on.spec_enabled and on.stats.tries == 0
        assert "sparse attention" in on.spec_reason, on.spec_reason
        assert list(on.token_ids) == list(off.token_ids) and on.text == off.text
        # the output is the engine's sparse greedy run
        n_out = len(off.token_ids)
        assert len(PROMPT) + n_out > (K + 3) * 64, (n_out, off.finish_reason)
        with Model(path) as m, m.new_session(n_ctx=N_CTX, n_threads=1, sparse_topk=K) as s:
            first = s.prefill(PROMPT)[0]
            rest, _ = s.decode(first, n_out - 1)
        assert [first] + rest == list(off.token_ids)

        # straight to the verifier: it refuses speculation itself, the output unchanged
        def tokens(**kw):
            msgs = list(vstub.GenerateTokens(vpb.GenerateTokensRequest(prompt=PROMPT, max_tokens=N_GEN, **kw),
                                             timeout=120))
            return [t for m in msgs for r in m.rounds for t in r.result.tokens], msgs

        plain, _ = tokens()
        spec, msgs = tokens(spec=True, k=4)
        assert spec == plain == list(off.token_ids)
        assert "verifier uses sparse attention (--sparse-attention 1" in msgs[0].spec_reason, msgs[0].spec_reason
        assert all(r.result.k == 0 for m in msgs for r in m.rounds)
        # the verifier's sessions are sparse ones: a sampled generation (the tiny model's greedy
        # output repeats one token, sparse or not; its sampled one follows the probabilities) is
        # the engine's sparse sampled run, and not the dense one
        sampling = common_pb2.SamplingParams(temperature=1.0, seed=7)
        got, _ = tokens(sampling=sampling)
        with Model(path) as m:
            runs = {topk: _sampled(m, topk, len(got), 7) for topk in (K, 0)}
        assert got == runs[K]
        assert runs[0] != runs[K]
    finally:
        vch.close()
        cch.close()


@pytest.mark.parametrize("argv, env, fragment", [
    (["--sparse-attention", "-1"], {}, "--sparse-attention / ECHOSPEC_SPARSE_ATTENTION -1"),
    ([], {"ECHOSPEC_SPARSE_ATTENTION": "16385"}, "must be in [0, 16384]"),
    (["--sparse-attention", "4", "--kv-sinks", "4", "--kv-window", "64"], {},
     "sparse attention does not combine with KV eviction"),
])
def test_bad_sparse_settings_exit_with_a_message(argv, env, fragment, capsys):
    from echospec.services.common.config import VerifierConfig, load
    with pytest.raises(SystemExit) as e:
        load(VerifierConfig, ["--model", "m.gguf", *argv], environ=env, prog="verifier")
    assert e.value.code == 2
    assert fragment in capsys.readouterr().err


def test_sparse_setting_parses_and_serve_offers_it(tmp_path):
    import subprocess
    import sys
    from echospec.services.common.config import VerifierConfig, load
    assert load(VerifierConfig, ["--sparse-attention", "8"], environ={}).sparse_attention == 8
    assert load(VerifierConfig, [], environ={"ECHOSPEC_SPARSE_ATTENTION": "3"}).sparse_attention == 3
    assert VerifierConfig().sparse_attention == 0                     # off by default
    r = subprocess.run([sys.executable, "-m", "echospec.cli", "serve", "--model", str(tmp_path / "x.gguf"),
                        "--sparse-attention", "-2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--sparse-attention" in r.stderr and "-2" in r.stderr, r.stderr


def test_a_prompt_is_never_cut_by_the_prefix_cache_under_sparse_attention(sparse_stack):
    # a kept session would leave only the prompt's last tokens to prefill, in a piece short
    # enough to attend like a decode step: the same request would then give another output
    # than it does cold. So the verifier reuses no prefix under sparse attention
    import grpc
    from echospec.v1 import common_pb2, verifier_pb2 as vpb, verifier_pb2_grpc
    st, path = sparse_stack
    long_prompt = (PROMPT * 30)[:300]                      # past (K + 3) blocks: sparse steps
    sampling = common_pb2.SamplingParams(temperature=1.0, seed=11)
    ch = grpc.insecure_channel(st.verifier_target)
    try:
        vstub = verifier_pb2_grpc.VerifierServiceStub(ch)

        def run(prompt, n, **kw):
            msgs = list(vstub.GenerateTokens(vpb.GenerateTokensRequest(
                prompt=prompt, max_tokens=n, **kw), timeout=120))
            return [t for m in msgs for r in m.rounds for t in r.result.tokens], msgs[0]

        run(long_prompt[:-3], 2)                           # leaves a session holding 297 + 1
        got, first = run(long_prompt, 16, sampling=sampling)
        assert first.cached_prompt_tokens == 0, first.cached_prompt_tokens
        with Model(path) as m:
            assert got == _sampled(m, K, 16, 11, long_prompt)
    finally:
        ch.close()
