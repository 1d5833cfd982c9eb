-- onceflow schema, version 6: the outbox's CHECK constraints check through
-- domains, so an INSERT no longer parses and plans them in full.
--
-- PostgreSQL 15 reads a table's CHECK expressions back from their stored
-- text and plans them again for every INSERT statement (ExecRelCheck), so a
-- one-row insert paid for the headers check's jsonb_path_exists tree whole
-- (~20 µs of backend CPU per event; BENCHMARKS.md, "Producer overhead"). A
-- domain's CHECK is planned once per connection and kept in its type cache
-- (until any constraint in the database changes). The columns keep their
-- types (text, jsonb): each table CHECK is now a cast to its domain, a small
-- expression, and a plain-SQL producer binds the same parameters as before.
-- The rules are unchanged: a malformed value is still refused at INSERT
-- (SQLSTATE 23514, constraint outbox_topic_check or outbox_headers_check),
-- now worded "value for domain <schema>.outbox_headers violates check
-- constraint ...".
--
-- Locking: ALTER TABLE takes an ACCESS EXCLUSIVE lock on outbox and reads
-- every pending row once to validate the new constraints; no column type
-- changes, nothing is rewritten and no index is rebuilt. Measured on the
-- project's 2-core VM under load (average 8): 1,000,000 pending rows (half
-- with headers) held the lock for 5.7-6.4 s, the revert 4.8 s; an empty
-- outbox takes milliseconds. Producers' inserts and the relay wait for the
-- lock: apply it when the backlog is small (it usually is: the table holds
-- pending events only).
CREATE DOMAIN outbox_topic AS text
    CONSTRAINT outbox_topic_check CHECK (VALUE <> '' AND length(VALUE) <= 249);

-- An object of string to string, published as record headers.
CREATE DOMAIN outbox_headers AS jsonb
    CONSTRAINT outbox_headers_check CHECK (jsonb_typeof(VALUE) = 'object'
        AND NOT jsonb_path_exists(VALUE, '$.* ? (@.type() != "string")'));

ALTER TABLE outbox
    DROP CONSTRAINT outbox_topic_check,
    DROP CONSTRAINT outbox_headers_check,
    ADD CONSTRAINT outbox_topic_check CHECK ((topic::outbox_topic) IS NOT NULL),
    ADD CONSTRAINT outbox_headers_check CHECK ((headers::outbox_headers) IS NOT NULL OR headers IS NULL);
