"""Session.forward_tree / Session.keep_path (es_forward_tree, es_session_keep_path): every node
of a token tree gets bitwise the argmax and logits ``forward()`` gives the last token of its
root-to-node path, on any thread count; after ``keep_path`` the session decodes bitwise as one
that ran the path with ``forward()``. Bad trees and paths raise EngineError with the KV cache
unchanged; what the engine does not support (a sliding-window model, KV eviction, sparse
attention) raises ES_ERR_UNSUPPORTED. The engine's own test (engine_c/tests/test_tree.c) also
compares the K and V bytes."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggufgen import write_tiny_model  # noqa: E402

from echospec.services.verifier.engine import (ES_ERR_CAPACITY, ES_ERR_INVALID_ARG, ES_ERR_UNSUPPORTED,
                                               MAX_TREE_NODES, EngineError, Model)


def random_tree(rng: random.Random, n: int, n_vocab: int) -> tuple[list[int], list[int]]:
    """n nodes: a chain one time in four, else mostly children of recent nodes and a few roots."""
    chain = rng.random() < 0.25
    tokens = [rng.randrange(n_vocab) for _ in range(n)]
    parents = []
    for i in range(n):
        if chain:
            parents.append(i - 1)
        elif i == 0 or rng.random() < 0.15:
            parents.append(-1)
        else:
            parents.append(max(-1, i - rng.randint(1, 3)))
    return tokens, parents


def path_of(parents: list[int], i: int) -> list[int]:
    """Node i's path, root first."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def history(n: int, n_vocab: int) -> list[int]:
    return [(p * 37 + 11) % n_vocab for p in range(n)]


def check_tree(s, ref, hist: list[int], tokens: list[int], parents: list[int], keep: int) -> None:
    """The tree on s against each node's chain on ref; then keep node keep's path and decode."""
    s.rollback(0)
    if hist:
        s.forward(hist)
    am, lg = s.forward_tree(tokens, parents, logits="all")
    assert s.n_past == len(hist)
    assert lg.shape == (len(tokens), ref.n_vocab)
    for i in range(len(tokens)):
        path = path_of(parents, i)
        ref.rollback(0)
        ram, rlg = ref.forward(hist + [tokens[j] for j in path], logits="last")
        assert int(am[i]) == int(ram[-1]), f"node {i}"
        assert np.array_equal(lg[i].view(np.uint32), rlg[0].view(np.uint32)), f"node {i} (depth {len(path) - 1})"
    path = path_of(parents, keep)
    s.keep_path(path)
    assert s.n_past == len(hist) + len(path)
    ref.rollback(0)
    ref.forward(hist + [tokens[j] for j in path])
    t = int(am[keep])
    for _ in range(3):
        a1, l1 = s.forward([t], logits="last")
        a2, l2 = ref.forward([t], logits="last")
        assert np.array_equal(l1.view(np.uint32), l2.view(np.uint32))
        assert int(a1[0]) == int(a2[0])
        t = int(a1[0])


@pytest.fixture(scope="module", params=[("llama", "Q4_1"), ("qwen3", "Q8_0"), ("qwen2", "F32")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def model(request, tmp_path_factory):
    arch, mt = request.param
    path = tmp_path_factory.mktemp("tree") / f"{arch}.gguf"
    write_tiny_model(path, arch=arch, matrix_type=mt, seed=7)
    m = Model(str(path))
    yield m
    m.close()


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_tree_equals_chains_tiny(model, n_threads):
    rng = random.Random(1000 + n_threads)
    nv = model.info.n_vocab
    with model.new_session(n_ctx=192, n_threads=n_threads) as s, model.new_session(n_ctx=192, n_threads=1) as ref:
        for hist_len in (0, 7, 60, 70):
            for _ in range(2):
                n = rng.randint(1, 40)
                tokens, parents = random_tree(rng, n, nv)
                check_tree(s, ref, history(hist_len, nv), tokens, parents, rng.randrange(n))


def test_chain_is_the_tree_of_width_one(model):
    nv = model.info.n_vocab
    toks = [(5 * i + 3) % nv for i in range(9)]
    with model.new_session(n_ctx=64, n_threads=2) as s, model.new_session(n_ctx=64, n_threads=2) as ref:
        s.forward([1, 2, 3])
        ref.forward([1, 2, 3])
        am, lg = s.forward_tree(toks, list(range(-1, 8)), logits="all")
        ram, rlg = ref.forward(toks, logits="all")
        assert np.array_equal(am, ram)
        assert np.array_equal(lg.view(np.uint32), rlg.view(np.uint32))
        am_none, _ = s.forward_tree(toks, list(range(-1, 8)))
        assert np.array_equal(am_none, ram)


def test_bad_trees_and_paths(model):
    nv = model.info.n_vocab
    with model.new_session(n_ctx=32, n_threads=1) as s, model.new_session(n_ctx=32, n_threads=1) as ref:
        s.forward([4, 5, 6])
        ref.forward([4, 5, 6])
        cases = [
            ([1, 2, 3], [-1, 1, 0], "parents[1]"),   # its own parent
            ([1, 2, 3], [-1, 2, 0], "parents[1]"),   # a later node
            ([1, 2, 3], [-2, 0, 0], "parents[0]"),
            ([1, 2], [-1], "parents must be"),
            ([], [], "n_nodes"),
            ([1, nv], [-1, 0], "vocabulary"),
            ([1] * (MAX_TREE_NODES + 1), list(range(-1, MAX_TREE_NODES)), "n_nodes"),
        ]
        for tokens, parents, words in cases:
            with pytest.raises(EngineError) as e:
                s.forward_tree(tokens, parents)
            assert e.value.status == ES_ERR_INVALID_ARG and words in e.value.message, (tokens, e.value)
            assert s.n_past == 3
        with pytest.raises(EngineError) as e:
            s.forward_tree([1] * 30, [-1] * 30)
        assert e.value.status == ES_ERR_CAPACITY
        with pytest.raises(EngineError) as e:   # no tree yet
            s.keep_path([0])
        assert e.value.status == ES_ERR_INVALID_ARG and "no tree" in e.value.message
        s.forward_tree([7, 8, 9, 10], [-1, 0, -1, 2])
        for nodes, words in (([2, 1], "not a child"), ([1], "not a root"), ([0, 1, 2], "not a child"),
                             ([0, 9], "node"), ([[0]], "1-D")):
            with pytest.raises(EngineError) as e:
                s.keep_path(nodes)
            assert e.value.status == ES_ERR_INVALID_ARG and words in e.value.message, (nodes, e.value)
            assert s.n_past == 3
        s.keep_path([2, 3])   # the tree survived the bad paths
        ref.forward([9, 10])
        a, la = s.forward([11], logits="last")
        b, lb = ref.forward([11], logits="last")
        assert np.array_equal(la.view(np.uint32), lb.view(np.uint32))
        s.forward_tree([7, 8], [-1, 0])
        s.forward([1])
        with pytest.raises(EngineError):   # another call dropped the tree
            s.keep_path([0])


def test_unsupported_sessions(tmp_path):
    path = tmp_path / "llama.gguf"
    write_tiny_model(path, arch="llama", matrix_type="F32", seed=3)
    with Model(str(path)) as m:
        for kwargs, words in (({"kv_sinks": 4, "kv_window": 32}, "eviction"), ({"sparse_topk": 1}, "sparse")):
            with m.new_session(n_ctx=64, n_threads=1, **kwargs) as s:
                with pytest.raises(EngineError) as e:
                    s.forward_tree([1, 2], [-1, 0])
                assert e.value.status == ES_ERR_UNSUPPORTED and words in e.value.message
    path = tmp_path / "hd32.gguf"      # a Q8_0 KV cache needs head_dim % 32 == 0
    write_tiny_model(path, arch="llama", matrix_type="F32", seed=3, head_dim=32)
    with Model(str(path)) as m, m.new_session(n_ctx=64, n_threads=1, kv_type="q8_0") as s:
        with pytest.raises(EngineError) as e:
            s.forward_tree([1, 2], [-1, 0])
        assert e.value.status == ES_ERR_UNSUPPORTED and "Q8_0 KV cache" in e.value.message
        assert s.n_past == 0


def test_tree_equals_chains_smollm2(smollm2_path):
    """The real model at 2 threads: trees after a prompt that crosses KV blocks, and kept paths."""
    rng = random.Random(7)
    with Model(smollm2_path) as m:
        nv = m.info.n_vocab
        with m.new_session(n_ctx=512, n_threads=2) as s, m.new_session(n_ctx=512, n_threads=2) as ref:
            for hist_len, n in ((50, 16), (120, 24)):
                hist = [rng.randrange(nv) for _ in range(hist_len)]
                tokens, parents = random_tree(rng, n, nv)
                check_tree(s, ref, hist, tokens, parents, rng.randrange(n))
