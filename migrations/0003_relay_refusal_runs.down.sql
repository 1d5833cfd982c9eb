ALTER TABLE relay_instances DROP COLUMN IF EXISTS token;
ALTER TABLE outbox DROP COLUMN IF EXISTS refused_kind;
