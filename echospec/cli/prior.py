"""`echospec prior`: build a model's draft prior (services/draft/prior.py) from its own answers.

The model answers each prompt of a prompt file (one per line; default: the 320 general prompts of
services/draft/prior_prompts.txt) greedily in the engine, through its chat template when it has
one, and the answers become the prior's table. A verifier serving that model file then loads it
(`echospec serve --draft-prior auto`, the default, reads it from where this command caches it).

    echospec prior                          # the default model: about 100 s on 2 cores
    echospec prior --if-missing             # ... unless it was built already and reads (scripts/run_main.sh)
    echospec prior --model gemma3-270m --chat-template t.jinja
    echospec prior --model M.gguf --out M.prior.npz --prompts my_prompts.txt --max-tokens 128
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from echospec.cli.common import _check_chat_template, _check_model, _die, _resolve_model, prior_problem


def default_prompts() -> Path:
    """The prompt file shipped with the services (installed beside the draft package)."""
    from echospec.services import draft
    return Path(draft.__file__).resolve().parent / "prior_prompts.txt"


class PromptTooLong(ValueError):
    """A prompt whose tokens and the answer's do not fit the model's trained context; ``index``
    is its place among the prompts (from 0)."""

    def __init__(self, msg: str, index: int):
        super().__init__(msg)
        self.index = index


def read_prompts(path: str | os.PathLike[str]) -> list[str]:
    """The non-empty lines of a UTF-8 prompt file, stripped."""
    return [p for _, p in read_prompt_lines(path)]


def read_prompt_lines(path: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """The non-empty lines of a UTF-8 prompt file, stripped, each with its line number (from 1).

    Raises:
        ValueError: an empty path, unreadable, not UTF-8, or no prompt in it.
    """
    if not str(path):
        raise ValueError("--prompts: an empty path (leave --prompts out for the shipped prompts)")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--prompts {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--prompts {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    prompts = [(i + 1, line.strip()) for i, line in enumerate(text.splitlines()) if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompt in it (one per line)")
    return prompts


def chat_template_of(model_path: str, chat_template: str = ""):
    """The chat template a model's prompts go through: the file ``chat_template``, else the
    model's own (a template without one refuses to render: the prompt is then continued)."""
    from echospec.services.coordinator.server import read_chat_template
    from echospec.services.text.chat_template import ChatTemplate
    from echospec.services.text.tokenizer import read_tokenizer_metadata

    meta = read_tokenizer_metadata(model_path)
    return ChatTemplate.from_metadata(meta, read_chat_template(chat_template) if chat_template else None)


def probe(model) -> None:
    """The verifier's warm-up on ``model`` (services/verifier/sessions.py VerifierCore.warm_up: a
    short prompt and a few greedy steps), so that a model `echospec serve` refuses (a NaN logits
    row: ES_ERR_BAD_WEIGHTS) gives no prior either.

    Raises:
        EngineError: as the verifier's warm-up."""
    from echospec.services.verifier.engine import MIN_CTX

    with model.new_session(n_ctx=MIN_CTX, n_threads=1) as s:
        pending, _ = s.prefill([min(1, model.info.n_vocab - 1)] * 4)
        for _ in range(8):
            pending = int(s.forward([pending])[0][0])


def answers(model_path: str, prompts: Sequence[str], max_tokens: int = 256, n_threads: int = 0,
            chat_template: str = "", progress: Callable[[int, int, int], None] | None = None
            ) -> tuple[list[list[int]], int]:
    """The model's greedy answer to each prompt: its output token ids, up to ``max_tokens``, EOS
    excluded, and the model's vocabulary size. Chat models answer the prompt as a user message; a
    model with neither a chat template nor ``chat_template`` (a file) continues the prompt text.

    Args:
        progress: called after each answer with (answers done, of how many, tokens so far).
    Raises:
        PromptTooLong: a prompt's tokens plus ``max_tokens`` exceed the model's trained context
            (checked for every prompt before the first answer). ValueError: an unreadable model
            or template file. EngineError: the engine refused.
    """
    from echospec.services.text.chat_template import MissingChatTemplateError
    from echospec.services.text.tokenizer import Tokenizer
    from echospec.services.verifier.engine import MIN_CTX, Model

    tmpl = chat_template_of(model_path, chat_template)
    tok = Tokenizer.from_gguf(model_path)
    eos = sorted(tok.eos_ids)
    threads = n_threads or len(os.sched_getaffinity(0))
    out: list[list[int]] = []
    total = 0
    with Model(model_path) as model:
        probe(model)
        inputs = []
        for i, p in enumerate(prompts):
            try:
                text = tmpl.render([{"role": "user", "content": p}], add_generation_prompt=True)
            except MissingChatTemplateError:
                text = p
            inputs.append(tok.encode(text))
            n_ctx = model.info.n_ctx_train
            if n_ctx > 0 and len(inputs[-1]) + max_tokens > n_ctx:
                raise PromptTooLong(f"{len(inputs[-1])} tokens, which with --max-tokens {max_tokens} "
                                    f"exceed the model's context of {n_ctx}", i)
        for i, ids in enumerate(inputs):
            # the engine's smallest KV (MIN_CTX) holds a short prompt and answer of a base model
            with model.new_session(n_ctx=max(MIN_CTX, len(ids) + max_tokens + 1), n_threads=threads) as s:
                first, _ = s.prefill(ids)
                seq = [first]
                if first not in eos and max_tokens > 1:
                    seq += s.decode(first, max_tokens - 1, stop_ids=eos)[0]
            seq = [t for t in seq if t not in eos]
            out.append(seq)
            total += len(seq)
            if progress is not None:
                progress(i + 1, len(prompts), total)
        return out, model.info.n_vocab


def cmd_prior(args: argparse.Namespace) -> int:
    from echospec.services.draft.prior import DraftPrior, PriorError, default_path
    from echospec.services.verifier.engine import EngineError

    if not 1 <= args.max_tokens <= 4096:
        _die(f"--max-tokens must be in [1, 4096], got {args.max_tokens}", 2)
    from echospec.services.common.config import EngineLimit
    most = int(EngineLimit("ES_MAX_THREADS"))
    if not 0 <= args.threads <= most:
        _die(f"--threads must be in [0, {most}], got {args.threads}", 2)
    if args.out == "":
        _die("--out: an empty path (leave --out out for the cached prior's place)", 2)
    try:
        lines = read_prompt_lines(args.prompts if args.prompts is not None else default_prompts())
    except ValueError as exc:
        _die(str(exc), 2)
    prompts = [p for _, p in lines]
    template = _check_chat_template(args.chat_template) if args.chat_template else ""
    model = _resolve_model(args.model)
    _check_model(model)   # exit 2: no such file, a directory; 1: the engine refuses it
    try:
        out = args.out or default_path(model)
    except PriorError as exc:
        _die(str(exc), 2)
    if os.path.islink(out):   # the file it points to is the prior's, not the link
        out = os.path.realpath(out)
    if args.if_missing and os.path.isfile(out):
        why = prior_problem(out, model)
        if not why:
            print(f"echospec prior: {out} is there already (--if-missing)", file=sys.stderr)
            print(out)
            return 0
        print(f"echospec prior: {why}; building it again", file=sys.stderr)
    _check_out(out)
    t0 = time.perf_counter()

    def progress(done: int, n: int, tokens: int) -> None:
        if done == n or done % 20 == 0:
            print(f"echospec prior: {done}/{n} answers, {tokens} tokens, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    try:
        chat = chat_template_of(model, template).missing is None
    except (OSError, ValueError) as exc:
        _die(f"--model {model}: {exc}")
    if not chat and not args.prompts:
        print(f"echospec prior: note: {os.path.basename(model)} has no chat template, so it continues "
              f"each prompt as text, and the default prompts are instructions for a chat model (a "
              f"base model mostly repeats itself after them): give --prompts with openings of the "
              f"text it will serve, or --chat-template", file=sys.stderr, flush=True)
    print(f"echospec prior: {model} answers {len(prompts)} prompts (up to {args.max_tokens} tokens "
          f"each{'' if chat else ', continued as text'}) ...", file=sys.stderr, flush=True)
    try:
        seqs, n_vocab = answers(model, prompts, args.max_tokens, args.threads, template, progress)
        prior = DraftPrior(seqs, n_vocab, model=os.path.basename(model))
        prior.save(out)
    except PromptTooLong as exc:
        n, line = exc.index + 1, lines[exc.index][0]
        _die(f"--prompts: prompt {n} (line {line}) is {exc}; shorten it or lower --max-tokens", 2)
    except EngineError as exc:
        _die(f"--model {model}: the engine refused it ({exc}); `echospec serve` would too")
    except (OSError, ValueError) as exc:
        _die(str(exc))
    print(f"echospec prior: {prior.n_tokens} tokens, {len(prior)} contexts -> {out}", file=sys.stderr)
    print(out)
    return 0


def _check_out(out: str) -> None:
    """Exit (status 2) unless a file can be written at ``out``: checked before the answers, which
    take minutes. Creates the missing directories above it. The prior is written beside ``out``
    and renamed onto it, so anything there but a regular file (a device, a pipe) is refused."""
    if os.path.isdir(out):
        _die(f"--out {out} is a directory", 2)
    if os.path.exists(out) and not os.path.isfile(out):
        _die(f"--out {out} is not a regular file (a device, pipe or socket); give a file's path", 2)
    parent = os.path.dirname(os.path.abspath(out))
    above = parent
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):    # makedirs would say "File exists"
        _die(f"--out {out}: cannot write there ({above} is not a directory)", 2)
    try:
        os.makedirs(parent, exist_ok=True)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        _die(f"--out {out}: cannot write there ({exc.strerror or exc})", 2)


def add_parser(sub) -> None:
    p = sub.add_parser("prior", help="build a model's draft prior (the table a verifier drafts free "
                                     "text from) from its own answers")
    p.add_argument("--model", help="GGUF file or model name (smollm2-135m, gemma3-270m; default: "
                                   "SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--out", help="the prior's file (default: where `echospec serve --draft-prior auto` "
                                 "looks for this model's: $ECHOSPEC_PRIORS, else <ECHOSPEC_CACHE>/priors/); "
                                 "missing directories above it are made, a symbolic link's file is written")
    p.add_argument("--prompts", help="UTF-8 text file, one prompt per line (default: the 320 general "
                                     "prompts shipped in services/draft/prior_prompts.txt)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer at most (default 256)")
    p.add_argument("--threads", type=int, default=0, help="engine threads (0: every CPU this process "
                                                          "may use)")
    p.add_argument("--chat-template", help="a Jinja chat template file for a model without its own "
                                           "(without either, each prompt is continued as text)")
    p.add_argument("--if-missing", action="store_true", help="do nothing when the prior's file is "
                                                              "there already and readable for this "
                                                              "model")
    p.set_defaults(fn=cmd_prior)
