-- onceflow schema, version 9: a dead event keeps its place in its key's
-- write order across replays.
--
-- Dead letters are listed and replayed in outbox id order, a key's write
-- order. But a replayed event gets a new outbox id, at the back of the
-- queue; if Kafka refused it again, its new dead letter sorted after its
-- key's later events that had stayed dead, and a replay of them all
-- published the key's events out of order (G3). A replay now records the
-- outbox id each event was first written with, by event_id and topic, which
-- the event keeps through the outbox and back. Keyed so, it needs nothing
-- from the relay: a relay of an earlier release that dead-letters a
-- replayed event keeps its place too. (The topic is part of the key: one
-- event id on several topics is one event fanned out, each copy in its own
-- place.)
--
-- One small row per replayed event; nothing else writes here.
CREATE TABLE dead_replays (
    event_id        uuid        NOT NULL,
    topic           text        NOT NULL,
    first_outbox_id bigint      NOT NULL,
    replayed_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, topic)
);
