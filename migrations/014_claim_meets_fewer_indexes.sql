-- A claim writes an entry in two indexes besides the primary key, not four.
--
-- A claim changes a task's status, which indexes hold, so it is never a
-- heap-only update: it writes an entry in every index whose predicate the
-- running task meets. Those were tasks_running, tasks_org_status and
-- tasks_admitted. The entries, not the row's width, are most of what a
-- status change costs PostgreSQL, and those of tasks_org_status and
-- tasks_admitted weighed most (docs/performance.md, the twenty-ninth and
-- thirtieth rounds).
--
-- Running tasks are now found through tasks_running alone, keyed by org
-- and type:
-- - tasks_org_status keeps the tasks in every other status; the overview
--   and bulk actions read an org's running tasks through tasks_running.
-- - tasks_admitted keeps the admitted tasks still PENDING; the scheduler
--   counts the slots running tasks hold through tasks_running.
-- The lease and heartbeat reapers read every entry of tasks_running, as
-- before; org and type never change while a task runs, so lease renewals
-- and progress reports stay heap-only.
DROP INDEX tasks_org_status;
CREATE INDEX tasks_org_status ON tasks (org_id, status, completed_at) INCLUDE (visibility)
    WHERE status IN ('PENDING', 'COMPLETED', 'FAILED', 'CANCELLED');

DROP INDEX tasks_admitted;
CREATE INDEX tasks_admitted ON tasks (type, org_id, concurrency_key) WHERE admitted AND status = 'PENDING';

DROP INDEX tasks_running;
CREATE INDEX tasks_running ON tasks (org_id, type) WHERE status = 'IN_PROGRESS';
