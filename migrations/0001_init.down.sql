DROP TABLE IF EXISTS relay_shards;
DROP TABLE IF EXISTS relay_rounds;
DROP TABLE IF EXISTS relay_instances;
DROP TABLE IF EXISTS processed_messages;
DROP TABLE IF EXISTS outbox_dead;
DROP TABLE IF EXISTS outbox;
DROP FUNCTION IF EXISTS outbox_notify();
