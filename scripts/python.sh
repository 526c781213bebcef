# Sourced by the scripts in this folder: sets PYTHON to the interpreter they all use, so that
# reproduce_paper.sh, apply_patches.sh, launch_torchrun.sh and the Slurm job run one Python:
#   PYTHON=/path/to/python   an explicit interpreter (an environment with megatron_slimpack, torch and
#                            megatron-core installed), used as given;
#   otherwise                the project's virtual environment, <project>/.venv/bin/python (`make setup`).
# The system `python` on PATH is never picked up silently. reproduce_paper.py passes its own
# interpreter to the launchers as PYTHON, and sbatch/srun hand the environment on to every node.
slimpack_project="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "error: PYTHON=$PYTHON is not an executable Python interpreter; set PYTHON to one (an environment" >&2
    echo "       with megatron_slimpack, torch and megatron-core), or unset it to use $slimpack_project/.venv" >&2
    exit 1
  fi
elif [[ -x "$slimpack_project/.venv/bin/python" ]]; then
  PYTHON="$slimpack_project/.venv/bin/python"
else
  echo "error: no Python for SlimPack: $slimpack_project/.venv/bin/python does not exist." >&2
  echo "       Create it (make setup, in $slimpack_project), or set PYTHON=/path/to/python: an environment" >&2
  echo "       with megatron_slimpack, torch and megatron-core installed." >&2
  exit 1
fi
export PYTHON
