#!/usr/bin/env bash
# The whole test suite: ruff, mypy, pytest on SQLite (everything, slow and browser tests
# included), then the database-touching tests again on PostgreSQL (not those marked
# sqlite_file: they read the SQLite file's own header).
#
#   TEST_DATABASE_URL  PostgreSQL for the second pass (default: the local server);
#                      set it empty to skip that pass.
#   extra arguments go to both pytest runs.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
export PATH="$PWD/$BIN:$PATH"

run_pytest() {
  "$BIN/python" -m pytest "$@"
  local code=$?
  if [ "$code" = 5 ]; then
    echo "error: pytest collected no tests" >&2
    return 1
  fi
  return "$code"
}

echo "==> ruff"
"$BIN/ruff" check . || exit 1
echo "==> mypy"
"$BIN/mypy" . || exit 1

echo "==> pytest on SQLite (all tests)"
run_pytest "$@" || exit 1

TEST_DATABASE_URL=${TEST_DATABASE_URL-postgres://postgres@127.0.0.1:5432/test}
if [ -z "$TEST_DATABASE_URL" ]; then
  echo "==> TEST_DATABASE_URL is empty: the PostgreSQL pass is skipped"
  exit 0
fi
if ! "$BIN/python" -c "import psycopg, sys; psycopg.connect(sys.argv[1], connect_timeout=5).close()" \
     "$TEST_DATABASE_URL" 2>/dev/null; then
  echo "error: PostgreSQL is not reachable at $TEST_DATABASE_URL; start it, or set" \
       "TEST_DATABASE_URL to another server (empty skips this pass)" >&2
  exit 1
fi
echo "==> pytest on PostgreSQL (database tests)"
DATABASE_URL="$TEST_DATABASE_URL" run_pytest -m "not slow and not browser and not sqlite_file" "$@" || exit 1
