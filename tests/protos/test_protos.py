"""The generated stubs in protos/ are what grpcio-tools makes from the .proto files today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    assert "nanokv_v1.proto" in protos and "kserve/grpc_service.proto" in protos
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"--python_out={tmp_path}",
           f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *[f"nanokv/protos/{p}" for p in protos]]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    made = tmp_path / "nanokv" / "protos"
    for path in sorted(made.rglob("*.py*")):
        f = str(path.relative_to(made))
        fresh = path.read_text()
        have = (ROOT / "protos" / f).read_text() if (ROOT / "protos" / f).exists() else None
        assert have == fresh, f"protos/{f} is stale: run `make protos`"
