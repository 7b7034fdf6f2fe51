#!/usr/bin/env bash
# roundpipe-sim on the shipped cost configs (tools/sim-configs): each one
# parses and yields a D = 8 row; bad executor settings fail with exit 2.
#   tests/cli/test_sim_configs.sh path/to/roundpipe-sim
set -euo pipefail
sim=${1:?usage: test_sim_configs.sh ROUNDPIPE_SIM}
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

shopt -s nullglob
configs=("$root"/tools/sim-configs/*.json)
[ ${#configs[@]} -ge 2 ] || fail "expected the Qwen3 configs in tools/sim-configs, found ${#configs[@]}"
for config in "${configs[@]}"; do
  out=$("$sim" --config "$config" --devices 1,8) || fail "roundpipe-sim --config $config exited $?"
  echo "$out"
  grep -Eq '^ +8 +9 ' <<< "$out" || fail "$config: no D = 8 row in the table"
done

status=0
"$sim" --config "${configs[0]}" --executor gpu > /dev/null 2> "$tmp/err" || status=$?
[ "$status" -eq 2 ] || fail "--executor gpu: exit $status, want 2"
grep -q "use accelerator" "$tmp/err" || fail "--executor gpu: message says nothing useful: $(cat "$tmp/err")"
status=0
"$sim" --config "${configs[0]}" --copy-delay-us -1 > /dev/null 2> "$tmp/err" || status=$?
[ "$status" -eq 2 ] || fail "--copy-delay-us -1: exit $status, want 2"
# The CPU executor with a copy delay is slower than the accelerator model.
fast=$("$sim" --config "${configs[0]}" --devices 2 | awk '$1 == 2 {print $4}')
slow=$("$sim" --config "${configs[0]}" --devices 2 --executor cpu --copy-delay-us 20000 | awk '$1 == 2 {print $4}')
awk -v a="$fast" -v b="$slow" 'BEGIN { exit !(b < a) }' || fail "cpu executor with delays: $slow mb/s, accelerator $fast mb/s"
echo "PASS"
