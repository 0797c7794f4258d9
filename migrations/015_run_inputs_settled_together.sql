-- Two fixes to what a node of a run reads as it is released.
--
-- 1. Dataset versions of siblings settled in one statement. A worker
--    completes the tasks it finished at about the same time in one UPDATE,
--    and the row trigger of each fires only once the statement is done, one
--    after the other. The first one's advance of the run already sees the
--    second task COMPLETED and releases the node below both, but the second
--    one's output datasets were still unrecorded: the node's task_inputs
--    (and its memo key) named the versions from before its parent wrote
--    them. Each settling now records the output versions of every completed
--    node of the run that lacks them, before the run moves forward; the
--    trigger of the second sibling then finds them already there.
--
-- 2. Retention and memoized results. A memoized node's task is the earlier
--    run's, and the nodes below it read its result when they are released,
--    possibly days later. Retention kept the tasks of a running run but not
--    those its memoized nodes point at, and the nodes below then ran with
--    null for that parent. The index lets retention skip those tasks by key.

CREATE INDEX dataset_versions_task ON dataset_versions (task_id) WHERE task_id IS NOT NULL;
CREATE INDEX run_nodes_memoized_task ON run_nodes (task_id) WHERE state = 'MEMOIZED';

CREATE OR REPLACE FUNCTION conveyor_task_settled() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    queued boolean := false;
BEGIN
    IF NEW.run_id IS NOT NULL THEN
        -- This task's outputs, and those of siblings settled by the same
        -- statement whose trigger has not fired yet.
        INSERT INTO dataset_versions (org_id, dataset, run_id, node, task_id)
        SELECT n.org_id, d.name, n.run_id, n.node, n.task_id
        FROM run_nodes n JOIN tasks t ON t.id = n.task_id AND t.status = 'COMPLETED'
            CROSS JOIN LATERAL unnest(n.output_datasets) WITH ORDINALITY AS d(name, i)
        WHERE n.run_id = NEW.run_id AND n.state = 'SUBMITTED' AND cardinality(n.output_datasets) > 0
            AND NOT EXISTS (SELECT 1 FROM dataset_versions v WHERE v.task_id = n.task_id)
        ORDER BY n.position, d.i;
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
