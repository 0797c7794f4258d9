package postgres

// The SQL of the worker's statements. Every write after the claim is fenced
// by (id, version, status = 'IN_PROGRESS') and bumps version.

// sqlClaim takes tasks for a worker: lock the rows that are claimable
// (PENDING and due, or IN_PROGRESS under an expired lease with attempts
// left and no cancel pending), then start their attempts and record them.
// One statement, so one short transaction; under concurrent claims the FOR
// UPDATE re-checks the condition on the row the winner committed, so only
// one claim of a task succeeds. Rows are locked in id order, so concurrent
// batches cannot deadlock.
const sqlClaim = `
WITH locked AS (
	SELECT id AS locked_id FROM tasks
	WHERE id = ANY($1::uuid[]) AND (
		(status = 'PENDING' AND next_run_at <= now() + interval '1 second')
		OR (status = 'IN_PROGRESS' AND lease_expires_at < now() AND attempt < max_attempts
			AND cancel_requested_at IS NULL))
	ORDER BY id
	FOR UPDATE
), upd AS (
	UPDATE tasks SET status = 'IN_PROGRESS', state = 'Running', progress = 0, attempt = attempt + 1,
		version = version + 1, worker_id = $2, lease_expires_at = now() + $3 * interval '1 millisecond',
		started_at = now(), updated_at = now()
	FROM locked WHERE id = locked.locked_id
	RETURNING ` + taskColumns + `
), event AS (
	INSERT INTO task_events (task_id, status, state, progress, actor, detail)
	SELECT id, status, state, progress, 'WORKER', jsonb_build_object('worker_id', $2::text, 'attempt', attempt)
	FROM upd
)
SELECT * FROM upd`

// fence is the condition of every write a worker makes on a task it holds.
const fence = `WHERE id = $1 AND version = $2 AND status = 'IN_PROGRESS'`

const sqlProgress = `
WITH upd AS (
	UPDATE tasks SET progress = $3, state = $4, lease_expires_at = now() + $5 * interval '1 millisecond',
		updated_at = now(), version = version + 1
	` + fence + `
	RETURNING id, status, state, progress, version
), event AS (
	INSERT INTO task_events (task_id, status, state, progress, actor)
	SELECT id, status, state, progress, 'WORKER' FROM upd
)
SELECT version FROM upd`

const sqlRenewLease = `UPDATE tasks SET lease_expires_at = now() + $3 * interval '1 millisecond',
	updated_at = now(), version = version + 1
	` + fence + ` RETURNING version`

// sqlComplete ends a batch of tasks COMPLETED with their results, each
// fenced by its own version; it returns the tasks it matched.
const sqlComplete = `
WITH input AS (
	SELECT * FROM unnest($1::uuid[], $2::int[], $3::text[]) AS i(task_id, version, result)
), upd AS (
	UPDATE tasks SET status = 'COMPLETED', state = 'Completed', progress = 100, error = NULL,
		lease_expires_at = NULL, completed_at = now(), updated_at = now(), version = tasks.version + 1
	FROM input
	WHERE tasks.id = input.task_id AND tasks.version = input.version AND tasks.status = 'IN_PROGRESS'
	RETURNING tasks.id, tasks.status, tasks.state, tasks.progress, tasks.version, tasks.attempt, input.result
), result AS (
	INSERT INTO task_results (task_id, payload) SELECT id, result::jsonb FROM upd
	ON CONFLICT (task_id) DO UPDATE SET payload = excluded.payload, created_at = now()
), event AS (
	INSERT INTO task_events (task_id, status, state, progress, actor, detail)
	SELECT id, status, state, progress, 'WORKER', jsonb_build_object('attempt', attempt) FROM upd
)
SELECT id, version FROM upd`

const sqlFail = `
WITH upd AS (
	UPDATE tasks SET status = 'FAILED', state = 'Failed', error = $3, lease_expires_at = NULL,
		completed_at = now(), updated_at = now(), version = version + 1
	` + fence + `
	RETURNING id, status, state, progress, version, attempt
), event AS (
	INSERT INTO task_events (task_id, status, state, progress, actor, detail)
	SELECT id, status, state, progress, 'WORKER',
		jsonb_build_object('attempt', attempt, 'error', $3::text, 'permanent', $4::bool)
	FROM upd
)
SELECT version FROM upd`

// sqlScheduleRetry puts a failed attempt back to PENDING and writes the
// task.run message that becomes available at next_run_at: the relay
// publishes it then.
const sqlScheduleRetry = `
WITH upd AS (
	UPDATE tasks SET status = 'PENDING', state = 'Retry scheduled', error = $3, worker_id = NULL,
		lease_expires_at = NULL, next_run_at = now() + $4 * interval '1 millisecond',
		traceparent = coalesce($5, traceparent), updated_at = now(), version = version + 1
	` + fence + `
	RETURNING id, type, status, state, progress, priority, attempt, version, next_run_at
), event AS (
	INSERT INTO task_events (task_id, status, state, progress, actor, detail)
	SELECT id, status, state, progress, 'WORKER',
		jsonb_build_object('attempt', attempt, 'error', $3::text, 'next_run_at', next_run_at)
	FROM upd
), message AS (
	INSERT INTO outbox (kind, task_id, routing_key, priority, body, headers, available_at)
	SELECT 'task.run', id, type, priority,
		jsonb_build_object('task_id', id, 'type', type, 'attempt', attempt), $6, next_run_at
	FROM upd
)
SELECT version FROM upd`

const sqlFinishCancelled = `
WITH upd AS (
	UPDATE tasks SET status = 'CANCELLED', state = 'Cancelled', lease_expires_at = NULL,
		completed_at = now(), updated_at = now(), version = version + 1
	` + fence + `
	RETURNING id, status, state, progress, version, attempt
), event AS (
	INSERT INTO task_events (task_id, status, state, progress, actor, detail)
	SELECT id, status, state, progress, 'WORKER', jsonb_build_object('attempt', attempt) FROM upd
)
SELECT version FROM upd`

// sqlHandBack returns a task whose handler was stopped by a shutdown. The
// attempt is given back: the task did not fail.
const sqlHandBack = `
WITH upd AS (
	UPDATE tasks SET status = 'PENDING', state = 'Queued', attempt = attempt - 1, worker_id = NULL,
		lease_expires_at = NULL, next_run_at = now(), updated_at = now(), version = version + 1
	` + fence + `
	RETURNING id, type, status, state, progress, priority, attempt, version
), event AS (
	INSERT INTO task_events (task_id, status, state, progress, actor, detail)
	SELECT id, status, state, progress, 'WORKER', jsonb_build_object('handed_back', $3::text) FROM upd
), message AS (
	INSERT INTO outbox (kind, task_id, routing_key, priority, body, headers)
	SELECT 'task.run', id, type, priority,
		jsonb_build_object('task_id', id, 'type', type, 'attempt', attempt), $4
	FROM upd
)
SELECT version FROM upd`

const sqlInspect = `SELECT status, version, coalesce(worker_id, ''), attempt, cancel_requested_at IS NOT NULL
	FROM tasks WHERE id = $1`

// Maintenance, run by the elected worker.

// sqlRequeueFromUpd writes a task.run message for each task an upd CTE
// returned, carrying the task's stored trace context: the maintenance
// statements that send tasks back to their queue share it.
const sqlRequeueFromUpd = `
	INSERT INTO outbox (kind, task_id, routing_key, priority, body, headers)
	SELECT 'task.run', id, type, priority, jsonb_build_object('task_id', id, 'type', type, 'attempt', attempt),
		CASE WHEN traceparent IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('traceparent', traceparent) END
	FROM upd`

// sqlReapLeases ends the attempts whose worker stopped renewing the lease:
// a cancelled task ends CANCELLED, one out of attempts FAILED, the others go
// back to PENDING with a new task.run message.
const sqlReapLeases = `
WITH expired AS (
	SELECT id AS expired_id FROM tasks
	WHERE status = 'IN_PROGRESS' AND lease_expires_at < now()
	ORDER BY lease_expires_at LIMIT $1
	FOR UPDATE SKIP LOCKED
), upd AS (
	UPDATE tasks SET
		status = CASE WHEN cancel_requested_at IS NOT NULL THEN 'CANCELLED'
			WHEN attempt >= max_attempts THEN 'FAILED' ELSE 'PENDING' END,
		state = CASE WHEN cancel_requested_at IS NOT NULL THEN 'Cancelled'
			WHEN attempt >= max_attempts THEN 'Failed' ELSE 'Queued' END,
		error = CASE WHEN cancel_requested_at IS NULL
			THEN 'lease expired: worker ' || coalesce(worker_id, '?') || ' stopped renewing it' ELSE error END,
		completed_at = CASE WHEN cancel_requested_at IS NULL AND attempt < max_attempts THEN NULL ELSE now() END,
		worker_id = NULL, lease_expires_at = NULL, next_run_at = now(), updated_at = now(),
		version = version + 1
	FROM expired WHERE id = expired.expired_id
	RETURNING id, type, status, state, progress, priority, attempt, traceparent
), event AS (
	INSERT INTO task_events (task_id, status, state, progress, actor, detail)
	SELECT id, status, state, progress, 'SYSTEM', '{"reason": "lease expired"}' FROM upd
), message AS (
` + sqlRequeueFromUpd + ` WHERE status = 'PENDING'
)
SELECT status, count(*) FROM upd GROUP BY status`

// sqlRepublishStale re-publishes PENDING tasks that have waited too long
// with no task.run message in the outbox: their message was lost with a
// queue, or was never consumed. NOT IN over the outbox is one hashed scan.
const sqlRepublishStale = `
WITH stale AS (
	SELECT id AS stale_id FROM tasks
	WHERE status = 'PENDING' AND next_run_at < now() - $1 * interval '1 millisecond'
		AND id NOT IN (SELECT task_id FROM outbox WHERE kind = 'task.run')
	ORDER BY next_run_at LIMIT $2
	FOR UPDATE SKIP LOCKED
), upd AS (
	UPDATE tasks SET next_run_at = now(), updated_at = now(), version = version + 1
	FROM stale WHERE id = stale.stale_id AND status = 'PENDING'
	RETURNING id, type, status, state, progress, priority, attempt, traceparent
), event AS (
	INSERT INTO task_events (task_id, status, state, progress, actor, detail)
	SELECT id, status, state, progress, 'SYSTEM', '{"reason": "republished"}' FROM upd
), message AS (
` + sqlRequeueFromUpd + `
)
SELECT count(*) FROM upd`

// sqlDeleteExpired removes terminal tasks past retention; their events and
// results go with them (ON DELETE CASCADE).
const sqlDeleteExpired = `DELETE FROM tasks WHERE id IN (
	SELECT id FROM tasks
	WHERE status IN ('COMPLETED', 'FAILED', 'CANCELLED')
		AND completed_at < now() - $1 * interval '1 millisecond'
	LIMIT $2)`

const sqlRegisterWorker = `INSERT INTO workers (id, hostname, pid, concurrency, types, version)
	VALUES ($1, $2, $3, $4, $5, $6)
	ON CONFLICT (id) DO UPDATE SET last_heartbeat_at = now()`

const sqlWorkerHeartbeat = `UPDATE workers SET last_heartbeat_at = now() WHERE id = $1`

const sqlRemoveWorker = `DELETE FROM workers WHERE id = $1`

const sqlReapWorkers = `DELETE FROM workers WHERE last_heartbeat_at < now() - $1 * interval '1 millisecond'`

const sqlCountWorkers = `SELECT count(*) FROM workers`

// sqlElect takes or keeps a leadership: a free or expired row is taken, the
// holder extends its own.
const sqlElect = `
INSERT INTO leaders (name, leader_id, expires_at) VALUES ($1, $2, now() + $3 * interval '1 millisecond')
ON CONFLICT (name) DO UPDATE SET leader_id = excluded.leader_id, expires_at = excluded.expires_at,
	elected_at = CASE WHEN leaders.leader_id = excluded.leader_id THEN leaders.elected_at ELSE now() END
WHERE leaders.leader_id = excluded.leader_id OR leaders.expires_at < now()
RETURNING leader_id`

const sqlResign = `DELETE FROM leaders WHERE name = $1 AND leader_id = $2`
