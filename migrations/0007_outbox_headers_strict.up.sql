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
-- Locking: a domain's constraint changes without touching the outbox (no
-- column has the domain's type; the table's CHECK casts to it), so this
-- takes milliseconds. Rows written before keep their headers; the relay
-- still publishes such a row, with its headers as "onceflow-bad-headers".
ALTER DOMAIN outbox_headers DROP CONSTRAINT outbox_headers_check;
ALTER DOMAIN outbox_headers ADD CONSTRAINT outbox_headers_check CHECK (jsonb_typeof(VALUE) = 'object'
    AND NOT jsonb_path_exists(VALUE, 'strict $.* ? (@.type() != "string")', '{}', true));
