"""The rooms of services/ import downward only: gateway -> coordinator -> verifier -> draft, all
of them over the shared rooms rpc/ and text/, which sit over common/. Nothing in services/
imports the echospec package above it (the CLI, the stack launcher)."""
import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[1] / "services"
LEVEL = {"common": 0, "rpc": 1, "text": 1, "draft": 2, "verifier": 3, "coordinator": 4, "gateway": 5}
# config.load validates the TLS files before a model loads (grpc_util.Tls.validate), a lazy import
# kept so that a bad certificate fails while the settings are read.
ALLOWED = {("common/config.py", "echospec.services.rpc.grpc_util")}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


def test_every_room_has_a_level():
    rooms = {p.name for p in SERVICES.iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(LEVEL)


def test_no_room_imports_a_higher_one():
    upward = []
    for path in sorted(SERVICES.rglob("*.py")):
        rel = path.relative_to(SERVICES)
        if len(rel.parts) < 2:
            continue
        room = rel.parts[0]
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[0] != "echospec":
                continue
            if parts[1:2] != ["services"]:
                if parts[1:2] not in (["v1"], ["_engine"]):   # stubs and the C extension: below all
                    upward.append(f"{rel.as_posix()} imports {mod}")
                continue
            other = parts[2] if len(parts) > 2 else ""
            if other in LEVEL and other != room and LEVEL[other] >= LEVEL[room] \
                    and (rel.as_posix(), mod) not in ALLOWED:
                upward.append(f"{rel.as_posix()} imports {mod}")
    assert not upward, "\n".join(upward)
