-- onceflow schema, version 5: an index on the key's hash, so a relay reads
-- the other keys of a shard without walking a blocked key's events.
--
-- The expression is the first 8 bytes of the sha256 the shard column is
-- computed from (so its first byte is the shard). While a key waits out a
-- retry, the relay reads the shard that holds it as the key-hash ranges
-- between blocked keys, and a key stuck with 300,000 pending events costs
-- its shard's reads nothing.
CREATE INDEX outbox_key_hash_idx ON outbox
    ((substring(sha256(coalesce(key, uuid_send(event_id))) FROM 1 FOR 8)), id);
