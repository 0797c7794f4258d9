-- Speed: what every task's claim and completion write, made cheaper
-- (docs/performance.md).
--
-- Events and results no longer check a foreign key to their task: each
-- insert ran a lookup and a row lock of the task (a third of the
-- completion's cost), though every row is written by a statement that has
-- just updated that very task. Deleting tasks still takes their events and
-- results along, by a statement trigger, as the cascade did: for retention
-- and for an org's deletion alike.
ALTER TABLE task_events DROP CONSTRAINT task_events_task_id_fkey;
ALTER TABLE task_results DROP CONSTRAINT task_results_task_id_fkey;

CREATE FUNCTION conveyor_tasks_deleted() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    DELETE FROM task_events e USING gone g WHERE e.task_id = g.id;
    DELETE FROM task_results r USING gone g WHERE r.task_id = g.id;
    RETURN NULL;
END $$;

CREATE TRIGGER tasks_deleted AFTER DELETE ON tasks REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION conveyor_tasks_deleted();

-- Room on every page for the updates that change no indexed column (the
-- relay's publish stamp, progress reports, lease renewals): PostgreSQL then
-- writes them as heap-only tuples, touching none of the indexes.
ALTER TABLE tasks SET (fillfactor = 80);

-- A task's type is checked when it is written, not each time its row is:
-- a CHECK constraint runs on every update of the row (the type's regular
-- expression was a tenth of a claim's cost), a domain's check only where a
-- value is assigned to the column.
CREATE DOMAIN conveyor_task_type AS text CHECK (VALUE ~ '^[a-z0-9][a-z0-9._-]{0,127}$');
ALTER TABLE tasks DROP CONSTRAINT tasks_type_check;
ALTER TABLE tasks ALTER COLUMN type TYPE conveyor_task_type;
