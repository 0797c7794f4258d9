-- Two fixes to conveyor_release_node (as in 013 otherwise).
--
-- 1. A memoized node names the run whose task it reuses. A node memoized
--    from a node that was itself memoized took that node's task, which ran
--    in an earlier run still, but named the run in between as
--    memoized_from: the run's graph then said the node's task was of a run
--    where it never ran. memoized_from is now the run of the task itself;
--    the nodes memoized so far are corrected where their task is still
--    there.
--
-- 2. A node whose job was removed and declared again (with another id)
--    while the node waited for its parents was skipped, and its run failed
--    with "job no longer exists" though the job was there. The node now
--    runs the org's job of its name, as a retried run's node does.

UPDATE run_nodes n SET memoized_from = t.run_id
FROM tasks t
WHERE n.state = 'MEMOIZED' AND t.id = n.task_id AND t.run_id IS NOT NULL
    AND n.memoized_from IS DISTINCT FROM t.run_id;

CREATE OR REPLACE FUNCTION conveyor_release_node(r workflow_runs, n run_nodes) RETURNS boolean
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
        -- The job was removed since the run began, and may have been
        -- declared again since: the node runs the org's job of its name.
        SELECT * INTO j FROM jobs WHERE org_id = r.org_id AND name = n.job;
    END IF;
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
        SELECT coalesce(t.run_id, rn.run_id) AS run_id, rn.task_id INTO prev
        FROM run_nodes rn JOIN tasks t ON t.id = rn.task_id AND t.status = 'COMPLETED'
        WHERE rn.memo_key = key AND rn.org_id = r.org_id AND rn.state IN ('SUBMITTED', 'MEMOIZED') AND rn.run_id <> r.id
        ORDER BY rn.run_id DESC LIMIT 1;
        IF FOUND THEN
            UPDATE run_nodes SET state = 'MEMOIZED', task_id = prev.task_id, memo_key = key,
                memoized_from = prev.run_id, job_id = j.id
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
    UPDATE run_nodes SET state = 'SUBMITTED', task_id = tid, memo_key = key, memoized_from = NULL, job_id = j.id
    WHERE run_id = r.id AND node = n.node;
    RETURN false;
END $$;
