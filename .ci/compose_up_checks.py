"""The generation checks of .ci/compose_up.sh, against a running compose stack.

    python .ci/compose_up_checks.py http  HOST:PORT
    python .ci/compose_up_checks.py move  GRPC_TARGET NAME=HOST:PORT NAME=HOST:PORT \
        --container-prefix PREFIX --kill CMD...

http: one chat completion through the gateway (urllib, no client library); prints its text.

move: a greedy 200-token streamed generation, run twice on the same prompt: once untouched
(the reference), then again while the verifier serving it is killed after its first tokens.
The serving verifier is the one whose /metrics shows a GenerateTokens call in flight
(`echospec_rpc_in_flight`, HOST:PORT of NAME); NAME is its compose service name, the host part
of the coordinator's address for it, and `CMD PREFIX+NAME-1` kills its container. Passes
when the second generation ends without error, its result reports a move away from the killed
verifier, and its text and tokens equal the reference's.

Exit status 0 on success; 1 with a message on stderr otherwise.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import urllib.request

from echospec_client import Client

# A raw prompt the model continues for the whole budget (no EOS in sight).
COUNT_PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
MAX_TOKENS = 200
KILL_AFTER_TOKENS = 16


def check_http(target: str) -> None:
    with urllib.request.urlopen(f"http://{target}/v1/models", timeout=30) as r:
        model = json.load(r)["data"][0]["id"]   # the one served: another name is a 404
    body = json.dumps({"model": model, "max_tokens": 24,
                       "messages": [{"role": "user", "content": "Name three planets."}]}).encode()
    req = urllib.request.Request(f"http://{target}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        reply = json.load(r)
    text = reply["choices"][0]["message"]["content"]
    used = reply["usage"]["completion_tokens"]
    if not text.strip() or used < 1:
        raise RuntimeError(f"empty completion: {reply}")
    print(f"{used} tokens: {text.strip()[:60]!r}")


def _in_flight(metrics: str) -> int:
    """GenerateTokens calls in flight on a verifier, from its /metrics text."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as r:
        text = r.read().decode()
    n = 0
    for m in re.finditer(r'^echospec_rpc_in_flight\{[^}]*GenerateTokens[^}]*\} (\S+)$', text, re.M):
        n += int(float(m.group(1)))
    return n


def check_move(target: str, verifiers: dict[str, str], prefix: str, kill: list[str]) -> None:
    with Client(target, timeout=300) as c:
        ref = c.complete(COUNT_PROMPT, max_tokens=MAX_TOKENS, temperature=0, spec=False)
        if ref.completion_tokens != MAX_TOKENS or ref.moves:
            raise RuntimeError(f"reference run: {ref.completion_tokens} tokens "
                               f"({ref.finish_reason}), moves {ref.moves}; expected "
                               f"{MAX_TOKENS}, none")
        tokens, killed, result = 0, "", None
        for chunk in c.stream(COUNT_PROMPT, max_tokens=MAX_TOKENS, temperature=0, spec=False):
            tokens += len(chunk.token_ids)
            if not killed and tokens >= KILL_AFTER_TOKENS:
                serving = [name for name, m in verifiers.items() if _in_flight(m) > 0]
                if len(serving) != 1:
                    raise RuntimeError(f"after {tokens} tokens, GenerateTokens in flight on "
                                       f"{serving or 'no verifier'}; expected exactly one")
                killed = serving[0]
                subprocess.run(kill + [f"{prefix}{killed}-1"], check=True, capture_output=True,
                               timeout=30)
                print(f"killed {killed} after {tokens} tokens;", flush=True)
            if chunk.result is not None:
                result = chunk.result
    if not killed:
        raise RuntimeError(f"the generation ended after {tokens} tokens, before the kill")
    if result is None:
        raise RuntimeError("the stream ended without a result")
    if not result.moves:
        raise RuntimeError(f"no move reported (verifier {result.verifier}); killed {killed}")
    m = result.moves[0]
    if m.from_verifier.split(":")[0] != killed:
        raise RuntimeError(f"the move was from {m.from_verifier}, but {killed} was killed")
    if result.text != ref.text or result.token_ids != ref.token_ids:
        raise RuntimeError(f"text after the move differs from the reference:\n  "
                           f"{result.text!r}\n  {ref.text!r}")
    print(f"{result.completion_tokens} tokens, moved {m.from_verifier} -> {m.to_verifier} at "
          f"token {m.at_token} ({m.reason[:60]}), resume {m.resume_ms:.0f} ms; text equals the "
          f"uninterrupted run")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="check", required=True)
    h = sub.add_parser("http")
    h.add_argument("target")
    m = sub.add_parser("move")
    m.add_argument("target")
    m.add_argument("verifiers", nargs=2, metavar="NAME=HOST:PORT")
    m.add_argument("--container-prefix", default="")
    m.add_argument("--kill", nargs=argparse.REMAINDER, required=True)
    args = p.parse_args(argv)
    try:
        if args.check == "http":
            check_http(args.target)
        else:
            check_move(args.target, dict(v.split("=", 1) for v in args.verifiers),
                       args.container_prefix, args.kill)
    except Exception as exc:  # noqa: BLE001 - any failure is the check's failure, with why
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
