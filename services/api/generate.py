"""`make proto`: generate the Python gRPC code for proto/ into services/api (never edit it)."""
from __future__ import annotations

import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main() -> int:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto").rglob("*.proto"))
    include = str(pathlib.Path(protoc.__file__).parent / "_proto")
    # Map proto/ to the virtual path services/api so the generated imports are
    # `services.api.pdserve.v1...` (the name `proto` is taken by a common library).
    args = ["protoc", f"-I{include}", "-Iservices/api=proto", "--python_out=.", "--pyi_out=.",
            "--grpc_python_out=."]
    args += [p.replace("proto/", "services/api/", 1) for p in protos]
    rc = protoc.main(args)
    if rc == 0:
        for pkg in ("services/api/pdserve", "services/api/pdserve/v1"):
            (ROOT / pkg / "__init__.py").touch()
        print(f"generated {len(protos)} proto file(s) into services/api/pdserve")
    return rc


if __name__ == "__main__":
    sys.exit(main())
