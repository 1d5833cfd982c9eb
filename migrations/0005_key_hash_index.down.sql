DROP INDEX IF EXISTS outbox_key_hash_idx;
