-- 0017: the check of outbox.attempts.outcome that 0016 added NOT VALID is
-- validated: one read of the table under SHARE UPDATE EXCLUSIVE, which
-- inserts (settles, recoveries) do not wait for; only VACUUM and other DDL
-- on the table do. Every row passes (see 0016).
ALTER TABLE outbox.attempts VALIDATE CONSTRAINT attempts_outcome_known;
