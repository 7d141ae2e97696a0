#!/usr/bin/env bash
# mypy cannot follow setuptools' package-dir mapping (spec/ is imported as kvcore.spec),
# so type-check a tree of symlinks laid out the way Python imports it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tree="$root/build/typecheck"
rm -rf "$tree" && mkdir -p "$tree/kvcore"
for entry in "$root"/kvcore/*; do
  ln -s "$entry" "$tree/kvcore/$(basename "$entry")"
done
ln -s "$root/spec" "$tree/kvcore/spec"
cd "$tree"
exec "${MYPY:-mypy}" --config-file "$root/pyproject.toml" -p kvcore
