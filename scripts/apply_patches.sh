#!/usr/bin/env bash
# Apply (or with --check, only test) the SlimPack change to a Megatron-LM checkout's pretrain_gpt.py.
#
#   scripts/apply_patches.sh [--check] MEGATRON_DIR
#
# The patch is chosen by the megatron-core release the trainer imports: the checkout's
# megatron/core/package_info.py, or, for a Megatron-LM checkout used with the megatron-core wheel (no
# megatron/core in it), the installed megatron-core's, found by the scripts' Python (PYTHON, or the
# project's .venv: scripts/python.sh) with the checkout first on its path, as pretrain_gpt.py runs.
#   0.16, 0.17  pretrain(..., extra_args_provider=with_slimpack_args(...)) + install_slimpack()
#   0.18, 0.19  parse_and_validate_args(extra_args_provider=with_slimpack_args(...)) + install_slimpack(args)
# Exit status: 0 applied / applies cleanly / already applied; 1 the checkout does not match; 2 usage.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
patches="$(cd "$here/../patches" && pwd)"
check=0
if [[ "${1:-}" == "--check" ]]; then check=1; shift; fi
if [[ $# -ne 1 || "$1" == -* ]]; then
  echo "usage: $0 [--check] MEGATRON_DIR" >&2
  exit 2
fi
dir="$1"
target="$dir/pretrain_gpt.py"
if [[ ! -f "$target" ]]; then
  echo "error: $dir is not a Megatron-LM checkout (expected $target)" >&2
  exit 1
fi
if ! command -v patch >/dev/null; then
  echo "error: the 'patch' program is required (apt-get install patch)" >&2
  exit 1
fi
# The flags validate_slimpack_args (megatron_slimpack/megatron/args.py) requires with --slimpack.
required="--slimpack --calculate-per-token-loss --no-rope-fusion --micro-batch-size 1 --context-parallel-size 1"
hint() {
  echo "train with: torchrun ... pretrain_gpt.py ... $required"
  echo "            (a context-parallel layout cp K: --slimpack-base-merge K instead, K times the data-parallel replicas)"
}

info="$dir/megatron/core/package_info.py"
if [[ -f "$info" ]]; then
  major="$(sed -n 's/^MAJOR *= *\([0-9]*\).*/\1/p' "$info" | head -1)"
  minor="$(sed -n 's/^MINOR *= *\([0-9]*\).*/\1/p' "$info" | head -1)"
  source_of_version="$info"
else
  source "$here/python.sh"
  # Where `import megatron.core` leads from the checkout (without importing it: that loads torch).
  if ! found="$(cd "$dir" && PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - <<'PY' 2>&1
import importlib.util, pathlib, re, sys
spec = importlib.util.find_spec("megatron")
for base in (spec.submodule_search_locations or []) if spec else []:
    info = pathlib.Path(base, "core", "package_info.py")
    if info.is_file():
        text = info.read_text()
        version = [re.search(rf"^{key} *= *([0-9]+)", text, re.M) for key in ("MAJOR", "MINOR")]
        if all(version):
            print(version[0].group(1), version[1].group(1), info)
            sys.exit(0)
sys.exit("megatron.core.package_info not found")
PY
)"; then
    echo "error: $dir has no megatron/core and $PYTHON finds no installed megatron-core ($found)." >&2
    echo "       Install megatron-core into that Python (pip install megatron-core==0.16.1, or another supported" >&2
    echo "       release), or set PYTHON to the interpreter that runs the trainer." >&2
    exit 1
  fi
  read -r major minor source_of_version <<<"$found"
fi
version="$major.$minor"
file="$patches/pretrain_gpt.mcore-$version.patch"
if [[ ! -f "$file" ]]; then
  supported="$(cd "$patches" && ls pretrain_gpt.mcore-*.patch | sed 's/pretrain_gpt.mcore-\(.*\).patch/\1/' | tr '\n' ' ')"
  echo "error: $dir has megatron-core $version ($source_of_version); supported versions: $supported" >&2
  if [[ -f "$info" ]]; then
    echo "       check out a supported release (e.g. git checkout core_v0.16.1) or port the few lines by hand" >&2
  else
    echo "       install a supported megatron-core into $PYTHON (e.g. pip install megatron-core==0.16.1) with the" >&2
    echo "       matching Megatron-LM checkout (git checkout core_v0.16.1), or port the few lines by hand" >&2
  fi
  exit 1
fi

if patch --dry-run --force -s -R -p1 -d "$dir" < "$file" >/dev/null 2>&1; then
  echo "SlimPack patch already applied to $target (megatron-core $version)"
  hint
  exit 0
fi
if ! output="$(patch --dry-run --force -p1 -d "$dir" < "$file" 2>&1)"; then
  echo "error: $target does not match the expected megatron-core $version pretrain_gpt.py;" >&2
  echo "       the patch $file would not apply:" >&2
  echo "$output" | sed 's/^/       /' >&2
  echo "       (a modified pretrain_gpt.py? apply the change by hand: see $file)" >&2
  exit 1
fi
if [[ $check -eq 1 ]]; then
  echo "$(basename "$file") applies cleanly to $target (megatron-core $version); nothing changed (--check)"
  exit 0
fi
patch --force -s -p1 -d "$dir" --no-backup-if-mismatch < "$file"
echo "applied $(basename "$file") to $target (megatron-core $version)"
hint
