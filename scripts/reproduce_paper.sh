#!/usr/bin/env bash
# Reproduce the paper grid (configs/bench/paper.yaml): baseline and SlimPack runs of every
# (model, context, cluster, dataset), then a speedup table from Megatron's
# "elapsed time per iteration (ms)" lines.
#
#   scripts/reproduce_paper.sh --dry-run                     # print every command
#   MEGATRON_DIR=... scripts/reproduce_paper.sh --models llama-7b --contexts 65536 \
#       --clusters h100-128 --datasets wikipedia --data-path-wikipedia /data/wiki_text_document
#   scripts/reproduce_paper.sh --parse-only --logs out/paper   # table from existing logs
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-$( [[ -x "$here/../.venv/bin/python" ]] && echo "$here/../.venv/bin/python" || echo python3)}"
exec "$PYTHON" "$here/reproduce_paper.py" "$@"
