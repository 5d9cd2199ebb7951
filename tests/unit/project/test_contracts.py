"""The generated code matches the protos, and the import rules of STYLE.md hold."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SERVICES = ROOT / "services"


def test_generated_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def hand_written() -> list[Path]:
    return [p for p in SERVICES.rglob("*.py") if "hetero_pd" not in p.relative_to(SERVICES).parts]


def roots(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


@pytest.mark.parametrize(
    "path",
    [
        p
        for p in hand_written()
        if "policy" in p.parts or p.name in ("kvformat.py", "gpus.py", "perfmodel.py", "domain.py")
    ],
    ids=lambda p: str(p.relative_to(SERVICES)),
)
def test_pure_modules_import_no_grpc_protobuf_or_redis(path: Path) -> None:
    bad = roots(imports_of(path)) & {"grpc", "google", "redis", "hetero_pd", "grpc_health"}
    assert not bad, f"{path.name} imports {bad}"


# Modules that sit at the gRPC edge: servicers, proto conversion, bootstrap, and gRPC
# clients (`*_client.py`, the informer; the tools, `hpd_tools` with the CLI tables and
# operator commands and `hpd_fleet` with the emulated fleet, which are clients of all
# three services; the engine agent's runtime, which speaks gRPC to the registry for its
# engine).
EDGE_PACKAGES = {"hpd_fleet", "hpd_tools"}
EDGE = {
    "api.py",
    "convert.py",
    "server.py",
    "rpc.py",
    "diagnostics.py",
    "informer.py",
    "client.py",
    "grpc_client.py",
    "agent.py",
    "control_client.py",
    "auth_interceptor.py",  # the servers' token check (an interceptor)
    "tracing_interceptor.py",  # spans around RPCs, server and client (interceptors)
    "channels.py",  # every client channel, with its identity
}


@pytest.mark.parametrize("path", hand_written(), ids=lambda p: str(p.relative_to(SERVICES)))
def test_only_edge_modules_import_grpc_or_generated_code(path: Path) -> None:
    if path.name in EDGE or path.name.endswith("_client.py") or EDGE_PACKAGES & set(path.parts):
        return
    names = imports_of(path)
    generated = {n for n in names if n.startswith("hetero_pd")}
    grpc_names = roots(names) & {"grpc", "grpc_health", "grpc_reflection"}
    assert not generated and not grpc_names, f"{path} imports {generated | grpc_names}"
