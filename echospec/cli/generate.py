"""`echospec generate`: one generation, streamed to stdout (or one JSON object)."""
from __future__ import annotations

import argparse
import json
import sys

from echospec.cli import common
from echospec.cli.common import (_add_client_args, _add_sampling_args, _check_sampling_flags, _die,
                                 _client_error, _gen_kwargs, _int32, _load_messages, _result_json,
                                 _target, _utf8)


def cmd_generate(args: argparse.Namespace) -> int:
    from echospec_client import ClientError

    if (args.prompt is None) == (args.messages is None):
        _die("give exactly one of a prompt argument or --messages FILE", 2)
    if args.prompt == "":
        _die("the prompt text is empty: give some text to continue", 2)
    _check_sampling_flags(args)
    messages = _load_messages(args.messages) if args.messages else None
    prompt = args.prompt
    if args.image:
        parts = [common.read_image("--image", path) for path in args.image]
        if messages is None:   # the prompt becomes a user message after the images
            messages, prompt = [{"role": "user", "content": parts + [{"type": "text",
                                                                      "text": args.prompt}]}], None
        else:                  # the images go before the last user message's text
            users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
            if not users:
                _die(f"--image: --messages {args.messages} has no user message to attach "
                     f"the image to", 2)
            text = users[-1].get("content")
            text = [{"type": "text", "text": text}] if isinstance(text, str) else list(text or [])
            users[-1]["content"] = parts + text
    kw = _gen_kwargs(args, messages=messages, prompt=prompt)
    if args.logprobs is not None:
        from echospec_client.limits import MAX_TOP_LOGPROBS
        if not 0 <= args.logprobs <= MAX_TOP_LOGPROBS:
            _die(f"--logprobs {args.logprobs}: must be in [0, {MAX_TOP_LOGPROBS}] (the alternatives "
                 f"shown per token)", 2)
        kw["logprobs"], kw["top_logprobs"] = True, args.logprobs
    with _target(args) as target:
        client = common._client(args, target)
        open_line = False   # streamed text not ended by a newline yet
        try:
            result = None
            for chunk in client.stream(**kw):
                if chunk.text and not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    open_line = not chunk.text.endswith("\n")
                if chunk.result is not None:
                    result = chunk.result
            if args.json:
                j = _result_json(result)
                # measured by the client, from the call to its last message (connect wait excluded)
                j["wall_s"] = round(result.wall_s, 4)
                j["ttft_s"] = None if result.ttft_s is None else round(result.ttft_s, 4)
                j["tokens_per_s"] = round(result.tokens_per_s, 2)
                if args.logprobs is not None:
                    j["logprobs"] = [_logprob_json(lp) for lp in result.logprobs]
                print(json.dumps(j, ensure_ascii=False))
                return 0
            sys.stdout.write("\n")
            if result is not None and args.logprobs is not None:
                for lp in result.logprobs:
                    alts = ", ".join(f"{t.token!r} {t.logprob:.4f}" for t in lp.top_logprobs)
                    print(f"{lp.token!r}\t{lp.logprob:.4f}" + (f"\t[{alts}]" if alts else ""),
                          file=sys.stderr)
            if result is not None:
                st = result.stats
                print(f"[{result.completion_tokens} tokens, finish: {result.finish_reason}, spec: "
                      f"{'on' if result.spec_enabled else 'off'}"
                      f"{' (' + result.spec_reason + ')' if result.spec_reason else ''}, tries "
                      f"{st.tries}, hits {st.hits}, kv_rolls {st.kv_rolls}]", file=sys.stderr)
            return 0
        except ClientError as exc:
            if open_line:   # the message goes on a line of its own, not after the partial text
                sys.stdout.write("\n")
                sys.stdout.flush()
            _client_error(exc, target)
        except (TypeError, ValueError) as exc:
            _die(str(exc), 2)
        finally:
            client.close()




def _logprob_json(lp) -> dict:
    """A client TokenLogprob as JSON (bytes as a list of ints, as OpenAI gives them)."""
    def one(x) -> dict:
        return {"token_id": x.token_id, "token": x.token, "bytes": list(x.bytes), "logprob": x.logprob}
    return {**one(lp), "top_logprobs": [one(t) for t in lp.top_logprobs]}


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt or chat messages")
    p.add_argument("prompt", nargs="?", type=_utf8, help="prompt text")
    p.add_argument("--messages", help="JSON file with a list of chat messages ('-': standard input)")
    p.add_argument("--image", metavar="FILE", action="append", default=[],
                   help="an image (PNG, JPEG, WebP, GIF) sent with the prompt, which is then a "
                        "chat user message (with --messages: before the last user message's "
                        "text); repeatable")
    p.add_argument("--prediction-file", help="text file with the expected output (a draft source, "
                   "like OpenAI's predicted outputs)")
    p.add_argument("--draft-namespace", type=_utf8, default="",
                   help="share draft memory with earlier requests of this namespace (default: none)")
    p.add_argument("--tree-nodes", dest="request_tree_nodes", metavar="N", type=_int32, default=0,
                   help="speculation: draft nodes a round verifies as a token tree (1..63; 0: the "
                        "server's default, its verifier's --tree-nodes; -1: chains)")
    p.add_argument("--json-schema", metavar="FILE", help="constrained output: JSON following the "
                   "JSON schema in FILE")
    p.add_argument("--json-object", action="store_true", help="constrained output: any JSON object")
    p.add_argument("--lark", metavar="FILE", help="constrained output: the Lark grammar in FILE "
                   "(rule start)")
    p.add_argument("--gbnf", metavar="FILE", help="constrained output: the GBNF grammar in FILE "
                   "(rule root)")
    p.add_argument("--logprobs", metavar="N", type=int, default=None,
                   help="each token's logprob and its N (0..20) most likely alternatives: on "
                   "standard error after the text, or in --json's \"logprobs\"")
    _add_client_args(p, "print one JSON object: the result, its stats, wall_s, ttft_s, tokens_per_s")
    _add_sampling_args(p)
    p.set_defaults(fn=cmd_generate)

