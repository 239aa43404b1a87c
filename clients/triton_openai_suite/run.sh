#!/usr/bin/env bash
# Run Triton's OpenAI-frontend tests (triton-inference-server/server python/openai/tests)
# against an OpenAI-compatible server, changing only their fixtures (conftest.py, utils.py).
#
#   run.sh [--base-url URL] [--start PROJECT_DIR] [--port N] [--out DIR] [-- PYTEST_ARGS...]
#
#   --base-url URL   server to test (default http://127.0.0.1:19100, or http://127.0.0.1:N with --port)
#   --start DIR      first build /tmp/suite-repo and start `clients.tritonserver serve` from the
#                    paged_llm checkout DIR (ports N..N+4, the make-serve OPENAI_FLAGS), wait for
#                    /health, run, then stop that server (it is killed by its process group id)
#   --port N         the OpenAI port (default 19100); Triton gets N+1 (http) .. N+4 (supervisor)
#   --out DIR        where junit.xml, pytest.log, probes.log, summary.md go (default $TMPDIR/triton-openai-suite)
#   after --          extra pytest arguments (e.g. -k chat, or a single test file)
# Env: TRITON_REPO (required: a git clone of triton-inference-server/server, or its .git dir),
#      TRITON_REV (default HEAD), VENV (default $HOME/triton-openai-venv, created if missing),
#      TEST_MODEL (llm), TEST_TOKENIZER (/tmp/suite-repo/llm/checkpoint), TEST_BACKEND (vllm).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PORT=19100; BASE_URL=""; START=""; OUT="${TMPDIR:-/tmp}/triton-openai-suite"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --base-url) BASE_URL="$2"; shift 2;;
    --start) START="$(cd "$2" && pwd)"; shift 2;;
    --port) PORT="$2"; shift 2;;
    --out) OUT="$2"; shift 2;;
    --) shift; break;;
    *) echo "unknown argument $1" >&2; exit 2;;
  esac
done
BASE_URL="${BASE_URL:-http://127.0.0.1:$PORT}"
TRITON_REPO="${TRITON_REPO:?set TRITON_REPO to a git clone of triton-inference-server/server}"
TRITON_REV="${TRITON_REV:-HEAD}"
VENV="${VENV:-$HOME/triton-openai-venv}"
SCRATCH=/tmp/triton-openai-tests
mkdir -p "$OUT"

# 1. A separate venv with their test requirements (requirements-test.txt + requirements.txt pins).
if [[ ! -x "$VENV/bin/pytest" ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "openai==1.107.3" "pytest==8.1.1" "pytest-asyncio==0.23.8" \
    "fastapi==0.121.2" "httpx==0.27.2" numpy requests pytest-timeout
fi

# 2. Their tests into a scratch folder; only conftest.py and utils.py replaced.
rm -rf "$SCRATCH"; mkdir -p "$SCRATCH"
git -C "$TRITON_REPO" archive "$TRITON_REV" python/openai/tests | tar -x -C "$SCRATCH" --strip-components=2
cp "$HERE/fixtures/conftest.py" "$HERE/fixtures/utils.py" "$SCRATCH/tests/"
cp -r "$HERE/fixtures/shims" "$SCRATCH/shims"
TRITON_COMMIT="$(git -C "$TRITON_REPO" rev-parse --short "$TRITON_REV")"

# 3. Optionally start our server.
SERVER_PID=""
cleanup() {
  if [[ -n "$SERVER_PID" ]]; then
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
}
trap cleanup EXIT
if [[ -n "$START" ]]; then
  rm -rf /tmp/suite-repo   # built afresh by this checkout's builder (an old one is kept by the builder otherwise)
  (cd "$START" && .venv/bin/python -m builder default --repository /tmp/suite-repo >"$OUT/build.log" 2>&1)
  cd "$START"
  setsid .venv/bin/python -m clients.tritonserver serve --model-repository /tmp/suite-repo \
    --http-port $((PORT+1)) --grpc-port $((PORT+2)) --metrics-port $((PORT+3)) \
    --supervisor-port $((PORT+4)) --openai-port "$PORT" \
    --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3 \
    >"$OUT/server.log" 2>&1 &
  SERVER_PID=$!
  cd "$HERE"
  PROJECT_COMMIT="$(git -C "$START" rev-parse --short HEAD)"
else
  PROJECT_COMMIT="(server started elsewhere)"
fi
for i in $(seq 300); do
  if curl -sf -m 2 "$BASE_URL/health" | grep -q ok; then break; fi
  if [[ -n "$SERVER_PID" ]] && ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "server exited; see $OUT/server.log" >&2; exit 1; fi
  [[ $i == 300 ]] && { echo "no healthy server at $BASE_URL" >&2; exit 1; }
  sleep 1
done

# 4. Run (--continue-on-collection-errors: modules that import Triton's own code fail to
#    import; they are counted as errors, the rest still runs).
cd "$SCRATCH"
set +e
TRITON_SUITE_BASE_URL="$BASE_URL" PYTHONPATH="$SCRATCH/shims" \
  "$VENV/bin/python" -m pytest tests -p no:cacheprovider -rA -q --timeout 600 \
  --continue-on-collection-errors --junitxml="$OUT/junit.xml" "$@" >"$OUT/pytest.log" 2>&1
RC=$?
cd "$HERE"
# Probes: checks that Triton's tests make only after an assertion we fail for an allowed
# reason (a random model's tool arguments), so they still get looked at.
"$VENV/bin/python" "$HERE/probes.py" "$BASE_URL" >"$OUT/probes.log" 2>&1
set -e
"$VENV/bin/python" "$HERE/summarize.py" "$OUT/junit.xml" \
  --meta "date=$(date -u +%Y-%m-%dT%H:%MZ)" "base_url=$BASE_URL" "triton_commit=$TRITON_COMMIT" \
         "project_commit=$PROJECT_COMMIT" "pytest_rc=$RC" >"$OUT/summary.md"
{ echo; echo "## probes.py"; echo '```'; cat "$OUT/probes.log"; echo '```'; } >>"$OUT/summary.md"
cat "$OUT/summary.md"
