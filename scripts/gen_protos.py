"""Generate the Python stubs of protos/echospec/v1/*.proto into echospec/v1/.

The generated ``*_pb2.py`` and ``*_pb2_grpc.py`` files are
build outputs (gitignored, never edited by hand). They import each other as
``echospec.v1.<name>_pb2``, so ``from echospec.v1 import coordinator_pb2``
works with the repository root (or the installed package) on sys.path.

Usage:
    python scripts/gen_protos.py [--out DIR]     # DIR defaults to the repo root
From setup.py / tests:
    from scripts.gen_protos import generate; generate()
Exit status: 0 on success, 1 with protoc's message on stderr on failure.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = Path("echospec") / "v1"


def proto_files() -> list[Path]:
    """Return the .proto files of echospec.v1, sorted (paths under protos/)."""
    return sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_dir: Path | str = ROOT) -> list[Path]:
    """Run grpc_tools.protoc over every echospec.v1 proto.

    Args:
        out_dir: directory receiving ``echospec/v1/*_pb2*.py`` (the repo root
            by default; setup.py may pass its build directory).
    Returns:
        The generated file paths.
    Raises:
        RuntimeError: protoc failed (the message holds its exit code).
    """
    from grpc_tools import protoc  # build-time dependency (grpcio-tools)
    import grpc_tools

    out = Path(out_dir)
    (out / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    for init in (out / "echospec" / "__init__.py", out / PACKAGE_DIR / "__init__.py"):
        if not init.exists():
            init.write_text('"""Generated package (scripts/gen_protos.py)."""\n')
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    protos = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with exit code {code} on {protos}")
    return sorted((out / PACKAGE_DIR).glob("*_pb2*.py*"))


def ensure_generated() -> None:
    """Generate the stubs into the repo root when any is missing or older than its proto."""
    for proto in proto_files():
        stem = proto.stem
        outs = [ROOT / PACKAGE_DIR / f"{stem}_pb2.py", ROOT / PACKAGE_DIR / f"{stem}_pb2_grpc.py"]
        if any(not o.exists() or o.stat().st_mtime < proto.stat().st_mtime for o in outs):
            generate(ROOT)
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT), help="output root (default: repo root)")
    ns = parser.parse_args(argv)
    try:
        files = generate(ns.out)
    except RuntimeError as exc:
        print(f"gen_protos: {exc}", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
