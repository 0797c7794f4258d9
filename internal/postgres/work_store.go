package postgres

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/task"
)

// WorkStore runs the worker's statements: the claim, the fenced writes of a
// running task, and the maintenance duties.
type WorkStore struct {
	pool     *pgxpool.Pool
	onOutbox func()
}

// NewWorkStore returns the worker's store. onOutbox, when not nil, is
// called after every commit that wrote an outbox row.
func NewWorkStore(pool *pgxpool.Pool, onOutbox func()) *WorkStore {
	if onOutbox == nil {
		onOutbox = func() {}
	}
	return &WorkStore{pool: pool, onOutbox: onOutbox}
}

// Claim starts an attempt of the task for workerID with a lease of the
// given length. ok is false when the task is not claimable: terminal,
// running under a live lease, not due yet, or unknown.
func (s *WorkStore) Claim(ctx context.Context, id uuid.UUID, workerID string, lease time.Duration) (t task.Task, ok bool, err error) {
	tasks, err := s.ClaimMany(ctx, []uuid.UUID{id}, workerID, lease)
	if err != nil || len(tasks) == 0 {
		return task.Task{}, false, err
	}
	return tasks[0], true, nil
}

// ClaimMany claims, in one transaction, those of the tasks that are
// claimable, and returns them.
func (s *WorkStore) ClaimMany(ctx context.Context, ids []uuid.UUID, workerID string, lease time.Duration) ([]task.Task, error) {
	rows, err := s.pool.Query(ctx, sqlClaim, ids, workerID, lease.Milliseconds())
	if err != nil {
		return nil, translate(err)
	}
	tasks, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (task.Task, error) { return scanTask(row) })
	return tasks, translate(err)
}

// Progress stores a progress report and renews the lease.
func (s *WorkStore) Progress(ctx context.Context, l *task.Lease, percent int, state string, lease time.Duration) error {
	return s.fenced(ctx, l, sqlProgress, percent, state, lease.Milliseconds())
}

// RenewLease extends the lease of a running task.
func (s *WorkStore) RenewLease(ctx context.Context, l *task.Lease, lease time.Duration) error {
	return s.fenced(ctx, l, sqlRenewLease, lease.Milliseconds())
}

// Complete ends the task COMPLETED with its result.
func (s *WorkStore) Complete(ctx context.Context, l *task.Lease, result []byte) error {
	done, err := s.CompleteMany(ctx, []task.Completion{{Lease: *l, Result: result}})
	if err != nil {
		return err
	}
	v, ok := done[l.TaskID]
	if !ok {
		return task.ErrFenced
	}
	l.Version = v
	return nil
}

// CompleteMany ends a batch of tasks COMPLETED in one transaction, each
// write fenced by its lease. It returns the new version of every task it
// completed; a task missing from the answer missed its fence.
func (s *WorkStore) CompleteMany(ctx context.Context, cs []task.Completion) (map[uuid.UUID]int, error) {
	ids := make([]uuid.UUID, len(cs))
	versions := make([]int, len(cs))
	results := make([]string, len(cs))
	for i, c := range cs {
		ids[i], versions[i], results[i] = c.Lease.TaskID, c.Lease.Version, string(c.Result)
	}
	rows, err := s.pool.Query(ctx, sqlComplete, ids, versions, results)
	if err != nil {
		return nil, translate(err)
	}
	done := make(map[uuid.UUID]int, len(cs))
	var id uuid.UUID
	var version int
	_, err = pgx.ForEachRow(rows, []any{&id, &version}, func() error {
		done[id] = version
		return nil
	})
	if err != nil {
		return nil, translate(err)
	}
	return done, nil
}

// Fail ends the task FAILED.
func (s *WorkStore) Fail(ctx context.Context, l *task.Lease, reason string, permanent bool) error {
	return s.fenced(ctx, l, sqlFail, reason, permanent)
}

// ScheduleRetry puts the task back to PENDING after a failed attempt, with a
// task.run message that becomes available after delay. traceparent, when
// set, becomes the task's trace (the retry's own trace).
func (s *WorkStore) ScheduleRetry(ctx context.Context, l *task.Lease, reason string, delay time.Duration, traceparent string, headers task.Carrier) error {
	if err := s.fenced(ctx, l, sqlScheduleRetry, reason, delay.Milliseconds(), nullable(traceparent), headersArg(headers)); err != nil {
		return err
	}
	s.onOutbox()
	return nil
}

// FinishCancelled ends a task whose cancellation the handler honoured.
func (s *WorkStore) FinishCancelled(ctx context.Context, l *task.Lease) error {
	return s.fenced(ctx, l, sqlFinishCancelled)
}

// HandBack returns a task to PENDING, giving its attempt back, and queues it
// again: its worker is shutting down.
func (s *WorkStore) HandBack(ctx context.Context, l *task.Lease, reason string, headers task.Carrier) error {
	if err := s.fenced(ctx, l, sqlHandBack, reason, headersArg(headers)); err != nil {
		return err
	}
	s.onOutbox()
	return nil
}

// Inspect reads who holds a task, after a fenced write missed.
func (s *WorkStore) Inspect(ctx context.Context, id uuid.UUID) (task.Hold, error) {
	var h task.Hold
	var status string
	err := s.pool.QueryRow(ctx, sqlInspect, id).Scan(&status, &h.Version, &h.WorkerID, &h.Attempt, &h.CancelRequested)
	h.Status = task.Status(status)
	return h, translate(err)
}

// fenced runs a write that must match the lease's version; on success the
// lease takes the new version.
func (s *WorkStore) fenced(ctx context.Context, l *task.Lease, sql string, args ...any) error {
	var version int
	err := s.pool.QueryRow(ctx, sql, append([]any{l.TaskID, l.Version}, args...)...).Scan(&version)
	if errors.Is(err, pgx.ErrNoRows) {
		return task.ErrFenced
	}
	if err != nil {
		return translate(err)
	}
	l.Version = version
	return nil
}

// WorkerInfo describes a worker process in the registry.
type WorkerInfo struct {
	ID          string
	Hostname    string
	PID         int
	Concurrency int
	Types       []string
	Version     string
}

// RegisterWorker adds the worker to the registry.
func (s *WorkStore) RegisterWorker(ctx context.Context, w WorkerInfo) error {
	_, err := s.pool.Exec(ctx, sqlRegisterWorker, w.ID, w.Hostname, w.PID, w.Concurrency, w.Types, w.Version)
	return translate(err)
}

// WorkerHeartbeat records that the worker is alive. registered is false when
// its row is gone (removed as dead while it was cut off): register again.
func (s *WorkStore) WorkerHeartbeat(ctx context.Context, id string) (registered bool, err error) {
	tag, err := s.pool.Exec(ctx, sqlWorkerHeartbeat, id)
	if err != nil {
		return false, translate(err)
	}
	return tag.RowsAffected() == 1, nil
}

// RemoveWorker takes the worker out of the registry.
func (s *WorkStore) RemoveWorker(ctx context.Context, id string) error {
	_, err := s.pool.Exec(ctx, sqlRemoveWorker, id)
	return translate(err)
}

// Elect takes or extends the named leadership for ttl. It reports whether
// id holds it.
func (s *WorkStore) Elect(ctx context.Context, name, id string, ttl time.Duration) (bool, error) {
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
func (s *WorkStore) Resign(ctx context.Context, name, id string) error {
	_, err := s.pool.Exec(ctx, sqlResign, name, id)
	return translate(err)
}

// ReapLeases ends up to limit attempts whose lease expired and returns how
// many tasks went to each status.
func (s *WorkStore) ReapLeases(ctx context.Context, limit int) (map[task.Status]int, error) {
	rows, err := s.pool.Query(ctx, sqlReapLeases, limit)
	if err != nil {
		return nil, translate(err)
	}
	out := map[task.Status]int{}
	var status string
	var n int
	_, err = pgx.ForEachRow(rows, []any{&status, &n}, func() error {
		out[task.Status(status)] = n
		return nil
	})
	if err != nil {
		return nil, translate(err)
	}
	if out[task.StatusPending] > 0 {
		s.onOutbox()
	}
	return out, nil
}

// RepublishStale queues again up to limit PENDING tasks that have waited
// longer than after with no message in the outbox.
func (s *WorkStore) RepublishStale(ctx context.Context, after time.Duration, limit int) (int, error) {
	var n int
	if err := s.pool.QueryRow(ctx, sqlRepublishStale, after.Milliseconds(), limit).Scan(&n); err != nil {
		return 0, translate(err)
	}
	if n > 0 {
		s.onOutbox()
	}
	return n, nil
}

// DeleteExpired deletes up to limit terminal tasks (with their events and
// results) that finished longer ago than retention.
func (s *WorkStore) DeleteExpired(ctx context.Context, retention time.Duration, limit int) (int, error) {
	tag, err := s.pool.Exec(ctx, sqlDeleteExpired, retention.Milliseconds(), limit)
	if err != nil {
		return 0, translate(err)
	}
	return int(tag.RowsAffected()), nil
}

// ReapWorkers removes workers silent for longer than deadAfter.
func (s *WorkStore) ReapWorkers(ctx context.Context, deadAfter time.Duration) (int, error) {
	tag, err := s.pool.Exec(ctx, sqlReapWorkers, deadAfter.Milliseconds())
	if err != nil {
		return 0, translate(err)
	}
	return int(tag.RowsAffected()), nil
}

// CountWorkers returns the number of registered workers.
func (s *WorkStore) CountWorkers(ctx context.Context) (int, error) {
	var n int
	err := s.pool.QueryRow(ctx, sqlCountWorkers).Scan(&n)
	return n, translate(err)
}

// Ping checks that the database answers.
func (s *WorkStore) Ping(ctx context.Context) error {
	if err := s.pool.Ping(ctx); err != nil {
		return fmt.Errorf("ping database: %w", err)
	}
	return nil
}
