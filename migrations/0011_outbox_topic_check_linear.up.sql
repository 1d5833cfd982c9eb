-- onceflow schema, version 11: the topic check of version 8, without the
-- bounded repetition that made it the producers' dearest statement part.
--
-- Version 8 wrote the name rule as '^[A-Za-z0-9._-]{1,249}$'. PostgreSQL's
-- regular-expression engine expands a bounded repetition into that many
-- states, and matching a short topic name against it took 25-40 µs of the
-- backend's CPU (against under 1 µs for the same pattern with '+'), on
-- every producer's INSERT: the outbox row's statements went from 14 µs more
-- than a plain table's row to about 100 µs more (BENCHMARKS.md, "The topic
-- check's bounded repetition"). The rule is unchanged: ASCII letters,
-- digits, '.', '_' and '-', one to 249 of them, neither '.' nor '..'; the
-- length is now counted apart (octet_length: the pattern admits only
-- ASCII, so bytes are characters).
--
-- Locking: only the domain changes. No column has the domain's type (the
-- table's CHECK casts to it), so no table is read or locked; producers'
-- inserts go on.
ALTER DOMAIN outbox_topic DROP CONSTRAINT outbox_topic_check;
ALTER DOMAIN outbox_topic ADD CONSTRAINT outbox_topic_check
    CHECK (octet_length(VALUE) <= 249 AND VALUE ~ '^[A-Za-z0-9._-]+$' AND VALUE NOT IN ('.', '..'));
