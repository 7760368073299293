-- 0002: evidence for recovery and reconciliation.
--
-- A claim is recorded as a batch: who claimed it, when, and (before the first
-- record is handed to the producer) when sending began, how partitions were
-- chosen, which offsets were already confirmed, and when the producer can no
-- longer write. Messages point at the batch of their current attempt, so the
-- evidence for every in-flight message is one join away, written once per
-- batch instead of once per message.

CREATE TABLE outbox.batches (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    publisher_id      uuid NOT NULL,
    claimed_at        timestamptz NOT NULL DEFAULT now(),
    -- Set, and committed, before the first record is sent. NULL: nothing of
    -- this batch can have reached Kafka.
    send_began_at     timestamptz,
    -- After this the producer that sent the batch has given up on every
    -- record (delivery timeout + request timeout since sending began).
    write_deadline    timestamptz,
    -- {"topic": partition count} used to choose each record's partition.
    partition_counts  jsonb,
    -- {"topic": {"partition": offset}}: the highest offsets confirmed before
    -- sending began; a record of this batch can only be above them.
    confirmed_offsets jsonb,
    settled_at        timestamptz
);
CREATE INDEX batches_publisher ON outbox.batches (publisher_id);

ALTER TABLE outbox.messages
    ADD COLUMN batch_id bigint,
    -- Set when reconciliation could not decide an uncertain message from the
    -- evidence left (log truncated, topic gone): an operator must decide.
    ADD COLUMN escalated_at timestamptz;
-- Operators resolving by hand may mark a message delivered without knowing
-- its offset; the decision records why.
ALTER TABLE outbox.messages DROP CONSTRAINT messages_delivered_located;
-- Marking a batch as sending looks up its messages; only in-flight rows matter.
CREATE INDEX messages_batch ON outbox.messages (batch_id) WHERE state = 'in_flight';
-- The reconciler reads uncertain messages in the order they become decidable.
CREATE INDEX messages_uncertain ON outbox.messages (available_at) WHERE state = 'uncertain';

ALTER TABLE outbox.attempts ADD COLUMN batch_id bigint;

-- The highest offset confirmed so far in each topic partition.
CREATE TABLE outbox.partition_offsets (
    topic            text NOT NULL,
    kafka_partition  integer NOT NULL,
    confirmed_offset bigint NOT NULL,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, kafka_partition)
);

-- Every decision taken on a message after the fact: by the reconciler from
-- what it found in Kafka, or by an operator with a reason.
CREATE TABLE outbox.decisions (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id  uuid NOT NULL REFERENCES outbox.messages (id) ON DELETE CASCADE,
    decided_at  timestamptz NOT NULL DEFAULT now(),
    -- 'reconciler <publisher id>' or 'operator <user>@<host>'.
    decided_by  text NOT NULL,
    from_state  text NOT NULL,
    to_state    text NOT NULL,
    reason      text NOT NULL,
    -- What the decision rests on: the scanned topic partition and offsets,
    -- the offset found, and for operators whatever they supplied.
    evidence    jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX decisions_message ON outbox.decisions (message_id);

UPDATE outbox.states
SET next_action = 'wait: the reconciler decides it from Kafka once the old producer can no '
                  'longer write; if escalated_at is set, read last_error and decide with '
                  'outbox resolve'
WHERE state = 'uncertain';
