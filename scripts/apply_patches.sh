#!/usr/bin/env bash
# Apply (or with --check, only test) the SlimPack change to a Megatron-LM checkout's pretrain_gpt.py.
#
#   scripts/apply_patches.sh [--check] MEGATRON_DIR
#
# The patch is chosen by the checkout's megatron-core version (megatron/core/package_info.py):
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
info="$dir/megatron/core/package_info.py"
target="$dir/pretrain_gpt.py"
if [[ ! -f "$info" || ! -f "$target" ]]; then
  echo "error: $dir is not a Megatron-LM checkout (expected $info and $target)" >&2
  exit 1
fi
if ! command -v patch >/dev/null; then
  echo "error: the 'patch' program is required (apt-get install patch)" >&2
  exit 1
fi
major="$(sed -n 's/^MAJOR *= *\([0-9]*\).*/\1/p' "$info" | head -1)"
minor="$(sed -n 's/^MINOR *= *\([0-9]*\).*/\1/p' "$info" | head -1)"
version="$major.$minor"
file="$patches/pretrain_gpt.mcore-$version.patch"
if [[ ! -f "$file" ]]; then
  supported="$(cd "$patches" && ls pretrain_gpt.mcore-*.patch | sed 's/pretrain_gpt.mcore-\(.*\).patch/\1/' | tr '\n' ' ')"
  echo "error: $dir has megatron-core $version; supported versions: $supported" >&2
  echo "       check out a supported release (e.g. git checkout core_v0.16.1) or port the few lines by hand" >&2
  exit 1
fi

if patch --dry-run --force -s -R -p1 -d "$dir" < "$file" >/dev/null 2>&1; then
  echo "SlimPack patch already applied to $target (megatron-core $version)"
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
echo "train with: torchrun ... pretrain_gpt.py ... --slimpack --calculate-per-token-loss --no-rope-fusion"
