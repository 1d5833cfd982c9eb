ALTER DOMAIN outbox_topic DROP CONSTRAINT outbox_topic_check;
ALTER DOMAIN outbox_topic ADD CONSTRAINT outbox_topic_check CHECK (VALUE <> '' AND length(VALUE) <= 249);

ALTER DOMAIN outbox_headers DROP CONSTRAINT outbox_headers_check;
ALTER DOMAIN outbox_headers ADD CONSTRAINT outbox_headers_check CHECK (jsonb_typeof(VALUE) = 'object'
    AND NOT jsonb_path_exists(VALUE, 'strict $.* ? (@.type() != "string")', '{}', true));
