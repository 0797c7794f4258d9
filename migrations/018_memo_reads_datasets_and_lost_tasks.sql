-- Three fixes to how a run moves.
--
-- 1. A node whose job no longer exists stops a run that stops at its first
--    failure (conveyor_advance_run as in 007, but for that condition).
--    conveyor_release_node skips a node whose job was removed while the
--    run was under way, and names it in the run's error, but the run went
--    on: with on_failure stop it kept submitting the nodes beside it, which
--    ran to an end that could only be FAILED, instead of failing at once
--    and having its tasks in flight cancelled as a failed node's run does.
--
-- 2. A node is memoized only while each of its output datasets holds what
--    the reused task wrote: that task wrote it, and no other run has since
--    (conveyor_release_node as in 016, but for that condition). A memoized
--    node writes no new version: the nodes below it read the datasets as
--    they are. Once another run (other params, or a forced one) had written
--    them since, they held that run's data, and the nodes below ran on it
--    under this run's params.
--
-- 3. A node of a running run whose task is gone runs again
--    (conveyor_advance_run). Retention spares the tasks of running runs
--    and those they memoized, as its statement sees the runs: a run that
--    memoized a task, or was retried, while that statement ran kept a
--    node whose task was then deleted. The nodes below a memoized one were
--    released with null for its result, and the run completed; those below
--    a completed one in a retried run waited for ever.

CREATE OR REPLACE FUNCTION conveyor_advance_run(p_run uuid) RETURNS integer LANGUAGE plpgsql SECURITY DEFINER AS $$
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
    -- Retention keeps the tasks of running runs and those they memoized,
    -- as its statement reads them: a run started or retried while that
    -- statement ran may have taken a task it then deleted. Such a node has
    -- no result to hand on; it runs again, as a retry runs one.
    UPDATE run_nodes c SET state = 'WAITING', task_id = NULL, memo_key = NULL, memoized_from = NULL
    WHERE c.run_id = p_run AND c.state IN ('SUBMITTED', 'MEMOIZED')
        AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = c.task_id);
    LOOP
        changed := false;
        SELECT string_agg(f.node, ', ' ORDER BY f.position) INTO failed
        FROM run_nodes f WHERE f.run_id = p_run AND conveyor_node_failed(f);
        -- In a running run that stops at its first failure, a node can only
        -- be SKIPPED because its job no longer exists (conveyor_release_node
        -- set the run's error): it will never run, so the run fails now.
        IF r.on_failure = 'stop' AND (failed IS NOT NULL
                OR EXISTS (SELECT 1 FROM run_nodes s WHERE s.run_id = p_run AND s.state = 'SKIPPED')) THEN
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
            -- That task wrote each output dataset, and no other run wrote
            -- it since (the nodes of one run may share a dataset).
            AND NOT EXISTS (SELECT 1 FROM unnest(n.output_datasets) AS o(name)
                WHERE NOT EXISTS (SELECT 1 FROM dataset_versions w WHERE w.task_id = rn.task_id AND w.dataset = o.name)
                    OR EXISTS (SELECT 1 FROM dataset_versions v WHERE v.org_id = r.org_id AND v.dataset = o.name
                        AND v.id > (SELECT max(w.id) FROM dataset_versions w WHERE w.task_id = rn.task_id AND w.dataset = o.name)
                        AND v.run_id IS DISTINCT FROM t.run_id))
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
