"""Build hooks: generate the gRPC stubs from protos/ (the server's and the light client's) and
compile the engine via cffi.

Everything else lives in pyproject.toml.
"""
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithProtos(build_py):
    """Run scripts/gen_protos.py (protos/ -> echospec/v1/*_pb2*.py, and the light client's
    clients/python/echospec_client/v1/*_pb2*.py) before build_py."""

    def run(self):
        subprocess.check_call([sys.executable, str(ROOT / "scripts" / "gen_protos.py")], cwd=ROOT)
        subprocess.check_call([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--client"],
                              cwd=ROOT)
        super().run()


setup(
    cffi_modules=["engine_c/build_ffi.py:ffibuilder"],
    cmdclass={"build_py": BuildPyWithProtos},
)
