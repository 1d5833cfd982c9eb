ALTER TABLE outbox_dead DROP COLUMN first_outbox_id;
ALTER TABLE outbox DROP COLUMN first_id;
