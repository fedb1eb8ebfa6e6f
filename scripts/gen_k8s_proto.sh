#!/usr/bin/env bash
# Regenerate the Python modules of the kubelet device-plugin API from our own api.proto.
# tests/k8s/test_proto_current.py fails when the committed modules differ from what this makes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
"$PYTHON" -m gpupool.k8s.deviceplugin.generate src
