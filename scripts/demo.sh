#!/usr/bin/env bash
# Install on a bare machine and run the main job: a real model (SmolLM2-135M)
# served with continuous batching through pagedkv's paged attention.
# Extra arguments go to the demo, e.g. `bash scripts/demo.sh --check`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh demo
printf '\n==> python -m pagedkv.demo %s\n' "$*"
python3 -m pagedkv.demo "$@"
