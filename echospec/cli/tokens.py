"""`echospec tokenize` and `echospec detokenize`: the coordinator's tokenizer."""
from __future__ import annotations

import argparse
import json

from echospec.cli.common import (_add_client_args, _client, _client_error, _int32, _seconds,
                                 _target, _utf8)


def _unary(args: argparse.Namespace, method: str, *call_args):
    """One unary call of the light client (--target, or a private stack); exits on an error."""
    from echospec_client import ClientError

    with _target(args) as target:
        client = _client(args, target)
        try:
            return getattr(client, method)(*call_args)
        except ClientError as exc:
            _client_error(exc, target)
        finally:
            client.close()


def cmd_tokenize(args: argparse.Namespace) -> int:
    ids = _unary(args, "tokenize", args.text)
    print(json.dumps({"token_ids": ids}) if args.json else " ".join(map(str, ids)))
    return 0


def cmd_detokenize(args: argparse.Namespace) -> int:
    text = _unary(args, "detokenize", args.ids)
    print(json.dumps({"text": text}, ensure_ascii=False) if args.json else text)
    return 0




def add_parsers(sub) -> None:
    p = sub.add_parser("tokenize", help="token ids of TEXT (no special tokens added)")
    p.add_argument("text", type=_utf8)
    _add_client_args(p)
    p.add_argument("--timeout", type=_seconds, default=60.0,
                   help="seconds for the connection and the call together (default 60)")
    p.set_defaults(fn=cmd_tokenize)

    p = sub.add_parser("detokenize", help="text of token ids")
    p.add_argument("ids", nargs="+", type=_int32)
    _add_client_args(p)
    p.add_argument("--timeout", type=_seconds, default=60.0,
                   help="seconds for the connection and the call together (default 60)")
    p.set_defaults(fn=cmd_detokenize)

