#!/usr/bin/env bash
# Debian's PostgreSQL server binaries for tests/test_postgres.py (the test starts its own server on a
# temporary directory and a free loopback port; nothing is started here). Idempotent.
set -euo pipefail
if ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "tests/setup/postgres.sh: PostgreSQL is not installed; run as root or: apt-get install -y postgresql" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq postgresql >/dev/null
