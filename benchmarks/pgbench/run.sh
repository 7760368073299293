#!/usr/bin/env bash
# The server's share of an enqueue, without Python: pgbench (C, prepared
# statements) runs these transactions in a scratch database, interleaved
# over two rounds (ROUNDS), at 1 and 16 clients, 10 s each (SECONDS_A_POINT):
#   order.sql             an order row alone (the business transaction)
#   two_orders.sql        the order and a second order row (any second insert)
#   order_minimal_row.sql the order and the least an outbox can write: one
#                         row (topic, key, value) in a table with only a
#                         bigint primary key
#   order_key_lock.sql    the order and the enqueue's per-key advisory lock
#   order_outbox_row_pk_only.sql
#                         the order and an outbox.messages row in a copy of
#                         the table with only its primary key (its width and
#                         stored columns, none of its other indexes, no trigger)
#   order_outbox_row.sql  the order and a plain INSERT of one outbox.messages row
#   order_enqueue         the order and the enqueue's own statement, for one
#                         keyed message: written here at each run from the
#                         library's (outbox.enqueue.insert_statement), so it
#                         is the statement of the code at hand
# and the outbox row once more with the wake-up trigger disabled.
# Run from the repository after `. ./.services.env`; prints transactions a
# second. Message ids here are random UUIDs, where the library's are UUIDv7.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${OUTBOX_DATABASE_URL:?source .services.env first}"
pgbench=$(ls -d /usr/lib/postgresql/*/bin/pgbench 2>/dev/null | sort -V | tail -1)
[[ -x $pgbench ]] || { echo "no pgbench under /usr/lib/postgresql/*/bin" >&2; exit 2; }
db=outbox_pgbench_$$
base=${OUTBOX_DATABASE_URL%/*}
psql "$OUTBOX_DATABASE_URL" -qc "CREATE DATABASE $db"
scripts=$(mktemp -d)
trap 'psql "$OUTBOX_DATABASE_URL" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)"; rm -rf "$scripts"' EXIT
cp "$here"/*.sql "$scripts"/
"$here/../../.venv/bin/python" - "$scripts/order_enqueue.sql" <<'PY'
import sys

from outbox.enqueue import insert_statement

row = (
    "(gen_random_uuid(), 'orders'::text, ('c-' || :c)::bytea,"
    " '{\"order\":1,\"customer\":17,\"total\":\"12.50\"}'::bytea,"
    " ARRAY['content-type']::text[], ARRAY['application/json'::bytea]::bytea[], NULL::text)"
)
with open(sys.argv[1], "w", encoding="utf-8") as script:
    script.write(
        "\\set c random(1, 1000)\nBEGIN;\n"
        "INSERT INTO bench_orders (customer, total) VALUES (:c, 12.5) RETURNING id;\n"
        f"{insert_statement(row)};\nCOMMIT;\n"
    )
PY
url=$base/$db
"$here/../../.venv/bin/outbox" --database-url "$url" migrate >/dev/null
psql "$url" -qc "CREATE TABLE bench_orders (id bigserial PRIMARY KEY, customer int NOT NULL,
    total numeric NOT NULL, created_at timestamptz NOT NULL DEFAULT now())" \
    -c "CREATE TABLE bench_events (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic text NOT NULL, key bytea, value bytea NOT NULL)" \
    -c "CREATE TABLE bench_messages_pk_only (LIKE outbox.messages INCLUDING DEFAULTS
    INCLUDING GENERATED INCLUDING IDENTITY INCLUDING CONSTRAINTS, PRIMARY KEY (id))"
point() { # clients script [label]
    psql "$url" -qc "TRUNCATE bench_orders, bench_events, bench_messages_pk_only, outbox.messages"
    local tps
    tps=$("$pgbench" -n -M prepared -c "$1" -j 2 -T "${SECONDS_A_POINT:-10}" -f "$scripts/$2.sql" "$url" 2>/dev/null |
        grep -o 'tps = [0-9.]*' | head -1)
    printf '%-3s clients  %-34s %s\n' "$1" "${3:-$2}" "$tps"
}
for round in $(seq "${ROUNDS:-2}"); do
    echo "round $round"
    for clients in 1 16; do
        for s in order two_orders order_minimal_row order_key_lock order_outbox_row_pk_only \
            order_outbox_row order_enqueue; do
            point "$clients" "$s"
        done
        psql "$url" -qc "ALTER TABLE outbox.messages DISABLE TRIGGER messages_notify_pending"
        point "$clients" order_outbox_row "order_outbox_row, trigger disabled"
        psql "$url" -qc "ALTER TABLE outbox.messages ENABLE TRIGGER messages_notify_pending"
    done
done
