#!/usr/bin/env bash
# Refresh the front-end libraries in static/vendor/ from npm at the versions pinned in
# static/vendor/package.json. The copied files are committed: the console must work offline,
# so nothing is loaded from a CDN at run time. Run this only to upgrade a library.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
vendor="$root/static/vendor"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cp "$vendor/package.json" "$work/"
(cd "$work" && npm install --no-audit --no-fund --ignore-scripts --omit=dev --loglevel=error)

copy() {  # copy <package-relative source> <destination name>
  install -m 0644 "$work/node_modules/$1" "$vendor/$2"
}
copy htmx.org/dist/htmx.min.js htmx.min.js
# Alpine's CSP build: it evaluates x-data/x-show/@click expressions with its own parser, so the
# Content-Security-Policy needs no 'unsafe-eval'.
copy @alpinejs/csp/dist/cdn.min.js alpinejs.min.js
copy chart.js/dist/chart.umd.min.js chart.umd.min.js
copy sortablejs/Sortable.min.js sortable.min.js
# Drag-to-zoom on the job page's charts. Its optional peer hammerjs (touch pinch and pan) is not
# copied: without it the plugin leaves those two out and zooms by wheel and drag.
copy chartjs-plugin-zoom/dist/chartjs-plugin-zoom.min.js chartjs-plugin-zoom.min.js
for pkg in htmx.org chart.js sortablejs chartjs-plugin-zoom; do
  license="$(ls "$work/node_modules/$pkg" | grep -i -m1 '^licen[cs]e' || true)"
  [ -n "$license" ] && install -m 0644 "$work/node_modules/$pkg/$license" "$vendor/LICENSE.$pkg"
done

# Record exactly what was installed, so a reviewer can compare against the registry.
(cd "$work" && node -e '
  const lock = require("./package-lock.json").packages;
  for (const [k, v] of Object.entries(lock)) if (k) console.log(k.replace("node_modules/", ""), v.version, v.integrity);
') > "$vendor/VERSIONS.txt"
echo "vendored into $vendor:"
cat "$vendor/VERSIONS.txt"
