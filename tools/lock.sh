#!/usr/bin/env bash
# The reference configurations whose artifact hashes are locked in artifacts/hashes.lock.json.
#   tools/lock.sh check    compile each and fail with a readable diff on any drift (CI runs this)
#   tools/lock.sh update   accept the current hashes deliberately (commit the rewritten lock)
# Graph hashes are of the canonical exported programs (the backend's binaries are machine specific), so the
# references compile with --backend eager: seconds, and the same IR the cpu backend compiles (the lock key names
# the IR family; cuda and neuron graphs differ in backend choices and would need entries of their own).
set -uo pipefail
mode=${1:?usage: tools/lock.sh check|update}
cd "$(dirname "$0")/.."
lock=artifacts/hashes.lock.json
case $mode in
  check) flag=--check-lock ;;
  update) flag=--update-lock ;;
  *) echo "usage: tools/lock.sh check|update" >&2; exit 2 ;;
esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
run() {
  local name=$1; shift
  local t0=$SECONDS
  if deepinfer-compile --backend eager --out "$work/$name" --cache-dir "$work/cache" "$flag" "$lock" "$@" \
      >"$work/$name.log" 2>&1; then
    echo "lock $mode ok: $name ($((SECONDS - t0))s)"
  else
    echo "lock $mode FAILED: $name"; grep -E "lock|changed|appeared|vanished|toolchain|error" "$work/$name.log" | tail -40
    status=1
  fi
}
# the embedded demo model, single rank and a multi-rank layout
run demo-cp1-ep1
run demo-cp2-ep2 --cp 2 --ep 2
# DeepSeek-V3 671B, shape only (its real config.json, no weights), at the product layout
run v3-671b-cp64-ep64 --model configs/deepseek-v3-671b --shape-only --cp 64 --ep 64 --dtype bfloat16 \
    --decode-buckets 1,8 --prefill-buckets 512 --context-limit 8192 --num-kv-blocks 32768
exit $status
