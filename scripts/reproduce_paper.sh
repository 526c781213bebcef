#!/usr/bin/env bash
# Reproduce the simulated paper grid on a GPU cluster: benchmarks/results/paper_table.json (the grid of
# configs/bench/paper.yaml: 4 models x 3 contexts x 128/256 H100s x 3 datasets, simulated by
# benchmarks/paper_table.py) reports every strategy in its own best layout ("tp2 pp1 cp2 dp32
# rc-selective"); this runs each (cell, strategy) with exactly that layout as a Megatron-LM
# pretrain_gpt.py job, then prints ms/iteration and the speedup over megatron-fixed from Megatron's
# "elapsed time per iteration (ms)" lines.
#
#   megatron-fixed (and megatron-stock): stock Megatron-LM, --context-parallel-size from the layout.
#     Megatron-LM cannot express megatron-fixed's per-document attention at these lengths (see
#     scripts/reproduce_paper.py): these runs attend causally across documents; --dry-run says so.
#   slimpack, its ablations, and every other strategy the plugin trains: --slimpack
#     --slimpack-strategy NAME; SlimPack's cp K runs as --context-parallel-size 1 and
#     --slimpack-base-merge K. A wlb-llm/slimpipe layout with cp > 1 cannot run (listed as NOT RUN).
#
#   scripts/reproduce_paper.sh --dry-run                     # print every run's command line
#   MEGATRON_DIR=... scripts/reproduce_paper.sh --models llama-7b --contexts 65536 \
#       --clusters h100-128 --datasets wikipedia --data-path-wikipedia /data/wiki_text_document
#   scripts/reproduce_paper.sh --parse-only --logs out/paper   # table from existing logs
#
# --launcher slurm (default) submits scripts/slurm_h100.sbatch with sbatch --wait, one job at a time;
# --launcher torchrun runs scripts/launch_torchrun.sh here (one node per call: set NNODES, NODE_RANK,
# MASTER_ADDR and run the same command on every node). --models, --contexts, --clusters, --datasets and
# --strategies pick a part of the grid (a value the grid lacks is an error listing the valid ones).
#
# Failures stop the script: a run that exits non-zero or prints no iteration time ends it with exit
# status 1 and the tail of the run's log (--keep-going runs the rest first). A run writes NAME.log.part
# while it runs; a successful log becomes NAME.log (reused by later calls), a failed one NAME.failed.log
# (never reused: the run is repeated).
#
# Python: PYTHON if set, otherwise the project's .venv (scripts/python.sh); the launchers run the same one.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/python.sh"
exec "$PYTHON" "$here/reproduce_paper.py" "$@"
