-- The dashboard's reads (GET /v1/overview) and bulk actions.

-- An org's tasks by status: the counts per status and the last hour's
-- completions and failures are index-only scans of it (visibility is
-- included because the row-level security policy reads it), and the
-- queues per type and bulk actions find the org's PENDING and IN_PROGRESS
-- tasks through it. Status changes already update tasks_status_id, so no
-- update that was HOT becomes one that is not.
CREATE INDEX tasks_org_status ON tasks (org_id, status, completed_at) INCLUDE (visibility);

-- The API reads how many of its org's messages wait in the outbox (rows
-- are still written, relayed and deleted only as before). Like events and
-- results, an outbox row follows its task: a caller sees only the rows of
-- its org's tasks it may see.
GRANT SELECT ON outbox TO conveyor_tenant;
CREATE POLICY tenant_read ON outbox FOR SELECT TO conveyor_tenant
    USING (org_id = conveyor_org() AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = task_id));
