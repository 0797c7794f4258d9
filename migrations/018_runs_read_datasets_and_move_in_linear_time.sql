-- Four fixes to how a run moves.
--
-- 1. A node whose job no longer exists stops a run that stops at its first
--    failure (conveyor_advance_run below).
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
--
-- 4. A run moves forward in time about linear in its nodes and edges
--    (conveyor_advance_run, rewritten). Each pass over a run tested every waiting node against each of its
--    parents, by a scan of the run's nodes per waiting node, and a memoized
--    node started another such pass for the nodes below it. On a 200-node
--    workflow whose nodes each depend on all the earlier ones (an allowed
--    one), each node's completion held the run's row lock for hundreds of
--    milliseconds, and a run memoized throughout took over ten seconds to
--    start, past the API's request timeout.
--
--    The run's nodes and edges are now read once, and the walk goes on in
--    memory: a memoized node takes one from the count of parents each of its
--    children waits for, and those it brings to none are released next, in
--    the order of their positions, as the passes released them; the nodes
--    below a failed or skipped one are found by one walk down from them.

CREATE OR REPLACE FUNCTION conveyor_advance_run(p_run uuid) RETURNS integer LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    r       workflow_runs%ROWTYPE;
    n       run_nodes%ROWTYPE;
    failed  text;
    -- Node i is the run's i-th by position; its children are
    -- kids[head[i]] to kids[head[i + 1] - 1].
    names   text[];
    waiting boolean[];
    pending integer[];
    head    integer[];
    kids    integer[];
    -- Failed or skipped nodes, whose waiting descendants are skipped.
    bad     integer[];
    wave    integer[];
    later   integer[];
    skip    text[] := '{}';
    gone    boolean;
    i       integer;
    kid     integer;
    at      integer;
    q       integer;
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

    -- The edges into waiting nodes (the others move nothing), each once,
    -- joined by hash; a name in depends_on that is no node of the run
    -- holds nothing back, as before.
    WITH v AS (
        SELECT c.node, c.state, c.depends_on, row_number() OVER (ORDER BY c.position)::integer AS i,
            conveyor_node_done(c) AS done, c.state = 'SKIPPED' OR conveyor_node_failed(c) AS bad
        FROM run_nodes c WHERE c.run_id = p_run
    ), e AS (
        SELECT cv.i AS child, pv.i AS parent, pv.done
        FROM v cv CROSS JOIN LATERAL unnest(cv.depends_on) AS d(name) JOIN v pv ON pv.node = d.name
        WHERE cv.state = 'WAITING'
    ), x AS (
        SELECT v.i, v.node, v.state, v.bad, coalesce(w.waits, 0) AS waits,
            (sum(coalesce(o.kids, 0)) OVER (ORDER BY v.i) - coalesce(o.kids, 0) + 1)::integer AS head
        FROM v
        LEFT JOIN (SELECT child, (count(*) FILTER (WHERE NOT done))::integer AS waits FROM e GROUP BY child) w
            ON w.child = v.i
        LEFT JOIN (SELECT parent, count(*)::integer AS kids FROM e GROUP BY parent) o ON o.parent = v.i
    ), ch AS (
        SELECT array_agg(e.child ORDER BY e.parent, e.child) AS list FROM e
    )
    SELECT array_agg(x.node ORDER BY x.i), array_agg(x.state = 'WAITING' ORDER BY x.i),
        array_agg(x.waits ORDER BY x.i), array_agg(x.head ORDER BY x.i),
        coalesce(array_agg(x.i ORDER BY x.i) FILTER (WHERE x.bad), '{}'),
        coalesce(array_agg(x.i ORDER BY x.i) FILTER (WHERE x.state = 'WAITING' AND x.waits = 0), '{}'),
        coalesce((SELECT ch.list FROM ch), '{}')
    INTO names, waiting, pending, head, bad, wave, kids
    FROM x;
    head := coalesce(head, '{}') || (cardinality(kids) + 1);

    -- Each wave holds the nodes whose parents all have their result, in
    -- the order of their positions.
    WHILE cardinality(wave) > 0 LOOP
        later := '{}';
        gone := false;
        FOREACH i IN ARRAY wave LOOP
            waiting[i] := false;
            SELECT * INTO n FROM run_nodes WHERE run_id = p_run AND node = names[i];
            IF NOT conveyor_release_node(r, n) THEN
                made := made + 1;
                CONTINUE;
            END IF;
            SELECT * INTO n FROM run_nodes WHERE run_id = p_run AND node = names[i];
            IF n.state = 'SKIPPED' THEN
                bad := bad || i;
                gone := true;
                CONTINUE;
            END IF;
            FOR at IN head[i] .. head[i + 1] - 1 LOOP
                kid := kids[at];
                pending[kid] := pending[kid] - 1;
                IF pending[kid] = 0 AND waiting[kid] THEN
                    later := later || kid;
                END IF;
            END LOOP;
        END LOOP;
        IF gone AND r.on_failure = 'stop' THEN
            UPDATE run_nodes SET state = 'SKIPPED' WHERE run_id = p_run AND state = 'WAITING';
            UPDATE workflow_runs SET status = 'FAILED', error = coalesce(error, 'node failed: ' || failed),
                finished_at = now(), updated_at = now()
            WHERE id = p_run;
            RETURN 0;
        END IF;
        wave := ARRAY(SELECT w FROM unnest(later) AS w ORDER BY w);
    END LOOP;

    -- Nodes below a failed or skipped one can never run.
    q := 1;
    WHILE q <= cardinality(bad) LOOP
        i := bad[q];
        q := q + 1;
        FOR at IN head[i] .. head[i + 1] - 1 LOOP
            kid := kids[at];
            IF waiting[kid] THEN
                waiting[kid] := false;
                skip := skip || names[kid];
                bad := bad || kid;
            END IF;
        END LOOP;
    END LOOP;
    UPDATE run_nodes SET state = 'SKIPPED' WHERE run_id = p_run AND node = ANY (skip) AND state = 'WAITING';

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
