-- Retention of workflow runs and dataset versions (docs/design.md,
-- "Workflows"; the statements are in internal/postgres/maintenance_store.go).
--
-- 1. Retention deleted finished tasks but never a run, its nodes or a
--    dataset version: every run of a workflow scheduled every minute stayed
--    for ever. A run that ended longer than RETENTION ago, with no task of
--    it in flight, is now deleted with its nodes (ON DELETE CASCADE); the
--    search walks the ended runs by when they ended.
--
-- 2. A dataset's versions other than its newest are deleted once they are
--    older than RETENTION and nothing reads them: no remaining node's task
--    wrote it (memoization, and the retry of a run, read the versions its
--    node's task wrote) and no remaining task read it (task_inputs). The
--    newest is always kept: a node released reads it, and its id goes
--    into the node's memo key. A run is deleted only once it ended longer
--    than RETENTION ago, so the versions of a deleted run are among those.
--
-- 3. A node keeps how its task ended. A node's standing was read from its
--    task alone, and once retention had deleted the task, a node of a run
--    still kept read SUBMITTED, as if its task had never run. Deleting a
--    task now writes its final status on its node.

CREATE INDEX workflow_runs_finished ON workflow_runs (finished_at) WHERE finished_at IS NOT NULL;

CREATE INDEX dataset_versions_created ON dataset_versions (created_at);
CREATE INDEX task_inputs_version ON task_inputs (input_version);
-- Every node that names a task, not only the memoized ones: retention
-- looks a version's task up among all the nodes.
CREATE INDEX run_nodes_task ON run_nodes (task_id) WHERE task_id IS NOT NULL;
DROP INDEX run_nodes_memoized_task;

ALTER TABLE run_nodes ADD COLUMN task_status text;

-- A completed run completed each of its nodes: those whose task is already
-- gone completed. For a run that failed or was cancelled it is not known.
UPDATE run_nodes n SET task_status = 'COMPLETED'
FROM workflow_runs r
WHERE r.id = n.run_id AND r.status = 'COMPLETED' AND n.state = 'SUBMITTED'
    AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = n.task_id);

CREATE OR REPLACE FUNCTION conveyor_tasks_deleted() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    DELETE FROM task_events e USING gone g WHERE e.task_id = g.id;
    DELETE FROM task_results r USING gone g WHERE r.task_id = g.id;
    DELETE FROM task_input_hashes h USING gone g
        WHERE h.org_id = g.org_id AND h.type = g.type AND h.input_hash = g.input_hash AND h.task_id = g.id;
    DELETE FROM task_listing l USING gone g WHERE l.org_id = g.org_id AND l.id = g.id;
    -- The node whose task this was keeps how it ended.
    UPDATE run_nodes n SET task_status = g.status
    FROM gone g
    WHERE g.run_id IS NOT NULL AND n.run_id = g.run_id AND n.node = g.node AND n.task_id = g.id;
    RETURN NULL;
END $$;
