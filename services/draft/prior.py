"""The model's own next token from a table of its earlier outputs: the draft prior. Pure.

A draft prior is an n-gram table of what one model writes: token sequences it produced greedily
(its answers to a set of prompts, ``prior_prompts.txt``; built by ``echospec prior``). For each
context of 1 .. ``max_n`` tokens that occurs in them it keeps the token that most often follows
(ties: the one seen first). ``next(history)`` looks up the longest context the history ends with
and returns that token, or None where no context matches.

Where the other sources have nothing (free text: no repeat, list or prediction), the verifier
drafts this one token beside the pending one. A verify of one draft costs about what a decode
step costs (V(1) / T is 1.02 for SmolLM2 at one thread), so a draft that the model takes a
quarter of the time already pays; the generation loop drafts it only while its acceptance in this
generation says it does (``PriorStats``).

Worked example (max_n = 2), sequences [[1, 2, 3], [1, 2, 4], [5, 2, 3]]:
    contexts (2,) -> 3 (twice, 4 once); (1, 2) -> 3 (seen first, a tie with 4); (5, 2) -> 3;
    next([9, 1, 2]) = 3 (context (1, 2)); next([7, 2]) = 3 (context (2,)); next([6]) = None.

File (numpy .npz, no pickles): ``tokens`` int32, the sequences one after another; ``ends``
int64, each sequence's end offset; ``n_vocab`` and ``max_n`` int64 scalars; ``model`` the name
of the model whose outputs they are (for people; the table works with any model of the same
vocabulary, only its acceptance differs); ``version``. The table is rebuilt on load (about 0.3 s
for 50k tokens).
"""
from __future__ import annotations

import os
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

PRIOR_VERSION = 1
MAX_N = 4


class PriorError(ValueError):
    """A draft prior that cannot be built or read; the message says why."""


class DraftPrior:
    """The most frequent next token after each context of 1 .. max_n tokens of some sequences.

    Args:
        seqs: token sequences (ints in [0, n_vocab)). n_vocab: the vocabulary size.
        max_n: the longest context, 1 .. 8. model: a name for the model that wrote them.
    Raises:
        PriorError: an id outside [0, n_vocab), n_vocab < 1 or max_n out of range.
    """

    def __init__(self, seqs: Iterable[Sequence[int]], n_vocab: int, max_n: int = MAX_N, model: str = ""):
        if n_vocab < 1:
            raise PriorError(f"n_vocab must be >= 1, got {n_vocab}")
        if not 1 <= max_n <= 8:
            raise PriorError(f"max_n must be in [1, 8], got {max_n}")
        self.n_vocab = int(n_vocab)
        self.max_n = int(max_n)
        self.model = model
        wide = [np.asarray(s, dtype=np.int64) for s in seqs]
        for i, s in enumerate(wide):       # checked before the narrowing, which would wrap 2**32 + 3 to 3
            if s.size and (int(s.min()) < 0 or int(s.max()) >= self.n_vocab):
                bad = int(s.min()) if int(s.min()) < 0 else int(s.max())
                raise PriorError(f"sequence {i} holds token id {bad}, outside [0, {self.n_vocab})")
        self.seqs = [s.astype(np.int32) for s in wide]
        counts: list[dict[tuple, Counter]] = [{} for _ in range(self.max_n + 1)]
        for s in self.seqs:
            seq = s.tolist()
            for i in range(1, len(seq)):
                for n in range(1, min(self.max_n, i) + 1):
                    counts[n].setdefault(tuple(seq[i - n:i]), Counter())[seq[i]] += 1
        # Counter.most_common keeps first-seen order among equal counts
        self._next = [{ctx: c.most_common(1)[0][0] for ctx, c in table.items()} for table in counts]

    @property
    def n_tokens(self) -> int:
        """Tokens in the sequences."""
        return sum(int(s.size) for s in self.seqs)

    def __len__(self) -> int:
        """Contexts in the table."""
        return sum(len(t) for t in self._next)

    def next(self, history: Sequence[int]) -> int | None:
        """The token most often after the longest context (up to max_n tokens) that ``history``
        ends with; None when none of its last 1 .. max_n tokens is a known context."""
        for n in range(min(self.max_n, len(history)), 0, -1):
            t = self._next[n].get(tuple(history[-n:]))
            if t is not None:
                return t
        return None

    def save(self, path: str) -> None:
        """Write the prior to ``path`` (.npz; written to a temporary file, then renamed; on a failure
        the temporary file is removed and ``path`` is unchanged)."""
        ends = np.cumsum([s.size for s in self.seqs], dtype=np.int64)
        tokens = np.concatenate(self.seqs) if self.seqs else np.zeros(0, np.int32)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                np.savez_compressed(f, tokens=tokens, ends=ends, n_vocab=np.int64(self.n_vocab),
                                    max_n=np.int64(self.max_n), model=np.str_(self.model),
                                    version=np.int64(PRIOR_VERSION))
            os.replace(tmp, path)
        except BaseException:        # a full disk, a directory at path, Ctrl-C: no temporary file left
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    @classmethod
    def load(cls, path: str, n_vocab: int | None = None) -> "DraftPrior":
        """Read a prior written by ``save``.

        Args:
            n_vocab: the serving model's vocabulary size; a prior of another size is refused.
        Raises:
            PriorError: no such file, not a prior, another version or vocabulary, bad contents.
        """
        def scalar(z, name: str) -> int:
            a = z[name]
            if not isinstance(a, np.ndarray):   # a member that is no .npy comes back as its bytes
                raise PriorError(f"draft prior {path}: {name} must be an integer scalar, got no array")
            if a.ndim != 0 or a.dtype.kind not in "iu":
                raise PriorError(f"draft prior {path}: {name} must be an integer scalar, "
                                 f"got {a.dtype} of shape {a.shape}")
            return int(a)

        try:
            with open(path, "rb") as f:
                # np.load would read a .npy as one array and anything else as a pickle it refuses
                if f.read(4) not in (b"PK\x03\x04", b"PK\x05\x06"):
                    raise zipfile.BadZipFile("not a zip archive")
            with np.load(path, allow_pickle=False) as z:
                missing = {"tokens", "ends", "n_vocab", "max_n", "version"} - set(z.files)
                if missing:
                    raise PriorError(f"draft prior {path}: not a draft prior (no {', '.join(sorted(missing))})")
                version = scalar(z, "version")
                if version != PRIOR_VERSION:
                    raise PriorError(f"draft prior {path}: version {version}, this build reads {PRIOR_VERSION}; "
                                     f"build it again with `echospec prior`")
                tokens, ends = z["tokens"], z["ends"]
                file_vocab, max_n = scalar(z, "n_vocab"), scalar(z, "max_n")
                model = str(z["model"]) if "model" in z.files else ""
        except PriorError:
            raise
        except FileNotFoundError:
            raise PriorError(f"draft prior {path}: no such file") from None
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, zlib.error) as exc:
            # zlib.error, BadZipFile (a bad CRC): a member's data damaged behind an intact directory
            raise PriorError(f"draft prior {path}: not a readable .npz file ({exc})") from None
        if n_vocab is not None and file_vocab != n_vocab:
            raise PriorError(f"draft prior {path}: built for a vocabulary of {file_vocab} tokens "
                             f"({model or 'unnamed model'}), the model has {n_vocab}")
        if not (isinstance(tokens, np.ndarray) and isinstance(ends, np.ndarray)) or tokens.ndim != 1 \
                or ends.ndim != 1 or tokens.dtype.kind != "i" or ends.dtype.kind != "i":
            raise PriorError(f"draft prior {path}: tokens and ends must be 1-D integer arrays")
        if ends.size and (np.any(np.diff(ends) < 0) or ends[0] < 0 or int(ends[-1]) != tokens.size):
            raise PriorError(f"draft prior {path}: ends must rise to the token count {tokens.size}")
        if not ends.size and tokens.size:
            raise PriorError(f"draft prior {path}: {tokens.size} tokens but no sequence ends")
        starts = np.concatenate([[0], ends[:-1]]) if ends.size else ends
        try:
            return cls([tokens[a:b] for a, b in zip(starts, ends)], file_vocab, max_n, model)
        except PriorError as exc:
            raise PriorError(f"draft prior {path}: {exc}") from None


def priors_dir() -> str:
    """Where `echospec prior` caches priors: ECHOSPEC_PRIORS, else (also when empty)
    <ECHOSPEC_CACHE>/priors, ECHOSPEC_CACHE defaulting (also when empty) to ~/.cache/echospec."""
    cache = os.environ.get("ECHOSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "echospec")
    return os.environ.get("ECHOSPEC_PRIORS") or os.path.join(cache, "priors")


def default_path(model_path: str) -> str:
    """Where `echospec prior` caches the prior of ``model_path``: <priors_dir>/<file name>.<bytes>
    .prior.npz (the size tells two files of one name apart without hashing gigabytes).

    Raises:
        PriorError: the model file cannot be read.
    """
    try:
        size = os.path.getsize(model_path)
    except OSError as exc:
        raise PriorError(f"model {model_path}: {exc.strerror or exc}") from None
    return os.path.join(priors_dir(), f"{os.path.basename(model_path)}.{size}.prior.npz")


def setting_kind(setting: str) -> str:
    """What a ``draft_prior`` setting names: "off" or "auto" (any case), else "file" (the config
    refuses a blank one)."""
    word = setting.strip().lower()
    return "off" if word == "off" else "auto" if word == "auto" else "file"


def resolve(setting: str, model_path: str) -> str:
    """The prior file a verifier loads for its ``draft_prior`` setting: "" for none ("off"; "auto"
    when ``default_path`` holds none), else a path (which ``DraftPrior.load`` then reads).

    Raises:
        PriorError: the model file cannot be read ("auto").
    """
    kind = setting_kind(setting)
    if kind == "off":
        return ""
    if kind == "auto":
        path = default_path(model_path)
        return path if os.path.isfile(path) else ""
    return setting


@dataclass
class PriorStats:
    """One generation's record of its prior drafts, and the chance that the next one is accepted.

    ``p`` is a moving average of the drafts' outcomes (weight ``alpha`` on the newest, so about the
    last 20 drafts), starting at ``seed`` (a prior's acceptance on free text is 0.15-0.3). A draft
    pays from an acceptance of about 0.05 (one more verify row costs a few % of T), so the loop
    drafts while p is at least ``min_p``; a round that does not draft moves p back toward the
    seed by ``drift`` of the gap, so text the prior stopped guessing is tried again now and then
    instead of never. Over long runs (tests/test_draft_prior.py) text whose drafts are kept 30 % of
    the time drafts in every round, 15 % in about 9 rounds of 10, and text the prior never
    guesses in about 3 of 10 (after the first 25 misses), at a few % of T each.

    Example (alpha 0.25, seed 0.25): miss, miss -> p 0.19, 0.14; hit -> 0.36.
    """

    seed: float = 0.25
    alpha: float = 0.05
    drift: float = 1 / 128
    min_p: float = 0.07
    tries: int = 0
    hits: int = 0
    p: float = -1.0

    def __post_init__(self) -> None:
        if self.p < 0:
            self.p = self.seed

    def record(self, accepted: bool) -> None:
        """One prior draft verified: accepted or not."""
        self.tries += 1
        self.hits += int(accepted)
        self.p += self.alpha * (float(accepted) - self.p)

    def idle(self) -> None:
        """A round without a prior draft."""
        self.p += self.drift * (self.seed - self.p)
