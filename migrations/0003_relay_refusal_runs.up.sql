-- What first_refused_at counts a continuous run of: 1 unknown topic, 2 topic
-- not authorized. Any other outcome of a publish attempt clears both, so each
-- grace period counts an unbroken run of its own answer.
ALTER TABLE outbox ADD COLUMN refused_kind smallint;

-- A token per relay process in its instance row: a second process started
-- under the same instance id is told apart from the first and refused.
ALTER TABLE relay_instances ADD COLUMN token text;
