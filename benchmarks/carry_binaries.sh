#!/usr/bin/env bash
# Copy programs of this machine, with every shared library they load and the dynamic loader, into .bin/
# (git-ignored), so that they run on the GPU machine, whose image lacks them (tc, redis-server):
#
#   benchmarks/carry_binaries.sh tc redis-server      # then: run(..., carry=[".bin"]) and .bin/tc ...
#
# Each .bin/NAME is a wrapper that starts the program through the carried loader with the carried
# libraries only, so the GPU machine's own C library (older or newer) plays no part. The loader's copy
# carries the program's name, so the process is still called NAME (`down` recognises redis-server so).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.bin
mkdir -p "$out/lib" "$out/libexec" "$out/loader"
for name in "$@"; do
  path=$(command -v "$name") || { echo "carry_binaries: $name is not installed here" >&2; exit 1; }
  cp -L "$path" "$out/libexec/$name"
  ldd "$path" | awk '/=> \//{print $3}' | while read -r lib; do cp -Ln "$lib" "$out/lib/"; done
  loader=$(ldd "$path" | awk '/ld-linux/{print ($3 != "" ? $3 : $1)}' | head -n1)
  cp -L "$loader" "$out/loader/$name"
  cat > "$out/$name" <<WRAP
#!/bin/sh
here=\$(cd "\$(dirname "\$0")" && pwd)
exec "\$here/loader/$name" --library-path "\$here/lib" "\$here/libexec/$name" "\$@"
WRAP
  chmod +x "$out/$name"
done
du -sh "$out"
