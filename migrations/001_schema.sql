-- Conveyor's data model (docs/design.md). Every later change is a new numbered file.

CREATE TABLE tasks (
    id                  uuid PRIMARY KEY,
    tenant_id           text        NOT NULL DEFAULT 'default',
    type                text        NOT NULL CHECK (type ~ '^[a-z0-9][a-z0-9._-]{0,127}$'),
    status              text        NOT NULL DEFAULT 'PENDING'
                        CHECK (status IN ('PENDING', 'IN_PROGRESS', 'COMPLETED', 'FAILED', 'CANCELLED')),
    state               text        NOT NULL DEFAULT 'Queued',
    progress            smallint    NOT NULL DEFAULT 0 CHECK (progress BETWEEN 0 AND 100),
    priority            smallint    NOT NULL DEFAULT 5 CHECK (priority BETWEEN 0 AND 9),
    payload             jsonb       NOT NULL DEFAULT '{}',
    metadata            jsonb       NOT NULL DEFAULT '{}',
    input_hash          char(64),
    idempotency_key     text,
    error               text,
    attempt             integer     NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts        integer     NOT NULL DEFAULT 3 CHECK (max_attempts >= 1),
    version             integer     NOT NULL DEFAULT 1,
    worker_id           text,
    lease_expires_at    timestamptz,
    next_run_at         timestamptz NOT NULL DEFAULT now(),
    cancel_requested_at timestamptz,
    traceparent         text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    started_at          timestamptz,
    completed_at        timestamptz,
    -- A terminal task has finished; a running one has a lease.
    CHECK ((status IN ('COMPLETED', 'FAILED', 'CANCELLED')) = (completed_at IS NOT NULL)),
    CHECK (status <> 'IN_PROGRESS' OR lease_expires_at IS NOT NULL)
);

-- Idempotency: one task per canonical input, one per client key.
CREATE UNIQUE INDEX tasks_input_hash_key ON tasks (tenant_id, type, input_hash)
    WHERE input_hash IS NOT NULL;
CREATE UNIQUE INDEX tasks_idempotency_key ON tasks (tenant_id, type, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Listing, newest first with a keyset cursor on the time-ordered UUIDv7 id.
CREATE INDEX tasks_status_id ON tasks (status, id DESC);
CREATE INDEX tasks_type_id ON tasks (type, id DESC);

-- Maintenance: PENDING tasks due to run (re-publication), expired leases,
-- retention of terminal tasks.
CREATE INDEX tasks_pending_next_run ON tasks (next_run_at) WHERE status = 'PENDING';
CREATE INDEX tasks_running_lease ON tasks (lease_expires_at) WHERE status = 'IN_PROGRESS';
CREATE INDEX tasks_terminal_completed ON tasks (completed_at)
    WHERE status IN ('COMPLETED', 'FAILED', 'CANCELLED');

CREATE TABLE task_events (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id    uuid        NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    status     text        NOT NULL
               CHECK (status IN ('PENDING', 'IN_PROGRESS', 'COMPLETED', 'FAILED', 'CANCELLED')),
    state      text        NOT NULL,
    progress   smallint    NOT NULL CHECK (progress BETWEEN 0 AND 100),
    detail     jsonb,
    actor      text        NOT NULL CHECK (actor IN ('API', 'RELAY', 'WORKER', 'SYSTEM')),
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX task_events_task_id ON task_events (task_id, id DESC);

CREATE TABLE task_results (
    task_id    uuid PRIMARY KEY REFERENCES tasks (id) ON DELETE CASCADE,
    payload    jsonb       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Messages waiting to be published. The id is the AMQP message_id.
CREATE TABLE outbox (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind         text        NOT NULL CHECK (kind IN ('task.run', 'task.cancel')),
    task_id      uuid        NOT NULL,
    routing_key  text        NOT NULL,
    priority     smallint    NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 9),
    body         jsonb       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}',
    available_at timestamptz NOT NULL DEFAULT now(),
    attempts     integer     NOT NULL DEFAULT 0,
    last_error   text,
    created_at   timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX outbox_available ON outbox (available_at, id);

CREATE TABLE workers (
    id                text PRIMARY KEY,
    hostname          text        NOT NULL,
    pid               integer     NOT NULL,
    concurrency       integer     NOT NULL,
    types             text[]      NOT NULL,
    version           text        NOT NULL DEFAULT '',
    started_at        timestamptz NOT NULL DEFAULT now(),
    last_heartbeat_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX workers_last_heartbeat ON workers (last_heartbeat_at);

-- Leadership for maintenance: one row per duty, held by a worker until it expires.
CREATE TABLE leaders (
    name       text PRIMARY KEY,
    leader_id  text        NOT NULL,
    elected_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
