-- 0004: lanes, the unit of work a publisher owns.
--
-- Every message falls in one of 32 lanes: a keyed message by the hash of its
-- (topic, key), an unkeyed one by the hash of its id. A lane is owned by one
-- publisher at a time, under a lease and a fence, and a publisher claims only
-- from the lanes it owns; so one key's messages are claimed by one publisher
-- at a time, in order, however many publishers run. Lanes move when
-- publishers start, stop or die (see the lane queries in outbox/queries.sql).
-- The number of lanes is fixed here: changing it moves keys between lanes.

ALTER TABLE outbox.messages
    ADD COLUMN lane smallint GENERATED ALWAYS AS (
        ((hashtextextended(CASE WHEN key IS NULL THEN id::text
                                ELSE topic || E'\n' || encode(key, 'hex') END, 0) % 32 + 32)
         % 32)::smallint
    ) STORED;

CREATE TABLE outbox.lanes (
    lane             smallint PRIMARY KEY,
    owner            uuid,
    lease_expires_at timestamptz,
    -- Raised at every change of owner.
    fence            bigint NOT NULL DEFAULT 0,
    acquired_at      timestamptz,
    CONSTRAINT lanes_owned_with_lease CHECK ((owner IS NULL) = (lease_expires_at IS NULL))
);
INSERT INTO outbox.lanes (lane) SELECT generate_series(0, 31);

-- Claims keep reading pending messages in seq order (messages_claimable) and
-- skip other publishers' lanes: an index on (lane, seq) would make "oldest
-- first across my lanes" a sort of every pending row of those lanes.
