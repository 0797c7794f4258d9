-- Jobs, schedules, concurrency limits, pauses, timeouts and fairness
-- (docs/design.md, "Jobs and admission").

-- A job: a named definition of the tasks it makes, declared by an org
-- (conveyor apply -f jobs.yaml), run on its cron schedule or when
-- triggered. next_tick_at is the schedule's cursor: the first tick no task
-- has been made for yet.
CREATE TABLE jobs (
    id                        uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    org_id                    uuid        NOT NULL REFERENCES orgs (id) ON DELETE CASCADE,
    name                      text        NOT NULL CHECK (name ~ '^[a-z0-9][a-z0-9._-]{0,127}$'),
    type                      text        NOT NULL CHECK (type ~ '^[a-z0-9][a-z0-9._-]{0,127}$'),
    payload                   jsonb       NOT NULL DEFAULT '{}',
    priority                  smallint    NOT NULL DEFAULT 5 CHECK (priority BETWEEN 0 AND 9),
    schedule                  text,
    timezone                  text        NOT NULL DEFAULT 'UTC',
    missed                    text        NOT NULL DEFAULT 'run_once' CHECK (missed IN ('skip', 'run_once')),
    max_attempts              integer     NOT NULL DEFAULT 3 CHECK (max_attempts >= 1),
    timeout_seconds           integer     CHECK (timeout_seconds > 0),
    heartbeat_timeout_seconds integer     CHECK (heartbeat_timeout_seconds > 0),
    max_concurrency           integer     CHECK (max_concurrency > 0),
    max_concurrency_per_key   integer     CHECK (max_concurrency_per_key > 0),
    active                    boolean     NOT NULL DEFAULT true,
    -- The SHA-256 of the definition as declared: an apply that changes
    -- nothing writes nothing.
    config_hash               char(64)    NOT NULL,
    definition                jsonb       NOT NULL,
    paused_at                 timestamptz,
    next_tick_at              timestamptz,
    created_at                timestamptz NOT NULL DEFAULT now(),
    updated_at                timestamptz NOT NULL DEFAULT now(),
    UNIQUE (org_id, name),
    UNIQUE (org_id, id)
);
-- The scheduler's due jobs.
CREATE INDEX jobs_due ON jobs (next_tick_at) WHERE active AND schedule IS NOT NULL AND paused_at IS NULL;

-- Limits and pauses of a task type within an org.
CREATE TABLE type_limits (
    org_id                  uuid        NOT NULL REFERENCES orgs (id) ON DELETE CASCADE,
    type                    text        NOT NULL CHECK (type ~ '^[a-z0-9][a-z0-9._-]{0,127}$'),
    max_concurrency         integer     CHECK (max_concurrency > 0),
    max_concurrency_per_key integer     CHECK (max_concurrency_per_key > 0),
    paused_at               timestamptz,
    updated_at              timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, type)
);

-- A task may belong to a job (and, made by its schedule, to one tick of
-- it), carry a concurrency key, bound its attempts' run time and the time
-- between its handler's heartbeats.
--
-- admitted: whether the task may reach the broker. A task whose job or
-- type is limited or paused, or whose type is in fair mode, waits in
-- PostgreSQL (admitted = false, no outbox message) until the scheduler
-- admits it; every other task is admitted as it is written.
ALTER TABLE tasks
    ADD COLUMN job_id               uuid,
    ADD COLUMN scheduled_at         timestamptz,
    ADD COLUMN concurrency_key      text    NOT NULL DEFAULT '' CHECK (length(concurrency_key) <= 255),
    ADD COLUMN admitted             boolean NOT NULL DEFAULT true,
    ADD COLUMN timeout_ms           bigint  CHECK (timeout_ms > 0),
    ADD COLUMN heartbeat_timeout_ms bigint  CHECK (heartbeat_timeout_ms > 0),
    ADD COLUMN heartbeat_at         timestamptz;

-- One task per tick of a job, whoever makes it and however often.
CREATE UNIQUE INDEX tasks_job_tick ON tasks (job_id, scheduled_at) WHERE scheduled_at IS NOT NULL;
-- What holds a slot: admitted tasks not yet finished, by scope and key.
CREATE INDEX tasks_admitted ON tasks (type, org_id, concurrency_key)
    WHERE admitted AND status IN ('PENDING', 'IN_PROGRESS');
CREATE INDEX tasks_admitted_job ON tasks (job_id, concurrency_key)
    WHERE job_id IS NOT NULL AND admitted AND status IN ('PENDING', 'IN_PROGRESS');
-- What waits for admission, in the order it is admitted within a group.
CREATE INDEX tasks_waiting ON tasks (type, org_id, concurrency_key, priority DESC, id)
    WHERE status = 'PENDING' AND NOT admitted;
-- Few tasks are both PENDING and admitted while a backlog waits: tell the
-- planner how status and admitted go together.
CREATE STATISTICS tasks_status_admitted (dependencies, mcv) ON status, admitted FROM tasks;
-- A job's tasks, newest first.
CREATE INDEX tasks_job ON tasks (job_id, id DESC) WHERE job_id IS NOT NULL;

-- A type shared by many orgs goes into fair mode while its broker queue
-- holds more than the scheduler's window: new tasks then wait and are
-- admitted round-robin across orgs.
ALTER TABLE task_types ADD COLUMN admit_directly boolean NOT NULL DEFAULT true;

-- Whether a new or requeued task must wait for the scheduler: its type is
-- in fair mode, or its type (in its org) or its job has a limit that
-- applies to it, or is paused.
CREATE FUNCTION conveyor_must_wait(p_org uuid, p_type text, p_job uuid, p_key text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM task_types WHERE name = p_type AND NOT admit_directly)
        OR EXISTS (SELECT 1 FROM type_limits l WHERE l.org_id = p_org AND l.type = p_type
            AND (l.paused_at IS NOT NULL OR l.max_concurrency IS NOT NULL
                OR (p_key <> '' AND l.max_concurrency_per_key IS NOT NULL)))
        OR (p_job IS NOT NULL AND EXISTS (SELECT 1 FROM jobs j WHERE j.id = p_job
            AND (j.paused_at IS NOT NULL OR j.max_concurrency IS NOT NULL
                OR (p_key <> '' AND j.max_concurrency_per_key IS NOT NULL))))
$$;

GRANT SELECT, INSERT, UPDATE, DELETE ON jobs, type_limits TO conveyor_tenant;
ALTER TABLE jobs ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON jobs TO conveyor_tenant USING (org_id = conveyor_org());
ALTER TABLE type_limits ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON type_limits TO conveyor_tenant USING (org_id = conveyor_org());
