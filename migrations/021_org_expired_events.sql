-- An org's newest event id survives its deletion by retention.
--
-- Event ids come from one sequence shared by every org. A stream resumed
-- after an id ahead of the API's hub was checked against the last id the
-- sequence handed out, any org's: the answer (refused or not) told a
-- caller how far other orgs' activity had gone. It is now checked against
-- the ids the caller's own org could have been sent: its stored events,
-- and the newest of its events that retention deleted, kept here (0: none
-- deleted yet), since a client that got those still resumes after them.
ALTER TABLE orgs ADD COLUMN events_expired_through bigint NOT NULL DEFAULT 0;

CREATE OR REPLACE FUNCTION conveyor_tasks_deleted() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    WITH deleted AS (
        DELETE FROM task_events e USING gone g WHERE e.task_id = g.id RETURNING e.org_id, e.id
    )
    UPDATE orgs o SET events_expired_through = d.newest
    FROM (SELECT org_id, max(id) AS newest FROM deleted GROUP BY org_id) d
    WHERE o.id = d.org_id AND o.events_expired_through < d.newest;
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
