-- onceflow schema, version 7: the headers check reads the object strictly.
--
-- Migration 6's check ran its JSON path in lax mode, which unwraps arrays:
-- a header whose value was an array of strings ({"tags": ["a"]}, or [])
-- passed, and the relay, which cannot publish it, sent that event's headers
-- as one "onceflow-bad-headers" header, losing the others. The strict path
-- looks at each member's value as it is. The silent flag keeps a non-object
-- (refused by the jsonb_typeof test) from raising an error instead of the
-- constraint's 23514.
--
-- Rows the lax check let through are rewritten first into that one header,
-- holding their JSON (what the relay published for them anyway), in the
-- outbox and in the dead letters: PostgreSQL checks a table's CHECK again
-- on every UPDATE, so the relay's own updates of such a row (a failure, a
-- crashed round's charge) would fail, and a dead one could not be replayed.
--
-- Locking: producers' inserts wait (SHARE ROW EXCLUSIVE on outbox) while
-- the pending rows are read once to find such rows (about half a second
-- per million on the project's 2-core VM; milliseconds for an empty
-- outbox), so none is written between that read and the new check. The
-- relay's reads go on; its deletes wait. No column changes type and
-- nothing is rewritten but the rows found.
LOCK TABLE outbox IN SHARE ROW EXCLUSIVE MODE;

UPDATE outbox SET headers = jsonb_build_object('onceflow-bad-headers', headers::text)
WHERE headers IS NOT NULL
    AND jsonb_path_exists(headers, 'strict $.* ? (@.type() != "string")', '{}', true);

UPDATE outbox_dead SET headers = jsonb_build_object('onceflow-bad-headers', headers::text)
WHERE headers IS NOT NULL AND jsonb_typeof(headers) = 'object'
    AND jsonb_path_exists(headers, 'strict $.* ? (@.type() != "string")', '{}', true);

ALTER DOMAIN outbox_headers DROP CONSTRAINT outbox_headers_check;
ALTER DOMAIN outbox_headers ADD CONSTRAINT outbox_headers_check CHECK (jsonb_typeof(VALUE) = 'object'
    AND NOT jsonb_path_exists(VALUE, 'strict $.* ? (@.type() != "string")', '{}', true));
