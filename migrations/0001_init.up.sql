-- onceflow schema, version 1.
--
-- Every name below is unqualified: the migrator runs this file with
-- search_path set to the target schema (default "onceflow"), so the same file
-- serves any schema. If you apply it with your own tool, set search_path first:
--   CREATE SCHEMA IF NOT EXISTS onceflow; SET search_path TO onceflow;

-- outbox holds pending events only: the relay deletes a row once Kafka has
-- acknowledged it, so the row count is the backlog. Producers in any language
-- may write with plain SQL:
--   INSERT INTO onceflow.outbox (topic, key, value, headers) VALUES (...);
CREATE TABLE outbox (
    -- The write order. Handed out before commit, so the relay never uses it as
    -- a cursor: it selects whatever is still pending.
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Published as the record's message-id header; stable across re-sends.
    event_id    uuid        NOT NULL DEFAULT gen_random_uuid(),
    topic       text        NOT NULL CHECK (topic <> '' AND length(topic) <= 249),
    key         bytea,
    value       bytea,
    -- An object of string to string, published as record headers.
    headers     jsonb CHECK (headers IS NULL OR (jsonb_typeof(headers) = 'object'
                     AND NOT jsonb_path_exists(headers, '$.* ? (@.type() != "string")'))),
    created_at  timestamptz NOT NULL DEFAULT now(),
    -- The unit of ordering and ownership: one of 256 shards, from the key (or,
    -- for a keyless event, its event id). One relay owns a shard at a time.
    shard       smallint    NOT NULL GENERATED ALWAYS AS
                    (get_byte(sha256(coalesce(key, uuid_send(event_id))), 0)) STORED,
    -- Publish attempts that failed or were cut short by a relay crash (a
    -- relay records the ids of its in-flight round in relay_instances, and
    -- the survivors charge them when it dies), so a row that crashes the
    -- relay cannot loop at zero attempts.
    attempts    integer     NOT NULL DEFAULT 0,
    last_error  text,
    -- When a refusal that may heal (an unknown topic) was first seen; the
    -- relay dead-letters the row once it is older than the grace period.
    first_refused_at timestamptz
);

-- Serves the relay's per-shard reads and the per-shard backlog figures.
CREATE INDEX outbox_shard_id_idx ON outbox (shard, id);

-- A commit that inserted outbox rows wakes every relay listening on
-- "onceflow_outbox"; the payload names the schema. PostgreSQL delivers
-- notifications at commit only, and folds repeats within a transaction.
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('onceflow_outbox', TG_TABLE_SCHEMA);
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();

-- Events Kafka refused for good. "onceflow dead replay" moves them back into
-- the outbox, keeping event_id.
CREATE TABLE outbox_dead (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    outbox_id   bigint      NOT NULL,
    event_id    uuid        NOT NULL,
    topic       text        NOT NULL,
    key         bytea,
    value       bytea,
    headers     jsonb,
    created_at  timestamptz NOT NULL,
    error       text        NOT NULL,
    attempts    integer     NOT NULL,
    dead_at     timestamptz NOT NULL DEFAULT now()
);

-- The idempotent consumer's dedup records: one per (consumer, message id).
CREATE TABLE processed_messages (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

-- Serves the retention janitor.
CREATE INDEX processed_messages_processed_at_idx ON processed_messages (processed_at);

-- Live relay processes. A relay renews lease_until while it lives; one whose
-- lease has lapsed counts as dead and its shards are free to take.
CREATE TABLE relay_instances (
    id           text        PRIMARY KEY,
    hostname     text        NOT NULL DEFAULT '',
    pid          integer     NOT NULL DEFAULT 0,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    lease_until  timestamptz NOT NULL
);

-- The span of outbox ids (and the shards) of each round a relay has in
-- flight: a row written as the round is read, before it is published, deleted with
-- the round's outcome, and left behind by a crash, so survivors can charge
-- those events an attempt. One small row per round, not one write per event;
-- one row per round, so reading a round never waits on the previous round's
-- commit. Unlogged: it only matters while the database stays up.
CREATE UNLOGGED TABLE relay_rounds (
    instance text     NOT NULL,
    lo       bigint   NOT NULL,
    hi       bigint   NOT NULL,
    shards   smallint[] NOT NULL,
    PRIMARY KEY (instance, lo)
);

-- Shard ownership. All times come from the database clock, so relays on
-- machines with skewed clocks still agree.
CREATE TABLE relay_shards (
    shard       smallint PRIMARY KEY CHECK (shard BETWEEN 0 AND 255),
    owner       text,
    lease_until timestamptz
);

INSERT INTO relay_shards (shard) SELECT generate_series(0, 255);
