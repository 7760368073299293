#!/bin/sh
# Run once by the postgres image, as its superuser, when the data directory is
# first created (compose.yaml mounts it into /docker-entrypoint-initdb.d).
# It makes the login users of compose.yaml; no component connects as the
# superuser afterwards:
#
#   outbox_owner  owns the database and the outbox schema: `outbox migrate --create-roles`
#   demo          the demo service: its own tables, and enqueues (outbox_writer)
#   publisher     outbox-publisher (outbox_publisher)
#   operator      the outbox CLI for people (outbox_operator)
#
# The three NOLOGIN roles are created here so that the logins can be members
# at once; `outbox migrate --create-roles` (run by the migrate service) finds
# them and grants each its privileges on the outbox tables.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
    -v owner_pw="${OUTBOX_OWNER_PASSWORD:?}" \
    -v demo_pw="${OUTBOX_DEMO_PASSWORD:?}" \
    -v publisher_pw="${OUTBOX_PUBLISHER_PASSWORD:?}" \
    -v operator_pw="${OUTBOX_OPERATOR_PASSWORD:?}" <<'SQL'
CREATE ROLE outbox_writer NOLOGIN;
CREATE ROLE outbox_publisher NOLOGIN;
CREATE ROLE outbox_operator NOLOGIN;
CREATE ROLE outbox_owner LOGIN PASSWORD :'owner_pw';
CREATE ROLE demo LOGIN PASSWORD :'demo_pw' IN ROLE outbox_writer;
CREATE ROLE publisher LOGIN PASSWORD :'publisher_pw' IN ROLE outbox_publisher;
CREATE ROLE operator LOGIN PASSWORD :'operator_pw' IN ROLE outbox_operator;
ALTER DATABASE :"DBNAME" OWNER TO outbox_owner;
ALTER SCHEMA public OWNER TO outbox_owner;
-- The demo keeps its orders in a schema of its own, first on its search_path
-- ("$user"): a service never gets CREATE on public, which is on every other
-- login's path (the outbox's statements resolve names in pg_catalog only, but
-- whatever else those logins run would not).
CREATE SCHEMA demo AUTHORIZATION demo;
SQL
