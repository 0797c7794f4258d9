-- The listings' keys move out of the tasks table too, into a table written
-- once per task, and the index of every task by status becomes an index of
-- the running ones.
--
-- As with the input hashes (migration 011): every claim and every
-- completion wrote a new entry in each index of tasks. Two of those
-- indexes served only the listings (an org's tasks newest first, of one
-- type or of all), and their keys never change; the index of every task by
-- status served only the search for running tasks (expired leases and
-- heartbeats). Together they were about as costly as the input hashes'
-- index (docs/performance.md, tenth round).
--
-- task_listing holds one row per task: a statement trigger writes the rows
-- of the tasks each insert wrote, whichever statement wrote them (a
-- submission, a workflow's node), and the tasks_deleted trigger deletes
-- them with their tasks. A listing walks it newest first and reads each
-- task by primary key.
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
