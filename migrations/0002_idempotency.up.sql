-- onceflow schema, version 2: HTTP Idempotency-Key records and run-once
-- fences (package idempotency).
--
-- Every name below is unqualified: the migrator runs this file with
-- search_path set to the target schema (default "onceflow").

-- One row per claimed key. A row is "running" while its first request (or
-- idempotency.Do call) works, "done" once its response is stored, and
-- "unstored" when the response was too large to keep: a retry then gets a
-- clear error instead of a re-run. Transactional claims never commit as
-- "running": the claim, the handler's writes and the response commit together.
CREATE TABLE idempotency_keys (
    -- Whose key this is: "http:" plus the principal the middleware's scope
    -- function returned, or "do:" plus a fence's namespace. The same key in
    -- two scopes is two independent operations.
    scope        text        NOT NULL,
    key          text        NOT NULL,
    -- Hash of the request (method, path, body by default); a retry whose
    -- fingerprint differs is refused (HTTP 422).
    fingerprint  bytea       NOT NULL,
    state        text        NOT NULL DEFAULT 'running'
                     CHECK (state IN ('running', 'done', 'unstored')),
    -- The claim's owner: completion and release only touch their own claim.
    token        uuid        NOT NULL,
    -- Leased claims only: until when the claimer is presumed alive. A
    -- "running" row whose lease has passed may be taken over. Database clock.
    lease_until  timestamptz,
    -- The stored response (HTTP) or result (idempotency.Do).
    status       integer,
    headers      jsonb,
    body         bytea,
    created_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    -- After this the record is dead: a new claim replaces it and the purge
    -- deletes it.
    expires_at   timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
);

-- Serves the purge of expired records.
CREATE INDEX idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);
