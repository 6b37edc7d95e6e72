"""Engine benchmark: echospec's C engine side by side with llama.cpp, same file, same threads.

What it measures (all greedy, on fixed pseudo-random token ids, so both engines see the same input):

    decode_tok_s    greedy decode of --decode-tokens tokens starting at context depth --depth
                    (each step feeds the previous argmax back), tokens / second.
    prefill_tok_s   one forward over a --prompt-tokens prompt from an empty KV cache, tokens / second,
                    with the output head on the last position only on both engines (ours:
                    Session.prefill, the services' prompt path; the peer: Llama.eval without
                    logits_all).
    T_ms            one decode step (N = 1 new token) at context depth --depth, milliseconds.
    V_ms[K]         one forward over K + 1 new tokens at depth --depth that yields the argmax of
                    every position (what verifying K drafts needs), milliseconds.
    verify_ratio[K] V(K) / T. Speculation with acceptance length a pays when
                    V(K) + overhead < (a + 1) * T, so this ratio is the engine's side of the gain
                    condition; 1.0 would make a verify as cheap as a decode step.

Ours runs through echospec.services.verifier.engine.Session.forward, with Session.rollback(depth) after every
timed call so that every repetition runs at the same depth. The peer is llama-cpp-python with
logits_all=True (its all-positions logits path), Llama.eval of the same tokens at the same n_past,
followed by the argmax of the rows it returns; setting Llama.n_tokens back to the depth rolls its
KV cache back (eval removes positions >= n_tokens before it runs). The peer's prefill and decode
ask for the last position's logits only, as a plain llama.cpp generation would.

The host drifts by up to 15 % over minutes, so the two engines are measured ALTERNATELY: every
round runs one engine's full measurement block, then the other's, and the order flips each round.
Ratios ours/peer are the median over rounds of the per-round paired ratio.

Usage:
    python bench/engine_bench.py                    # SmolLM2 (fetched on first use), 2 threads, table
    python bench/engine_bench.py --json             # one JSON object on stdout
    python bench/engine_bench.py --model M.gguf --threads 4 --no-peer --quick
    python bench/engine_bench.py --depth 2048 --prompt-tokens 2048    # long context: T, V, decode at 2048
    python bench/engine_bench.py --simd avx2        # our AVX2 path, compiled for this run (any x86-64 host)
Board-shaped files (Qwen3 shapes, K-quants): python bench/qwen3_shapes.py, then --model on its output.

JSON keys: decode_tok_s, prefill_tok_s, verify_ratio (object "K" -> V(K)/T), T_ms, V_ms ("K" -> ms),
peer (the same keys for llama.cpp, or null), peer_error (why the peer is null), ratios (ours/peer),
goals, argmax agreement with the peer, and the run's settings (threads, simd, simd_build, host_isa,
model, arch, n_vocab, n_ctx, rounds, ...). Ours also: load_s (model load and session), rss_mib (the
resident memory they added), file_mib, and for a mixture of experts n_expert, n_expert_used and
experts_per_layer ("K" -> the distinct experts per layer a verify of K drafts read: the union of the
K + 1 rows' choices); needed_acceptance (ours and the peer's): the smallest per-token acceptance at
which drafting some measured K pays, V(K) + overhead < (E(K) + 1) T under the geometric model, with
--overhead-ms for the services' per-round overhead.
Progress goes to stderr. Exit status: 0 on success, 2 when the model or the engine is unusable.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_KS = (1, 2, 4, 8, 16)
GOAL_V4_OVER_T = 1.3          # the first speed goal (AVX-512, SmolLM2 Q4_1, depth 64): kept as a regression mark
# the engine's speed goals, on each benchmark file, with the peer in the same run
GOAL_DECODE_VS_PEER = 1.3     # decode >= 1.3x llama.cpp (SmolLM2 Q4_K_M / Q8_0, Qwen3-0.6B Q4_K_M, depth 2048)
GOAL_V4_QWEN3 = 1.4           # V(4)/T on the Qwen3 shapes
GOAL_V4_OTHER = 1.5           # V(4)/T on SmolLM2 Q4_1 and Q4_K_M (with AVX2)
GOAL_PREFILL_LONG = 1.5       # a 2048-token prefill >= 1.5x llama.cpp
LONG_PREFILL = 2048
SIMD_BUILDS = ("installed", "native", "avx512", "avx2", "scalar")


class BenchError(RuntimeError):
    """A setup problem the user must fix (missing model, engine not built); exit status 2."""


def log(msg: str) -> None:
    print(f"[engine_bench] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Which engine build runs, and on what CPU
# ---------------------------------------------------------------------------------------------

def host_isa() -> str:
    """The host's SIMD level as the engine names them (avx512-vnni, avx2, neon-dotprod, ...)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "neon-dotprod" if "asimddp" in flags else "neon"
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        return "avx512-vnni"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return machine or "unknown"


def build_engine_module(mode: str, dest: Path) -> Path:
    """Compile echospec._engine with ECHOSPEC_SIMD=mode into dest; returns the extension's path.

    The same cffi build as `pip install` (engine_c/build_ffi.py), run on a copy of engine_c's
    sources in dest (its source paths are relative to the tree it sits in), so the installed
    module and the source tree are untouched.
    """
    src = ROOT / "engine_c"
    for part in ("src", "include"):
        shutil.copytree(src / part, dest / "engine_c" / part)
    shutil.copy2(src / "build_ffi.py", dest / "engine_c" / "build_ffi.py")
    code = ("import sys; sys.path.insert(0, 'engine_c'); import build_ffi; "
            "print(build_ffi.ffibuilder.compile(tmpdir='.'))")
    env = dict(os.environ, ECHOSPEC_SIMD=mode)
    log(f"building the engine module with ECHOSPEC_SIMD={mode} in {dest} (about a minute)")
    try:
        r = subprocess.run([sys.executable, "-c", code], cwd=dest, env=env,
                           capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BenchError(f"cannot build the engine module with ECHOSPEC_SIMD={mode}: {e}") from e
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-15:])
        raise BenchError(f"building the engine module with ECHOSPEC_SIMD={mode} failed:\n{tail}")
    so = dest / r.stdout.strip().splitlines()[-1]
    if not so.is_file():
        raise BenchError(f"the ECHOSPEC_SIMD={mode} build reported {so}, which does not exist")
    return so


def use_engine_module(so: Path) -> None:
    """Import the extension at `so` as echospec._engine, before echospec.services.verifier.engine imports it."""
    import echospec  # noqa: F401  (the parent package must exist first)

    if "echospec.services.verifier.engine" in sys.modules or "echospec._engine" in sys.modules:
        raise BenchError("the engine module is already imported; --simd must be applied first")
    spec = importlib.util.spec_from_file_location("echospec._engine", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["echospec._engine"] = mod


# ---------------------------------------------------------------------------------------------
# Engines behind one small interface: reset(n_past), prefill(tokens), step(tokens) -> argmax
# ---------------------------------------------------------------------------------------------

class OursRunner:
    """echospec's C engine through the Python wrapper (echospec.services.verifier.engine)."""

    name = "echospec"

    def __init__(self, model_path: str, threads: int, n_ctx: int, kv_type: str = "f16"):
        try:
            from echospec.services.verifier import engine
        except ImportError as e:  # echospec._engine missing: the cffi module is not built
            raise BenchError(
                f"cannot import the engine module ({e}); build it with "
                f"`cd {ROOT} && .venv/bin/pip install -e . --no-build-isolation` "
                f"or `python engine_c/build_ffi.py`") from e
        self._engine = engine
        rss0 = _rss_bytes()
        t0 = time.monotonic()
        try:
            self.model = engine.Model(model_path)
            self.session = self.model.new_session(n_ctx=n_ctx, n_threads=threads, kv_type=kv_type)
        except engine.EngineError as e:
            raise BenchError(f"echospec engine cannot load {model_path}: {e}") from e
        self.load_s = time.monotonic() - t0                 # the model load and its KV cache
        self.rss_bytes = _rss_bytes() - rss0                # resident memory they added
        self.n_vocab = self.model.info.n_vocab
        self.simd = engine.simd_name()
        self.version = "echospec " + self.simd

    def reset(self, n_past: int) -> None:
        """Roll the KV cache back to its first n_past positions."""
        self.session.rollback(n_past)

    def prefill(self, tokens: np.ndarray) -> None:
        """A prompt evaluation as the services run one (Session.prefill, es_forward_last): the
        output head on the last position only, like the peer's; results unused."""
        self.session.prefill(tokens)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Forward over tokens (int32 [N]); returns the argmax of every position (int32 [N])."""
        am, _ = self.session.forward(tokens)
        return am

    def experts_per_layer(self) -> float | None:
        """Distinct experts per layer that the last forward read (mixture of experts), else None."""
        if not self.model.info.n_expert:
            return None
        return self.session.experts_read / self.model.info.n_layer

    def close(self) -> None:
        self.model.close()


class PeerRunner:
    """llama.cpp through llama-cpp-python (the optional `bench` extra), logits_all=True."""

    name = "llama.cpp"

    def __init__(self, model_path: str, threads: int, n_ctx: int, flash_attn: bool = False):
        import llama_cpp  # ImportError is reported as peer_error by the caller

        self.flash_attn = flash_attn
        self.llm = llama_cpp.Llama(
            model_path=model_path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
            n_threads=threads, n_threads_batch=threads, logits_all=True, flash_attn=flash_attn,
            verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.version = f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}"
        self.simd = self._system_info(llama_cpp)
        self._set_logits_all(True)

    @staticmethod
    def _system_info(llama_cpp) -> str:
        try:
            info = llama_cpp.llama_print_system_info()
            return info.decode(errors="replace").strip() if isinstance(info, bytes) else str(info)
        except Exception:  # informational only
            return "?"

    def reset(self, n_past: int) -> None:
        """Roll back: the next eval removes KV positions >= n_past before it runs."""
        self.llm.n_tokens = n_past

    def _set_logits_all(self, on: bool) -> None:
        """Llama.eval marks every batch position for logits when this flag is set (the last always).

        llama-cpp-python 0.3.x keeps it in Llama._logits_all; older releases read
        context_params.logits_all. A ctypes struct would accept any attribute silently, so the
        attribute is checked, not assumed.
        """
        if hasattr(self.llm, "_logits_all"):
            self.llm._logits_all = on
        elif hasattr(type(self.llm.context_params), "logits_all"):
            self.llm.context_params.logits_all = on
        else:
            raise RuntimeError("this llama-cpp-python has no logits_all switch the bench knows")

    def _eval(self, tokens: np.ndarray, all_logits: bool) -> None:
        self._set_logits_all(all_logits)
        try:
            self.llm.eval(tokens.tolist())
        finally:
            self._set_logits_all(True)

    def prefill(self, tokens: np.ndarray) -> None:
        """A plain prompt evaluation: only the last position's logits are produced."""
        self._eval(tokens, all_logits=False)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """eval with logits for every position, then the argmax of each row (int32 [N])."""
        n0 = self.llm.n_tokens
        self._eval(tokens, all_logits=True)
        rows = self.llm.scores[n0:n0 + len(tokens)]
        return np.argmax(rows, axis=1).astype(np.int32)

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close:
            close()


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------

@dataclass
class Plan:
    """What one round measures. Token arrays are int32."""
    prompt: np.ndarray          # [prompt_tokens], prefill from an empty KV cache
    context: np.ndarray         # [depth], brings the KV cache to the verify/decode depth
    draft: np.ndarray           # [max(K) + 1], the verify input (first K + 1 used)
    ks: Sequence[int]
    inner: int                  # repetitions of T and of each V(K) per round
    decode_tokens: int

    @property
    def depth(self) -> int:
        return int(self.context.size)


@dataclass
class RoundResult:
    prefill_tok_s: float
    decode_tok_s: float
    t_ms: float                              # median of the round's T samples
    v_ms: dict[int, float]                   # K -> median of the round's V(K) samples
    decode_ids: list[int] = field(default_factory=list)
    verify_argmax: list[int] = field(default_factory=list)
    experts: dict[int, float] = field(default_factory=dict)   # K -> distinct experts per layer (MoE)


def _rss_bytes() -> int:
    """This process's resident set now (Linux /proc; 0 where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter_ns()
    out = fn()
    return (time.perf_counter_ns() - t0) / 1e6, out


def measure_round(r, plan: Plan) -> RoundResult:
    """One engine's block: prefill, then T and V(K) interleaved at depth, then a greedy decode."""
    # prefill from an empty KV cache
    r.reset(0)
    ms, _ = _timed(lambda: r.prefill(plan.prompt))
    prefill_tok_s = plan.prompt.size / (ms / 1e3)

    # bring the cache to the depth (untimed)
    r.reset(0)
    r.prefill(plan.context)
    depth = plan.depth

    # T and V(K): each sample is one call at n_past == depth, rolled back after it
    t_samples: list[float] = []
    v_samples: dict[int, list[float]] = {k: [] for k in plan.ks}
    verify_argmax: list[int] = []
    kmax = max(plan.ks)
    experts: dict[int, float] = {}
    union = getattr(r, "experts_per_layer", lambda: None)
    for _ in range(plan.inner):
        ms, _ = _timed(lambda: r.step(plan.draft[:1]))
        r.reset(depth)
        t_samples.append(ms)
        for k in plan.ks:
            ms, am = _timed(lambda k=k: r.step(plan.draft[:k + 1]))
            if union() is not None:
                experts[k] = union()
            r.reset(depth)
            v_samples[k].append(ms)
            if k == kmax:
                verify_argmax = [int(x) for x in am]

    # greedy decode from the depth, feeding each argmax back
    tok = plan.draft[:1]
    ids: list[int] = []

    def decode() -> None:
        nonlocal tok
        for _ in range(plan.decode_tokens):
            am = r.step(tok)
            tok = am[-1:]
            ids.append(int(tok[0]))

    ms, _ = _timed(decode)
    r.reset(depth)
    return RoundResult(
        prefill_tok_s=prefill_tok_s,
        decode_tok_s=plan.decode_tokens / (ms / 1e3),
        t_ms=statistics.median(t_samples),
        v_ms={k: statistics.median(v) for k, v in v_samples.items()},
        decode_ids=ids, verify_argmax=verify_argmax, experts=experts)


def summarize(rounds: list[RoundResult], ks: Sequence[int]) -> dict:
    """Medians over rounds; verify_ratio[K] is the median of the per-round V(K)/T."""
    med = statistics.median
    return {
        "decode_tok_s": med(x.decode_tok_s for x in rounds),
        "prefill_tok_s": med(x.prefill_tok_s for x in rounds),
        "verify_ratio": {str(k): med(x.v_ms[k] / x.t_ms for x in rounds) for k in ks},
        "T_ms": med(x.t_ms for x in rounds),
        "V_ms": {str(k): med(x.v_ms[k] for x in rounds) for k in ks},
        "decode_tok_s_spread": [min(x.decode_tok_s for x in rounds), max(x.decode_tok_s for x in rounds)],
        "T_ms_spread": [min(x.t_ms for x in rounds), max(x.t_ms for x in rounds)],
        **({"experts_per_layer": {str(k): rounds[-1].experts[k] for k in ks}}
           if rounds and rounds[-1].experts else {}),
    }


def needed_acceptance(t_ms: float, v_ms: dict, overhead_ms: float) -> float | None:
    """The smallest per-token acceptance p (to 0.01) at which drafting some measured K pays:
    V(K) + overhead < (E(K) + 1) * T with E(K) = p + p^2 + ... + p^K (the spec controller's
    geometric model and economics.gain_condition); None when no K pays even at p = 1."""
    from echospec.services.common.economics import gain_condition

    for i in range(101):
        p = i / 100
        for k, v in v_ms.items():
            e = sum(p ** j for j in range(1, int(k) + 1))
            if gain_condition(e, v, overhead_ms, t_ms)[0]:
                return p
    return None


def paired_ratios(ours: list[RoundResult], peer: list[RoundResult], ks: Sequence[int]) -> dict:
    """ours/peer per round (the two blocks ran back to back), median over rounds."""
    med = statistics.median
    pairs = list(zip(ours, peer))
    return {
        "decode_tok_s": med(a.decode_tok_s / b.decode_tok_s for a, b in pairs),
        "prefill_tok_s": med(a.prefill_tok_s / b.prefill_tok_s for a, b in pairs),
        "T_ms": med(a.t_ms / b.t_ms for a, b in pairs),
        "V_ms": {str(k): med(a.v_ms[k] / b.v_ms[k] for a, b in pairs) for k in ks},
        "verify_ratio": {str(k): med((a.v_ms[k] / a.t_ms) / (b.v_ms[k] / b.t_ms) for a, b in pairs)
                         for k in ks},
    }


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# Setup and output
# ---------------------------------------------------------------------------------------------

def resolve_model(arg: str | None) -> Path:
    """The --model path, or the default SmolLM2 file via scripts/fetch_model.py (fetched if absent)."""
    if arg:
        p = Path(arg).expanduser()
        if not p.is_file():
            raise BenchError(f"model file not found: {p} (give a GGUF path with --model, or omit "
                             f"--model to use the default SmolLM2 from scripts/fetch_model.py)")
        return p
    spec = importlib.util.spec_from_file_location("fetch_model", ROOT / "scripts" / "fetch_model.py")
    fm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fm)
    try:
        return Path(fm.fetch())
    except (RuntimeError, OSError) as e:
        raise BenchError(f"default model unavailable: {e} (run `python scripts/fetch_model.py`, "
                         f"or pass --model PATH)") from e


def make_plan(n_vocab: int, args) -> Plan:
    """Fixed pseudo-random token ids (seeded), away from the low ids where special tokens live."""
    rng = np.random.default_rng(args.seed)
    lo = min(100, n_vocab // 2)

    def draw(n: int) -> np.ndarray:
        return rng.integers(lo, n_vocab, size=n, dtype=np.int64).astype(np.int32)

    return Plan(prompt=draw(args.prompt_tokens), context=draw(args.depth), draft=draw(max(args.ks) + 1),
                ks=tuple(args.ks), inner=args.inner, decode_tokens=args.decode_tokens)


MAX_N_CTX = 16384   # the largest context the benchmark sets up (depth 8192 and beyond for profiling)


def needed_n_ctx(args) -> int:
    """The KV cache both engines get: the prefill, or the depth plus the longest verify or decode."""
    return max(args.prompt_tokens, args.depth + max(max(args.ks) + 1, args.decode_tokens)) + 8


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 via scripts/fetch_model.py)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--no-peer", action="store_true", help="skip llama.cpp (peer is then null)")
    ap.add_argument("--quick", action="store_true",
                    help="a fast sanity run: 2 rounds, 2 repetitions, 8 decode tokens, 32-token prompt "
                         "(flags given explicitly keep their values)")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per engine (default 8)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured rounds per engine first (default 1)")
    ap.add_argument("--inner", type=int, default=None, help="T and V(K) samples per round (default 5)")
    ap.add_argument("--depth", type=int, default=64, help="context depth of T, V(K) and decode (default 64)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="prefill length (default 128)")
    ap.add_argument("--decode-tokens", type=int, default=None,
                    help="greedy decode length per round (default 64)")
    ap.add_argument("--ks", type=_k_list, default=list(DEFAULT_KS),
                    help="draft lengths K for V(K)/T (default 1,2,4,8,16)")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the token ids (default 1234)")
    ap.add_argument("--overhead-ms", type=float, default=0.5,
                    help="per-round overhead of the services for needed_acceptance (default 0.5 ms)")
    ap.add_argument("--simd", choices=SIMD_BUILDS, default="installed",
                    help="our engine build: 'installed' (default) imports the installed echospec._engine; "
                         "native, avx512, avx2, scalar compile it with that ECHOSPEC_SIMD into a temporary "
                         "directory first (about a minute), e.g. to measure the AVX2 path on an AVX-512 host")
    ap.add_argument("--kv-type", choices=("f16", "q8_0"), default="f16",
                    help="our engine's KV cache type (default f16; the peer keeps its F16 cache)")
    ap.add_argument("--peer-flash-attn", action="store_true",
                    help="run llama.cpp with flash_attn=True (llama-cpp-python's default is off; its F16 KV "
                         "cache either way)")
    args = ap.parse_args(argv)
    defaults = dict(rounds=8, warmup=1, inner=5, decode_tokens=64, prompt_tokens=128)
    if args.quick:
        defaults.update(rounds=2, warmup=1, inner=2, decode_tokens=8, prompt_tokens=32)
    for name, value in defaults.items():   # explicit flags win over --quick
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("threads", "rounds", "inner", "depth", "prompt_tokens", "decode_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads > 256:
        ap.error(f"--threads {args.threads}: the engine runs at most 256 threads")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if not args.ks or min(args.ks) < 1:
        ap.error("--ks needs positive draft lengths")
    if not 0 <= args.seed < 2 ** 32:
        ap.error(f"--seed {args.seed}: must be in [0, 2^32)")
    n_ctx = needed_n_ctx(args)
    if n_ctx > MAX_N_CTX:
        ap.error(f"--depth, --ks, --decode-tokens and --prompt-tokens need a context of {n_ctx} tokens; "
                 f"at most {MAX_N_CTX} (the benchmark's KV cache)")
    return args


def run(args) -> dict:
    model_path = resolve_model(args.model)
    if args.simd != "installed":
        build_dir = Path(tempfile.mkdtemp(prefix=f"echospec-engine-{args.simd}-"))
        try:
            use_engine_module(build_engine_module(args.simd, build_dir))
        finally:  # the loaded extension stays mapped after its file is removed
            shutil.rmtree(build_dir, ignore_errors=True)
    n_ctx = needed_n_ctx(args)
    log(f"model {model_path}, threads {args.threads}, n_ctx {n_ctx}, KV cache {args.kv_type}")
    ours = OursRunner(str(model_path), args.threads, n_ctx, args.kv_type)
    runners = [ours]
    peer, peer_error = None, None
    if args.no_peer:
        peer_error = "disabled by --no-peer"
    else:
        try:
            peer = PeerRunner(str(model_path), args.threads, n_ctx, flash_attn=args.peer_flash_attn)
            runners.append(peer)
            log(f"peer: {peer.version}")
        except ImportError as e:
            peer_error = (f"llama-cpp-python is not installed ({e}); "
                          f"install the bench extra: pip install llama-cpp-python")
        except Exception as e:  # the peer refusing the file must not stop our own figures
            peer_error = f"llama-cpp-python could not load the model: {type(e).__name__}: {e}"
        if peer_error:
            log(f"peer skipped: {peer_error}")
    if peer is not None and peer.n_vocab != ours.n_vocab:
        raise BenchError(f"n_vocab differs: echospec {ours.n_vocab}, llama.cpp {peer.n_vocab}")

    load_before = os.getloadavg()[0]
    if load_before > os.cpu_count() - args.threads + 0.5:
        log(f"warning: 1-minute load average {load_before:.1f} on {os.cpu_count()} cores: other "
            f"processes compete for the CPU, the figures will be noisy")
    plan = make_plan(ours.n_vocab, args)
    results: dict[str, list[RoundResult]] = {r.name: [] for r in runners}
    total = args.warmup + args.rounds
    t_start = time.monotonic()
    for i in range(total):
        order = runners if i % 2 == 0 else runners[::-1]
        for r in order:
            res = measure_round(r, plan)
            if i >= args.warmup:
                results[r.name].append(res)
            log(f"round {i + 1}/{total}{' (warm-up)' if i < args.warmup else ''} {r.name}: "
                f"decode {res.decode_tok_s:.1f} tok/s, prefill {res.prefill_tok_s:.1f} tok/s, "
                f"T {res.t_ms:.2f} ms, V({max(plan.ks)}) {res.v_ms[max(plan.ks)]:.2f} ms")
    elapsed = time.monotonic() - t_start

    out = summarize(results[ours.name], plan.ks)
    out["needed_acceptance"] = needed_acceptance(out["T_ms"], out["V_ms"], args.overhead_ms)
    weight_bytes = ours.model.info.weight_bytes
    out.update({
        "model": str(model_path),
        "threads": args.threads,
        "simd": ours.simd,
        "simd_build": args.simd,
        "host_isa": host_isa(),
        "arch": ours.model.info.arch,
        "n_expert": ours.model.info.n_expert,
        "n_expert_used": ours.model.info.n_expert_used,
        "load_s": round(ours.load_s, 2),
        "rss_mib": round(ours.rss_bytes / 2 ** 20, 1),
        "file_mib": round(model_path.stat().st_size / 2 ** 20, 1),
        "overhead_ms": args.overhead_ms,
        "n_vocab": ours.n_vocab,
        "n_ctx": n_ctx,
        "kv_type": args.kv_type,
        "kv_mib": round(ours.session.kv_bytes / 2 ** 20, 1),
        "depth": plan.depth,
        "prompt_tokens": int(plan.prompt.size),
        "decode_tokens": plan.decode_tokens,
        "ks": list(plan.ks),
        "rounds": args.rounds,
        "warmup": args.warmup,
        "inner": args.inner,
        "seconds": round(elapsed, 2),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cpu_count": os.cpu_count(),
        "weight_mib": weight_bytes / 2 ** 20,
        "decode_weight_gb_s": weight_bytes / (out["T_ms"] / 1e3) / 1e9,
        "peer": None,
        "peer_error": peer_error,
        "ratios": None,
    })
    if peer is not None:
        p = summarize(results[peer.name], plan.ks)
        p["needed_acceptance"] = needed_acceptance(p["T_ms"], p["V_ms"], args.overhead_ms)
        p["version"] = peer.version
        p["system_info"] = peer.simd
        p["flash_attn"] = peer.flash_attn
        out["peer"] = p
        out["ratios"] = paired_ratios(results[ours.name], results[peer.name], plan.ks)
        a, b = results[ours.name][0], results[peer.name][0]
        out["argmax_agreement"] = {
            "verify_positions_equal": sum(x == y for x, y in zip(a.verify_argmax, b.verify_argmax)),
            "verify_positions": len(a.verify_argmax),
            "decode_common_prefix": _common_prefix(a.decode_ids, b.decode_ids),
            "decode_tokens": len(a.decode_ids),
        }
    out["goals"] = goals(out, plan)
    for r in runners:
        r.close()
    return out


def goals(out: dict, plan: Plan) -> dict:
    """The engine's speed goals that this run measures (None: not measurable without the peer).

    decode_ge_1.3x_peer: on every file (the goals name SmolLM2 Q4_K_M / Q8_0, the Qwen3-0.6B
    shape and depth 2048). verify_ratio_4_le_X: X = 1.4 on qwen3 files, 1.5 on the others.
    prefill_ge_1.5x_peer: only for a prefill of >= 2048 tokens. The first goals stay as marks:
    decode_at_least_peer and verify_ratio_4_le_1.3 (AVX-512, SmolLM2 Q4_1, depth 64).
    """
    r = out["ratios"]
    k4 = "4" if 4 in plan.ks else None
    v4_goal = GOAL_V4_QWEN3 if out["arch"] == "qwen3" else GOAL_V4_OTHER
    g = {
        f"decode_ge_{GOAL_DECODE_VS_PEER}x_peer": None if r is None else r["decode_tok_s"] >= GOAL_DECODE_VS_PEER,
        f"verify_ratio_4_le_{v4_goal}": None if k4 is None else out["verify_ratio"][k4] <= v4_goal,
    }
    if plan.prompt.size >= LONG_PREFILL:
        g[f"prefill_ge_{GOAL_PREFILL_LONG}x_peer"] = None if r is None else r["prefill_tok_s"] >= GOAL_PREFILL_LONG
    g["decode_at_least_peer"] = None if r is None else r["decode_tok_s"] >= 1.0
    g[f"verify_ratio_4_le_{GOAL_V4_OVER_T}"] = None if k4 is None else out["verify_ratio"][k4] <= GOAL_V4_OVER_T
    return g


def format_table(res: dict) -> str:
    peer = res["peer"]
    rat = res["ratios"]
    lines = [
        f"echospec engine bench: {Path(res['model']).name}, threads {res['threads']}, simd {res['simd']} "
        f"(build {res['simd_build']}, host {res['host_isa']}), "
        f"depth {res['depth']}, {res['rounds']} rounds"
        f"{' alternating with the peer' if peer is not None else ' (no peer)'} ({res['seconds']} s, "
        f"load average {res['loadavg_1m'][0]:.1f} -> {res['loadavg_1m'][1]:.1f} on {res['cpu_count']} cores)",
        f"{'':28}{'echospec':>12}{'llama.cpp':>12}{'ours/peer':>11}",
    ]

    def row(label: str, ours: float, p: float | None, r: float | None, fmt: str = "{:.2f}") -> str:
        ps = fmt.format(p) if p is not None else "-"
        rs = f"{r:.2f}" if r is not None else "-"
        return f"{label:28}{fmt.format(ours):>12}{ps:>12}{rs:>11}"

    lines.append(row("decode tok/s", res["decode_tok_s"], peer and peer["decode_tok_s"],
                     rat and rat["decode_tok_s"], "{:.1f}"))
    lines.append(row(f"prefill tok/s ({res['prompt_tokens']} tok)", res["prefill_tok_s"],
                     peer and peer["prefill_tok_s"], rat and rat["prefill_tok_s"], "{:.1f}"))
    lines.append(row(f"T ms (1 token @ {res['depth']})", res["T_ms"], peer and peer["T_ms"], rat and rat["T_ms"]))
    for k in res["verify_ratio"]:
        lines.append(row(f"V({k}) ms ({int(k) + 1} tokens)", res["V_ms"][k], peer and peer["V_ms"][k],
                         rat and rat["V_ms"][k]))
    for k in res["verify_ratio"]:
        lines.append(row(f"V({k})/T", res["verify_ratio"][k], peer and peer["verify_ratio"][k],
                         rat and rat["verify_ratio"][k]))
    na, pna = res["needed_acceptance"], peer and peer["needed_acceptance"]
    lines.append(f"acceptance speculation needs (some K pays, overhead {res['overhead_ms']} ms): "
                 f"{'none pays' if na is None else na} (llama.cpp: {'-' if peer is None else pna})")
    if res.get("experts_per_layer"):
        lines.append("experts read per layer by a verify of K drafts: " +
                     ", ".join(f"K={k}: {v:.1f}" for k, v in res["experts_per_layer"].items()) +
                     f" (of {res['n_expert']}, {res['n_expert_used']} per token)")
    lines.append(f"load {res['load_s']} s, resident {res['rss_mib']:.0f} MiB for a {res['file_mib']:.0f} MiB file")
    lines.append(f"weights read per step: {res['weight_mib']:.1f} MiB -> "
                 f"{res['decode_weight_gb_s']:.1f} GB/s at T")
    if peer is None:
        lines.append(f"peer: none ({res['peer_error']})")
    else:
        lines.append(f"peer: {peer['version']}")
        ag = res["argmax_agreement"]
        lines.append(f"argmax agreement with the peer: verify {ag['verify_positions_equal']}/"
                     f"{ag['verify_positions']} positions, decode common prefix "
                     f"{ag['decode_common_prefix']}/{ag['decode_tokens']} tokens")
    goal_text = ", ".join(f"{k}: {'-' if v is None else ('yes' if v else 'NO')}" for k, v in res["goals"].items())
    lines.append(f"goals: {goal_text}")
    return "\n".join(lines)


def _k_list(text: str) -> list[int]:
    """--ks: comma-separated draft lengths, each >= 1."""
    try:
        ks = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers "
                                         f"(e.g. 1,2,4,8)") from None
    if any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"{text!r}: every K must be >= 1")
    return ks


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        res = run(args)
    except BenchError as e:
        print(f"engine_bench: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res))
    else:
        print(format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
