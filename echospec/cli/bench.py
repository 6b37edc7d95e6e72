"""`echospec bench`: workloads run greedy with speculation off and on, compared."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from echospec.cli.common import (_add_client_args, _check_messages, _check_sampling_flags, _client,
                                 _client_error, _die, _gen_kwargs, _int32, _read_text, _seconds,
                                 _target, _valid_unicode)
from echospec_client.limits import MAX_TREE_DRAFT_NODES


_WORKLOAD_FIELDS = frozenset({"id", "kind", "messages", "prompt", "max_tokens", "prediction",
                              "draft_namespace", "grammar", "tools", "tool_choice", "image"})
_MAX_IMAGES = 16   # the coordinator's limit per request
_GRAMMAR_KINDS = ("json_schema", "json_object", "lark", "gbnf")


def _load_workloads(path: str) -> list[dict]:
    from echospec.services.common.config import CoordinatorConfig

    max_tokens_limit = CoordinatorConfig().max_tokens_limit
    out, ids = [], set()
    lines = _read_text("--workloads", path).splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            w = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            _die(f"{path}:{n}: not valid JSON ({type(exc).__name__}: {exc})", 2)
        if not _valid_unicode(w):
            _die(f"{path}:{n}: a string is not valid Unicode (a lone surrogate)", 2)
        if not isinstance(w, dict) or not isinstance(w.get("id"), str) or not w["id"]:
            _die(f"{path}:{n}: each workload is a JSON object with a non-empty string id", 2)
        if w["id"] in ids:
            _die(f"{path}:{n}: duplicate workload id {w['id']!r}", 2)
        ids.add(w["id"])
        unknown = sorted(set(w) - _WORKLOAD_FIELDS)
        if unknown:   # a misspelt max_tokens would otherwise run with the default silently
            _die(f"{path}:{n}: unknown field {unknown[0]!r} (a workload has "
                 f"{', '.join(sorted(_WORKLOAD_FIELDS))})", 2)
        msgs, prompt = w.get("messages"), w.get("prompt")
        if (msgs is None) == (prompt is None):
            _die(f"{path}:{n}: give exactly one of messages or prompt", 2)
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            _die(f"{path}:{n}: prompt must be a non-empty string", 2)
        if msgs is not None:
            if not isinstance(msgs, list) or not msgs:
                _die(f"{path}:{n}: messages must be a non-empty list of chat messages", 2)
            _check_messages(msgs, f"{path}:{n}")
        for key in ("prediction", "draft_namespace"):
            if key in w and not isinstance(w[key], str):
                _die(f"{path}:{n}: {key} must be a string", 2)
        g = w.get("grammar")
        if g is not None and not (isinstance(g, dict) and len(g) == 1 and next(iter(g)) in _GRAMMAR_KINDS):
            _die(f"{path}:{n}: grammar must be an object of one key, one of {', '.join(_GRAMMAR_KINDS)} "
                 f"(as the client's grammar argument), got {json.dumps(g)[:80]}", 2)
        if "tools" in w and (not isinstance(w["tools"], list) or msgs is None):
            _die(f"{path}:{n}: tools must be a list of OpenAI function tools, with messages", 2)
        if "tool_choice" in w and (not isinstance(w["tool_choice"], (str, dict)) or "tools" not in w):
            _die(f"{path}:{n}: tool_choice must be a string or an object, with tools", 2)
        mt = w.get("max_tokens", 256)
        if not isinstance(mt, int) or isinstance(mt, bool) or not 1 <= mt <= max_tokens_limit:
            _die(f"{path}:{n}: max_tokens must be an integer in [1, {max_tokens_limit}], "
                 f"got {mt!r}", 2)
        if "image" in w:
            w = _attach_images(w, path, f"{path}:{n}")
        out.append(w)
    if not out:
        _die(f"{path}: no workloads", 2)
    return out


def _attach_images(w: dict, path: str, where: str) -> dict:
    """The workload with its ``image`` files (a path or a list of paths, relative to the workload
    file's directory) read and put before the last user message's text, as ``generate --image``
    does with --messages; exits 2 naming ``where`` on a bad field or file."""
    from echospec.cli.common import load_image

    files = w["image"]
    files = [files] if isinstance(files, str) else files
    if not isinstance(files, list) or not files or len(files) > _MAX_IMAGES or \
            not all(isinstance(f, str) and f for f in files):
        _die(f"{where}: image must be an image file's path or a list of 1 to {_MAX_IMAGES} paths "
             f"(relative to the workload file), got {json.dumps(w['image'])[:80]}", 2)
    msgs = w.get("messages")
    users = [i for i, m in enumerate(msgs or []) if m.get("role") == "user"]
    if not users:
        _die(f"{where}: image needs messages with a user message to attach the image to", 2)
    base = Path(path).parent
    parts = []
    for f in files:
        try:
            parts.append(load_image("image", str(base / f)))
        except ValueError as exc:
            _die(f"{where}: {exc}", 2)
    msgs = [dict(m) for m in msgs]
    text = msgs[users[-1]].get("content")
    text = [{"type": "text", "text": text}] if isinstance(text, str) else list(text or [])
    msgs[users[-1]]["content"] = parts + text
    return {**w, "messages": msgs}


def _run_one(client, args, w: dict, spec: str) -> tuple[dict, object]:
    max_tokens = args.max_tokens or w.get("max_tokens") or 256
    kw = _gen_kwargs(args, messages=w.get("messages"), prompt=w.get("prompt"),
                     max_tokens=max_tokens, spec=spec)
    kw["temperature"] = 0.0
    kw["prediction"] = w.get("prediction", "")
    kw["draft_namespace"] = w.get("draft_namespace", "")
    if w.get("grammar") is not None:
        kw["grammar"] = w["grammar"]
    for key in ("tools", "tool_choice"):
        if key in w:
            kw[key] = w[key]
    r = client.complete(**kw)
    dt = r.wall_s
    s = r.stats
    return {"seconds": round(dt, 4), "tokens": r.completion_tokens,
            "tokens_per_s": round(r.completion_tokens / dt, 2) if dt > 0 else 0.0,
            "tries": s.tries, "hits": s.hits, "kv_rolls": s.kv_rolls, "draft_tokens": s.draft_tokens,
            "rounds": s.rounds, "tokens_per_forward": round(r.completion_tokens / (s.rounds + 1), 3),
            "proposals": s.proposals, "prefill_ms": round(s.prefill_ms, 3),
            "t_ms": round(s.t_ms, 3), "v_ms": round(s.v_ms, 3), "overhead_ms": round(s.overhead_ms, 3),
            "overhead_share": round(s.overhead_share, 4), "spec_enabled": r.spec_enabled,
            "spec_reason": r.spec_reason,
            "accepted_prediction_tokens": s.accepted_prediction_tokens,
            "rejected_prediction_tokens": s.rejected_prediction_tokens,
            "tree_rounds": s.tree_rounds, "expected_accepted": round(s.expected_accepted, 3),
            "sources": s.sources}, r


def _median_run(runs: list[dict]) -> dict:
    """The run with the median time (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]


def cmd_bench(args: argparse.Namespace) -> int:
    from echospec_client import ClientError

    if args.threads < 0:
        _die(f"--threads {args.threads}: must be >= 0 (0: the usable CPUs less one)", 2)
    if args.repeat < 1:
        _die(f"--repeat {args.repeat}: must be >= 1", 2)
    if not 0 <= args.tree_nodes <= MAX_TREE_DRAFT_NODES:   # before a private stack starts
        _die(f"--tree-nodes {args.tree_nodes}: draft nodes per tree round must be in "
             f"[0, {MAX_TREE_DRAFT_NODES}] (0: chains)", 2)
    if args.tree_nodes and args.target is not None:
        _die("--tree-nodes applies to a private stack; the server at --target uses its own "
             "(its verifier's --tree-nodes)", 2)
    if args.threads and args.target is not None:
        _die("--threads applies to a private stack; the server at --target uses its own "
             "(its verifier's --threads)", 2)
    if args.threads and args.target is None:
        from echospec.services.common.config import EngineLimit
        most = int(EngineLimit("ES_MAX_THREADS"))
        if args.threads > most:   # before a private stack starts
            _die(f"--threads {args.threads}: engine threads must be in [0, {most}] (0: the usable "
                 f"CPUs less one)", 2)
    _check_sampling_flags(args)
    workloads = _load_workloads(args.workloads)
    rows = []
    with _target(args) as target:
        client = _client(args, target)
        i, w = 0, workloads[0]
        try:
            for i, w in enumerate(workloads, 1):
                print(f"echospec bench: [{i}/{len(workloads)}] {w['id']} ...", file=sys.stderr, flush=True)
                if args.warmup and i == 1:
                    _run_one(client, args, w, "off")
                offs, ons, identical = [], [], True
                for _ in range(args.repeat):   # off and on alternate: load drifts hit both alike
                    off, roff = _run_one(client, args, w, "off")
                    on, ron = _run_one(client, args, w, "on")
                    identical &= list(roff.token_ids) == list(ron.token_ids) and roff.text == ron.text
                    offs.append(off)
                    ons.append(on)
                off, on = _median_run(offs), _median_run(ons)
                row = {"id": w["id"], "kind": w.get("kind", ""), "identical": identical, "off": off, "on": on}
                if args.repeat > 1:
                    row["off_seconds"] = [x["seconds"] for x in offs]
                    row["on_seconds"] = [x["seconds"] for x in ons]
                rows.append(row)
                if args.json:
                    print(json.dumps(row, ensure_ascii=False), flush=True)
        except ClientError as exc:
            # the run stops at the first failure (a server that is down would fail every later
            # workload too), with the finished rows shown and the failed workload named
            if not args.json and rows:
                _print_table(rows)
                sys.stdout.flush()
            _client_error(exc, target, f"workload {i}/{len(workloads)} {w['id']!r} failed "
                                       f"({len(rows)} finished)")
        finally:
            client.close()
    if not args.json:
        _print_table(rows)
    return 0 if all(r["identical"] for r in rows) else 1


def _print_table(rows: list[dict]) -> None:
    hdr = (f"{'workload':<15} {'off s':>7} {'on s':>7} {'net':>7} {'off tok/s':>9} {'on tok/s':>9} "
           f"{'tokens':>6} {'tries':>5} {'hits':>5} {'kv_rolls':>8} {'T ms':>6} {'V ms':>6} "
           f"{'ovh ms':>6} {'tok/fwd':>7} {'identical':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        off, on = r["off"], r["on"]
        net = (off["seconds"] / on["seconds"] - 1.0) * 100 if on["seconds"] > 0 else 0.0
        print(f"{r['id']:<15} {off['seconds']:>7.2f} {on['seconds']:>7.2f} {net:>+6.1f}% "
              f"{off['tokens_per_s']:>9.1f} {on['tokens_per_s']:>9.1f} {on['tokens']:>6} {on['tries']:>5} "
              f"{on['hits']:>5} {on['kv_rolls']:>8} {on['t_ms']:>6.2f} {on['v_ms']:>6.2f} "
              f"{on['overhead_ms']:>6.2f} {on['tokens_per_forward']:>7.2f} {'yes' if r['identical'] else 'NO':>9}")
    t_off = sum(r["off"]["seconds"] for r in rows)
    t_on = sum(r["on"]["seconds"] for r in rows)
    if t_on > 0:
        print(f"total: off {t_off:.2f} s, on {t_on:.2f} s, net {(t_off / t_on - 1) * 100:+.1f}% "
              f"(positive = speculation faster); identical: "
              f"{sum(r['identical'] for r in rows)}/{len(rows)}")




def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run workloads greedy with speculation off and on")
    p.add_argument("--workloads", required=True, help="JSONL: id, messages (or prompt); optional "
                   "max_tokens (default 256), prediction (text), draft_namespace, grammar "
                   "(one key: json_schema, json_object, lark or gbnf), tools and tool_choice, "
                   "image (a file or a list of files, relative to the JSONL, put before the last "
                   "user message's text)")
    p.add_argument("--k", type=_int32, default=0, help="drafts per round (0: server default)")
    p.add_argument("--max-tokens", type=_int32, default=0, help="override each workload's max_tokens")
    p.add_argument("--threads", type=_int32, default=0, help="engine threads of a private stack")
    p.add_argument("--tree-nodes", type=_int32, default=0,
                   help="the private stack's verifier --tree-nodes (token-tree rounds; 0: chains)")
    p.add_argument("--mmproj", default="", metavar="FILE",
                   help="the private stack's vision projector (a Qwen3-VL model's mmproj GGUF), for "
                        "workloads with an image")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up run")
    p.add_argument("--repeat", type=_int32, default=1,
                   help="off/on pairs per workload, alternating; the table shows the median run of each")
    p.add_argument("--timeout", type=_seconds, default=900.0,
                   help="seconds to connect, and for each generation (default 900)")
    _add_client_args(p, "print one JSON line per workload (as each finishes) instead of the table")
    p.set_defaults(fn=cmd_bench)
