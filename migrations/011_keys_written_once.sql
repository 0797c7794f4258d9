-- Keys that never change move out of the tasks table, into tables written
-- once, when the task is; the index of every task by status becomes an
-- index of the running ones.
--
-- Every update of a task that changes an indexed column (each claim, each
-- completion: the status is indexed) writes a new entry in every index of
-- tasks, whichever columns changed. Four of them held keys that never
-- change or served one search only: the unique input hash (random
-- 64-character keys, the costliest entry of all), the listings' org and
-- org-and-type indexes, and the index of every task by status, which only
-- the searches for running tasks read. Without them a claim and a
-- completion cost PostgreSQL about 50 µs a task instead of 70-80
-- (docs/performance.md, tenth round).

-- Deduplication by input hash. A submission with a hash inserts its row
-- here first, and its task only if that row went in: a hash already taken
-- makes the submission do nothing, as the unique index did. Only
-- submissions with a hash are deduplicated, and none of them carries the
-- tasks table's other unique keys (a child's key, a job's tick), so a row
-- here always has its task. tasks.input_hash still records the hash, for
-- reading.
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

-- The listings' keys: one row per task. A statement trigger writes the
-- rows of the tasks each insert wrote, whichever statement wrote them (a
-- submission, a workflow's node). A listing walks it newest first and
-- reads each task by primary key.
CREATE TABLE task_listing (
    org_id uuid NOT NULL,
    id     uuid NOT NULL,
    type   text NOT NULL,
    PRIMARY KEY (org_id, id)
);
CREATE INDEX task_listing_type ON task_listing (org_id, type, id);
INSERT INTO task_listing (org_id, id, type) SELECT org_id, id, type FROM tasks;
DROP INDEX tasks_org_id;
DROP INDEX tasks_org_type_id;

ALTER TABLE task_listing ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant ON task_listing TO conveyor_tenant USING (org_id = conveyor_org());
GRANT SELECT ON task_listing TO conveyor_tenant;

CREATE FUNCTION conveyor_tasks_inserted() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    INSERT INTO task_listing (org_id, id, type) SELECT org_id, id, type FROM born;
    RETURN NULL;
END $$;
CREATE TRIGGER tasks_inserted AFTER INSERT ON tasks REFERENCING NEW TABLE AS born
    FOR EACH STATEMENT EXECUTE FUNCTION conveyor_tasks_inserted();

-- Deleting tasks (retention, an org's deletion) frees their hashes and
-- unlists them.
CREATE OR REPLACE FUNCTION conveyor_tasks_deleted() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    DELETE FROM task_events e USING gone g WHERE e.task_id = g.id;
    DELETE FROM task_results r USING gone g WHERE r.task_id = g.id;
    DELETE FROM task_input_hashes h USING gone g
        WHERE h.org_id = g.org_id AND h.type = g.type AND h.input_hash = g.input_hash AND h.task_id = g.id;
    DELETE FROM task_listing l USING gone g WHERE l.org_id = g.org_id AND l.id = g.id;
    RETURN NULL;
END $$;

-- The running tasks, for the searches for expired leases and heartbeats: a
-- claim writes an entry here, a completion none. Its key is the id, which
-- never changes, so lease renewals and progress reports stay heap-only.
CREATE INDEX tasks_running ON tasks (id) WHERE status = 'IN_PROGRESS';
DROP INDEX tasks_status_id;
