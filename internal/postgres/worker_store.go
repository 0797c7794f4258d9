package postgres

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/registry"
	"github.com/conveyorhq/conveyor/internal/task"
)

// A worker's statements: the claim, the transitions of the tasks it holds
// (lifecycle.go), and its registry rows.

// sqlClaim takes tasks for a worker: lock the rows that are claimable
// (PENDING and due, or IN_PROGRESS under an expired lease with attempts
// left, no cancel pending and nothing that would make it wait for the
// scheduler), then start their attempts and record them. A task of a
// paused or limited job or type is not taken over: the reaper queues it
// again, to wait as a task sent back to its queue does (a takeover after
// a pause answered would start its next attempt all the same).
// Due means due now, with no margin: a task's message becomes available
// only once the task is due, by the database's clock, and the claim's
// transaction starts after the relay's that published it, so only a stray
// message (a duplicate of an earlier attempt's) comes early, and a margin
// would let it cut a retry's backoff short.
// One statement, so one short transaction; under concurrent claims the FOR
// UPDATE re-checks the condition on the row the winner committed, so only
// one claim of a task succeeds. Rows are locked in id order, so concurrent
// batches cannot deadlock.
var sqlClaim = statement("tasks.claim", `
WITH locked AS (
	-- The condition is a CASE, which no index can serve, so the rows are
	-- found by their primary key whatever the statistics say: with the
	-- condition spelt as an OR of indexed columns, a fresh backlog (not
	-- analyzed yet) made the planner scan every pending task per claim.
	SELECT id AS locked_id FROM tasks
	WHERE id = ANY($1::uuid[]) AND CASE status
		WHEN `+lit(task.StatusPending)+` THEN admitted AND next_run_at <= now()
		WHEN `+lit(task.StatusInProgress)+` THEN lease_expires_at < now() AND attempt < max_attempts
			AND cancel_requested_at IS NULL AND NOT conveyor_must_wait(org_id, type, job_id, concurrency_key)
		ELSE false END
	ORDER BY id
	FOR UPDATE
), upd AS (
	UPDATE tasks SET status = $4, state = $5, progress = 0, attempt = attempt + 1,
		version = version + 1, worker_id = $2, lease_expires_at = now() + $3 * interval '1 millisecond',
		started_at = now(), updated_at = now(), heartbeat_at = now()
	FROM locked WHERE id = locked.locked_id
	RETURNING `+claimColumns+`
), event AS (
	INSERT INTO task_events (task_id, org_id, status, state, progress, actor, detail)
	SELECT id, org_id, status, $5, 0, $6, jsonb_build_object('worker_id', $2::text, 'attempt', attempt)
	FROM upd
)
SELECT * FROM upd`)

// claimColumns are the columns of a claimed task that a worker reads: what
// its handler is given, what bounds its run, and what its children inherit.
// A claim returns only these (every column of a batch is formatted by
// PostgreSQL and read by the worker).
const claimColumns = `id, org_id, visibility, type, status, priority, payload, metadata, attempt,
	max_attempts, version, worker_id, lease_expires_at, next_run_at, started_at,
	coalesce(timeout_ms, 0) AS timeout_ms, coalesce(heartbeat_timeout_ms, 0) AS heartbeat_timeout_ms,
	run_id, coalesce(node, '') AS node, inputs, parent_id`

// scanClaimed reads the claimColumns of a row.
func scanClaimed(row pgx.CollectableRow) (task.Task, error) {
	return scanClaimedWith(row)
}

// scanClaimedWith reads the claimColumns of a row, then any extra
// destinations.
func scanClaimedWith(row pgx.Row, extra ...any) (task.Task, error) {
	var t task.Task
	var v scanned
	dest := []any{&t.ID, &t.OrgID, &t.Visibility, &t.Type, &v.status, &t.Priority, &v.payload, &v.metadata,
		&t.Attempt, &t.MaxAttempts, &t.Version, &t.WorkerID, &t.LeaseExpiresAt, &t.NextRunAt, &t.StartedAt,
		&v.timeout, &v.heartbeatTimeout, &t.RunID, &t.Node, &v.inputs, &t.ParentID}
	if err := row.Scan(append(dest, extra...)...); err != nil {
		return task.Task{}, err
	}
	v.fill(&t)
	return t, nil
}

var sqlInspect = statement("tasks.inspect", `
SELECT status, version, coalesce(worker_id, ''), attempt, cancel_requested_at IS NOT NULL
FROM tasks WHERE id = $1`)

// sqlRegisterWorker adds a worker, or records a worker whose id is
// already there as it is now: a process restarted under the same WORKER_ID
// before maintenance removed its row may serve other types, at another
// concurrency. A registration the same process makes again (its answer
// lost) keeps its start.
var sqlRegisterWorker = statement("workers.register", `
INSERT INTO workers (id, hostname, pid, concurrency, types, version)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (id) DO UPDATE SET hostname = excluded.hostname, pid = excluded.pid,
	concurrency = excluded.concurrency, types = excluded.types, version = excluded.version,
	started_at = CASE WHEN (workers.hostname, workers.pid) = (excluded.hostname, excluded.pid)
		THEN workers.started_at ELSE now() END,
	last_heartbeat_at = now()`)

var sqlWorkerHeartbeat = statement("workers.heartbeat", `UPDATE workers SET last_heartbeat_at = now() WHERE id = $1`)

var sqlRemoveWorker = statement("workers.remove", `DELETE FROM workers WHERE id = $1`)

// sqlTypesReady records types whose queues a worker has declared and
// releases the messages parked while no queue took them.
var sqlTypesReady = statement("task_types.ready", `
WITH known AS (
	INSERT INTO task_types (name) SELECT unnest($1::text[])
	ON CONFLICT (name) DO UPDATE SET last_seen_at = now()
)
UPDATE outbox SET available_at = now()
WHERE task_type = ANY($1) AND available_at = 'infinity'`)

// WorkerStore runs a worker's statements.
type WorkerStore struct {
	pool     *pgxpool.Pool
	onOutbox func()
	// OnEvents, when set, is called after every commit that wrote task
	// events (the stream hubs' wake-up). It must not block.
	OnEvents func()
}

// NewWorkerStore returns a worker's store. onOutbox, when not nil, is called
// after every commit that wrote or released an outbox row.
func NewWorkerStore(pool *pgxpool.Pool, onOutbox func()) *WorkerStore {
	if onOutbox == nil {
		onOutbox = func() {}
	}
	return &WorkerStore{pool: pool, onOutbox: onOutbox}
}

// Claim claims, in one transaction, those of the tasks that are claimable
// for workerID with a lease of the given length, and returns them.
func (s *WorkerStore) Claim(ctx context.Context, ids []uuid.UUID, workerID string, lease time.Duration) ([]task.Task, error) {
	rows, err := s.pool.Query(ctx, sqlClaim, claimArgs(ids, workerID, lease)...)
	if err != nil {
		return nil, translate(err)
	}
	tasks, err := readClaimed(rows, len(ids))
	if len(tasks) > 0 {
		call(s.OnEvents)
	}
	return tasks, translate(err)
}

// claimArgs are sqlClaim's parameters.
func claimArgs(ids []uuid.UUID, workerID string, lease time.Duration) []any {
	r := task.Lifecycle[task.Claim]
	return []any{ids, workerID, lease.Milliseconds(), string(r.To), r.State, string(r.Actor)}
}

// readClaimed reads the tasks sqlClaim claimed of n asked for.
func readClaimed(rows pgx.Rows, n int) ([]task.Task, error) {
	return pgx.AppendRows(make([]task.Task, 0, n), rows, scanClaimed)
}

// Apply applies changes of tasks the worker holds, each fenced by its
// version, in one statement. It answers one Applied and one error per
// change: a change PostgreSQL refuses for its data fails alone. err is a
// failure of the whole call.
func (s *WorkerStore) Apply(ctx context.Context, changes []task.Change) ([]task.Applied, []error, error) {
	return applyAndWake(ctx, s.pool, changes, s.onOutbox, s.OnEvents)
}

// ApplyAndClaim applies changes as Apply does and claims as Claim does, in
// one round trip and one transaction: one commit for both. A batch that
// PostgreSQL refuses whole (a change's data, a deadlock) is written again
// as Apply and Claim, one after the other, so that each change fails alone
// as it would there. errs has one error per change (a batch of changes
// refused whole fails each of them, and the claims still land); err is a
// failure of the whole call.
func (s *WorkerStore) ApplyAndClaim(ctx context.Context, changes []task.Change, ids []uuid.UUID, workerID string,
	lease time.Duration) ([]task.Applied, []error, []task.Task, error) {
	if len(changes) == 0 {
		tasks, err := s.Claim(ctx, ids, workerID, lease)
		return nil, nil, tasks, err
	}
	if len(ids) == 0 {
		out, errs := s.applyEach(ctx, changes)
		return out, errs, nil, nil
	}
	a, err := newApplyQuery(changes)
	if err != nil {
		return s.applyThenClaim(ctx, changes, ids, workerID, lease)
	}
	var (
		out    []task.Applied
		queued bool
		tasks  []task.Task
	)
	batch := &pgx.Batch{}
	batch.Queue(a.sql, a.args...).Query(func(rows pgx.Rows) error {
		var err error
		out, queued, err = a.read(rows)
		return err
	})
	batch.Queue(sqlClaim, claimArgs(ids, workerID, lease)...).Query(func(rows pgx.Rows) error {
		var err error
		tasks, err = readClaimed(rows, len(ids))
		return err
	})
	// A batch is one implicit transaction: both statements commit, or
	// neither does.
	if err := s.pool.SendBatch(ctx, batch).Close(); err != nil {
		if pgCode(err) != "" {
			return s.applyThenClaim(ctx, changes, ids, workerID, lease)
		}
		return nil, nil, nil, translate(err)
	}
	errs := make([]error, len(changes))
	if queued {
		call(s.onOutbox)
	}
	if len(tasks) > 0 || wroteEvents(changes, out, errs) {
		call(s.OnEvents)
	}
	return out, errs, tasks, nil
}

// applyThenClaim is ApplyAndClaim in two transactions.
func (s *WorkerStore) applyThenClaim(ctx context.Context, changes []task.Change, ids []uuid.UUID, workerID string,
	lease time.Duration) ([]task.Applied, []error, []task.Task, error) {
	out, errs := s.applyEach(ctx, changes)
	tasks, err := s.Claim(ctx, ids, workerID, lease)
	return out, errs, tasks, err
}

// applyEach is Apply with a failure of the whole batch given to each of
// its changes.
func (s *WorkerStore) applyEach(ctx context.Context, changes []task.Change) ([]task.Applied, []error) {
	out, errs, err := s.Apply(ctx, changes)
	if err != nil {
		return make([]task.Applied, len(changes)), slices.Repeat([]error{err}, len(changes))
	}
	return out, errs
}

// Inspect reads who holds a task, after a fenced write missed.
func (s *WorkerStore) Inspect(ctx context.Context, id uuid.UUID) (task.Hold, error) {
	var h task.Hold
	var status string
	err := s.pool.QueryRow(ctx, sqlInspect, id).Scan(&status, &h.Version, &h.WorkerID, &h.Attempt, &h.CancelRequested)
	h.Status = task.Status(status)
	return h, translate(err)
}

// sqlHeld reads a task the worker holds in the attempt given, as a claim
// returns it, and whether a cancel was requested since.
var sqlHeld = statement("tasks.held", `SELECT `+claimColumns+`, cancel_requested_at IS NOT NULL FROM tasks
WHERE id = $1 AND `+isRunning+` AND worker_id = $2 AND attempt = $3`)

// Held reads the task id if workerID holds it, running its attempt: a
// claim whose commit landed though its answer was lost. ok is false when
// the task is not so held.
//
// The task is answered at the version its claim left. No attempt runs it
// yet, so the only change it can have had since is a cancel's request,
// which moved it one version on: answered at that version, the run the
// worker adopts would take the cancel's broadcast for an earlier run's,
// and its writes would land over the cancel, completing the task.
func (s *WorkerStore) Held(ctx context.Context, id uuid.UUID, workerID string, attempt int) (task.Task, bool, error) {
	var cancelRequested bool
	t, err := scanClaimedWith(s.pool.QueryRow(ctx, sqlHeld, id, workerID, attempt), &cancelRequested)
	if errors.Is(err, pgx.ErrNoRows) {
		return task.Task{}, false, nil
	}
	if err != nil {
		return task.Task{}, false, translate(err)
	}
	if cancelRequested {
		t.Version--
	}
	return t, true, nil
}

// Register adds the worker to the registry.
func (s *WorkerStore) Register(ctx context.Context, w registry.Worker) error {
	_, err := s.pool.Exec(ctx, sqlRegisterWorker, w.ID, w.Hostname, w.PID, w.Concurrency, w.Types, w.Version)
	return translate(err)
}

// Heartbeat records that the worker is alive. registered is false when its
// row is gone (removed as dead while it was cut off): register again.
func (s *WorkerStore) Heartbeat(ctx context.Context, id string) (registered bool, err error) {
	tag, err := s.pool.Exec(ctx, sqlWorkerHeartbeat, id)
	if err != nil {
		return false, translate(err)
	}
	return tag.RowsAffected() == 1, nil
}

// Leave takes the worker out of the registry.
func (s *WorkerStore) Leave(ctx context.Context, id string) error {
	_, err := s.pool.Exec(ctx, sqlRemoveWorker, id)
	return translate(err)
}

// TypesReady records that the worker declared the queues of types, and
// releases the messages of those types that were parked for want of a
// queue.
func (s *WorkerStore) TypesReady(ctx context.Context, types []string) error {
	tag, err := s.pool.Exec(ctx, sqlTypesReady, types)
	if err != nil {
		return fmt.Errorf("mark task types ready: %w", translate(err))
	}
	if tag.RowsAffected() > 0 {
		s.onOutbox()
	}
	return nil
}

// sqlChildren reads where a parent's children stand, with the result of
// those that completed.
var sqlChildren = statement("tasks.children", `
SELECT c.child_key, c.id, c.status, coalesce(c.error, ''),
	(SELECT r.payload FROM task_results r WHERE r.task_id = c.id AND c.`+isCompleted+`)
FROM tasks c WHERE c.parent_id = $1 ORDER BY c.child_key`)

// sqlSpawnHeld locks the parent of a Spawn while the attempt that spawns
// still holds it, for the rest of the transaction: a parent that was lost
// meanwhile (its lease expired, and it was ended or taken over) spawns
// nothing, as none of its handler's other writes lands. Nor does one whose
// cancel was requested and whose worker has not heard of it yet: its
// children would start work after the cancel was accepted.
var sqlSpawnHeld = statement("tasks.spawn_held", `
SELECT 1 FROM tasks WHERE id = $1 AND status = `+lit(task.StatusInProgress)+` AND worker_id = $2 AND attempt = $3
	AND cancel_requested_at IS NULL
FOR SHARE`)

// Spawn submits the children of parent that it has not spawned yet (a
// child is unique per parent and key, so spawning again submits nothing),
// then reads where all its children stand. It answers task.ErrFenced, and
// spawns nothing, when the parent's attempt no longer holds the task or
// its cancel was requested.
func (s *WorkerStore) Spawn(ctx context.Context, parent task.Task, children []task.Submission, trace task.Carrier) ([]task.ChildState, error) {
	var rows submitRows
	for _, sub := range children {
		if err := rows.add(sub, nil, trace); err != nil {
			return nil, err
		}
	}
	batch := &pgx.Batch{}
	if len(children) > 0 {
		batch.Queue(sqlSubmit, rows.args()...)
	}
	var out []task.ChildState
	batch.Queue(sqlChildren, parent.ID).Query(func(rows pgx.Rows) error {
		var err error
		out, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (task.ChildState, error) {
			var c task.ChildState
			var status string
			var result []byte
			err := row.Scan(&c.Key, &c.ID, &status, &c.Error, &result)
			c.Status = task.Status(status)
			if result != nil {
				c.Result = result
			}
			return c, err
		})
		return err
	})
	var made bool
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var held int
		if err := tx.QueryRow(ctx, sqlSpawnHeld, parent.ID, parent.WorkerID, parent.Attempt).Scan(&held); err != nil {
			if errors.Is(err, pgx.ErrNoRows) {
				return task.ErrFenced
			}
			return err
		}
		br := tx.SendBatch(ctx, batch)
		if len(children) > 0 {
			tag, err := br.Exec()
			if err != nil {
				_ = br.Close()
				return err
			}
			made = tag.RowsAffected() > 0
		}
		return br.Close()
	})
	if errors.Is(err, task.ErrFenced) {
		return nil, err
	}
	if err != nil {
		return nil, translate(err)
	}
	if made {
		call(s.onOutbox)
		call(s.OnEvents)
	}
	return out, nil
}
