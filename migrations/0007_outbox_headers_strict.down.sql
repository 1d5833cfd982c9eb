ALTER DOMAIN outbox_headers DROP CONSTRAINT outbox_headers_check;
ALTER DOMAIN outbox_headers ADD CONSTRAINT outbox_headers_check CHECK (jsonb_typeof(VALUE) = 'object'
    AND NOT jsonb_path_exists(VALUE, '$.* ? (@.type() != "string")'));
