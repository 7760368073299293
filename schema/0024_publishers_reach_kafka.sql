-- 0024: each publisher says, with its heartbeat, when it last reached Kafka.
--
-- A publisher that cannot reach Kafka while the others can (a host cut off
-- from the brokers) kept renewing its lanes: its loop turns, settling every
-- batch back to pending as an outage, so the keys of its share of the lanes
-- waited for as long as its host stayed cut off, while the others idled. Its
-- heartbeat now stops once it has not reached Kafka for a lease and another
-- live publisher has (kafka_reached_at within its lease): its lanes expire
-- and the others take them, as they do a stalled publisher's. It beats again
-- once it reaches Kafka, or when no other does (when Kafka is away for all,
-- nobody steps back). NULL: not reported (a publisher before this version).
--
-- The roles are granted in outbox/roles.sql (`outbox migrate
-- --create-roles`); their names are the deployment's. So that a publisher of
-- this version, which starts only once this migration is applied, never
-- meets a role that may beat but not say this, every role that may update
-- heartbeat_at gets the new column too. Adding a nullable column rewrites
-- nothing; it locks outbox.publishers (a handful of rows) for a moment.
ALTER TABLE outbox.publishers ADD COLUMN kafka_reached_at timestamptz;

DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END
        FROM pg_attribute AS att
        CROSS JOIN LATERAL aclexplode(att.attacl) AS a
        LEFT JOIN pg_roles AS r ON r.oid = a.grantee
        WHERE att.attrelid = 'outbox.publishers'::regclass
          AND att.attname = 'heartbeat_at'
          AND a.privilege_type = 'UPDATE'
          AND a.grantee <> (SELECT relowner FROM pg_class WHERE oid = 'outbox.publishers'::regclass)
    LOOP
        EXECUTE format('GRANT UPDATE (kafka_reached_at) ON outbox.publishers TO %s', grantee);
    END LOOP;
END $$;
