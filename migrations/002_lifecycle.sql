-- One lifecycle statement, exact idempotency, bounded task types, and the
-- broker's confirmation recorded on the task.

-- Lease renewals and progress reports touch no indexed column, so they are
-- HOT updates; leave room on each page for them. The lease reaper finds
-- running tasks through tasks_status_id (few tasks run at once).
ALTER TABLE tasks SET (fillfactor = 90);
DROP INDEX tasks_running_lease;

-- When the broker last confirmed a task.run message of the task: a PENDING
-- task whose message was confirmed long ago, and whose queue is empty, lost
-- that message and is published again.
ALTER TABLE tasks ADD COLUMN published_at timestamptz;

-- Idempotency keys, each naming one task; several keys may name the same
-- task (a keyed submission that matches an existing task by its input).
-- request_hash identifies the whole submission the key was first used with;
-- it is NULL for keys recorded before this migration, which are then
-- compared by payload.
CREATE TABLE task_idempotency_keys (
    tenant_id    text        NOT NULL,
    type         text        NOT NULL,
    key          text        NOT NULL,
    task_id      uuid        NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    request_hash char(64),
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, type, key)
);
CREATE INDEX task_idempotency_keys_task ON task_idempotency_keys (task_id);
INSERT INTO task_idempotency_keys (tenant_id, type, key, task_id, created_at)
    SELECT tenant_id, type, idempotency_key, id, created_at FROM tasks WHERE idempotency_key IS NOT NULL;
-- tasks.idempotency_key now only records the key the task was created with.
DROP INDEX tasks_idempotency_key;

-- The task types some worker has declared a queue for: a set that grows
-- with deployments, not with client input.
CREATE TABLE task_types (
    name          text PRIMARY KEY CHECK (name ~ '^[a-z0-9][a-z0-9._-]{0,127}$'),
    first_seen_at timestamptz NOT NULL DEFAULT now(),
    last_seen_at  timestamptz NOT NULL DEFAULT now()
);
INSERT INTO task_types (name) SELECT DISTINCT unnest(types) FROM workers ON CONFLICT DO NOTHING;

-- Outbox rows hold the message's fields; the relay builds the body. A row
-- whose type has no queue yet is parked (available_at = 'infinity') until a
-- worker for the type declares its queue.
ALTER TABLE outbox
    ADD COLUMN task_type    text,
    ADD COLUMN attempt      integer,
    ADD COLUMN task_version integer;
UPDATE outbox SET task_type = body->>'type', attempt = coalesce((body->>'attempt')::integer, 0), task_version = 0;
ALTER TABLE outbox
    ALTER COLUMN task_type SET NOT NULL,
    ALTER COLUMN attempt SET NOT NULL,
    ALTER COLUMN task_version SET NOT NULL,
    DROP COLUMN body,
    DROP COLUMN routing_key;
