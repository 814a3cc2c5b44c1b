#!/bin/bash
# The official postgres image's contract, as far as taskgate uses it: POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB,
# an empty PGDATA initialised on first start, password logins over TCP, and `-c`/`-p` arguments passed to postgres.
set -euo pipefail
[ "${1:0:1}" = - ] && set -- postgres "$@"
if [ "$1" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
    user=${POSTGRES_USER:-postgres}
    db=${POSTGRES_DB:-$user}
    : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
    initdb -D "$PGDATA" -U "$user" --pwfile=<(printf '%s\n' "$POSTGRES_PASSWORD") --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
    if [ "$db" != postgres ]; then
        echo "CREATE DATABASE \"$db\"" | postgres --single -D "$PGDATA" postgres >/dev/null
    fi
fi
exec "$@"
