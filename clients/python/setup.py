"""Build of the light client: the gRPC stubs of the public protos, then a pure-Python wheel.

In the repository the stubs are generated from ../../protos by scripts/gen_protos.py
(generate_client) each time this file runs; an sdist carries them already generated
(MANIFEST.in), so it builds without the repository. The dependencies are the grpcio and
protobuf versions the stubs were generated for, read from the stubs themselves.
"""
import importlib.util
import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STUBS = HERE / "echospec_client" / "v1"


def _generate() -> None:
    script = REPO / "scripts" / "gen_protos.py"
    if script.is_file() and (REPO / "protos" / "echospec" / "v1" / "coordinator.proto").is_file():
        spec = importlib.util.spec_from_file_location("echospec_gen_protos", script)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.generate_client(STUBS)
    elif not (STUBS / "coordinator_pb2_grpc.py").is_file():
        raise RuntimeError(f"no protos at {REPO / 'protos'} and no generated stubs in {STUBS}")


def _requirements() -> list[str]:
    grpc_ver = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'",
                         (STUBS / "coordinator_pb2_grpc.py").read_text(encoding="utf-8"))
    pb_ver = re.search(r"# Protobuf Python Version: ([0-9.]+)",
                       (STUBS / "coordinator_pb2.py").read_text(encoding="utf-8"))
    if grpc_ver is None or pb_ver is None:
        raise RuntimeError(f"cannot read the generator versions from the stubs in {STUBS}")
    return [f"grpcio>={grpc_ver.group(1)}", f"protobuf>={pb_ver.group(1)}"]


_generate()
setup(install_requires=_requirements())
