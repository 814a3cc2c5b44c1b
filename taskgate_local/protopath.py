"""`python -m taskgate_local.protopath`: the folder holding google/rpc/status.proto (googleapis-common-protos), which
protoc needs besides protos/ because gateway.proto uses google.rpc.Status."""

from __future__ import annotations

from pathlib import Path

from google.rpc import status_pb2


def include_dir() -> Path:
    """The import root of google/rpc/*.proto as installed with grpcio-status."""
    return Path(status_pb2.__file__).parents[2]


if __name__ == "__main__":
    print(include_dir())
