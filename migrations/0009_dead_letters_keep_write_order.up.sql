-- onceflow schema, version 9: a dead event keeps its place in its key's
-- write order across replays.
--
-- Dead letters are listed and replayed in outbox id order, a key's write
-- order. But a replayed event gets a new outbox id, at the back of the
-- queue; if Kafka refused it again, its new dead letter sorted after its
-- key's later events that had stayed dead, and a replay of them all
-- published the key's events out of order (G3). The first id travels with
-- the event now: outbox.first_id is set by a replay (NULL for an event as
-- first written) and outbox_dead.first_outbox_id by the relay when it
-- dead-letters (NULL in rows written before this version: their outbox_id).
--
-- Nullable columns without a default: no row is rewritten, and the brief
-- ACCESS EXCLUSIVE lock on each table is held only to change the catalog.
ALTER TABLE outbox ADD COLUMN first_id bigint;
ALTER TABLE outbox_dead ADD COLUMN first_outbox_id bigint;
