-- Deduplication by input hash moves out of the tasks table, into a table
-- written once, when the task is submitted.
--
-- A unique index on tasks (org_id, type, input_hash) got a new entry at
-- every status change of every task, as every index of tasks does when an
-- indexed column changes: the claim and the completion each wrote one, at
-- a random place in a large index of 64-character keys. That was the most
-- expensive of the entries a status change writes: about 10 µs of the
-- 70-80 µs of PostgreSQL time a claim and a completion cost together
-- (docs/performance.md, tenth round). Here the hash is written once and
-- never again; tasks.input_hash still records it, for reading.
--
-- A submission with a hash inserts its row here first, and its task only
-- if that row went in: a hash already taken makes the submission do
-- nothing, as the unique index did. Only submissions with a hash are
-- deduplicated, and none of them carries the tasks table's other unique
-- keys (a child's key, a job's tick), so a row here always has its task.
CREATE TABLE task_input_hashes (
    org_id     uuid               NOT NULL,
    type       conveyor_task_type NOT NULL,
    input_hash char(64)           NOT NULL,
    task_id    uuid               NOT NULL,
    PRIMARY KEY (org_id, type, input_hash)
);
INSERT INTO task_input_hashes (org_id, type, input_hash, task_id)
    SELECT org_id, type, input_hash, id FROM tasks WHERE input_hash IS NOT NULL;
DROP INDEX tasks_input_hash_key;

ALTER TABLE task_input_hashes ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON task_input_hashes TO conveyor_tenant USING (org_id = conveyor_org());
GRANT SELECT, INSERT ON task_input_hashes TO conveyor_tenant;

-- Deleting tasks (retention, an org's deletion) frees their hashes.
CREATE OR REPLACE FUNCTION conveyor_tasks_deleted() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    DELETE FROM task_events e USING gone g WHERE e.task_id = g.id;
    DELETE FROM task_results r USING gone g WHERE r.task_id = g.id;
    DELETE FROM task_input_hashes h USING gone g
        WHERE h.org_id = g.org_id AND h.type = g.type AND h.input_hash = g.input_hash AND h.task_id = g.id;
    RETURN NULL;
END $$;
