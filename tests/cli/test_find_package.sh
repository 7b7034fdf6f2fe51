#!/usr/bin/env bash
# The installed C++ package as a user's project sees it: installs the build
# into a temporary prefix (cmake --install), configures tests/package with
# find_package(roundpipe) and links both libraries (roundpipe::roundpipe,
# roundpipe::models), then trains the tiny preset a few steps with it.
#   tests/cli/test_find_package.sh BUILD_DIR
set -euo pipefail
build=${1:?usage: test_find_package.sh BUILD_DIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

cmake --install "$build" --prefix "$tmp/prefix" --component Unspecified > "$tmp/install.log" ||
  { cat "$tmp/install.log"; fail "cmake --install exited $?"; }
for f in lib/libroundpipe.a lib/libroundpipe_models.a include/roundpipe/roundpipe.h include/roundpipe/models.h \
         lib/cmake/roundpipe/roundpipeConfig.cmake; do
  [ -e "$tmp/prefix/$f" ] || fail "the install has no $f"
done
torch_prefix=$(grep -E '^Torch_DIR:' "$build/CMakeCache.txt" | cut -d= -f2-)
cmake -S "$root/tests/package" -B "$tmp/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" -DTorch_DIR="$torch_prefix" > "$tmp/configure.log" 2>&1 ||
  { cat "$tmp/configure.log"; fail "find_package(roundpipe) failed"; }
cmake --build "$tmp/consumer" > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; fail "the consumer did not build"; }
ROUNDPIPE_DEVICES=cpu:2 "$tmp/consumer/consumer" || fail "the consumer's training run failed"
