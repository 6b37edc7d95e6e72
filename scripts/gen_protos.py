"""Generate the Python stubs of protos/echospec/v1/*.proto into echospec/v1/.

The generated ``*_pb2.py`` and ``*_pb2_grpc.py`` files are
build outputs (gitignored, never edited by hand). They import each other as
``echospec.v1.<name>_pb2``, so ``from echospec.v1 import coordinator_pb2``
works with the repository root (or the installed package) on sys.path.

The light client (clients/python) gets the public protos (common, coordinator)
as ``echospec_client.v1`` from `generate_client`: the same protoc output with
the imports between the stubs renamed, so the client installs without the
server package. Both sets register the same proto files (same names, same
bytes) in protobuf's default pool, so they can be imported in one process.

Usage:
    python scripts/gen_protos.py [--out DIR]     # DIR defaults to the repo root
    python scripts/gen_protos.py --client        # clients/python/echospec_client/v1/
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


CLIENT_PROTOS = ("common", "coordinator")   # the public API: what a client of the coordinator needs
CLIENT_DIR = ROOT / "clients" / "python" / "echospec_client" / "v1"


def generate_client(out_pkg_dir: Path | str = CLIENT_DIR) -> list[Path]:
    """Generate the client's stubs of CLIENT_PROTOS into `out_pkg_dir` as package echospec_client.v1.

    protoc writes ``from echospec.v1 import x_pb2`` (the import path follows the
    proto file path); those lines, and only those, are rewritten to
    ``from echospec_client.v1 import x_pb2``.

    Args:
        out_pkg_dir: the directory of the echospec_client.v1 package.
    Returns:
        The generated file paths.
    Raises:
        RuntimeError: protoc failed.
    """
    import tempfile

    from grpc_tools import protoc  # build-time dependency (grpcio-tools)
    import grpc_tools

    out = Path(out_pkg_dir)
    out.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    protos = [str(PACKAGE_DIR / f"{name}.proto") for name in CLIENT_PROTOS]
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        code = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}",
                            f"--python_out={tmp}", f"--grpc_python_out={tmp}", *protos])
        if code != 0:
            raise RuntimeError(f"grpc_tools.protoc failed with exit code {code} on {protos}")
        for src in sorted((Path(tmp) / PACKAGE_DIR).glob("*_pb2*.py")):
            lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
            lines = ["from echospec_client.v1 import" + ln[len("from echospec.v1 import"):]
                     if ln.startswith("from echospec.v1 import") else ln for ln in lines]
            dst = out / src.name
            dst.write_text("".join(lines), encoding="utf-8")
            written.append(dst)
    return written


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
    parser.add_argument("--out", default=None,
                        help="output root (default: repo root; with --client: the client's v1 package dir)")
    parser.add_argument("--client", action="store_true",
                        help="generate the light client's echospec_client.v1 stubs instead")
    ns = parser.parse_args(argv)
    try:
        if ns.client:
            files = generate_client(ns.out or CLIENT_DIR)
        else:
            files = generate(ns.out or ROOT)
    except RuntimeError as exc:
        print(f"gen_protos: {exc}", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
