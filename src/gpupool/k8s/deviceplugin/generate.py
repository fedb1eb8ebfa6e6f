"""Generate the Python modules of the device-plugin API from api.proto (needs grpcio-tools).

The generated modules are committed, so that installing gpupool needs no protoc; this
module (run by scripts/gen_k8s_proto.sh) makes them again, and a test checks that the
committed ones are what it makes.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

PROTO = "gpupool/k8s/deviceplugin/v1beta1/api.proto"
GENERATED = ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")


def generate(src_root: Path, out_root: Path) -> list[Path]:
    """Run protoc on `src_root/PROTO`, writing the modules under `out_root` (same layout)."""
    from grpc_tools import protoc

    include = resources.files("grpc_tools") / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / PROTO).parent.mkdir(parents=True, exist_ok=True)
    status = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{src_root}",
            f"-I{include}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(src_root / PROTO),
        ]
    )
    if status != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {status})")
    folder = (out_root / PROTO).parent
    return [folder / name for name in GENERATED]


def main(argv: list[str]) -> int:
    src_root = Path(argv[0] if argv else "src")
    for path in generate(src_root, src_root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
