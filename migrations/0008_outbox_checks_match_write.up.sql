-- onceflow schema, version 8: the outbox's checks refuse what outbox.Write
-- refuses, so a plain-SQL producer learns at its INSERT, in its transaction.
--
-- - A topic name Kafka refuses (anything but ASCII letters, digits, '.',
--   '_' and '-'; '.' and '..'; over 249 characters). Version 7 let any
--   non-empty name through; the relay could only dead-letter such an event,
--   and a broker that answers "unknown topic" for it (kfake does) made the
--   relay wait out the unknown-topic grace first, holding the key's later
--   events on valid topics behind it.
-- - A "message-id" header. The relay publishes the event's event_id under
--   that name and drops the producer's, so a producer that meant it as its
--   own id saw each copy of an event get another id, and consumers could not
--   deduplicate them. Set the event_id column instead.
--
-- Rows the earlier checks let through are mended first, because PostgreSQL
-- checks a table's CHECK again on every UPDATE (the relay's failure and
-- crash charges) and a replay inserts a dead row again: their message-id
-- header is dropped (what the relay published for them anyway), and a
-- pending event on a refused topic name is dead-lettered (what Kafka would
-- have had the relay do). Dead events on such names stay dead: replaying
-- them is refused by the new check.
--
-- jsonb_exists is the ? operator, spelled so that migration tools that bind
-- parameters do not read it as a placeholder.
--
-- Locking: producers' inserts wait (SHARE ROW EXCLUSIVE on outbox) while
-- the pending rows are read once to find such rows, so none is written
-- between that read and the new checks. The relay's reads go on; its
-- deletes wait.
LOCK TABLE outbox IN SHARE ROW EXCLUSIVE MODE;

UPDATE outbox SET headers = headers - 'message-id' WHERE jsonb_exists(headers, 'message-id');

UPDATE outbox_dead SET headers = headers - 'message-id'
WHERE jsonb_typeof(headers) = 'object' AND jsonb_exists(headers, 'message-id');

WITH refused AS (
    DELETE FROM outbox WHERE NOT (topic ~ '^[A-Za-z0-9._-]{1,249}$' AND topic NOT IN ('.', '..'))
    RETURNING id, event_id, topic, key, value, headers, created_at, attempts)
INSERT INTO outbox_dead (outbox_id, event_id, topic, key, value, headers, created_at, attempts, error)
SELECT id, event_id, topic, key, value, headers, created_at, attempts,
    'topic name Kafka refuses (only ASCII letters, digits, ''.'', ''_'' and ''-'', at most 249): dead-lettered by migration 0008'
FROM refused ORDER BY id;

ALTER DOMAIN outbox_topic DROP CONSTRAINT outbox_topic_check;
ALTER DOMAIN outbox_topic ADD CONSTRAINT outbox_topic_check
    CHECK (VALUE ~ '^[A-Za-z0-9._-]{1,249}$' AND VALUE NOT IN ('.', '..'));

ALTER DOMAIN outbox_headers DROP CONSTRAINT outbox_headers_check;
ALTER DOMAIN outbox_headers ADD CONSTRAINT outbox_headers_check CHECK (jsonb_typeof(VALUE) = 'object'
    AND NOT jsonb_path_exists(VALUE, 'strict $.* ? (@.type() != "string")', '{}', true)
    AND NOT jsonb_exists(VALUE, 'message-id'));
