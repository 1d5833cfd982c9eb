ALTER TABLE relay_instances DROP COLUMN kafka_ok;
