package postgres

import (
	"context"
	"errors"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/task"
)

// The maintenance leader's statements. Its changes of tasks go through
// the lifecycle's statements like everyone's; these only find the tasks to
// change, elect the leader, and clean up.

// sqlElect takes or keeps a leadership: a free or expired row is taken, the
// holder extends its own.
var sqlElect = statement("leaders.elect", `
INSERT INTO leaders (name, leader_id, expires_at) VALUES ($1, $2, now() + $3 * interval '1 millisecond')
ON CONFLICT (name) DO UPDATE SET leader_id = excluded.leader_id, expires_at = excluded.expires_at,
	elected_at = CASE WHEN leaders.leader_id = excluded.leader_id THEN leaders.elected_at ELSE now() END
WHERE leaders.leader_id = excluded.leader_id OR leaders.expires_at < now()
RETURNING leader_id`)

var sqlResign = statement("leaders.resign", `DELETE FROM leaders WHERE name = $1 AND leader_id = $2`)

// sqlExpiredLeases finds running tasks whose worker stopped renewing the
// lease, oldest expiry first.
var sqlExpiredLeases = statement("tasks.expired_leases", `
SELECT id, type, status, version, attempt, max_attempts, cancel_requested_at IS NOT NULL, coalesce(worker_id, '')
FROM tasks
WHERE `+isRunning+` AND lease_expires_at < now()
ORDER BY lease_expires_at LIMIT $1`)

// sqlStalePending finds PENDING tasks, due for longer than $1, whose last
// message was confirmed longer than $1 ago (or never, and they are that
// old) and that have no message waiting in the outbox: their message is
// either still in its queue or lost. The anti-join is NOT EXISTS, which
// PostgreSQL can always run as a hashed anti-join, however large the
// outbox. The types of $3 are left out: the leader found their queues
// busy, and a backlog of them must not hide the lost tasks of others.
var sqlStalePending = statement("tasks.stale_pending", `
SELECT id, type, status, version, attempt, max_attempts, cancel_requested_at IS NOT NULL, coalesce(worker_id, '')
FROM tasks t
WHERE `+isPending+` AND admitted AND next_run_at < now() - $1 * interval '1 millisecond'
	AND coalesce(published_at, created_at) < now() - $1 * interval '1 millisecond'
	AND NOT (t.type = ANY ($3::text[]))
	AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.task_id = t.id AND o.kind = 'task.run')
ORDER BY next_run_at LIMIT $2`)

// expiredTask says that the task t finished longer ago than retention ($1)
// and that nothing keeps it. The tasks of a workflow run still running stay:
// the run reads its completed nodes' tasks (their status, and their results
// for the nodes below them) until it ends. So do the tasks, of earlier
// runs, whose result a node of a running run memoized: the nodes below it
// read that result when they are released. So do the children of a parent
// task not ended: its handler reads them by key when it runs again, and
// would spawn a deleted one again. So do the tasks an Idempotency-Key was
// bound to within retention: a key goes with its task, and a key bound just
// now to a task found by its input (finished long ago) would otherwise be
// gone at once, and the same request sent again would make a second task.
var expiredTask = isTerminal + ` AND completed_at < now() - $1 * interval '1 millisecond'
	AND (t.run_id IS NULL OR NOT EXISTS (SELECT 1 FROM workflow_runs r
		WHERE r.id = t.run_id AND r.status = '` + job.RunRunning + `'))
	AND NOT EXISTS (SELECT 1 FROM run_nodes n JOIN workflow_runs r ON r.id = n.run_id
		WHERE n.task_id = t.id AND n.state = '` + job.NodeMemoized + `' AND r.status = '` + job.RunRunning + `')
	AND (t.parent_id IS NULL OR NOT EXISTS (SELECT 1 FROM tasks p WHERE p.id = t.parent_id
		AND p.status IN (` + inFlight + `)))
	-- A scalar subquery, read per task through the keys' index: as a
	-- NOT EXISTS it may be planned as a scan of every key.
	AND coalesce((SELECT max(k.created_at) FROM task_idempotency_keys k WHERE k.task_id = t.id), '-infinity')
		< now() - $1 * interval '1 millisecond'`

// sqlPickExpired locks a batch of terminal tasks past retention
// (expiredTask), which sqlDeleteExpired then deletes. A row lock is what
// orders retention against the writers that keep a task: a retry changes
// the row, and the binding of an Idempotency-Key to it holds the row (its
// reference) until it commits. Locked first, the tasks are read again by
// the delete, whose snapshot is taken after the lock: a key bound by a
// transaction that committed while this one waited for the row is seen
// there, and none can be bound after it. A single statement would judge
// every condition by its own snapshot, taken before the wait, and delete
// the task of a key bound meanwhile, with the key.
var sqlPickExpired = statement("tasks.delete_expired.pick", `
SELECT id FROM tasks t WHERE `+expiredTask+`
LIMIT $2
FOR UPDATE`)

// sqlDeleteExpired removes the tasks sqlPickExpired locked ($2) that are
// still expired; their events and results go with them (the tasks_deleted
// trigger), and so do their idempotency keys (ON DELETE CASCADE). The batch
// is taken as an array of ids, deleted by their key: as an IN, the planner
// joined the batch to every expired task (the re-check's terms match the
// index of terminal tasks), reading the whole backlog again for each batch
// of it.
var sqlDeleteExpired = statement("tasks.delete_expired", `
DELETE FROM tasks t WHERE id = ANY ($2::uuid[]) AND `+expiredTask)

// sqlDeleteExpiredRuns removes workflow runs that ended longer ago than
// retention, with their nodes (ON DELETE CASCADE), unless a task of theirs
// is still in flight: a task of a stopped run may still be running, and
// the run is its record. Only a run that ended has finished_at set; the
// search walks workflow_runs_finished up to the cut-off and reads each
// run's tasks in flight by key (tasks_run_open). As for tasks, the batch is
// taken as an array of ids, deleted by their key, and checked again on the
// row as it is when it is locked: a run retried meanwhile is RUNNING, and
// stays.
var sqlDeleteExpiredRuns = statement("workflow_runs.delete_expired", `
DELETE FROM workflow_runs WHERE id = ANY (ARRAY(
	SELECT id FROM workflow_runs r WHERE r.finished_at < now() - $1 * interval '1 millisecond'
		AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.run_id = r.id AND t.status IN (`+inFlight+`))
	LIMIT $2))
	AND status <> '`+job.RunRunning+`' AND finished_at < now() - $1 * interval '1 millisecond'
	AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.run_id = workflow_runs.id AND t.status IN (`+inFlight+`))`)

// sqlDeleteExpiredVersions removes the dataset versions older than
// retention that nothing reads any more. The newest version of a dataset
// stays whatever its age: a node released reads it, and its id is part of
// the node's memo key. So does a version whose task is the task of a
// remaining node: memoization reuses that task only while the versions it
// wrote are there, and a retried run checks them too. So does a version a
// remaining task read (task_inputs): every task of a running run remains.
// A run is deleted only once it ended longer ago than retention, so the
// versions its nodes wrote are older than that, and go here unless another
// run's node memoized their task. The versions kept past retention (each
// dataset's newest, those still referenced) are passed over again at
// each batch; they are as many as the datasets and the runs kept.
var sqlDeleteExpiredVersions = statement("dataset_versions.delete_expired", `
DELETE FROM dataset_versions WHERE id = ANY (ARRAY(
	SELECT v.id FROM dataset_versions v WHERE v.created_at < now() - $1 * interval '1 millisecond'
		-- Scalar subqueries, read per version through dataset_versions_latest,
		-- run_nodes_task and task_inputs_version: as EXISTS or NOT EXISTS
		-- they may be planned as a scan of every version or node at every
		-- batch.
		AND v.id < (SELECT max(l.id) FROM dataset_versions l WHERE l.org_id = v.org_id AND l.dataset = v.dataset)
		AND (SELECT n.task_id FROM run_nodes n WHERE n.task_id = v.task_id LIMIT 1) IS NULL
		AND (SELECT i.input_version FROM task_inputs i WHERE i.input_version = v.id LIMIT 1) IS NULL
	LIMIT $2))`)

// sqlParkedTypes lists the types of parked messages that a live worker
// consumes: maintenance releases those whose queue exists.
var sqlParkedTypes = statement("outbox.parked_types", `
SELECT DISTINCT o.task_type FROM outbox o
WHERE o.available_at = 'infinity' AND o.task_type IN (
	SELECT unnest(types) FROM workers WHERE last_heartbeat_at > now() - $1 * interval '1 millisecond')`)

// sqlReleaseParked is the backstop of WorkerStore.TypesReady: messages
// parked for the given types are released, and parked messages of tasks no
// longer PENDING are dropped.
var sqlReleaseParked = statement("outbox.release_parked", `
WITH dropped AS (
	DELETE FROM outbox o WHERE o.available_at = 'infinity'
		AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = o.task_id AND t.`+isPending+`)
)
UPDATE outbox o SET available_at = now()
WHERE o.available_at = 'infinity' AND o.task_type = ANY($1)
	AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = o.task_id AND t.`+isPending+`)`)

// sqlHeartbeatExpired finds running tasks whose handler has not sent a
// heartbeat (a progress report) within the task's heartbeat timeout and a
// grace of $2 ms more.
var sqlHeartbeatExpired = statement("tasks.heartbeat_expired", `
SELECT id, type, status, version, attempt, max_attempts, cancel_requested_at IS NOT NULL, coalesce(worker_id, ''),
	heartbeat_timeout_ms
FROM tasks
WHERE `+isRunning+` AND heartbeat_timeout_ms IS NOT NULL
	AND heartbeat_at < now() - (heartbeat_timeout_ms + $2) * interval '1 millisecond'
ORDER BY heartbeat_at LIMIT $1`)

// sqlIndexScans makes the rest of a transaction read tables through their
// indexes, entry by entry. The reaper's reads of running tasks go through
// tasks_running, which holds an entry for every task claimed since the
// table's last vacuum, most of them finished long ago: a bitmap scan
// visits each of those rows on every pass (about 57,000 rows and 250 ms a
// pass in a burn-down), and so does a scan of the table, while a plain
// index scan marks the dead entries it meets, and later passes skip them.
var sqlIndexScans = statement("maintenance.index_scans",
	`SELECT set_config('enable_bitmapscan', 'off', true), set_config('enable_seqscan', 'off', true)`)

// queryRunning runs a read of running tasks with rows, in a transaction
// that reads indexes entry by entry.
func (s *MaintenanceStore) queryRunning(ctx context.Context, sql string, rows func(pgx.Rows) error, args ...any) error {
	return translate(pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlIndexScans); err != nil {
			return err
		}
		r, err := tx.Query(ctx, sql, args...)
		if err != nil {
			return err
		}
		return rows(r)
	}))
}

var sqlReapWorkers = statement("workers.reap", `DELETE FROM workers WHERE last_heartbeat_at < now() - $1 * interval '1 millisecond'`)

var sqlCountWorkers = statement("workers.count", `SELECT count(*) FROM workers`)

// MaintenanceStore runs the maintenance leader's statements.
type MaintenanceStore struct {
	pool     *pgxpool.Pool
	onOutbox func()
	// OnEvents, when set, is called after every commit that wrote task
	// events. It must not block.
	OnEvents func()
}

// NewMaintenanceStore returns the maintenance leader's store. onOutbox, when
// not nil, is called after every commit that wrote or released an outbox
// row.
func NewMaintenanceStore(pool *pgxpool.Pool, onOutbox func()) *MaintenanceStore {
	if onOutbox == nil {
		onOutbox = func() {}
	}
	return &MaintenanceStore{pool: pool, onOutbox: onOutbox}
}

// Elect takes or extends the named leadership for ttl. It reports whether
// id holds it.
func (s *MaintenanceStore) Elect(ctx context.Context, name, id string, ttl time.Duration) (bool, error) {
	var leader string
	err := s.pool.QueryRow(ctx, sqlElect, name, id, ttl.Milliseconds()).Scan(&leader)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, translate(err)
	}
	return leader == id, nil
}

// Resign gives up a leadership id holds, so another worker takes it at once.
func (s *MaintenanceStore) Resign(ctx context.Context, name, id string) error {
	_, err := s.pool.Exec(ctx, sqlResign, name, id)
	return translate(err)
}

// ExpiredLeases lists up to limit running tasks whose lease expired.
func (s *MaintenanceStore) ExpiredLeases(ctx context.Context, limit int) ([]task.Standing, error) {
	var out []task.Standing
	err := s.queryRunning(ctx, sqlExpiredLeases, func(rows pgx.Rows) (err error) {
		out, err = collectStandings(rows)
		return err
	}, limit)
	return out, err
}

// StalePending lists up to limit PENDING tasks that waited longer than
// after since they were due and since their message was confirmed, with no
// message in the outbox, leaving out the tasks of the types in skip.
func (s *MaintenanceStore) StalePending(ctx context.Context, after time.Duration, limit int, skip []string) ([]task.Standing, error) {
	if skip == nil {
		skip = []string{}
	}
	rows, err := s.pool.Query(ctx, sqlStalePending, after.Milliseconds(), limit, skip)
	if err != nil {
		return nil, translate(err)
	}
	out, err := collectStandings(rows)
	return out, translate(err)
}

func collectStandings(rows pgx.Rows) ([]task.Standing, error) {
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (task.Standing, error) {
		var st task.Standing
		var status string
		err := row.Scan(&st.ID, &st.Type, &status, &st.Version, &st.Attempt, &st.MaxAttempts, &st.CancelPending, &st.WorkerID)
		st.Status = task.Status(status)
		return st, err
	})
}

// Apply applies the leader's changes, each fenced by its version.
func (s *MaintenanceStore) Apply(ctx context.Context, changes []task.Change) ([]task.Applied, []error, error) {
	return applyAndWake(ctx, s.pool, changes, s.onOutbox, s.OnEvents)
}

// DeleteExpired deletes up to limit terminal tasks (with their events,
// results and keys) that finished longer ago than retention.
func (s *MaintenanceStore) DeleteExpired(ctx context.Context, retention time.Duration, limit int) (int, error) {
	var n int
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, sqlPickExpired, retention.Milliseconds(), limit)
		if err != nil {
			return err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
		if err != nil || len(ids) == 0 {
			return err
		}
		tag, err := tx.Exec(ctx, sqlDeleteExpired, retention.Milliseconds(), ids)
		n = int(tag.RowsAffected())
		return err
	})
	if err != nil {
		return 0, translate(err)
	}
	return n, nil
}

// DeleteExpiredRuns deletes up to limit workflow runs (with their nodes)
// that ended longer ago than retention and have no task in flight.
func (s *MaintenanceStore) DeleteExpiredRuns(ctx context.Context, retention time.Duration, limit int) (int, error) {
	tag, err := s.pool.Exec(ctx, sqlDeleteExpiredRuns, retention.Milliseconds(), limit)
	if err != nil {
		return 0, translate(err)
	}
	return int(tag.RowsAffected()), nil
}

// DeleteExpiredVersions deletes up to limit dataset versions older than
// retention that are not their dataset's newest and that no remaining run
// node or task refers to.
func (s *MaintenanceStore) DeleteExpiredVersions(ctx context.Context, retention time.Duration, limit int) (int, error) {
	tag, err := s.pool.Exec(ctx, sqlDeleteExpiredVersions, retention.Milliseconds(), limit)
	if err != nil {
		return 0, translate(err)
	}
	return int(tag.RowsAffected()), nil
}

// ParkedTypes lists the types of parked messages that a worker heard from
// within deadAfter consumes.
func (s *MaintenanceStore) ParkedTypes(ctx context.Context, deadAfter time.Duration) ([]string, error) {
	rows, err := s.pool.Query(ctx, sqlParkedTypes, deadAfter.Milliseconds())
	if err != nil {
		return nil, translate(err)
	}
	types, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, translate(err)
	}
	return types, nil
}

// ReleaseParked releases the parked messages of types, and drops parked
// messages of tasks that are no longer PENDING. It returns how many it
// released.
func (s *MaintenanceStore) ReleaseParked(ctx context.Context, types []string) (int, error) {
	tag, err := s.pool.Exec(ctx, sqlReleaseParked, types)
	if err != nil {
		return 0, translate(err)
	}
	if tag.RowsAffected() > 0 {
		s.onOutbox()
	}
	return int(tag.RowsAffected()), nil
}

// ReapWorkers removes workers silent for longer than deadAfter.
func (s *MaintenanceStore) ReapWorkers(ctx context.Context, deadAfter time.Duration) (int, error) {
	tag, err := s.pool.Exec(ctx, sqlReapWorkers, deadAfter.Milliseconds())
	if err != nil {
		return 0, translate(err)
	}
	return int(tag.RowsAffected()), nil
}

// CountWorkers returns the number of registered workers.
func (s *MaintenanceStore) CountWorkers(ctx context.Context) (int, error) {
	var n int
	err := s.pool.QueryRow(ctx, sqlCountWorkers).Scan(&n)
	return n, translate(err)
}

// HeartbeatExpired lists up to limit running tasks whose handler's
// heartbeats stopped for longer than the task's heartbeat timeout plus
// grace.
func (s *MaintenanceStore) HeartbeatExpired(ctx context.Context, grace time.Duration, limit int) ([]task.Standing, []time.Duration, error) {
	var out []task.Standing
	var timeouts []time.Duration
	err := s.queryRunning(ctx, sqlHeartbeatExpired, func(rows pgx.Rows) error {
		var st task.Standing
		var status string
		var ms int64
		_, err := pgx.ForEachRow(rows, []any{&st.ID, &st.Type, &status, &st.Version, &st.Attempt, &st.MaxAttempts,
			&st.CancelPending, &st.WorkerID, &ms}, func() error {
			st.Status = task.Status(status)
			out = append(out, st)
			timeouts = append(timeouts, time.Duration(ms)*time.Millisecond)
			return nil
		})
		return err
	}, limit, grace.Milliseconds())
	return out, timeouts, err
}
