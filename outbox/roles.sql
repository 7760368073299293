-- The privileges of the three outbox roles, by name (outbox/roles.py runs them).
-- {writer}, {publisher} and {operator} are the roles' names, quoted as
-- identifiers. Every block runs in one transaction with the others, as the
-- owner of the outbox tables: the grants are exactly these, and a running
-- publisher or service never sees them half made.
--
-- PostgreSQL checks column privileges, so an UPDATE grant names the columns
-- a role's statements write and nothing else: a role cannot rewrite a
-- payload, a topic or a key it may not. Locking a row (SELECT ... FOR UPDATE
-- or FOR SHARE) needs UPDATE on one of its columns. Views run with their
-- owner's privileges: a grant on a view is all a reader needs, except for
-- outbox.status, whose exact count of a small table's closed messages runs in
-- a function with the reader's privileges (schema/0009_status_at_scale.sql):
-- its readers need SELECT on outbox.messages too, as the publisher and
-- operator roles have.

-- name: revoke
-- Start from nothing on every outbox object (a table's column grants go with
-- it), so that a privilege dropped from this file is dropped from the roles.
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM {writer}, {publisher}, {operator};
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox FROM {writer}, {publisher}, {operator};
REVOKE ALL ON SCHEMA outbox FROM {writer}, {publisher}, {operator};

-- name: writer
-- A service that enqueues: insert_messages and ids_by_idempotency_key. The
-- insert's ON CONFLICT (idempotency_key) and RETURNING id read those two
-- columns; seq (an identity), lane and key_hash (generated) need no grant,
-- nor the advisory locks (and the transaction-local setting that remembers
-- them, take_key_locks) or the NOTIFY of the insert trigger. Nothing else
-- of any message is readable: not its value, headers, key, topic or state.
-- The trigger, as the transaction commits, takes outbox.wakeup in ROW
-- EXCLUSIVE mode if no publisher sleeps (it notifies otherwise), which LOCK
-- TABLE allows only with INSERT on it: the view holds nothing and takes no
-- row. Without it the trigger notifies on every commit.
GRANT USAGE ON SCHEMA outbox TO {writer};
GRANT INSERT (id, topic, key, value, header_names, header_values, idempotency_key)
    ON outbox.messages TO {writer};
GRANT SELECT (id, idempotency_key) ON outbox.messages TO {writer};
GRANT INSERT ON outbox.wakeup TO {writer};

-- name: publisher
-- outbox-publisher and outbox-publisher reconcile: claim, mark, settle,
-- recovery, reconciliation, heartbeat, lanes, metrics (read), retention
-- (outbox purge, or a publisher's retention, --purge-delivered-after), LISTEN (which
-- needs no grant) and the announcement of its sleep: outbox.wakeup held in
-- SHARE mode, which LOCK TABLE allows only with UPDATE on it (the view holds
-- nothing to update). It reads every outbox table and view; it writes the
-- delivery columns of a message, never its payload, topic or key.
GRANT USAGE ON SCHEMA outbox TO {publisher};
GRANT SELECT ON ALL TABLES IN SCHEMA outbox TO {publisher};
GRANT UPDATE (state, fence, attempts, batch_id, kafka_partition, kafka_offset, delivered_at,
              available_at, escalated_at, last_error, failures, send_alone, held, updated_at)
    ON outbox.messages TO {publisher};
GRANT INSERT (publisher_id, lease_expires_at, message_ids, key_hashes),
      UPDATE (send_began_at, write_deadline, transactional_id, partition_counts,
              confirmed_offsets, settled_at, lease_expires_at, message_ids)
    ON outbox.batches TO {publisher};
GRANT INSERT ON outbox.attempts TO {publisher};
GRANT INSERT (message_id, decided_by, from_state, to_state, reason, evidence)
    ON outbox.decisions TO {publisher};
GRANT INSERT (topic, kafka_partition, confirmed_offset), UPDATE (confirmed_offset, updated_at)
    ON outbox.partition_offsets TO {publisher};
GRANT INSERT (id, host, pid, version, lease_seconds),
      UPDATE (heartbeat_at, stopped_at, transactional_id, kafka_reached_at)
    ON outbox.publishers TO {publisher};
GRANT UPDATE (owner, lease_expires_at, fence, acquired_at) ON outbox.lanes TO {publisher};
GRANT UPDATE ON outbox.wakeup TO {publisher};
-- Retention: purge_delivered, purge_attempts, purge_decisions, purge_batches.
GRANT DELETE ON outbox.messages, outbox.attempts, outbox.decisions, outbox.batches
    TO {publisher};

-- name: operator
-- outbox status, list and inspect (every table and view), and the decisions:
-- resolve, retry and discard (resolve_lock, resolve_message,
-- retry_quarantined, and release_held_of for what waited behind the message),
-- each recorded in outbox.decisions. No DELETE: the
-- decisions an operator took cannot be erased by one (retention is the
-- publisher role's). A decision raises the message's fence, so that a second
-- decision made from the same reading is refused. resolve_lock locks the
-- message's row and its lane's advisory lock, never the lane row: no grant
-- on outbox.lanes beyond reading it (one would let an operator's open
-- transaction lock the lanes every claim reads).
GRANT USAGE ON SCHEMA outbox TO {operator};
GRANT SELECT ON ALL TABLES IN SCHEMA outbox TO {operator};
GRANT UPDATE (state, fence, kafka_partition, kafka_offset, delivered_at, available_at,
              escalated_at, failures, last_error, held, updated_at)
    ON outbox.messages TO {operator};
GRANT INSERT (message_id, decided_by, from_state, to_state, reason, evidence)
    ON outbox.decisions TO {operator};
