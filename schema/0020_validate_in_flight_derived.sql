-- 0020: the check of outbox.messages that 0019 added NOT VALID is
-- validated: one read of the table under SHARE UPDATE EXCLUSIVE, which
-- enqueues, claims and settles do not wait for; only VACUUM and other DDL
-- on the table do. Every row passes (see 0019).
ALTER TABLE outbox.messages VALIDATE CONSTRAINT messages_in_flight_derived;
