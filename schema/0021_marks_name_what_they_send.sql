-- 0021: a batch's mark rewrites the messages it names (mark_sending), so
-- whoever marks batches needs UPDATE of outbox.batches.message_ids.
--
-- A mark leaves out a message that another open batch names (a claim made
-- on a stale snapshot), and the batch then names only what it may send:
-- recovery goes by what a batch names, so it no longer makes such a message
-- uncertain from the evidence of a batch that never sent it, and one message
-- is named by at most one batch that began sending.
--
-- The roles are granted in outbox/roles.sql (`outbox migrate
-- --create-roles`); their names are the deployment's. So that a publisher of
-- this version, which starts only once this migration is applied, never
-- meets a role that may mark but not rewrite, every role that may set
-- send_began_at here gets the new column too. No row is read or written.
DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END
        FROM pg_attribute AS att
        CROSS JOIN LATERAL aclexplode(att.attacl) AS a
        LEFT JOIN pg_roles AS r ON r.oid = a.grantee
        WHERE att.attrelid = 'outbox.batches'::regclass
          AND att.attname = 'send_began_at'
          AND a.privilege_type = 'UPDATE'
          AND a.grantee <> (SELECT relowner FROM pg_class WHERE oid = 'outbox.batches'::regclass)
    LOOP
        EXECUTE format('GRANT UPDATE (message_ids) ON outbox.batches TO %s', grantee);
    END LOOP;
END $$;
