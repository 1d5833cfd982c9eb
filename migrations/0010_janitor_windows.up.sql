-- onceflow schema, version 10: the consumers' janitors on one schema keep
-- dedup records for the longest window any of them keeps.
--
-- Services that share a schema share processed_messages, and a janitor
-- deletes every consumer's expired records: one configured with a shorter
-- window than another service's expired that service's records early, and
-- a redelivery within its window was processed twice. Each janitor now
-- records its window here as it sweeps, and deletes only what is older than
-- the longest window recorded by a janitor seen within twice that window.
-- (A window whose janitor has not swept for that long lapses: its
-- consumers' messages still in Kafka arrived after it stopped, so no record
-- of theirs is needed; twice, so that a janitor that sweeps late is not
-- taken for gone.)
--
-- A few rows, one per distinct window; nothing else writes here.
CREATE TABLE janitor_windows (
    window_seconds bigint      PRIMARY KEY,
    seen_at        timestamptz NOT NULL DEFAULT now()
);
