#!/usr/bin/env bash
# Regenerate the committed gRPC/protobuf code from fedps/proto/*.proto.
# Usage: bash fedps/proto/generate.sh [--check]
#   --check  regenerate into a temporary tree and fail if anything differs.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="$root"
if [[ "${1:-}" == "--check" ]]; then
  out="$(mktemp -d)"
  trap 'rm -rf "$out"' EXIT
  mkdir -p "$out/fedps/proto"
fi
cd "$root"
python -m grpc_tools.protoc -I . \
  --python_out="$out" --grpc_python_out="$out" --mypy_out="$out" --mypy_grpc_out="$out" \
  fedps/proto/*.proto 2> >(grep -v '^Writing mypy to' >&2)
if [[ "${1:-}" == "--check" ]]; then
  status=0
  for f in "$out"/fedps/proto/*_pb2*.py*; do
    name="fedps/proto/$(basename "$f")"
    if ! cmp -s "$f" "$root/$name"; then
      echo "generated code is stale: $name (run: bash fedps/proto/generate.sh)" >&2
      status=1
    fi
  done
  exit $status
fi
