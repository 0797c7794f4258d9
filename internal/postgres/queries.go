package postgres

// The SQL of the API's statements, in one place. Every write bumps version.

// taskColumns are the columns scanTask reads, in its order.
const taskColumns = `id, tenant_id, type, status, state, progress, priority, payload, metadata,
	coalesce(input_hash, ''), coalesce(idempotency_key, ''), coalesce(error, ''), attempt, max_attempts,
	version, coalesce(worker_id, ''), lease_expires_at, next_run_at, cancel_requested_at,
	coalesce(traceparent, ''), created_at, updated_at, started_at, completed_at`

// sqlSubmit inserts a task with its first event and its outbox row. One
// statement is one transaction; a conflict on either idempotency index
// inserts nothing and returns no row.
const sqlSubmit = `
WITH ins AS (
	INSERT INTO tasks (id, tenant_id, type, priority, payload, metadata, input_hash,
		idempotency_key, max_attempts, traceparent)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
	ON CONFLICT DO NOTHING
	RETURNING ` + taskColumns + `
), event AS (
	INSERT INTO task_events (task_id, status, state, progress, actor)
	SELECT id, status, state, progress, 'API' FROM ins
), message AS (
	INSERT INTO outbox (kind, task_id, routing_key, priority, body, headers)
	SELECT 'task.run', id, type, priority,
		jsonb_build_object('task_id', id, 'type', type, 'attempt', attempt), $11
	FROM ins
)
SELECT * FROM ins`

const sqlTaskByIdempotencyKey = `SELECT ` + taskColumns + ` FROM tasks
	WHERE tenant_id = $1 AND type = $2 AND idempotency_key = $3`

const sqlTaskByInputHash = `SELECT ` + taskColumns + ` FROM tasks
	WHERE tenant_id = $1 AND type = $2 AND input_hash = $3`

const sqlTaskByID = `SELECT ` + taskColumns + ` FROM tasks WHERE id = $1`

const sqlGetTask = `SELECT ` + taskColumns + `,
	(SELECT r.payload FROM task_results r WHERE r.task_id = tasks.id AND tasks.status = 'COMPLETED')
	FROM tasks WHERE id = $1`

const sqlListTasks = `SELECT ` + taskColumns + ` FROM tasks`

const sqlTaskExists = `SELECT EXISTS (SELECT 1 FROM tasks WHERE id = $1)`

const sqlTaskEvents = `SELECT id, task_id, status, state, progress, detail, actor, created_at
	FROM task_events WHERE task_id = $1 ORDER BY id DESC LIMIT $2`

const sqlLockTask = `SELECT status, cancel_requested_at IS NOT NULL FROM tasks WHERE id = $1 FOR UPDATE`

const sqlCancelPending = `
WITH upd AS (
	UPDATE tasks SET status = 'CANCELLED', state = 'Cancelled', cancel_requested_at = now(),
		completed_at = now(), updated_at = now(), version = version + 1
	WHERE id = $1 AND status = 'PENDING'
	RETURNING ` + taskColumns + `
), event AS (
	INSERT INTO task_events (task_id, status, state, progress, actor)
	SELECT id, status, state, progress, 'API' FROM upd
)
SELECT * FROM upd`

// sqlRequestCancel marks a running task and broadcasts a task.cancel message
// to every worker through the control exchange.
const sqlRequestCancel = `
WITH upd AS (
	UPDATE tasks SET cancel_requested_at = now(), updated_at = now(), version = version + 1
	WHERE id = $1 AND status = 'IN_PROGRESS'
	RETURNING ` + taskColumns + `
), event AS (
	INSERT INTO task_events (task_id, status, state, progress, actor)
	SELECT id, status, 'Cancel requested', progress, 'API' FROM upd
), message AS (
	INSERT INTO outbox (kind, task_id, routing_key, priority, body, headers)
	SELECT 'task.cancel', id, '', 9,
		jsonb_build_object('task_id', id, 'type', type, 'attempt', attempt), $2
	FROM upd
)
SELECT * FROM upd`

const sqlRetry = `
WITH upd AS (
	UPDATE tasks SET status = 'PENDING', state = 'Queued', progress = 0, attempt = 0, error = NULL,
		worker_id = NULL, lease_expires_at = NULL, cancel_requested_at = NULL, started_at = NULL,
		completed_at = NULL, next_run_at = now(), traceparent = $2, updated_at = now(),
		version = version + 1
	WHERE id = $1 AND status IN ('FAILED', 'CANCELLED')
	RETURNING ` + taskColumns + `
), event AS (
	INSERT INTO task_events (task_id, status, state, progress, actor, detail)
	SELECT id, status, state, progress, 'API', '{"retry": true}' FROM upd
), message AS (
	INSERT INTO outbox (kind, task_id, routing_key, priority, body, headers)
	SELECT 'task.run', id, type, priority,
		jsonb_build_object('task_id', id, 'type', type, 'attempt', attempt), $3
	FROM upd
)
SELECT * FROM upd`
