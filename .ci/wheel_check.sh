#!/usr/bin/env bash
# The package as a user installs it (issue 28): build a wheel of this clone, install it into a fresh
# virtual environment and run generate and the server from a folder outside the clone, so that
# nothing is read from the clone's rheo_engine/ or weights/.
#   bash .ci/wheel_check.sh [WORKDIR]     (WORKDIR: default a new temporary folder, removed after)
# The venv is a new one made from the same interpreter, without its packages; it then sees
# exactly the wheel's declared dependencies and what they require in turn, linked from the
# environment that runs this script (.ci/wheel_deps.py): what `pip install WHEEL` gives a user,
# without downloading torch again, whether that interpreter is a system Python, a virtual
# environment or a conda environment. A dependency the wheel forgets to declare is then missing
# there, and generate or the server fails. PYTHON picks the interpreter (default python3; the
# test passes its own). After `bash rheo.sh setup` the build reuses its compiled objects
# (setup.py: one object folder), so this takes well under a minute.
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
# No pip of its own in the venv (nor the old setuptools ensurepip brings with it, which torch's
# requirement refuses): this environment's pip installs into it (pip >= 22.3: --python).
"$PY" -m venv --without-pip "$work/venv"
vpy="$work/venv/bin/python"
vpip=("$PY" -m pip --python "$vpy")
"${vpip[@]}" install -q --no-deps "$wheel" 2>&1 | grep -v "Running pip as the 'root' user" >&2 || true
# The server's two come with the [server] extra, as a user installs them (README, Install).
echo "== the wheel's declared dependencies with [server], linked from $("$PY" -c 'import sys; print(sys.prefix)')"
"$PY" .ci/wheel_deps.py "$wheel" "$work/deps" server | sed 's/^/   /'
site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$work/deps')" >"$site/_rheo_wheel_deps.pth"
# Every installed distribution's requirements met: rheo-engine's and its dependencies'.
"${vpip[@]}" check
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
