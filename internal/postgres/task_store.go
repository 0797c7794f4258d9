package postgres

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/task"
)

// TaskStore runs the API's statements: submissions, reads, cancel and retry.
type TaskStore struct {
	pool *pgxpool.Pool
	// onOutbox is called after a commit that added outbox rows (the relay's
	// wake-up). It must not block.
	onOutbox func()
}

// NewTaskStore returns a store on pool. onOutbox, when not nil, is called
// after every commit that wrote an outbox row.
func NewTaskStore(pool *pgxpool.Pool, onOutbox func()) *TaskStore {
	if onOutbox == nil {
		onOutbox = func() {}
	}
	return &TaskStore{pool: pool, onOutbox: onOutbox}
}

// Submit stores a task, its PENDING event and its task.run outbox row in one
// statement (so one transaction), or returns the existing task when the
// submission is a duplicate.
func (s *TaskStore) Submit(ctx context.Context, sub task.Submission, headers task.Carrier) (task.Submitted, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return task.Submitted{}, fmt.Errorf("new task id: %w", err)
	}
	for range 3 {
		t, err := scanTask(s.pool.QueryRow(ctx, sqlSubmit, submitArgs(id, sub, headers)...))
		if err == nil {
			s.onOutbox()
			return task.Submitted{Task: t, Created: true}, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return task.Submitted{}, translate(err)
		}
		existing, err := s.findDuplicate(ctx, s.pool, sub)
		if err == nil {
			return task.Submitted{Task: existing}, nil
		}
		if !errors.Is(err, task.ErrNotFound) {
			return task.Submitted{}, err
		}
		// The conflicting task went away between the two statements
		// (retention); insert again.
	}
	return task.Submitted{}, errors.New("submit: conflicting task kept disappearing")
}

// SubmitBatch stores many submissions in one transaction. The answer has one
// entry per submission, in order. Any error rolls back the whole batch.
func (s *TaskStore) SubmitBatch(ctx context.Context, subs []task.Submission, headers task.Carrier) ([]task.Submitted, error) {
	out := make([]task.Submitted, len(subs))
	created := false
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		batch := &pgx.Batch{}
		for _, sub := range subs {
			id, err := uuid.NewV7()
			if err != nil {
				return fmt.Errorf("new task id: %w", err)
			}
			batch.Queue(sqlSubmit, submitArgs(id, sub, headers)...)
		}
		results := tx.SendBatch(ctx, batch)
		var dups []int
		for i := range subs {
			t, err := scanTask(results.QueryRow())
			switch {
			case err == nil:
				out[i] = task.Submitted{Task: t, Created: true}
				created = true
			case errors.Is(err, pgx.ErrNoRows):
				dups = append(dups, i)
			default:
				_ = results.Close()
				return translate(err)
			}
		}
		if err := results.Close(); err != nil {
			return translate(err)
		}
		for _, i := range dups {
			t, err := s.findDuplicate(ctx, tx, subs[i])
			if err != nil {
				return err
			}
			out[i] = task.Submitted{Task: t}
		}
		return nil
	})
	if err != nil {
		return nil, translate(err)
	}
	if created {
		s.onOutbox()
	}
	return out, nil
}

func submitArgs(id uuid.UUID, sub task.Submission, headers task.Carrier) []any {
	var hash, key *string
	if sub.Dedupe {
		hash = &sub.InputHash
	}
	if sub.IdempotencyKey != "" {
		key = &sub.IdempotencyKey
	}
	return []any{id, sub.TenantID, sub.Type, sub.Priority, sub.Payload, sub.Metadata,
		hash, key, sub.MaxAttempts, nullable(sub.Traceparent), headersArg(headers)}
}

// querier is what both a pool and a transaction offer.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// findDuplicate returns the task an insert conflicted with. A task found by
// idempotency key must have the same input, or the reuse is an error.
func (s *TaskStore) findDuplicate(ctx context.Context, q querier, sub task.Submission) (task.Task, error) {
	if sub.IdempotencyKey != "" {
		t, err := scanTask(q.QueryRow(ctx, sqlTaskByIdempotencyKey, sub.TenantID, sub.Type, sub.IdempotencyKey))
		switch {
		case err == nil:
			hash, herr := task.InputHash(t.Type, t.Payload)
			if herr != nil {
				return task.Task{}, fmt.Errorf("hash stored payload of task %s: %w", t.ID, herr)
			}
			if hash != sub.InputHash {
				return task.Task{}, &task.Error{Code: task.ErrCodeIdempotencyMismatch, Field: "Idempotency-Key",
					Message: fmt.Sprintf("key already used by task %s with a different payload", t.ID)}
			}
			return t, nil
		case !errors.Is(err, pgx.ErrNoRows):
			return task.Task{}, translate(err)
		}
	}
	if sub.Dedupe {
		t, err := scanTask(q.QueryRow(ctx, sqlTaskByInputHash, sub.TenantID, sub.Type, sub.InputHash))
		if err == nil || !errors.Is(err, pgx.ErrNoRows) {
			return t, translate(err)
		}
	}
	return task.Task{}, task.ErrNotFound
}

// Get returns the task with its result once it has one.
func (s *TaskStore) Get(ctx context.Context, id uuid.UUID) (task.Task, error) {
	var result []byte
	t, err := scanTask(s.pool.QueryRow(ctx, sqlGetTask, id), &result)
	if err != nil {
		return task.Task{}, translate(err)
	}
	t.Result = result
	return t, nil
}

// List returns tasks newest first.
func (s *TaskStore) List(ctx context.Context, f task.ListFilter) ([]task.Task, error) {
	sql, args := listQuery(f)
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, translate(err)
	}
	defer rows.Close()
	var out []task.Task
	for rows.Next() {
		t, err := scanTask(rows)
		if err != nil {
			return nil, translate(err)
		}
		out = append(out, t)
	}
	return out, translate(rows.Err())
}

func listQuery(f task.ListFilter) (string, []any) {
	sql := sqlListTasks
	var args []any
	where := func(cond string, arg any) {
		args = append(args, arg)
		if len(args) == 1 {
			sql += " WHERE "
		} else {
			sql += " AND "
		}
		sql += fmt.Sprintf(cond, len(args))
	}
	if f.Status != "" {
		where("status = $%d", string(f.Status))
	}
	if f.Type != "" {
		where("type = $%d", f.Type)
	}
	if f.After != uuid.Nil {
		where("id < $%d", f.After)
	}
	args = append(args, f.Limit)
	sql += fmt.Sprintf(" ORDER BY id DESC LIMIT $%d", len(args))
	return sql, args
}

// Events returns a task's most recent events, newest first.
func (s *TaskStore) Events(ctx context.Context, id uuid.UUID, limit int) ([]task.Event, error) {
	var exists bool
	if err := s.pool.QueryRow(ctx, sqlTaskExists, id).Scan(&exists); err != nil {
		return nil, translate(err)
	}
	if !exists {
		return nil, task.ErrNotFound
	}
	rows, err := s.pool.Query(ctx, sqlTaskEvents, id, limit)
	if err != nil {
		return nil, translate(err)
	}
	events, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (task.Event, error) {
		var e task.Event
		var status, actor string
		err := row.Scan(&e.ID, &e.TaskID, &status, &e.State, &e.Progress, &e.Detail, &actor, &e.CreatedAt)
		e.Status, e.Actor = task.Status(status), task.Actor(actor)
		return e, err
	})
	return events, translate(err)
}

// Cancel cancels a PENDING task at once, or asks the worker running an
// IN_PROGRESS task to stop. A terminal task is a conflict.
func (s *TaskStore) Cancel(ctx context.Context, id uuid.UUID, headers task.Carrier) (task.Task, task.CancelOutcome, error) {
	var t task.Task
	var outcome task.CancelOutcome
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var status string
		var requested bool
		if err := tx.QueryRow(ctx, sqlLockTask, id).Scan(&status, &requested); err != nil {
			return err
		}
		var err error
		switch st := task.Status(status); {
		case st == task.StatusPending:
			outcome = task.Cancelled
			t, err = scanTask(tx.QueryRow(ctx, sqlCancelPending, id))
		case st == task.StatusInProgress && requested:
			// Asked before: answer the same, write nothing new.
			outcome = task.CancelRequested
			t, err = scanTask(tx.QueryRow(ctx, sqlTaskByID, id))
		case st == task.StatusInProgress:
			outcome = task.CancelRequested
			t, err = scanTask(tx.QueryRow(ctx, sqlRequestCancel, id, headersArg(headers)))
		default:
			return task.Errorf(task.ErrCodeConflict, "task is %s and cannot be cancelled", st)
		}
		return err
	})
	if err != nil {
		return task.Task{}, 0, translate(err)
	}
	if outcome == task.CancelRequested {
		s.onOutbox()
	}
	return t, outcome, nil
}

// Retry puts a FAILED or CANCELLED task back to PENDING with attempt 0 and
// queues it again. traceparent is the context of the retrying request.
func (s *TaskStore) Retry(ctx context.Context, id uuid.UUID, traceparent string, headers task.Carrier) (task.Task, error) {
	t, err := scanTask(s.pool.QueryRow(ctx, sqlRetry, id, nullable(traceparent), headersArg(headers)))
	if errors.Is(err, pgx.ErrNoRows) {
		var status string
		var requested bool
		if err := s.pool.QueryRow(ctx, sqlLockTask, id).Scan(&status, &requested); err != nil {
			return task.Task{}, translate(err)
		}
		return task.Task{}, task.Errorf(task.ErrCodeConflict, "task is %s; only FAILED or CANCELLED tasks can be retried", status)
	}
	if err != nil {
		return task.Task{}, translate(err)
	}
	s.onOutbox()
	return t, nil
}

// Ping checks that the database answers.
func (s *TaskStore) Ping(ctx context.Context) error { return s.pool.Ping(ctx) }

// scanTask reads the taskColumns of a row, then any extra destinations.
func scanTask(row pgx.Row, extra ...any) (task.Task, error) {
	var t task.Task
	var status string
	var payload, metadata []byte
	dest := []any{&t.ID, &t.TenantID, &t.Type, &status, &t.State, &t.Progress, &t.Priority,
		&payload, &metadata, &t.InputHash, &t.IdempotencyKey, &t.Error, &t.Attempt, &t.MaxAttempts,
		&t.Version, &t.WorkerID, &t.LeaseExpiresAt, &t.NextRunAt, &t.CancelRequestedAt, &t.Traceparent,
		&t.CreatedAt, &t.UpdatedAt, &t.StartedAt, &t.CompletedAt}
	if err := row.Scan(append(dest, extra...)...); err != nil {
		return task.Task{}, err
	}
	t.Status = task.Status(status)
	t.Payload, t.Metadata = json.RawMessage(payload), json.RawMessage(metadata)
	return t, nil
}

func nullable(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// headersArg is the outbox headers column value: never NULL.
func headersArg(h task.Carrier) map[string]string {
	if h == nil {
		return map[string]string{}
	}
	return h
}
