-- Workflows: DAGs of jobs, their runs, fan-out children, memoization and
-- dataset lineage (docs/design.md, "Workflows").
--
-- A run moves forward inside PostgreSQL: when a task of a run settles (its
-- status becomes COMPLETED, FAILED or CANCELLED), a trigger, in the same
-- transaction, records the datasets it produced and submits every node
-- whose parents have all completed (task, first event, outbox message), so
-- no crash between "B completed" and "D submitted" can leave a run stuck.
-- Likewise a task that waits for the children it spawned is queued again by
-- the settling of its last child.

-- A time-ordered UUID (version 7), as the services make them in Go, for
-- the tasks the database submits itself.
CREATE FUNCTION conveyor_uuidv7() RETURNS uuid LANGUAGE sql VOLATILE AS $$
    SELECT encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid())
        PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
        FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid
$$;

-- A workflow: a named DAG of an org's jobs (definition.nodes), with a
-- failure policy, memoization, and an optional cron source whose cursor is
-- next_tick_at, as for jobs.
CREATE TABLE workflows (
    id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    org_id       uuid        NOT NULL REFERENCES orgs (id) ON DELETE CASCADE,
    name         text        NOT NULL CHECK (name ~ '^[a-z0-9][a-z0-9._-]{0,127}$'),
    definition   jsonb       NOT NULL,
    config_hash  char(64)    NOT NULL,
    schedule     text,
    timezone     text        NOT NULL DEFAULT 'UTC',
    missed       text        NOT NULL DEFAULT 'run_once' CHECK (missed IN ('skip', 'run_once')),
    active       boolean     NOT NULL DEFAULT true,
    next_tick_at timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (org_id, name)
);
CREATE INDEX workflows_due ON workflows (next_tick_at) WHERE active AND schedule IS NOT NULL;

-- A run of a workflow. Its nodes are copied from the definition when it
-- starts, so a later apply does not change a run under way.
CREATE TABLE workflow_runs (
    id           uuid PRIMARY KEY,
    org_id       uuid        NOT NULL REFERENCES orgs (id) ON DELETE CASCADE,
    workflow_id  uuid        REFERENCES workflows (id) ON DELETE SET NULL,
    workflow     text        NOT NULL,
    status       text        NOT NULL DEFAULT 'RUNNING'
                 CHECK (status IN ('RUNNING', 'COMPLETED', 'FAILED', 'CANCELLED')),
    -- stop: the first failed node fails the run and cancels the rest;
    -- continue: the branches that do not depend on it run to the end.
    on_failure   text        NOT NULL CHECK (on_failure IN ('stop', 'continue')),
    memoize      boolean     NOT NULL,
    force        boolean     NOT NULL DEFAULT false,
    params       jsonb       NOT NULL DEFAULT '{}',
    visibility   text[]      NOT NULL DEFAULT '{}',
    traceparent  text,
    -- The cron tick that made the run, if a schedule did.
    scheduled_at timestamptz,
    principal    jsonb,
    error        text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz,
    CHECK ((status = 'RUNNING') = (finished_at IS NULL))
);
CREATE UNIQUE INDEX workflow_runs_tick ON workflow_runs (workflow_id, scheduled_at) WHERE scheduled_at IS NOT NULL;
CREATE INDEX workflow_runs_list ON workflow_runs (org_id, workflow, id DESC);
-- Runs that stopped while tasks of theirs may still be in flight.
CREATE INDEX workflow_runs_stopped ON workflow_runs (id) WHERE status IN ('FAILED', 'CANCELLED');

-- The nodes of a run. state: WAITING for its parents, SUBMITTED (task_id
-- is its task), MEMOIZED (task_id is the earlier completed task whose
-- result it reuses, from run memoized_from), SKIPPED (a parent failed or
-- the run stopped). memo_key: the SHA-256 of what the node's result
-- depends on (the workflow, the node, its job's config hash, the run's
-- params, its parents' results and its input datasets' versions).
CREATE TABLE run_nodes (
    run_id          uuid     NOT NULL REFERENCES workflow_runs (id) ON DELETE CASCADE,
    node            text     NOT NULL,
    org_id          uuid     NOT NULL,
    position        integer  NOT NULL,
    job_id          uuid,
    job             text     NOT NULL,
    depends_on      text[]   NOT NULL DEFAULT '{}',
    input_datasets  text[]   NOT NULL DEFAULT '{}',
    output_datasets text[]   NOT NULL DEFAULT '{}',
    state           text     NOT NULL DEFAULT 'WAITING'
                    CHECK (state IN ('WAITING', 'SUBMITTED', 'MEMOIZED', 'SKIPPED')),
    task_id         uuid,
    memo_key        char(64),
    memoized_from   uuid,
    PRIMARY KEY (run_id, node)
);
CREATE INDEX run_nodes_memo ON run_nodes (memo_key) WHERE memo_key IS NOT NULL;

-- Every version of a dataset: one per completed task of a node that
-- declares it among its outputs. The id is the version.
CREATE TABLE dataset_versions (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    org_id     uuid        NOT NULL REFERENCES orgs (id) ON DELETE CASCADE,
    dataset    text        NOT NULL,
    run_id     uuid,
    node       text,
    task_id    uuid,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX dataset_versions_latest ON dataset_versions (org_id, dataset, id DESC);

-- The dataset versions a node's task read, as it was submitted.
CREATE TABLE task_inputs (
    task_id       uuid   NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    org_id        uuid   NOT NULL,
    input_dataset text   NOT NULL,
    input_version bigint NOT NULL,
    PRIMARY KEY (task_id, input_dataset)
);

-- A task may be a node of a run (run_id, node; inputs holds the run's
-- params and its parents' results), or a child a handler spawned
-- (parent_id, child_key: one child per key and parent).
ALTER TABLE tasks
    ADD COLUMN run_id    uuid,
    ADD COLUMN node      text,
    ADD COLUMN parent_id uuid,
    ADD COLUMN child_key text,
    ADD COLUMN inputs    jsonb;
CREATE INDEX tasks_run ON tasks (run_id, node) WHERE run_id IS NOT NULL;
CREATE UNIQUE INDEX tasks_child ON tasks (parent_id, child_key) WHERE parent_id IS NOT NULL;
-- What the scheduler's sweeps read: tasks in flight of runs and of
-- parents (to cancel those whose run or parent stopped), and parents
-- waiting for their children (to wake one whose last child settled in a
-- race with its going to wait).
CREATE INDEX tasks_run_open ON tasks (run_id) WHERE run_id IS NOT NULL AND status IN ('PENDING', 'IN_PROGRESS');
CREATE INDEX tasks_child_open ON tasks (parent_id) WHERE parent_id IS NOT NULL AND status IN ('PENDING', 'IN_PROGRESS');
CREATE INDEX tasks_awaiting ON tasks (id) WHERE status = 'PENDING' AND state = 'Waiting for children';

-- conveyor_release_node submits node n of run r, or memoizes it; it
-- returns true when it memoized (the node's children may now be ready).
CREATE FUNCTION conveyor_release_node(r workflow_runs, n run_nodes) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    j        jobs%ROWTYPE;
    parents  jsonb;
    versions jsonb;
    key      text;
    prev     record;
    tid      uuid;
    wait     boolean;
    label    text;
BEGIN
    SELECT * INTO j FROM jobs WHERE id = n.job_id;
    IF NOT FOUND THEN
        -- The job was removed since the run began: the node cannot run.
        UPDATE run_nodes SET state = 'SKIPPED' WHERE run_id = r.id AND node = n.node;
        UPDATE workflow_runs SET error = format('node %s: job %s no longer exists', n.node, n.job)
        WHERE id = r.id AND error IS NULL;
        RETURN true;
    END IF;
    SELECT coalesce(jsonb_object_agg(p.node, coalesce(res.payload, 'null'::jsonb)), '{}') INTO parents
    FROM run_nodes p LEFT JOIN task_results res ON res.task_id = p.task_id
    WHERE p.run_id = r.id AND p.node = ANY (n.depends_on);
    SELECT coalesce(jsonb_object_agg(d.name, coalesce(v.id, 0)), '{}') INTO versions
    FROM unnest(n.input_datasets) AS d(name)
    LEFT JOIN LATERAL (SELECT id FROM dataset_versions
        WHERE org_id = r.org_id AND dataset = d.name ORDER BY id DESC LIMIT 1) v ON true;
    key := encode(sha256(convert_to(jsonb_build_object('workflow', r.workflow_id, 'node', n.node,
        'config', j.config_hash, 'params', r.params, 'parents', parents, 'datasets', versions)::text, 'UTF8')), 'hex');

    IF r.memoize AND NOT r.force THEN
        SELECT rn.run_id, rn.task_id INTO prev
        FROM run_nodes rn JOIN tasks t ON t.id = rn.task_id AND t.status = 'COMPLETED'
        WHERE rn.memo_key = key AND rn.state IN ('SUBMITTED', 'MEMOIZED') AND rn.run_id <> r.id
        ORDER BY rn.run_id DESC LIMIT 1;
        IF FOUND THEN
            UPDATE run_nodes SET state = 'MEMOIZED', task_id = prev.task_id, memo_key = key,
                memoized_from = prev.run_id
            WHERE run_id = r.id AND node = n.node;
            RETURN true;
        END IF;
    END IF;

    tid := conveyor_uuidv7();
    wait := conveyor_must_wait(r.org_id, j.type, j.id, '');
    label := CASE WHEN wait THEN 'Waiting' ELSE 'Queued' END;
    INSERT INTO tasks (id, org_id, type, status, state, priority, payload, max_attempts, traceparent, visibility,
        next_run_at, timeout_ms, heartbeat_timeout_ms, job_id, admitted, run_id, node, inputs)
    VALUES (tid, r.org_id, j.type, 'PENDING', label, j.priority, j.payload, j.max_attempts, r.traceparent,
        r.visibility, now(), j.timeout_seconds * 1000::bigint, j.heartbeat_timeout_seconds * 1000::bigint, j.id,
        NOT wait, r.id, n.node, jsonb_build_object('params', r.params, 'parents', parents));
    INSERT INTO task_events (task_id, org_id, status, state, progress, actor, detail)
    VALUES (tid, r.org_id, 'PENDING', label, 0, 'SYSTEM',
        jsonb_build_object('workflow', r.workflow, 'run_id', r.id, 'node', n.node));
    IF NOT wait THEN
        INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, priority, headers, available_at)
        VALUES ('task.run', r.org_id, tid, j.type, 0, 1, j.priority,
            CASE WHEN r.traceparent IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('traceparent', r.traceparent) END,
            now());
    END IF;
    INSERT INTO task_inputs (task_id, org_id, input_dataset, input_version)
    SELECT tid, r.org_id, v.key, v.value::bigint FROM jsonb_each_text(versions) v;
    UPDATE run_nodes SET state = 'SUBMITTED', task_id = tid, memo_key = key, memoized_from = NULL
    WHERE run_id = r.id AND node = n.node;
    RETURN false;
END $$;

-- conveyor_node_done: the node has its result (its task completed, or it
-- was memoized).
CREATE FUNCTION conveyor_node_done(n run_nodes) RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT n.state = 'MEMOIZED'
        OR (n.state = 'SUBMITTED' AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = n.task_id AND t.status = 'COMPLETED'))
$$;

-- conveyor_node_failed: the node's task ended without a result.
CREATE FUNCTION conveyor_node_failed(n run_nodes) RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT n.state = 'SUBMITTED'
        AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = n.task_id AND t.status IN ('FAILED', 'CANCELLED'))
$$;

-- conveyor_advance_run moves a running run forward under its row lock:
-- nodes below a failed one are skipped (or, with on_failure = stop, the
-- run fails), ready nodes are submitted or memoized until nothing more is
-- ready, and the run ends when nothing is left to run.
--
-- It runs as the schema's owner (security definer): a run's tasks share its
-- visibility, and its progress must not depend on who settled the task.
CREATE FUNCTION conveyor_advance_run(p_run uuid) RETURNS integer LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    r       workflow_runs%ROWTYPE;
    n       run_nodes%ROWTYPE;
    changed boolean;
    failed  text;
    made    integer := 0;
BEGIN
    SELECT * INTO r FROM workflow_runs WHERE id = p_run FOR UPDATE;
    IF NOT FOUND OR r.status <> 'RUNNING' THEN
        RETURN 0;
    END IF;
    LOOP
        changed := false;
        SELECT string_agg(f.node, ', ' ORDER BY f.position) INTO failed
        FROM run_nodes f WHERE f.run_id = p_run AND conveyor_node_failed(f);
        IF failed IS NOT NULL AND r.on_failure = 'stop' THEN
            UPDATE run_nodes SET state = 'SKIPPED' WHERE run_id = p_run AND state = 'WAITING';
            UPDATE workflow_runs SET status = 'FAILED', error = coalesce(error, 'node failed: ' || failed),
                finished_at = now(), updated_at = now()
            WHERE id = p_run;
            RETURN 0;
        END IF;
        -- Nodes below a failed or skipped one can never run.
        UPDATE run_nodes c SET state = 'SKIPPED'
        WHERE c.run_id = p_run AND c.state = 'WAITING' AND EXISTS (
            SELECT 1 FROM run_nodes p WHERE p.run_id = p_run AND p.node = ANY (c.depends_on)
                AND (p.state = 'SKIPPED' OR conveyor_node_failed(p)));
        IF FOUND THEN
            changed := true;
        END IF;
        FOR n IN
            SELECT * FROM run_nodes c WHERE c.run_id = p_run AND c.state = 'WAITING'
                AND NOT EXISTS (SELECT 1 FROM run_nodes p WHERE p.run_id = p_run AND p.node = ANY (c.depends_on)
                    AND NOT conveyor_node_done(p))
            ORDER BY c.position
        LOOP
            IF conveyor_release_node(r, n) THEN
                changed := true;
            ELSE
                made := made + 1;
            END IF;
        END LOOP;
        EXIT WHEN NOT changed;
    END LOOP;

    IF NOT EXISTS (SELECT 1 FROM run_nodes c WHERE c.run_id = p_run AND NOT conveyor_node_done(c)) THEN
        UPDATE workflow_runs SET status = 'COMPLETED', finished_at = now(), updated_at = now() WHERE id = p_run;
    ELSIF NOT EXISTS (SELECT 1 FROM run_nodes c LEFT JOIN tasks t ON t.id = c.task_id AND c.state = 'SUBMITTED'
            WHERE c.run_id = p_run AND (c.state = 'WAITING' OR t.status IN ('PENDING', 'IN_PROGRESS'))) THEN
        -- Nothing runs and nothing can: the branches that could finish did.
        UPDATE workflow_runs SET status = 'FAILED', finished_at = now(), updated_at = now(),
            error = coalesce(error, 'node failed: ' || failed)
        WHERE id = p_run;
    END IF;
    RETURN made;
END $$;

-- conveyor_wake_parent queues again a task that waits for its children
-- (state "Waiting for children", not admitted, due never) once none of
-- them is left to finish. The parent's row lock orders this against the
-- worker putting the parent to wait.
CREATE FUNCTION conveyor_wake_parent(p_parent uuid) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    p    tasks%ROWTYPE;
    wait boolean;
BEGIN
    SELECT * INTO p FROM tasks WHERE id = p_parent FOR UPDATE;
    IF NOT FOUND OR p.status <> 'PENDING' OR p.state <> 'Waiting for children' THEN
        RETURN false;
    END IF;
    IF EXISTS (SELECT 1 FROM tasks c WHERE c.parent_id = p_parent AND c.status IN ('PENDING', 'IN_PROGRESS')) THEN
        RETURN false;
    END IF;
    wait := conveyor_must_wait(p.org_id, p.type, p.job_id, p.concurrency_key);
    UPDATE tasks SET state = CASE WHEN wait THEN 'Waiting' ELSE 'Queued' END, admitted = NOT wait,
        next_run_at = now(), version = version + 1, updated_at = now()
    WHERE id = p_parent RETURNING * INTO p;
    INSERT INTO task_events (task_id, org_id, status, state, progress, actor, detail)
    VALUES (p.id, p.org_id, p.status, p.state, p.progress, 'SYSTEM', '{"reason": "children finished"}');
    IF NOT wait THEN
        INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, priority, headers, available_at)
        VALUES ('task.run', p.org_id, p.id, p.type, p.attempt, p.version, p.priority,
            CASE WHEN p.traceparent IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('traceparent', p.traceparent) END,
            now());
    END IF;
    RETURN true;
END $$;

CREATE FUNCTION conveyor_task_settled() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    queued boolean := false;
BEGIN
    IF NEW.run_id IS NOT NULL THEN
        IF NEW.status = 'COMPLETED' THEN
            INSERT INTO dataset_versions (org_id, dataset, run_id, node, task_id)
            SELECT NEW.org_id, d.name, NEW.run_id, NEW.node, NEW.id
            FROM run_nodes n CROSS JOIN LATERAL unnest(n.output_datasets) AS d(name)
            WHERE n.run_id = NEW.run_id AND n.node = NEW.node AND n.task_id = NEW.id;
        END IF;
        queued := conveyor_advance_run(NEW.run_id) > 0;
    END IF;
    IF NEW.parent_id IS NOT NULL THEN
        queued := conveyor_wake_parent(NEW.parent_id) OR queued;
    END IF;
    -- What this queued goes out now, not at the relays' next poll (their
    -- LISTEN channel). NOTIFY takes a database-wide lock at commit: only a
    -- settling that queued something sends one (not each of a thousand
    -- children but the last).
    IF queued THEN
        PERFORM pg_notify('conveyor_outbox', '');
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER tasks_settled AFTER UPDATE OF status ON tasks FOR EACH ROW
    WHEN ((NEW.run_id IS NOT NULL OR NEW.parent_id IS NOT NULL)
        AND NEW.status IN ('COMPLETED', 'FAILED', 'CANCELLED') AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION conveyor_task_settled();

GRANT SELECT, INSERT, UPDATE, DELETE ON workflows, workflow_runs, run_nodes, dataset_versions, task_inputs
    TO conveyor_tenant;
ALTER TABLE workflows ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON workflows TO conveyor_tenant USING (org_id = conveyor_org());
ALTER TABLE workflow_runs ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON workflow_runs TO conveyor_tenant USING (org_id = conveyor_org());
ALTER TABLE run_nodes ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON run_nodes TO conveyor_tenant USING (org_id = conveyor_org());
ALTER TABLE dataset_versions ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON dataset_versions TO conveyor_tenant USING (org_id = conveyor_org());
ALTER TABLE task_inputs ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON task_inputs TO conveyor_tenant USING (org_id = conveyor_org());
