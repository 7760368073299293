-- 0001: messages, attempts, publishers, the status view and the NOTIFY trigger.
--
-- Everything lives in the `outbox` schema so that it never collides with the
-- producing service's own tables. `outbox migrate` runs this file inside one
-- transaction and records it in outbox.schema_migrations.

CREATE TABLE outbox.messages (
    -- Stable message id, chosen by the library (UUIDv7, so new ids sort by
    -- time and the primary key index stays compact). It travels to Kafka in
    -- the `outbox-id` header, which is how a record is found again later.
    id               uuid PRIMARY KEY,
    -- Allocation order; the publisher claims in this order.
    seq              bigint GENERATED ALWAYS AS IDENTITY,
    topic            text NOT NULL,
    key              bytea,
    value            bytea NOT NULL,
    -- Kafka headers are an ordered list that may repeat names, so they are
    -- kept as two parallel arrays rather than a map.
    header_names     text[] NOT NULL DEFAULT '{}',
    header_values    bytea[] NOT NULL DEFAULT '{}',
    idempotency_key  text UNIQUE,
    state            text NOT NULL DEFAULT 'pending',
    created_at       timestamptz NOT NULL DEFAULT now(),
    -- Not claimable before this time (retry backoff).
    available_at     timestamptz NOT NULL DEFAULT now(),
    -- Lease: which publisher owns the row and until when. `fence` grows by
    -- one at every claim; a write that carries an older fence changes nothing.
    lease_owner      uuid,
    lease_expires_at timestamptz,
    fence            bigint NOT NULL DEFAULT 0,
    attempts         integer NOT NULL DEFAULT 0,
    -- Where the broker put it: the partition is chosen before sending.
    kafka_partition  integer,
    kafka_offset     bigint,
    delivered_at     timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    last_error       text,
    CONSTRAINT messages_state_known CHECK (
        state IN ('pending', 'in_flight', 'delivered', 'uncertain', 'quarantined', 'discarded')),
    CONSTRAINT messages_headers_paired CHECK (
        cardinality(header_names) = cardinality(header_values)),
    CONSTRAINT messages_in_flight_leased CHECK (
        state <> 'in_flight' OR (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CONSTRAINT messages_delivered_located CHECK (
        state <> 'delivered' OR (kafka_partition IS NOT NULL AND kafka_offset IS NOT NULL))
);

-- Claims read only deliverable rows, so their cost does not grow with the
-- number of delivered or quarantined rows kept in the table.
CREATE INDEX messages_claimable ON outbox.messages (seq) WHERE state = 'pending';
-- Recovery looks for expired leases among in-flight rows only.
CREATE INDEX messages_leased ON outbox.messages (lease_expires_at) WHERE state = 'in_flight';

-- One row per publisher process: who it is and whether it is still alive.
CREATE TABLE outbox.publishers (
    id            uuid PRIMARY KEY,
    host          text NOT NULL,
    pid           integer NOT NULL,
    version       text NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    stopped_at    timestamptz
);

-- One row per attempt to deliver a message: the evidence recovery and
-- operators decide from.
CREATE TABLE outbox.attempts (
    message_id      uuid NOT NULL REFERENCES outbox.messages (id) ON DELETE CASCADE,
    attempt         integer NOT NULL,
    publisher_id    uuid NOT NULL,
    fence           bigint NOT NULL,
    started_at      timestamptz NOT NULL,
    send_began      boolean NOT NULL DEFAULT false,
    finished_at     timestamptz,
    outcome         text,
    error           text,
    kafka_partition integer,
    kafka_offset    bigint,
    PRIMARY KEY (message_id, attempt),
    CONSTRAINT attempts_outcome_known CHECK (
        outcome IS NULL OR outcome IN ('delivered', 'failed', 'uncertain', 'abandoned'))
);

-- The states a message can be in, with what each means for an operator.
CREATE TABLE outbox.states (
    state        text PRIMARY KEY,
    position     integer NOT NULL UNIQUE,
    healthy      boolean NOT NULL,
    next_action  text NOT NULL
);
INSERT INTO outbox.states (state, position, healthy, next_action) VALUES
    ('pending',     1, true,  'none: a publisher will claim it'),
    ('in_flight',   2, true,  'none while the lease is live; an expired lease is recovered by the publisher'),
    ('delivered',   3, true,  'none'),
    ('uncertain',   4, false, 'reconcile against Kafka (outbox reconcile), or decide by hand with outbox resolve'),
    ('quarantined', 5, false, 'read last_error, fix the cause, then retry or discard it with a reason'),
    ('discarded',   6, true,  'none: an operator decided not to deliver it');

-- One query for "what state is the work in and what is the next safe action".
CREATE VIEW outbox.status AS
SELECT s.state,
       count(m.id)                        AS messages,
       min(m.created_at)                  AS oldest_created_at,
       s.healthy OR count(m.id) = 0       AS healthy,
       s.next_action
FROM outbox.states AS s
LEFT JOIN outbox.messages AS m ON m.state = s.state
GROUP BY s.state, s.position, s.healthy, s.next_action
ORDER BY s.position;

-- Wake publishers when intents commit. A statement-level trigger sends one
-- notification per INSERT statement; NOTIFY is delivered only on commit and
-- identical notifications in one transaction are folded into one.
CREATE FUNCTION outbox.notify_pending() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_pending', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER messages_notify_pending
AFTER INSERT ON outbox.messages
FOR EACH STATEMENT EXECUTE FUNCTION outbox.notify_pending();
