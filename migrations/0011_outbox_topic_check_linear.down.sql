ALTER DOMAIN outbox_topic DROP CONSTRAINT outbox_topic_check;
ALTER DOMAIN outbox_topic ADD CONSTRAINT outbox_topic_check
    CHECK (VALUE ~ '^[A-Za-z0-9._-]{1,249}$' AND VALUE NOT IN ('.', '..'));
