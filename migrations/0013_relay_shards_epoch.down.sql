ALTER TABLE relay_shards DROP COLUMN epoch;
