"""`echospec chat`: an interactive multi-turn chat."""
from __future__ import annotations

import argparse
import signal
import sys

from echospec.cli import common
from echospec.cli.common import (_add_client_args, _add_sampling_args, _check_sampling_flags,
                                 _client_error, _die, _gen_kwargs, _target, _utf8)


CHAT_COMMANDS = ("commands: /reset clears the history (the system prompt stays), /stats prints the "
                 "last turn's statistics, /history lists the messages, /image FILE attaches an "
                 "image (PNG, JPEG, WebP, GIF) to your next message, /quit or Ctrl-D ends; "
                 "Ctrl-C stops a reply; a line starting with // is sent with one / removed")


def _turn_line(r) -> str:
    """One line on a finished turn: its speed and how much of the prompt the prefix cache held."""
    s = r.stats
    ttft = "-" if r.ttft_s is None else f"{r.ttft_s:.3f} s"
    spec = (f", spec: tries {s.tries}, hits {s.hits}" if r.spec_enabled else "")
    return (f"[{r.completion_tokens} tokens, {r.tokens_per_s:.1f} tok/s, first token {ttft}, "
            f"prompt {r.prompt_tokens} tokens ({s.cached_prompt_tokens} cached), "
            f"finish: {r.finish_reason}{spec}]")


def _stats_text(r, turns: int, history: list[dict]) -> str:
    """The /stats report of the last turn `r` (None before the first)."""
    head = f"session: {turns} turn(s), {len(history)} message(s) in the history"
    if r is None:
        return head + "\nno turn yet"
    s = r.stats
    ttft = "-" if r.ttft_s is None else f"{r.ttft_s:.3f} s"
    spec = "on" if r.spec_enabled else "off"
    if r.spec_reason:
        spec += f" ({r.spec_reason})"
    return "\n".join([
        head,
        f"last turn: {r.completion_tokens} tokens in {r.wall_s:.3f} s ({r.tokens_per_s:.1f} tok/s), "
        f"first token after {ttft}, finish: {r.finish_reason}",
        f"prompt: {r.prompt_tokens} tokens, {s.cached_prompt_tokens} of them cached "
        f"(cached_prompt_tokens), prefill {s.prefill_ms:.1f} ms",
        f"speculation: {spec}; tries {s.tries}, hits {s.hits}, kv_rolls {s.kv_rolls}, "
        f"draft_tokens {s.draft_tokens}, acceptance rate {s.acceptance_rate:.3f}, "
        f"mean acceptance length {s.mean_acceptance_length:.3f}",
        f"T {s.t_ms:.2f} ms, V {s.v_ms:.2f} ms, overhead {s.overhead_ms:.2f} ms",
    ])


def _chat_turn(client, kw: dict, history: list[dict]):
    """Stream one reply to `history` onto stdout. Returns the Result, or None when Ctrl-C
    stopped it (the call is cancelled). Raises echospec_client.ClientError."""
    stream = client.stream(messages=history, **kw)
    result = None
    try:
        for chunk in stream:
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            if chunk.result is not None:
                result = chunk.result
    except KeyboardInterrupt:
        stream.close()   # cancels the call; the server frees the generation
        print("\n(stopped; the turn is dropped)", file=sys.stderr, flush=True)
        return None
    sys.stdout.write("\n")
    sys.stdout.flush()
    return result


def _content_text(content) -> str:
    """A history message's content for /history: its text, an image shown as [image TYPE, N bytes]."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] if p.get("type") == "text" else
                   f"[image {p.get('media_type') or '?'}, {len(p.get('image', b''))} bytes]"
                   for p in content)


def _drop_oldest_turn(history: list[dict], start: int) -> bool:
    """Drop the oldest turn after the system messages (history[:start]): its user message and
    the replies up to the next user message. False when only the newest user message is left."""
    users = [i for i in range(start, len(history)) if history[i]["role"] == "user"]
    if len(users) < 2:
        return False
    del history[users[0]:users[1]]
    return True


# tokens the chat template adds around a message (role markers, separators), roughly
TEMPLATE_TOKENS_PER_MESSAGE = 8


def _reply_room(max_tokens: int, default: int, n_ctx: int) -> int:
    """Tokens a turn keeps free in the server's context for its reply: --max-tokens (else the
    server's default), at most a quarter of the context."""
    want = max_tokens if max_tokens > 0 else (default or 256)
    return max(1, min(want, n_ctx // 4))


def _turn_tokens(client, history: list[dict], start: int) -> int:
    """About how many prompt tokens the oldest turn after history[:start] takes (its messages'
    text tokens and the template's markers; an image part counts nothing here)."""
    users = [i for i in range(start, len(history)) if history[i]["role"] == "user"]
    end = users[1] if len(users) > 1 else len(history)
    n = 0
    for m in history[users[0]:end] if users else []:
        text = m["content"] if isinstance(m["content"], str) else \
            "".join(p.get("text", "") for p in m["content"])
        n += len(client.tokenize(text)) + TEMPLATE_TOKENS_PER_MESSAGE
    return n


def _make_room(client, history: list[dict], start: int, last, line: str, room: int, n_ctx: int) -> int:
    """Drop the oldest turns until the next prompt (the last one, its reply and ``line``) leaves
    ``room`` tokens for this turn's reply in the context; returns how many were dropped. Without
    it a turn that still fits gets a reply of a few tokens, cut by the context."""
    if last is None or not n_ctx:
        return 0
    n_line = len(client.tokenize(line)) + TEMPLATE_TOKENS_PER_MESSAGE
    if n_line + room >= n_ctx:   # no drop makes room: the server says the message is too long
        return 0
    # the reply as the next prompt holds it: its text tokenized again, which may be more tokens
    # than the model wrote
    need = (last.prompt_tokens + len(client.tokenize(last.text)) + TEMPLATE_TOKENS_PER_MESSAGE
            + n_line + room)
    dropped = 0
    while need > n_ctx:
        n = _turn_tokens(client, history, start)
        if not _drop_oldest_turn(history, start):
            break
        need -= n
        dropped += 1
    return dropped


def _read_image_or_say(path: str):
    """The image part of file ``path``, or None after saying on standard error why it cannot be
    sent (the chat goes on)."""
    try:
        return common.load_image("/image", path)
    except ValueError as exc:
        print(f"echospec: {exc}", file=sys.stderr, flush=True)
        return None


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive multi-turn chat: each line is a user message, the reply streams back, and
    the history (system prompt, user and assistant messages) is sent again each turn, so the
    verifier's prefix cache supplies the KV of what the previous turns already prefilled."""
    from echospec_client import ClientError

    _check_sampling_flags(args)
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    kw = _gen_kwargs(args, messages=system)
    del kw["messages"]
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    with _target(args) as target:
        client = common._client(args, target)
        try:
            try:
                info = client.info()
            except ClientError as exc:
                _client_error(exc, target)
            if info.chat_template_missing:   # every turn would be refused: say so once, at start
                _die(f"chat needs a chat template, and the server has none: "
                     f"{info.chat_template_missing}", 2)
            # the server's limits GetInfo reports, with the server's words for them
            if info.k_max and args.k > info.k_max:
                _die(f"--k {args.k}: must be in [0, {info.k_max}] (0: the server's default "
                     f"{info.k_default})", 2)
            if info.max_tokens_limit and args.max_tokens > info.max_tokens_limit:
                _die(f"--max-tokens {args.max_tokens}: max_tokens must be in "
                     f"[1, {info.max_tokens_limit}]", 2)
            if args.system and info.n_ctx:
                # a system message the context cannot hold would fail every turn: say so at start
                try:
                    n_sys = len(client.tokenize(args.system))
                except ClientError as exc:
                    _client_error(exc, target)
                if n_sys >= info.n_ctx:
                    _die(f"--system is {n_sys} tokens; the server's context holds {info.n_ctx} "
                         f"(the system message, the turns and each reply)", 2)
            print(f"echospec chat: {target}, model {info.model}; {CHAT_COMMANDS}",
                  file=sys.stderr, flush=True)
            # Ctrl-C stops a reply (or is ignored at the prompt) instead of ending the command
            signal.signal(signal.SIGINT, signal.default_int_handler)
            history = list(system)
            pending: list[dict] = []   # /image parts for the next user message
            last, turns = None, 0
            # a prompt is for a person at a terminal: piped lines get none (it would land on
            # stdout between the replies, and the last one would end the output unterminated)
            interactive = sys.stdin.isatty()
            while True:
                try:
                    line = input("you> " if interactive else "")
                except EOFError:
                    if interactive:   # Ctrl-D: end the prompt's line
                        print(file=sys.stderr)
                    return 0
                except KeyboardInterrupt:
                    print("\n(Ctrl-D or /quit ends the chat)", file=sys.stderr, flush=True)
                    continue
                cmd = line.strip()
                if not cmd:
                    continue
                if cmd.startswith("/") and not cmd.startswith("//"):
                    if cmd in ("/quit", "/exit"):
                        return 0
                    if cmd == "/reset":
                        history = list(system)
                        pending = []
                        print("(history cleared)", flush=True)
                    elif cmd == "/image" or cmd.startswith("/image "):
                        path = cmd[len("/image"):].strip()
                        if not path:
                            print("echospec: /image FILE: name an image file", file=sys.stderr,
                                  flush=True)
                            continue
                        part = _read_image_or_say(path)
                        if part is not None:
                            pending.append(part)
                            note = "" if info.images else \
                                f"; the server's model takes no images: {info.images_missing}"
                            print(f"(image {path} attached to your next message{note})",
                                  file=sys.stderr, flush=True)
                    elif cmd == "/stats":
                        print(_stats_text(last, turns, history), flush=True)
                    elif cmd == "/history":
                        for m in history:
                            print(f"{m['role']}: {_content_text(m['content'])}")
                        if not history:
                            print("(no messages)")
                        sys.stdout.flush()
                    elif cmd == "/help":
                        print(CHAT_COMMANDS, flush=True)
                    else:
                        print(f"unknown command {cmd.split()[0]}; {CHAT_COMMANDS}", file=sys.stderr,
                              flush=True)
                    continue
                if line.startswith("//"):
                    line = line[1:]
                try:
                    line.encode("utf-8")
                except UnicodeEncodeError:   # stdin bytes that are not UTF-8 (surrogateescape)
                    print("echospec: the line is not valid UTF-8 text; it is not sent",
                          file=sys.stderr, flush=True)
                    continue
                if pending:
                    history.append({"role": "user",
                                    "content": pending + [{"type": "text", "text": line}]})
                else:
                    history.append({"role": "user", "content": line})
                try:
                    dropped = _make_room(client, history, len(system), last, line,
                                         _reply_room(args.max_tokens, info.max_tokens_default, info.n_ctx),
                                         info.n_ctx)
                except ClientError:   # the turn itself says what is wrong with the server
                    dropped = 0
                while True:
                    try:
                        result = _chat_turn(client, kw, history)
                    except ClientError as exc:
                        # a history that outgrew the context loses its oldest turns, one at a time
                        if "fit the context" in exc.details and _drop_oldest_turn(history, len(system)):
                            dropped += 1
                            continue
                        alone = not any(m["role"] == "user" for m in history[len(system):-1])
                        print(f"\nechospec: {exc.code.name}: {exc.details} (the turn is dropped"
                              + ("; the message alone is too long for the server's context: "
                                 "shorten it" if alone and "fit the context" in exc.details else
                                 "; /reset clears the history") + ")", file=sys.stderr, flush=True)
                        result = None
                    except KeyboardInterrupt:   # between the prompt and the first chunk
                        print("\n(stopped; the turn is dropped)", file=sys.stderr, flush=True)
                        result = None
                    break
                if dropped:
                    print(f"(the history outgrew the server's context: the oldest {dropped} "
                          f"turn(s) were dropped to leave room for the reply)", file=sys.stderr,
                          flush=True)
                if result is None:   # the turn is dropped, with the images attached to it
                    history.pop()
                    if pending:
                        print(f"({len(pending)} image(s) dropped with the turn; /image attaches "
                              f"again)", file=sys.stderr, flush=True)
                        pending = []
                    continue
                pending = []
                history.append({"role": "assistant", "content": result.text})
                last, turns = result, turns + 1
                print(_turn_line(result), file=sys.stderr, flush=True)
        finally:
            client.close()



def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat (streamed replies, /reset, /stats)")
    p.add_argument("--system", type=_utf8, help="system message (default: none; the chat template "
                                                "may add its own)")
    _add_client_args(p, json_help=None)
    _add_sampling_args(p)
    p.set_defaults(fn=cmd_chat)

