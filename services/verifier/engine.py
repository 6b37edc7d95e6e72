"""Thin Python wrapper over the echospec C engine (the one importer of ``echospec._engine``).

Shapes and dtypes follow engine_c/include/echospec_engine.h:
    tokens  int32 [n_tokens]
    argmax  int32 [n_tokens]            greedy next token after each position
    logits  float32 [rows, n_vocab]     rows = 1 ("last") or n_tokens ("all")

Errors raise :class:`EngineError` carrying the C status code, its name and the
engine's message. After a failed call the KV cache is unchanged.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn, Sequence

import numpy as np

from echospec._engine import ffi, lib

# The es_status values and names, read from the C header through cffi (the one source).
STATUS_NAMES = {getattr(lib, n): n for n in dir(lib) if n == "ES_OK" or n.startswith("ES_ERR_")}
ES_ERR_IO, ES_ERR_FORMAT, ES_ERR_UNSUPPORTED = lib.ES_ERR_IO, lib.ES_ERR_FORMAT, lib.ES_ERR_UNSUPPORTED
ES_ERR_MISSING_TENSOR, ES_ERR_INVALID_ARG = lib.ES_ERR_MISSING_TENSOR, lib.ES_ERR_INVALID_ARG
ES_ERR_CAPACITY, ES_ERR_NOMEM, ES_ERR_INTERNAL = lib.ES_ERR_CAPACITY, lib.ES_ERR_NOMEM, lib.ES_ERR_INTERNAL
ES_ERR_BAD_WEIGHTS = lib.ES_ERR_BAD_WEIGHTS
# es_session_new's limits (echospec_engine.h)
MIN_CTX, MAX_CTX, MAX_THREADS = lib.ES_MIN_CTX, lib.ES_MAX_CTX, lib.ES_MAX_THREADS
# positions a sliding-window layer's ring keeps beyond the window when a session sets none
SWA_SLACK = lib.ES_SWA_SLACK
EVICT_MAX_POS = lib.ES_EVICT_MAX_POS   # KV eviction: the positions a session may reach
MAX_TREE_NODES = lib.ES_MAX_TREE_NODES   # nodes of one forward_tree call
TOKEN_EMBD = lib.ES_TOKEN_EMBD   # forward_embd: the row takes the next given embedding

_LOGITS_MODES = {"none": 0, "last": 1, "all": 2}


def _logits_buffer(logits: str, rows: int, n_vocab: int) -> tuple[int, np.ndarray | None]:
    """(logits_mode, the buffer a forward call writes its logits to): none, the last row
    [1, n_vocab] or every row [rows, n_vocab]."""
    mode = _LOGITS_MODES[logits]
    if mode == 0:
        return mode, None
    return mode, np.empty((1 if mode == 1 else rows, n_vocab), dtype=np.float32)
# the KV cache types (es_kv_type), as the services' kv_type setting names them
KV_TYPES = {"f16": lib.ES_KV_F16, "q8_0": lib.ES_KV_Q8_0}


class VerifyRun(NamedTuple):
    """Session.verify_run's result: the tokens of its rounds (each round's kept drafts, then its
    bonus token), and per round the drafts verified (k) and kept (r), the forward's ms and the KV
    rollback's (0 where every draft was kept). A tuple: made after each run, when the
    interpreter's code and data have left the caches, where a frozen dataclass costs more."""

    tokens: list
    k: list
    r: list
    ms: list
    rollback_ms: list


class _RunBuffers:
    """A session's es_verify_run arguments and result arrays, for runs of up to ``cap`` tokens."""

    def __init__(self, cap: int):
        self.cap = cap
        self.args = ffi.new("es_verify_run_args *")
        self.drafts = ffi.new("int32_t[]", cap)
        self.tokens, self.round_k, self.round_r = (ffi.new("int32_t[]", cap) for _ in range(3))
        self.ms, self.rollback_ms = ffi.new("float[]", cap), ffi.new("float[]", cap)
        self.interrupt: Any = None   # the interrupt pointer last checked (a scheduler's, each call)
        a = self.args
        a.tokens_out, a.round_k, a.round_r = self.tokens, self.round_k, self.round_r
        a.ms_out, a.rollback_ms_out = self.ms, self.rollback_ms


class EngineError(RuntimeError):
    """A failed engine call.

    Attributes:
        status: the C status code (int, one of the ES_ERR_* values).
        name: its name, e.g. "ES_ERR_CAPACITY".
        message: the engine's message naming the field or argument.
    """

    def __init__(self, status: int, message: str):
        self.status = int(status)
        self.name = STATUS_NAMES.get(self.status, f"ES_STATUS_{status}")
        self.message = message
        super().__init__(f"{self.name}: {message}")


@dataclass(frozen=True)
class ModelInfo:
    """Hyperparameters read from the GGUF metadata (see es_model_info)."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_freq_base: float
    rope_dim: int
    rope_neox: bool
    norm_eps: float
    tied_output: bool
    weight_bytes: int           # bytes a decode step reads (with n_expert_used of n_expert experts)
    file_weight_bytes: int      # bytes of every tensor the forward pass uses
    n_expert: int = 0           # mixture of experts: experts per layer (0: dense)
    n_expert_used: int = 0      # experts each token runs
    n_ff_exp: int = 0           # one expert's SwiGLU size
    rope_sections: tuple = (0, 0, 0, 0)   # Qwen3-VL's multimodal RoPE (t, h, w, 4th); zeros: plain RoPE
    n_deepstack: int = 0        # Qwen3-VL: layers fed the vision tower's deepstack features
    n_swa: int = 0              # Gemma 3: sliding window of the local layers (0: none)
    n_swa_layers: int = 0       # layers with the sliding window
    rope_freq_base_swa: float = 0.0   # their RoPE base
    rope_freq_scale: float = 1.0      # RoPE position scale of the global layers


def simd_name() -> str:
    """The SIMD path compiled into the engine ("avx512", "avx2", "neon-dotprod", "neon", "scalar")."""
    return ffi.string(lib.es_simd_name()).decode()


class Model:
    """A GGUF model loaded into the engine (read-only, shareable by sessions).

    Args:
        path: GGUF file (versions 2 and 3; llama, qwen2, qwen3, qwen3moe, qwen3vl,
            qwen3vlmoe (of Qwen3-VL, the text decoder) and gemma3 architectures).
        repack: copy the Q4_0 / Q4_1 / Q8_0 matrices into the SIMD kernels'
            layout (the same bytes again; the mapped pages are released).
            False: keep them as mapped, for a load that only validates the
            file or reads its metadata; forward passes are then much slower
            (scalar kernels for those types) but give bitwise the same logits.
        check_weights: the full weights check (ES_MODEL_CHECK_WEIGHTS): decode every value
            of every quantized tensor. Every block scale and every float value is checked
            at any load.
    Raises:
        EngineError: ES_ERR_IO, ES_ERR_FORMAT, ES_ERR_UNSUPPORTED,
            ES_ERR_MISSING_TENSOR with a message naming the field,
            ES_ERR_BAD_WEIGHTS naming the tensor and block of a NaN or infinite
            value, or ES_ERR_NOMEM when the repacked copy can not be made.
    """

    def __init__(self, path: str, repack: bool = True, check_weights: bool = False):
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise TypeError(f"path must be a str, bytes or os.PathLike, not {type(path).__name__}")
        raw = os.fsencode(path)   # file names that are not UTF-8 round-trip (surrogateescape)
        self.path = os.fsdecode(raw)
        if b"\x00" in raw:
            raise EngineError(ES_ERR_INVALID_ARG, "model path contains a NUL character")
        out = ffi.new("es_model **")
        err = ffi.new("char[512]")
        params = ffi.new("es_model_params *")
        params.flags = ((0 if repack else lib.ES_MODEL_NO_REPACK)
                        | (lib.ES_MODEL_CHECK_WEIGHTS if check_weights else 0))
        st = lib.es_model_load(raw, params, out, err, 512)
        if st != 0:
            raise EngineError(st, ffi.string(err).decode(errors="replace"))
        self._ptr = out[0]
        self._sessions: set[Session] = set()
        self._lock = threading.Lock()
        ci = ffi.new("es_model_info *")
        lib.es_model_get_info(self._ptr, ci)
        self.info = ModelInfo(
            arch=ffi.string(ci.arch).decode(), n_vocab=ci.n_vocab, n_ctx_train=ci.n_ctx_train,
            n_embd=ci.n_embd, n_layer=ci.n_layer, n_head=ci.n_head, n_head_kv=ci.n_head_kv,
            head_dim=ci.head_dim, n_ff=ci.n_ff, rope_freq_base=ci.rope_freq_base,
            rope_dim=ci.rope_dim, rope_neox=bool(ci.rope_neox), norm_eps=ci.norm_eps,
            tied_output=bool(ci.tied_output), weight_bytes=ci.weight_bytes,
            file_weight_bytes=ci.file_weight_bytes, n_expert=ci.n_expert, n_expert_used=ci.n_expert_used,
            n_ff_exp=ci.n_ff_exp, rope_sections=tuple(ci.rope_sections), n_deepstack=ci.n_deepstack,
            n_swa=ci.n_swa, n_swa_layers=ci.n_swa_layers, rope_freq_base_swa=ci.rope_freq_base_swa,
            rope_freq_scale=ci.rope_freq_scale)

    def new_session(self, n_ctx: int = 0, n_threads: int = 0, swa_slack: int = 0,
                    swa_full: bool = False, kv_sinks: int = 0, kv_window: int = 0,
                    sparse_topk: int = 0, kv_type: str = "f16") -> "Session":
        """Create a session with its own KV cache.

        A model with a sliding window (Gemma 3's local layers, ``info.n_swa``) keeps each local
        layer's KV in a ring of round_up(n_swa + swa_slack, 64) positions (at most n_ctx), so
        the cache's size follows the global layers; a session can then roll back at least
        ``swa_slack`` positions from the furthest it has written (``min_rollback``), or to 0.

        Args:
            n_ctx: KV capacity in tokens (0: min(n_ctx_train, 4096)).
            n_threads: worker threads including the caller (0: all online cores).
            swa_slack: positions the rings keep beyond the window (0: SWA_SLACK); also the most
                tokens one forward piece writes (a longer forward runs in pieces, same bits).
            swa_full: keep every position in every layer (any rollback; more memory).
            kv_sinks: KV eviction: the first positions every query attends (attention sinks).
            kv_window: KV eviction: the most recent positions every query attends; 0: none.
                With it each layer keeps the sinks plus a ring of round_up(kv_window +
                swa_slack, 64) positions, a session runs past n_ctx, positions stay absolute
                (es_session_params in the header), and ``min_rollback`` says how far back it
                can go once positions were evicted.
            sparse_topk: sparse attention: a call of up to 8 tokens (decode, verify) attends, per
                global layer and KV head, the first block of 64 positions, the two recent blocks
                and the ``sparse_topk`` other blocks of the largest key bound, chosen once for
                the call (es_session_params in the header); 0: full attention. Deterministic,
                but a verify over n tokens is then not n decode steps (no exact speculation).
            kv_type: the KV cache's element type, "f16" (the default) or "q8_0" (ggml's Q8_0:
                34 bytes per 32 values; needs a head_dim that is a multiple of 32). Exact
                relative to itself: a verify over n tokens is still n decode steps, bitwise.
        Raises:
            EngineError: ES_ERR_INVALID_ARG, ES_ERR_NOMEM or ES_ERR_INTERNAL; ES_ERR_UNSUPPORTED
                for KV eviction on a model with sliding-window layers, or with sparse_topk,
                and for kv_type "q8_0" on a head_dim that is not a multiple of 32;
                ES_ERR_INVALID_ARG for a kv_type not in KV_TYPES.
        """
        if self._ptr is None:
            raise EngineError(ES_ERR_INVALID_ARG, "model is closed")
        s = Session(self, n_ctx, n_threads, swa_slack, swa_full, kv_sinks, kv_window, sparse_topk, kv_type)
        with self._lock:
            self._sessions.add(s)
        return s

    def _forget(self, s: "Session") -> None:
        with self._lock:
            self._sessions.discard(s)

    def close(self) -> None:
        """Free the model and every session still open on it. Idempotent."""
        with self._lock:
            sessions = list(self._sessions)
        for s in sessions:
            s.close()
        if self._ptr is not None:
            lib.es_model_free(self._ptr)
            self._ptr = None

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Session:
    """One KV sequence on a model. Use from one thread at a time."""

    def __init__(self, model: Model, n_ctx: int, n_threads: int, swa_slack: int = 0, swa_full: bool = False,
                 kv_sinks: int = 0, kv_window: int = 0, sparse_topk: int = 0, kv_type: str = "f16"):
        self.model = model
        self.n_vocab = model.info.n_vocab
        p = ffi.new("es_session_params *")
        p.n_ctx = _int32(n_ctx, "n_ctx")
        p.n_threads = _int32(n_threads, "n_threads")
        p.swa_slack = _int32(swa_slack, "swa_slack")
        if not isinstance(swa_full, (bool, np.bool_)):
            raise TypeError(f"swa_full must be True or False, not {swa_full!r}")
        p.swa_full = int(swa_full)
        p.kv_sinks = _int32(kv_sinks, "kv_sinks")
        p.kv_window = _int32(kv_window, "kv_window")
        p.sparse_topk = _int32(sparse_topk, "sparse_topk")
        p.kv_type = kv_type_code(kv_type)
        out = ffi.new("es_session **")
        err = ffi.new("char[512]")
        st = lib.es_session_new(model._ptr, p, out, err, 512)
        if st != 0:
            raise EngineError(st, ffi.string(err).decode(errors="replace"))
        self._ptr = out[0]
        # the thread count the next call uses, kept here: every cffi call releases and retakes
        # the GIL, and the scheduler sets the count before each forward (see the setter)
        self._threads = lib.es_session_threads(self._ptr)
        self._run_bufs: _RunBuffers | None = None   # verify_run's arguments, kept between calls

    def _check(self) -> None:
        if self._ptr is None:
            raise EngineError(ES_ERR_INVALID_ARG, "session is closed")

    def _raise(self, st: int) -> None:
        raise EngineError(st, ffi.string(lib.es_session_last_error(self._ptr)).decode(errors="replace"))

    @property
    def n_past(self) -> int:
        """Positions held in the KV cache (tokens)."""
        self._check()
        return lib.es_session_n_past(self._ptr)

    @property
    def experts_read(self) -> int:
        """Expert matrices (one expert's gate, up and down count once) the last forward read, over all
        layers; 0 for a dense model. A verify of K drafts reads the union of its K + 1 rows' choices."""
        self._check()
        return lib.es_session_experts_read(self._ptr)

    @property
    def n_ctx(self) -> int:
        """KV capacity (tokens)."""
        self._check()
        return lib.es_session_n_ctx(self._ptr)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV cache (K and V of every layer) allocated at creation: n_ctx positions
        per global layer, the ring's per sliding-window layer (see Model.new_session)."""
        self._check()
        return lib.es_session_kv_bytes(self._ptr)

    @property
    def min_rollback(self) -> int:
        """The smallest n_past > 0 ``rollback`` can reach now, 0 when it can reach any (rollback
        to 0 always works). Not 0 only when sliding-window rings have wrapped."""
        self._check()
        return lib.es_session_min_rollback(self._ptr)

    @property
    def pool_threads(self) -> int:
        """Threads of the session's pool, the caller included (fixed at creation)."""
        self._check()
        return lib.es_session_pool_threads(self._ptr)

    @property
    def threads(self) -> int:
        """Threads the next call uses (the whole pool unless set lower)."""
        self._check()
        return self._threads

    @threads.setter
    def threads(self, n: int) -> None:
        """Run the next calls on ``n`` of the pool's threads (es_session_set_threads).

        The pool's other workers sleep. Results are bitwise the same for any count;
        forward_batch uses its first item's count.
        Raises:
            EngineError: ES_ERR_INVALID_ARG when n is not in [1, pool_threads]
                (the count is then unchanged).
        """
        self._check()
        if type(n) is int and n == self._threads:   # no C call (no GIL hand-off) between two forwards
            return
        v = _int32(n, "threads")
        st = lib.es_session_set_threads(self._ptr, v)
        if st != 0:
            self._raise(st)
        self._threads = v

    def forward(self, tokens: Sequence[int] | np.ndarray, logits: str = "none",
                positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Append ``tokens`` to the sequence and run the model over them.

        Args:
            tokens: int token ids, length N >= 1, each in [0, n_vocab).
            logits: "none", "last" (float32 [1, n_vocab]) or "all" (float32 [N, n_vocab]).
            positions: None (each token's KV position), or int [N, 3]: the (t, h, w) positions of
                Qwen3-VL's multimodal RoPE (models without sections rotate by t).
        Returns:
            (argmax int32 [N], logits or None). argmax[i] is the greedy token
            after position n_past + i.
        Raises:
            EngineError: ES_ERR_INVALID_ARG (empty, token out of range),
                ES_ERR_CAPACITY (n_past + N > n_ctx), ES_ERR_BAD_WEIGHTS (a logits row holds
                a NaN: no argmax is made up). The KV cache is then unchanged.
        """
        self._check()
        _check_logits(logits)
        tok = self._tokens(tokens)
        n = tok.size
        am = np.empty(max(n, 1), dtype=np.int32)
        mode, out = _logits_buffer(logits, max(n, 1), self.n_vocab)
        if positions is None:
            st = lib.es_forward(
                self._ptr, ffi.from_buffer("int32_t[]", tok) if n else ffi.NULL, n,
                ffi.from_buffer("int32_t[]", am),
                ffi.from_buffer("float[]", out) if out is not None else ffi.NULL, mode)
        else:
            pos = np.ascontiguousarray(positions, dtype=np.int64)
            if pos.shape != (n, 3) or (pos.size and (pos.min() < 0 or pos.max() > np.iinfo(np.int32).max)):
                raise EngineError(ES_ERR_INVALID_ARG, f"positions must be non-negative int32 of shape ({n}, 3), "
                                  f"got shape {tuple(pos.shape)}")
            pos32 = pos.astype(np.int32)
            st = lib.es_forward_positions(
                self._ptr, ffi.from_buffer("int32_t[]", tok) if n else ffi.NULL, n,
                ffi.from_buffer("int32_t[]", pos32), ffi.from_buffer("int32_t[]", am),
                ffi.from_buffer("float[]", out) if out is not None else ffi.NULL, mode)
        if st != 0:
            self._raise(st)
        return am[:n], out

    def forward_embd(self, tokens: Sequence[int] | np.ndarray, positions: np.ndarray,
                     embd: np.ndarray, deepstack: np.ndarray | None,
                     logits: str = "last") -> tuple[np.ndarray, np.ndarray | None]:
        """``forward`` with some rows' inputs given as embeddings (es_forward_embd): a token
        TOKEN_EMBD (-1) takes the next row of ``embd``; ``deepstack`` [n_deepstack, n_rows,
        n_embd] (or None) is added after the first text layers at those rows.

        Raises:
            EngineError: as ``forward``; ES_ERR_INVALID_ARG when the TOKEN_EMBD count is not
                len(embd) or the shapes do not agree. The KV cache is then unchanged.
        """
        self._check()
        _check_logits(logits)
        tok = self._tokens(tokens)
        n = tok.size
        e = np.ascontiguousarray(embd, dtype=np.float32)
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        if pos.shape != (n, 3) or (pos.size and (pos.min() < 0 or pos.max() > np.iinfo(np.int32).max)):
            raise EngineError(ES_ERR_INVALID_ARG, f"positions must be non-negative int32 of shape ({n}, 3), "
                              f"got shape {tuple(pos.shape)}")
        pos32 = pos.astype(np.int32)
        if e.ndim != 2:
            raise EngineError(ES_ERR_INVALID_ARG, f"embd must be 2-D, got shape {e.shape}")
        ds = None if deepstack is None else np.ascontiguousarray(deepstack, dtype=np.float32)
        if ds is not None and (ds.ndim != 3 or ds.shape[1:] != e.shape):
            raise EngineError(ES_ERR_INVALID_ARG, f"deepstack must be [n, {e.shape[0]}, {e.shape[1]}], "
                              f"got shape {ds.shape}")
        am = np.empty(max(n, 1), dtype=np.int32)
        mode, out = _logits_buffer(logits, max(n, 1), self.n_vocab)
        st = lib.es_forward_embd(
            self._ptr, ffi.from_buffer("int32_t[]", tok) if n else ffi.NULL, n,
            ffi.from_buffer("int32_t[]", pos32),
            ffi.from_buffer("float[]", e) if e.size else ffi.NULL, int(e.shape[0]),
            ffi.from_buffer("float[]", ds) if ds is not None and ds.size else ffi.NULL,
            0 if ds is None else int(ds.shape[0]),
            ffi.from_buffer("int32_t[]", am),
            ffi.from_buffer("float[]", out) if out is not None else ffi.NULL, mode)
        if st != 0:
            self._raise(st)
        return am[:n], out

    def forward_tree(self, tokens: Sequence[int] | np.ndarray, parents: Sequence[int] | np.ndarray,
                     logits: str = "none") -> tuple[np.ndarray, np.ndarray | None]:
        """Verify a token tree in one forward pass (es_forward_tree).

        Node i (``tokens[i]``) follows node ``parents[i]``, or the last cached position when
        ``parents[i]`` is -1; parents precede children. Node i sits at position
        n_past + depth(i) and attends the cache and its ancestors only, so its argmax and logits
        are bitwise those ``forward()`` gives the last token of its root-to-node path. A chain
        (``parents[i] = i - 1``) is the tree of width 1.

        Example: tokens [a, b, c, d], parents [-1, 0, 0, 2] is the tree a -> b, a -> c -> d;
        argmax[3] is the greedy token after the path a, c, d.

        Args:
            tokens: int token ids, N in [1, MAX_TREE_NODES], each in [0, n_vocab).
            parents: int [N], parents[i] in [-1, i).
            logits: "none", "last" (float32 [1, n_vocab], node N - 1) or "all" (float32 [N, n_vocab]).
        Returns:
            (argmax int32 [N], logits or None).
        The KV cache: n_past does not move; the nodes wait in their slots for ``keep_path``
        (any other forward call or a rollback drops them).
        Raises:
            EngineError: ES_ERR_INVALID_ARG (N out of range, a parent not -1 or an earlier node, a
                token out of range), ES_ERR_CAPACITY (n_past + N > n_ctx), ES_ERR_UNSUPPORTED (KV
                eviction, sparse attention, a sliding-window model), ES_ERR_BAD_WEIGHTS. The KV
                cache is then unchanged.
        """
        self._check()
        _check_logits(logits)
        tok = self._tokens(tokens)
        n = tok.size
        par = np.asarray(parents)
        if par.shape != (n,) or (n and not np.issubdtype(par.dtype, np.integer)):
            raise EngineError(ES_ERR_INVALID_ARG, f"parents must be {n} integers (one per token), "
                              f"got shape {par.shape} of {par.dtype}")
        if n and (int(par.min()) < -1 or int(par.max()) >= n):
            bad = next(i for i, p in enumerate(par.tolist()) if p < -1 or p >= n)
            raise EngineError(ES_ERR_INVALID_ARG, f"parents[{bad}] = {int(par[bad])}: a node's parent is -1 "
                              f"or an earlier node")
        par32 = np.ascontiguousarray(par.astype(np.int32))
        am = np.empty(max(n, 1), dtype=np.int32)
        mode, out = _logits_buffer(logits, max(n, 1), self.n_vocab)
        args = (self._ptr, ffi.from_buffer("int32_t[]", tok) if n else ffi.NULL,
                ffi.from_buffer("int32_t[]", par32) if n else ffi.NULL, n, ffi.from_buffer("int32_t[]", am),
                ffi.from_buffer("float[]", out) if out is not None else ffi.NULL, mode)
        t0 = time.perf_counter()
        st = lib.es_forward_tree(*args)
        _calls.ms = (time.perf_counter() - t0) * 1e3
        if st != 0:
            self._raise(st)
        return am[:n], out

    def keep_path(self, nodes: Sequence[int] | np.ndarray) -> None:
        """Keep one root-to-node path of the tree ``forward_tree`` just verified (es_session_keep_path).

        ``nodes[0]`` is a root and ``nodes[j]`` a child of ``nodes[j - 1]``. Their K and V move to
        positions n_past .. n_past + len - 1 and n_past advances by len: the KV cache is then
        bitwise that of ``forward()`` over the path's tokens. The other nodes are dropped; an
        empty path keeps none. The tree is gone after a successful call.

        Args:
            nodes: int node indices of the path, root first (length 0 .. N).
        Raises:
            EngineError: ES_ERR_INVALID_ARG when the last call was not a successful forward_tree
                (or the session rolled back since), or the nodes are not such a path; the KV
                cache and the tree are then unchanged.
        """
        self._check()
        arr = np.asarray(nodes)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise EngineError(ES_ERR_INVALID_ARG, f"nodes must be a 1-D sequence of integers, got shape "
                              f"{arr.shape} of {arr.dtype}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= MAX_TREE_NODES):
            raise EngineError(ES_ERR_INVALID_ARG, f"nodes must be node indices in [0, {MAX_TREE_NODES}), "
                              f"got {arr.tolist()}")
        n32 = np.ascontiguousarray(arr.astype(np.int32))
        st = lib.es_session_keep_path(self._ptr, ffi.from_buffer("int32_t[]", n32) if n32.size else ffi.NULL,
                                      n32.size)
        if st != 0:
            self._raise(st)

    def prefill(self, tokens: Sequence[int] | np.ndarray, logits: bool = False
                ) -> tuple[int, np.ndarray | None]:
        """Append ``tokens`` and run the model, with the output head on the last position only.

        Args:
            tokens: int token ids, length N >= 1, each in [0, n_vocab).
            logits: also return the last position's logits (float32 [1, n_vocab]).
        Returns:
            (greedy token after the last position, logits or None); bitwise what
            forward() gives for that position.
        Raises:
            TypeError: logits is not a bool (e.g. forward()'s "none"/"last"/"all").
            EngineError: as forward(); the KV cache is then unchanged.
        """
        self._check()
        if not isinstance(logits, (bool, np.bool_)):
            raise TypeError(f"prefill's logits must be True or False, not {logits!r} (it returns the last "
                            f"position's logits only; forward() takes 'none', 'last' or 'all')")
        tok = self._tokens(tokens)
        am = np.empty(1, dtype=np.int32)
        out = np.empty((1, self.n_vocab), dtype=np.float32) if logits else None
        st = lib.es_forward_last(
            self._ptr, ffi.from_buffer("int32_t[]", tok) if tok.size else ffi.NULL, tok.size,
            ffi.from_buffer("int32_t[]", am), ffi.from_buffer("float[]", out) if out is not None else ffi.NULL)
        if st != 0:
            self._raise(st)
        return int(am[0]), out

    def decode(self, token: int, max_steps: int, stop_ids: Sequence[int] = (),
               interrupt: Any = None) -> tuple[list[int], list[float]]:
        """Greedy decoding in the engine (es_decode): up to ``max_steps`` one-token steps, each fed
        the previous step's argmax, with no return to Python between them.

        Args:
            token: the first step's token (not yet in the KV cache).
            max_steps: >= 1; n_past + max_steps must fit in n_ctx.
            stop_ids: the run ends after the step that produces one of them (EOS).
            interrupt: None, or an ``ffi.new("int32_t *")`` another thread may set to
                non-zero: the run ends after the step that is running (at least one runs).
        Returns:
            (tokens, ms): the steps' greedy tokens, bitwise those of one forward() per step,
            and each step's wall time. The KV cache then holds ``token`` and every returned
            token but the last.
        Raises:
            EngineError: bad arguments, a run past n_ctx, or a step's own failure; the KV
                cache is then as before the call (steps done before a failing one are rolled back).
        """
        r = decode_batch([(self, token, max_steps, stop_ids)], interrupt)[0]
        if isinstance(r, EngineError):
            raise r
        return r

    def verify_run(self, token: int, drafts: Sequence[int], k: int, max_out: int, stop_ids: Sequence[int] = (),
                   max_ms: float = 0.0, interrupt: Any = None) -> "VerifyRun":
        """Speculative rounds over a known draft sequence in the engine (es_verify_run), with no
        return to Python between them.

        Round j verifies [pending] + the next k_j drafts (k_j = min(k, drafts left, max_out - tokens
        so far - 1, n_ctx - n_past - 1); pending is ``token`` in round 0), keeps the longest prefix
        greedy decoding agrees with, rolls the KV cache back over the rest and yields those drafts
        and the bonus token. The next round runs only while every draft was kept and the bonus is
        the next draft, no yielded token is in ``stop_ids``, ``max_ms`` (0: no limit) has not passed
        and ``interrupt`` (an ``ffi.new("int32_t *")`` another thread may set) is 0.

        Returns:
            VerifyRun: the tokens (bitwise those of the caller's verify loop and of greedy
            decoding), each round's (k, r), forward ms and rollback ms. The KV cache then holds
            ``token`` and every returned token but the last.
        Any max_out that fits in int32 is taken: the run's arrays are as long as it can yield, at
        most min(max_out, len(drafts) + 1, n_ctx - n_past) tokens.

        Raises:
            EngineError: bad arguments (an empty drafts, k < 1, max_out < 2, a token, k, max_out or
                stop id that is not an int32, a token out of range, max_ms not a number, no room
                for a round of one draft, on a session whose sliding-window rings wrap a round of
                more drafts than they can roll back), a session with KV eviction or sparse
                attention (ES_ERR_UNSUPPORTED), both before any round; a round's own failure, after
                which the KV cache is rolled back to where it was before the call.
            TypeError: interrupt is not None or an ``int32_t *`` cdata (nothing runs).
        """
        self._check()
        d = self._tokens(drafts)
        tok, k, max_out = _int32(token, "token"), _int32(k, "k"), _int32(max_out, "max_out")
        if isinstance(stop_ids, (int, np.integer)):
            raise EngineError(ES_ERR_INVALID_ARG, f"stop_ids must be a sequence of token ids, not {stop_ids!r}")
        stops = [_int32(t, "stop id") for t in stop_ids]
        if isinstance(max_ms, bool) or not isinstance(max_ms, (int, float, np.integer, np.floating)) \
                or max_ms != max_ms:
            raise EngineError(ES_ERR_INVALID_ARG, f"max_ms must be a number of ms (<= 0: no limit), not {max_ms!r}")
        b = self._run_bufs
        if interrupt is not None and (b is None or interrupt is not b.interrupt) and not (
                isinstance(interrupt, ffi.CData)
                and ffi.typeof(interrupt).kind in ("pointer", "array")
                and ffi.typeof(interrupt).item is ffi.typeof("int32_t")
                and interrupt != ffi.NULL):
            raise TypeError(f"interrupt must be None or an ffi.new('int32_t *'), not {interrupt!r:.80}")
        # the arrays hold the drafts and what the run can write (es_verify_run_args: n_max <=
        # min(max_out, drafts + 1)), not max_out of each; kept for the next call (a run's
        # Python is a share of every round it verifies)
        n = max(1, min(max_out, d.size + 1), d.size)
        if b is None or b.cap < n:
            b = self._run_bufs = _RunBuffers(max(n, 2 * b.cap if b is not None else 64))
        b.interrupt = interrupt
        a = b.args
        if d.size:
            ffi.memmove(b.drafts, d, 4 * d.size)
        st_ids = ffi.new("int32_t[]", stops) if stops else ffi.NULL
        a.token, a.drafts, a.n_drafts, a.k, a.max_out = tok, b.drafts if d.size else ffi.NULL, d.size, k, max_out
        a.max_ms, a.stop_ids, a.n_stop = float(max_ms), st_ids, len(stops)
        a.interrupt = interrupt if interrupt is not None else ffi.NULL
        # no other C call comes between the events a generation hands its reader and this one:
        # each lets another Python thread take the GIL, and the reader's work would then wait
        # for the GIL here instead of running beside the forward
        t0 = time.perf_counter()
        st = lib.es_verify_run(self._ptr, a)
        _calls.ms = (time.perf_counter() - t0) * 1e3
        if st != 0:
            msg = ffi.string(lib.es_session_last_error(self._ptr)).decode(errors="replace")
            n0 = a.n_past_in
            if lib.es_session_n_past(self._ptr) != n0 and lib.es_session_rollback(self._ptr, n0) != 0:
                msg += (f"; the KV cache stays after its {a.n_rounds} rounds: n_past {n0} is out of the "
                        f"sliding-window layers' reach")
            raise EngineError(st, msg)
        r = a.n_rounds
        return VerifyRun(ffi.unpack(b.tokens, a.n_out), ffi.unpack(b.round_k, r), ffi.unpack(b.round_r, r),
                         ffi.unpack(b.ms, r), ffi.unpack(b.rollback_ms, r))

    def _tokens(self, tokens) -> np.ndarray:
        if type(tokens) is list and all(type(t) is int for t in tokens):   # the scheduler's steps
            try:
                return np.array(tokens, dtype=np.int32)
            except OverflowError:
                _raise_token_not_int32(tokens)
        raw = np.asarray(tokens)
        if raw.ndim != 1:
            raise EngineError(ES_ERR_INVALID_ARG, f"tokens must be a 1-D sequence, got shape {raw.shape}")
        if raw.size and not np.issubdtype(raw.dtype, np.integer):
            raise EngineError(ES_ERR_INVALID_ARG, f"token ids must be integers, got {raw.dtype}")
        # Range check on the values as given: a cast to int64 first would turn uint64 2**64-1 into -1.
        if raw.size and (int(raw.min()) < -(2 ** 31) or int(raw.max()) >= 2 ** 31):
            _raise_token_not_int32(raw.tolist())
        return np.ascontiguousarray(raw.astype(np.int32))

    def rollback(self, n_past: int) -> None:
        """Truncate the KV cache to its first ``n_past`` positions (exact).

        Raises:
            EngineError: ES_ERR_INVALID_ARG when n_past < 0, > the current n_past, or in
                [1, min_rollback) (the sliding-window rings no longer hold what position
                n_past attends; the message says how far back the session can go). The KV
                cache is then unchanged.
        """
        self._check()
        st = lib.es_session_rollback(self._ptr, _int32(n_past, "n_past"))
        if st != 0:
            self._raise(st)

    def close(self) -> None:
        """Free the KV cache and the threads. Idempotent."""
        if self._ptr is not None:
            lib.es_session_free(self._ptr)
            self._ptr = None
            self.model._forget(self)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_calls = threading.local()


def last_call_ms() -> float | None:
    """The wall time of this thread's last forward_batch (its es_forward_batch calls) or
    Session.forward_tree (es_forward_tree), the C calls alone, without the Python around them;
    None before the first or after ``reset_call_ms``."""
    return getattr(_calls, "ms", None)


def reset_call_ms() -> None:
    _calls.ms = None


_HEADS = {"all": lib.ES_HEAD_ALL, "last": lib.ES_HEAD_LAST}
# sessions per es_forward_batch call (echospec_engine.h); forward_batch splits longer batches
MAX_BATCH = lib.ES_MAX_BATCH


def forward_batch(items: Sequence[tuple["Session", Sequence[int] | np.ndarray, str, str]]
                  ) -> list[tuple[np.ndarray, np.ndarray | None] | EngineError]:
    """One forward over several sessions of a model (es_forward_batch).

    The rows of every item go through each matmul together (each weight block
    is read once for the batch); each item's results are bitwise what
    Session.forward (head "all") or Session.prefill (head "last") give it
    alone. The call runs on the first item's session's threads (as many as
    its ``threads``) and owns every session of the batch while it runs.

    Args:
        items: (session, tokens, head, logits) per session, each session at most
            once. tokens: int ids, N >= 1; head: "all" (every position) or
            "last" (the last one only); logits: "none", "last" (the last head
            row) or "all" (every head row).
    Returns:
        Per item, in order: (argmax int32 [head rows], logits float32
        [rows, n_vocab] or None), or the EngineError of that item, which did
        not run (its KV cache is unchanged; the other items ran).
    Raises:
        TypeError: an item is not a 4-tuple or its first element is not a Session.
        ValueError: an unknown head or logits name.
        Both are raised before any item runs (a batch longer than MAX_BATCH included).
    """
    for i, item in enumerate(items):
        if not isinstance(item, (tuple, list)) or len(item) != 4:
            raise TypeError(f"items[{i}] must be a (session, tokens, head, logits) tuple, not {item!r:.80}")
        session, _, head, logits = item
        if not isinstance(session, Session):
            raise TypeError(f"items[{i}]: the session must be a Session, not {type(session).__name__}")
        if not isinstance(head, str) or head not in _HEADS:
            raise ValueError(f"items[{i}]: head must be 'all' or 'last', not {head!r}")
        _check_logits(logits, f"items[{i}]: ")
    results: list = [None] * len(items)
    _calls.ms = 0.0
    for start in range(0, len(items), MAX_BATCH):
        _forward_batch_call(items[start:start + MAX_BATCH], results, start)
    return results


def _forward_batch_call(items, results: list, offset: int) -> None:
    c_items = ffi.new("es_batch_item[]", len(items))
    keep = []          # the buffers the call reads and writes
    outs = []
    ran = []
    for i, (session, tokens, head, logits) in enumerate(items):   # checked by forward_batch
        try:
            session._check()
            tok = session._tokens(tokens)
        except EngineError as exc:
            results[offset + i] = exc
            continue
        n = tok.size
        rows = max(n, 1) if head == "all" else 1
        am = np.empty(rows, dtype=np.int32)
        mode, out = _logits_buffer(logits, rows, session.n_vocab)
        it = c_items[len(ran)]
        it.session = session._ptr
        if n:
            t = ffi.from_buffer("int32_t[]", tok)
            keep.append(t)
            it.tokens = t
        it.n_tokens = n
        it.head = _HEADS[head]
        a = ffi.from_buffer("int32_t[]", am)
        keep.append(a)
        it.argmax_out = a
        if out is not None:
            o = ffi.from_buffer("float[]", out)
            keep.append(o)
            it.logits_out = o
        it.logits_mode = mode
        ran.append(i)
        outs.append((session, am[:n] if head == "all" else am, out))
    if not ran:
        return
    t0 = time.perf_counter()
    lib.es_forward_batch(c_items, len(ran))
    _calls.ms += (time.perf_counter() - t0) * 1e3
    for j, i in enumerate(ran):
        session, am, out = outs[j]
        st = c_items[j].status
        if st != 0:
            results[offset + i] = EngineError(
                st, ffi.string(lib.es_session_last_error(session._ptr)).decode(errors="replace"))
        else:
            results[offset + i] = (am, out)


def decode_batch(items: Sequence[tuple["Session", int, int, Sequence[int]]], interrupt: Any = None
                 ) -> list[tuple[list[int], list[float]] | EngineError]:
    """Greedy decoding in the engine for several sessions at once (es_decode_batch).

    Each step is one forward over the sessions still decoding, each fed its own last token;
    each session's tokens are bitwise what Session.decode gives it alone. The call runs on the
    first item's session's threads and owns every session while it runs.

    Args:
        items: (session, token, max_steps, stop_ids) per session, each session at most once
            (as Session.decode's arguments).
        interrupt: None, or an ``ffi.new("int32_t *")`` another thread may set to non-zero: the
            run ends after the step that is running (at least one runs).
    Returns:
        Per item, in order: (tokens, ms: each of its steps' wall time), or the EngineError of
        that item (bad arguments, a run past n_ctx or a failed step), whose KV cache is then
        as before the call (steps it did before a failure are rolled back, where its
        sliding-window rings still reach that far: else the message says so).
    Raises:
        TypeError: an item is not a 4-tuple of a Session and its arguments; raised before any
            item runs, as is ValueError for more than MAX_BATCH items.
    """
    if len(items) > MAX_BATCH:
        raise ValueError(f"decode_batch takes at most {MAX_BATCH} sessions, got {len(items)}")
    results: list = [None] * len(items)
    c_items = ffi.new("es_decode_item[]", max(len(items), 1))
    keep, ran = [], []
    for i, item in enumerate(items):
        if not isinstance(item, (tuple, list)) or len(item) != 4 or not isinstance(item[0], Session):
            raise TypeError(f"items[{i}] must be a (session, token, max_steps, stop_ids) tuple, not {item!r:.80}")
    most = 1
    for i, (session, token, max_steps, stop_ids) in enumerate(items):
        try:
            session._check()
            it = c_items[len(ran)]
            it.session = session._ptr
            it.token = _int32(token, "token")
            it.max_steps = _int32(max_steps, "max_steps")
            stops = [_int32(t, "stop id") for t in stop_ids]
        except EngineError as exc:
            results[i] = exc
            continue
        out = ffi.new("int32_t[]", max(it.max_steps, 1))
        st = ffi.new("int32_t[]", stops) if stops else ffi.NULL
        keep += [out, st]
        it.tokens_out, it.stop_ids, it.n_stop = out, st, len(stops)
        most = max(most, it.max_steps)
        ran.append((i, session, lib.es_session_n_past(session._ptr), out))
    if not ran:
        return results
    ms = ffi.new("float[]", most)
    n_steps = ffi.new("int32_t *")
    lib.es_decode_batch(c_items, len(ran), interrupt if interrupt is not None else ffi.NULL, ms, n_steps)
    for j, (i, session, n0, out) in enumerate(ran):
        c = c_items[j]
        if c.status != 0:
            msg = ffi.string(lib.es_session_last_error(session._ptr)).decode(errors="replace")
            if lib.es_session_n_past(session._ptr) != n0 and lib.es_session_rollback(session._ptr, n0) != 0:
                msg += (f"; the KV cache stays after its {c.n_out} steps: n_past {n0} is out of the "
                        f"sliding-window layers' reach")
            results[i] = EngineError(c.status, msg)
        else:
            results[i] = (list(out[0:c.n_out]), list(ms[0:c.n_out]))
    return results


def _check_logits(logits, where: str = "") -> None:
    """ValueError unless ``logits`` is one of the names of _LOGITS_MODES."""
    if not isinstance(logits, str) or logits not in _LOGITS_MODES:
        raise ValueError(f"{where}logits must be one of {sorted(_LOGITS_MODES)}, not {logits!r}")


def _raise_token_not_int32(tokens: list) -> NoReturn:
    """EngineError(ES_ERR_INVALID_ARG) quoting the first token id (a Python int) outside int32."""
    i, t = next((i, t) for i, t in enumerate(tokens) if not -(2 ** 31) <= t < 2 ** 31)
    raise EngineError(ES_ERR_INVALID_ARG, f"token {t} at index {i} does not fit in int32 "
                                          f"[{-(2 ** 31)}, {2 ** 31 - 1}]")


def _int32(v, name: str) -> int:
    """v as a C int32 argument; EngineError(ES_ERR_INVALID_ARG) for a non-integer or one out of range."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise EngineError(ES_ERR_INVALID_ARG, f"{name} must be an integer, not {type(v).__name__}")
    if not -(2 ** 31) <= int(v) < 2 ** 31:
        raise EngineError(ES_ERR_INVALID_ARG, f"{name} = {int(v)} does not fit in int32")
    return int(v)


def kv_type_code(kv_type: str) -> int:
    """The engine's es_kv_type of a kv_type name ("f16", "q8_0"; any case); EngineError
    (ES_ERR_INVALID_ARG) naming the types for any other."""
    code = KV_TYPES.get(kv_type.lower()) if isinstance(kv_type, str) else None
    if code is None:
        raise EngineError(ES_ERR_INVALID_ARG, f"kv_type {kv_type!r} is not one of {', '.join(KV_TYPES)}")
    return code


RNG_ZERO_STATE = 0x9E3779B97F4A7C15   # sampler.c: the state a seed of 0 stands for


def rng_advance(rng: int, n: int) -> int:
    """The sampler's RNG state after n draws from ``rng``: es_sample draws exactly once per
    sampled token (temperature > 0), so a generation resumed after n sampled tokens continues
    with this state and samples what the uninterrupted one would have (sampler.c's xorshift64*
    state update, written once more here; tests/test_fleet_resume.py checks it against sample()).

    Args:
        rng: a 64-bit state or seed (0: the sampler's fixed constant). n: draws, >= 0.
    Returns:
        The state in [0, 2**64); ``rng`` itself (masked) when n is 0.
    """
    mask = 0xFFFFFFFFFFFFFFFF
    x = int(rng) & mask
    for _ in range(n):
        if x == 0:
            x = RNG_ZERO_STATE
        x ^= x >> 12
        x = (x ^ (x << 25)) & mask
        x ^= x >> 27
    return x


def sample(logits_row: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0, rng: int = 0) -> tuple[int, int]:
    """Draw one token from a logits row with the engine's sampler.

    Args:
        logits_row: float32 [n_vocab].
        temperature: <= 0 means greedy: the first index of the largest logit.
        top_k: <= 0 off. top_p: >= 1 off. min_p: <= 0 off.
        rng: 64-bit xorshift64* state (seed it from the request seed): an int in
            [-2**63, 2**64); a negative one is read as its two's complement.
    Returns:
        (token id, the advanced rng state, in [0, 2**64)).
    Raises:
        TypeError: rng is not an integer (a float or bool would be silently truncated).
        ValueError: logits_row is empty or not 1-D, a parameter is NaN, top_k is not an
            int32, rng is outside [-2**63, 2**64), a logit is NaN (greedy too: the
            message names its position), or (sampling) a logit is +inf or every logit is -inf.
    """
    if isinstance(rng, (bool, np.bool_)) or not isinstance(rng, (int, np.integer)):
        raise TypeError(f"rng must be an integer (a 64-bit seed or state), not {type(rng).__name__} {rng!r}")
    if not -(2 ** 63) <= int(rng) < 2 ** 64:
        raise ValueError(f"rng = {int(rng)} is outside the 64-bit range [{-(2 ** 63)}, {2 ** 64 - 1}]")
    row = np.asarray(logits_row, dtype=np.float32)
    if row.ndim != 1:
        raise ValueError(f"logits_row must be 1-D, got shape {row.shape}")
    row = np.ascontiguousarray(row)
    if row.size == 0:
        raise ValueError("logits_row is empty")
    p = ffi.new("es_sampler_params *")
    p.temperature = float(temperature)
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not -(2 ** 31) <= int(top_k) < 2 ** 31:
        raise ValueError(f"top_k must be an int32, not {top_k!r}")
    p.top_k = int(top_k)
    p.top_p = float(top_p)
    p.min_p = float(min_p)
    st = ffi.new("uint64_t *", int(rng) & 0xFFFFFFFFFFFFFFFF)
    tok = lib.es_sample(ffi.from_buffer("float[]", row), row.size, p, st)
    if tok < 0:
        raise ValueError(_sample_refusal(row, p))
    return int(tok), int(st[0])


def _sample_refusal(row: np.ndarray, p) -> str:
    """Why es_sample returned -1 for these arguments (its rules, in its order)."""
    for name in ("temperature", "top_p", "min_p"):
        if np.isnan(getattr(p, name)):
            return f"{name} is NaN"
    nan = np.flatnonzero(np.isnan(row))
    if nan.size:
        return f"logit {int(nan[0])} is NaN ({nan.size} NaN logits): no token can be chosen"
    if np.isposinf(row).any():
        return f"logit {int(np.flatnonzero(np.isposinf(row))[0])} is +inf: sampling (temperature > 0) needs finite logits"
    return "no finite logit: every logit is -inf"


@dataclass(frozen=True)
class VisionInfo:
    """Sizes of a vision encoder (see es_vision_info)."""

    patch_size: int             # pixels per patch side
    merge_size: int             # patches per merged token side
    n_embd: int                 # width of the image embeddings (the text model's hidden size)
    n_embd_vision: int
    n_layer: int
    n_head: int
    n_deepstack: int            # deepstack outputs per image token
    image_mean: tuple           # RGB normalisation: (value / 255 - mean) / std
    image_std: tuple
    min_pixels: int             # the file's pixel budget, 0 when it has none
    max_pixels: int
    deepstack_layers: tuple = ()   # the vision layer each deepstack merger reads

    @property
    def side(self) -> int:
        """Pixels per merged token side: image sides are multiples of it."""
        return self.patch_size * self.merge_size


class Vision:
    """A Qwen3-VL vision encoder read from a projector GGUF (mmproj).

    Args:
        path: the projector file (general.architecture "clip", projector qwen3vl_merger).
    Raises:
        EngineError: ES_ERR_IO / ES_ERR_FORMAT / ES_ERR_UNSUPPORTED / ES_ERR_MISSING_TENSOR /
            ES_ERR_BAD_WEIGHTS / ES_ERR_NOMEM with the engine's message.
    """

    def __init__(self, path: str):
        raw = os.fsencode(path)
        self.path = os.fsdecode(raw)
        if b"\x00" in raw:
            raise EngineError(ES_ERR_INVALID_ARG, "projector path contains a NUL character")
        out = ffi.new("es_vision **")
        err = ffi.new("char[512]")
        st = lib.es_vision_load(raw, out, err, 512)
        if st != 0:
            raise EngineError(st, ffi.string(err).decode(errors="replace"))
        self._ptr = out[0]
        self._lock = threading.Lock()   # the handle's error message: one encode at a time
        ci = ffi.new("es_vision_info *")
        lib.es_vision_get_info(self._ptr, ci)
        self.info = VisionInfo(
            patch_size=ci.patch_size, merge_size=ci.merge_size, n_embd=ci.n_embd,
            n_embd_vision=ci.n_embd_vision, n_layer=ci.n_layer, n_head=ci.n_head,
            n_deepstack=ci.n_deepstack, image_mean=tuple(float(x) for x in ci.image_mean),
            image_std=tuple(float(x) for x in ci.image_std), min_pixels=ci.min_pixels,
            max_pixels=ci.max_pixels,
            deepstack_layers=tuple(int(lib.es_vision_deepstack_layer(self._ptr, k))
                                   for k in range(ci.n_deepstack)))

    def encode(self, pixels: np.ndarray, n_threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Encode one normalised image.

        Args:
            pixels: float32 [3, H, W], H and W multiples of ``info.side``.
            n_threads: encoder threads (the results do not depend on it).
        Returns:
            (embeddings float32 [n, n_embd], deepstack float32 [n_deepstack, n, n_embd]),
            n = (H / side) * (W / side), tokens row-major over the merged grid.
        Raises:
            EngineError: ES_ERR_INVALID_ARG (bad shape), ES_ERR_NOMEM, ES_ERR_INTERNAL.
        """
        if self._ptr is None:
            raise EngineError(ES_ERR_INVALID_ARG, "vision encoder is closed")
        px = np.ascontiguousarray(pixels, dtype=np.float32)
        if px.ndim != 3 or px.shape[0] != 3:
            raise EngineError(ES_ERR_INVALID_ARG, f"pixels must be [3, H, W], got {list(px.shape)}")
        h, w = int(px.shape[1]), int(px.shape[2])
        side = self.info.side
        n = (h // side) * (w // side)
        embd = np.empty((max(n, 1), self.info.n_embd), dtype=np.float32)
        ds = np.empty((max(self.info.n_deepstack, 1), max(n, 1), self.info.n_embd), dtype=np.float32)
        with self._lock:
            st = lib.es_vision_encode(self._ptr, ffi.from_buffer("float[]", px), h, w, n_threads,
                                      ffi.from_buffer("float[]", embd),
                                      ffi.from_buffer("float[]", ds) if self.info.n_deepstack else ffi.NULL)
            if st != 0:
                raise EngineError(st, ffi.string(lib.es_vision_last_error(self._ptr)).decode(errors="replace"))
        return embd[:n], ds[:self.info.n_deepstack, :n]

    def close(self) -> None:
        """Free the encoder. Idempotent."""
        if self._ptr is not None:
            lib.es_vision_free(self._ptr)
            self._ptr = None
