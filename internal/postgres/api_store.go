package postgres

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	oteltrace "go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// The API's statements: submissions, reads, and the client's transitions.

// taskResult is the result of the task of the row, once it is COMPLETED: a
// duplicate submission answers the task as its GET does.
var taskResult = `(SELECT r.payload FROM task_results r WHERE r.task_id = tasks.id AND tasks.` + isCompleted + `)`

var sqlTaskByInputHash = statement("tasks.by_input_hash", `SELECT `+taskColumns+`, `+taskResult+` FROM tasks
	WHERE id = (SELECT task_id FROM task_input_hashes WHERE org_id = $1 AND type = $2 AND input_hash = $3)
	AND org_id = $1`)

// sqlKeysLookup finds the idempotency keys a batch names, with the task each
// names; same_payload serves keys recorded before request hashes were.
var sqlKeysLookup = statement("idempotency_keys.lookup", `
SELECT t.*, k.type, k.key, coalesce(k.request_hash, ''), t.payload = u.payload::jsonb
FROM unnest($2::text[], $3::text[], $4::text[]) AS u(type, key, payload)
JOIN task_idempotency_keys k ON k.org_id = $1 AND k.type = u.type AND k.key = u.key
CROSS JOIN LATERAL (SELECT `+taskColumns+`, `+taskResult+` AS result
	FROM tasks WHERE tasks.id = k.task_id AND tasks.org_id = $1) t`)

// sqlKeysInsert binds new idempotency keys to their tasks, in key order; a
// key another transaction bound meanwhile is not returned.
var sqlKeysInsert = statement("idempotency_keys.insert", `
INSERT INTO task_idempotency_keys (org_id, type, key, task_id, request_hash)
SELECT $1, u.type, u.key, u.task_id, u.request_hash
FROM unnest($2::text[], $3::text[], $4::uuid[], $5::text[]) AS u(type, key, task_id, request_hash)
ORDER BY u.type, u.key
ON CONFLICT DO NOTHING
RETURNING type, key`)

// sqlKeysHidden finds the first of the named keys that is bound to a task
// the caller cannot see (row-level security hides the task, not the key).
var sqlKeysHidden = statement("idempotency_keys.hidden", `
SELECT u.type, u.key FROM unnest($2::text[], $3::text[]) AS u(type, key)
JOIN task_idempotency_keys k ON k.org_id = $1 AND k.type = u.type AND k.key = u.key
WHERE NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = k.task_id)
ORDER BY u.type, u.key LIMIT 1`)

var sqlGetTask = statement("tasks.get", `SELECT `+taskColumns+`, `+taskResult+`
	FROM tasks WHERE id = $1 AND org_id = $2`)

// summaryColumns are taskColumns without the client's documents: a listing
// of 500 tasks must not carry 500 payloads.
var summaryColumns = strings.Replace(taskColumns, "payload, metadata",
	"NULL::jsonb AS payload, NULL::jsonb AS metadata", 1)

// sqlTaskEvents answers no row at all when the task is not there (or not
// the caller's to see), and a row with a NULL event id when it has no
// events before $4. Its last column says whether $4 is one of the task's
// events (or no cursor at all): a task's events go only with the task.
var sqlTaskEvents = statement("task_events.list", `SELECT e.id, t.id, e.status, e.state, e.progress,
		coalesce(e.error, ''), e.detail, e.actor, e.principal, e.created_at,
		$4 = 9223372036854775807 OR EXISTS (SELECT 1 FROM task_events c WHERE c.id = $4 AND c.task_id = t.id)
	FROM tasks t LEFT JOIN LATERAL (
		SELECT * FROM task_events WHERE task_id = t.id AND org_id = $3 AND id < $4
		ORDER BY id DESC LIMIT $2) e ON true
	WHERE t.id = $1 AND t.org_id = $3`)

// sqlTaskStanding reads the task's run only while the run is there:
// retention deletes a run that ended, and a task of it that ended later
// (asked to stop) may outlive it; nothing is left for such a task to move.
var sqlTaskStanding = statement("tasks.standing", `SELECT status, version, cancel_requested_at IS NOT NULL,
	(SELECT r.id FROM workflow_runs r WHERE r.id = t.run_id), coalesce(node, ''), coalesce(traceparent, '')
	FROM tasks t WHERE id = $1 AND org_id = $2`)

// standing is where a task stands, as a single-task action reads it.
type standing struct {
	status        task.Status
	cancelPending bool
	// run and node name the workflow run and node the task is of; run is
	// nil once retention has deleted the run.
	run  *uuid.UUID
	node string
	// traceparent is the task's trace before the action.
	traceparent string
}

var sqlKnownTypes = statement("task_types.list", `SELECT name FROM task_types ORDER BY name`)

var isCompleted = "status = " + lit(task.StatusCompleted)

// APIStore runs the API's statements.
type APIStore struct {
	pool *pgxpool.Pool
	// onOutbox is called after a commit that added outbox rows (the
	// relay's wake-up). It must not block.
	onOutbox func()
	// OnEvents, when set, is called after every commit that wrote task
	// events (the stream hubs' wake-up). It must not block.
	OnEvents func()
	// submit writes one submission without a key and reports whether it
	// made a new task.
	submit func(context.Context, auth.Scope, task.Submission, *task.Principal, task.Carrier) (task.Task, bool, error)
}

// Single submissions are committed in groups of at most maxSubmitGroup, by
// at most submitFlushers transactions at once.
const (
	submitFlushers = 2
	maxSubmitGroup = 100
)

// NewAPIStore returns the API's store. onOutbox, when not nil, is called
// after every commit that wrote an outbox row.
func NewAPIStore(pool *pgxpool.Pool, onOutbox func()) *APIStore {
	if onOutbox == nil {
		onOutbox = func() {}
	}
	return &APIStore{pool: pool, onOutbox: onOutbox, submit: newSubmitGroup(pool, submitFlushers, maxSubmitGroup).submit}
}

// CommitEachSubmission makes every single submission a transaction of its
// own, as a client writing tasks directly would (the benchmark's ceiling).
func (s *APIStore) CommitEachSubmission() {
	s.submit = func(ctx context.Context, sc auth.Scope, sub task.Submission, by *task.Principal,
		trace task.Carrier) (task.Task, bool, error) {
		return submitAlone(ctx, s.pool, sc, sub, by, trace)
	}
}

// Submit stores a task of the principal's org, its PENDING event and its
// task.run message, or returns the task the submission duplicates. trace is
// the W3C context of the request: it becomes the task's trace and travels
// with its message.
func (s *APIStore) Submit(ctx context.Context, p auth.Principal, sub task.Submission, trace task.Carrier) (task.Submitted, error) {
	sub.OrgID = p.OrgID
	if sub.IdempotencyKey != "" {
		out, err := s.SubmitBatch(ctx, p, []task.Submission{sub}, trace)
		if err != nil {
			// A single submission's key is its Idempotency-Key header.
			var e *task.Error
			if errors.As(err, &e) && e.Code == task.ErrCodeIdempotencyMismatch {
				err = &task.Error{Code: e.Code, Field: "Idempotency-Key", Message: e.Message}
			}
			return task.Submitted{}, err
		}
		return out[0], nil
	}
	// No key: one statement, the fast path, committed with the other
	// single submissions of the moment.
	for range 3 {
		t, created, err := s.submit(ctx, p.Scope(), sub, p.Actor(), trace)
		if err != nil {
			return task.Submitted{}, translate(err)
		}
		if created {
			s.onOutbox()
			call(s.OnEvents)
			return task.Submitted{Task: t, Created: true}, nil
		}
		var result []byte
		existing, err := scanTask(scopedRow(ctx, s.pool, p.Scope(), sqlTaskByInputHash, sub.OrgID, sub.Type, sub.InputHash), &result)
		if err == nil {
			existing.Result = result
			return task.Submitted{Task: existing}, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return task.Submitted{}, translate(err)
		}
		// The task it conflicted with went away meanwhile (retention):
		// insert again.
	}
	return task.Submitted{}, errors.New("submit: conflicting task kept disappearing")
}

// errRaced: a concurrent transaction bound an idempotency key this one was
// about to bind; the whole transaction runs again and finds that key.
var errRaced = errors.New("idempotency key bound concurrently")

// conflicted reports a transaction rolled back whole for concurrent work:
// a lost race for an idempotency key, a deadlock, a serialization failure.
// Running it again may succeed.
func conflicted(err error) bool {
	code := pgCode(err)
	return errors.Is(err, errRaced) || code == codeDeadlock || code == codeSerialization
}

// outlasted is the error of a transaction that failed at its last try:
// one that lost to concurrent work every time is worth another request,
// not an internal error (nothing was written).
func outlasted(err error) error {
	if conflicted(err) {
		return &task.Error{Code: task.ErrCodeUnavailable,
			Message: "the database rolled this back, again and again, for a conflict with concurrent work; try again"}
	}
	return translate(err)
}

// SubmitBatch stores many submissions in one transaction and answers one
// entry per submission, in order. Any error rolls back the whole batch.
//
// Rows are written in a fixed order — tasks by (type, input hash), then keys
// by (type, key) — so that two batches sharing inputs wait for each other
// instead of deadlocking; a transaction that still loses a deadlock or a
// race for a key runs again.
func (s *APIStore) SubmitBatch(ctx context.Context, p auth.Principal, subs []task.Submission, trace task.Carrier) ([]task.Submitted, error) {
	subs = slices.Clone(subs)
	for i := range subs {
		subs[i].OrgID = p.OrgID
	}
	var out []task.Submitted
	var created bool
	var err error
	for range 5 {
		err = inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
			out, created, err = submitAll(ctx, tx, p.Actor(), subs, trace)
			return err
		})
		if !conflicted(err) {
			break
		}
	}
	if err != nil {
		return nil, outlasted(err)
	}
	if created {
		s.onOutbox()
		call(s.OnEvents)
	}
	return out, nil
}

// keyOf names an idempotency key within an org.
type keyOf struct{ typ, key string }

func submitAll(ctx context.Context, tx pgx.Tx, by *task.Principal, subs []task.Submission, trace task.Carrier) ([]task.Submitted, bool, error) {
	out := make([]task.Submitted, len(subs))
	done := make([]bool, len(subs))
	org := subs[0].OrgID

	// Keys first: a key already bound answers with its task, or refuses a
	// different request. Within the batch, the first use of a key binds it.
	first := map[keyOf]int{}
	var lookup []keyOf
	var payloads []string
	for i, sub := range subs {
		if sub.OrgID != org {
			return nil, false, errors.New("submit: a batch spans orgs")
		}
		if sub.IdempotencyKey == "" {
			continue
		}
		k := keyOf{sub.Type, sub.IdempotencyKey}
		if _, seen := first[k]; !seen {
			first[k] = i
			lookup = append(lookup, k)
			payloads = append(payloads, string(sub.Payload))
		}
	}
	bound := map[keyOf]task.Task{}
	if len(lookup) > 0 {
		types, keys := make([]string, len(lookup)), make([]string, len(lookup))
		for i, k := range lookup {
			types[i], keys[i] = k.typ, k.key
		}
		rows, err := tx.Query(ctx, sqlKeysLookup, org, types, keys, payloads)
		if err != nil {
			return nil, false, err
		}
		for rows.Next() {
			var k keyOf
			var requestHash string
			var samePayload bool
			var result []byte
			dest, err := scanTask(rows, &result, &k.typ, &k.key, &requestHash, &samePayload)
			if err != nil {
				rows.Close()
				return nil, false, err
			}
			sub := subs[first[k]]
			same := requestHash == sub.RequestHash || requestHash == sub.DefaultedRequestHash ||
				(requestHash == "" && samePayload)
			if !same {
				rows.Close()
				return nil, false, keyMismatch(first[k], dest.ID)
			}
			dest.Result = result
			bound[k] = dest
		}
		if err := rows.Err(); err != nil {
			return nil, false, err
		}
	}
	for i, sub := range subs {
		if sub.IdempotencyKey == "" {
			continue
		}
		k := keyOf{sub.Type, sub.IdempotencyKey}
		if j := first[k]; j != i && subs[j].RequestHash != sub.RequestHash {
			return nil, false, keyMismatch(i, uuid.Nil)
		}
		if t, ok := bound[k]; ok {
			out[i], done[i] = task.Submitted{Task: t}, true
		}
	}

	// Then the tasks, in (type, input hash) order; a later use of a key
	// within the batch takes the task of its first use.
	order := make([]int, 0, len(subs))
	for i, sub := range subs {
		if !done[i] && (sub.IdempotencyKey == "" || first[keyOf{sub.Type, sub.IdempotencyKey}] == i) {
			order = append(order, i)
		}
	}
	sort.SliceStable(order, func(a, b int) bool {
		x, y := subs[order[a]], subs[order[b]]
		if x.Type != y.Type {
			return x.Type < y.Type
		}
		return x.InputHash < y.InputHash
	})
	var rows submitRows
	for _, i := range order {
		if err := rows.add(subs[i], by, trace); err != nil {
			return nil, false, err
		}
	}
	var made map[uuid.UUID]task.Task
	if len(order) > 0 {
		r, err := tx.Query(ctx, sqlSubmit, rows.args()...)
		if err != nil {
			return nil, false, err
		}
		if made, err = collectSubmitted(r); err != nil {
			return nil, false, err
		}
	}
	created := false
	var dups []int
	for k, i := range order {
		if t, ok := made[rows.ids[k]]; ok {
			out[i], done[i], created = task.Submitted{Task: t, Created: true}, true, true
		} else {
			dups = append(dups, i)
		}
	}
	for _, i := range dups {
		sub := subs[i]
		var result []byte
		t, err := scanTask(tx.QueryRow(ctx, sqlTaskByInputHash, sub.OrgID, sub.Type, sub.InputHash), &result)
		if err != nil {
			// Without dedupe nothing conflicts; a conflict whose task is
			// gone was removed by retention meanwhile: run again.
			if errors.Is(err, pgx.ErrNoRows) {
				return nil, false, errRaced
			}
			return nil, false, err
		}
		t.Result = result
		out[i], done[i] = task.Submitted{Task: t}, true
	}

	// Bind the new keys, and answer the later uses of each key.
	var types, keys, requestHashes []string
	var taskIDs []uuid.UUID
	for _, k := range lookup {
		if _, ok := bound[k]; ok {
			continue
		}
		i := first[k]
		types, keys = append(types, k.typ), append(keys, k.key)
		taskIDs, requestHashes = append(taskIDs, out[i].Task.ID), append(requestHashes, subs[i].RequestHash)
	}
	if len(keys) > 0 {
		rows, err := tx.Query(ctx, sqlKeysInsert, org, types, keys, taskIDs, requestHashes)
		if err != nil {
			return nil, false, err
		}
		n := 0
		for rows.Next() {
			n++
		}
		if err := rows.Err(); err != nil {
			if keyLostItsTask(err) {
				// Retention deleted a task found by its input after it
				// was found: run again, and make it anew.
				return nil, false, errRaced
			}
			return nil, false, err
		}
		if n != len(keys) {
			// Either another transaction bound a key meanwhile (run
			// again, and find it), or a key is bound to a task this caller
			// may not see: then it was used with another request (one
			// restricted to roles the caller lacks), and which task it
			// names stays unsaid.
			var hidden keyOf
			err := tx.QueryRow(ctx, sqlKeysHidden, org, types, keys).Scan(&hidden.typ, &hidden.key)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil, false, errRaced
			}
			if err != nil {
				return nil, false, err
			}
			return nil, false, keyMismatch(first[hidden], uuid.Nil)
		}
	}
	for i, sub := range subs {
		if !done[i] {
			out[i] = task.Submitted{Task: out[first[keyOf{sub.Type, sub.IdempotencyKey}]].Task}
		}
	}
	return out, created, nil
}

// keyLostItsTask reports a key whose binding found its task deleted.
func keyLostItsTask(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == codeForeignKeyViolation &&
		pgErr.ConstraintName == "task_idempotency_keys_task_id_fkey"
}

// keyMismatch refuses the key of the i-th submission of a batch (Submit
// names the header instead).
func keyMismatch(i int, existing uuid.UUID) error {
	msg := "key already used with a different request"
	if existing != uuid.Nil {
		msg = fmt.Sprintf("key already used by task %s with a different request", existing)
	}
	return &task.Error{Code: task.ErrCodeIdempotencyMismatch, Field: fmt.Sprintf("tasks[%d].idempotency_key", i),
		Message: msg}
}

// Get returns the task with its result once it has one: a task of the
// principal's org it may see, or task.ErrNotFound.
func (s *APIStore) Get(ctx context.Context, p auth.Principal, id uuid.UUID) (task.Task, error) {
	return get(ctx, scopedRow, s.pool, p.Scope(), id)
}

func get[Q any](ctx context.Context, row func(context.Context, Q, auth.Scope, string, ...any) pgx.Row,
	q Q, sc auth.Scope, id uuid.UUID) (task.Task, error) {
	var result []byte
	t, err := scanTask(row(ctx, q, sc, sqlGetTask, id, sc.OrgID), &result)
	if err != nil {
		return task.Task{}, translate(err)
	}
	t.Result = result
	return t, nil
}

// List returns task summaries (no payload, metadata or result), newest
// first.
func (s *APIStore) List(ctx context.Context, p auth.Principal, f task.ListFilter) ([]task.Task, error) {
	sql, args := listSQL(p.OrgID, f)
	tasks, err := scopedRows(ctx, s.pool, p.Scope(), func(row pgx.CollectableRow) (task.Task, error) { return scanTask(row) },
		sql, args...)
	return tasks, translate(err)
}

// Events returns a task's most recent events before the event id before
// (0: from its newest), newest first, at most limit.
func (s *APIStore) Events(ctx context.Context, p auth.Principal, id uuid.UUID, limit int, before int64) ([]task.Event, error) {
	if before <= 0 {
		before = math.MaxInt64
	}
	cursorOK := true
	events, err := scopedRows(ctx, s.pool, p.Scope(), func(row pgx.CollectableRow) (task.Event, error) {
		var e task.Event
		var eventID *int64
		var status, actor *string
		var state *string
		var progress *int
		var errText *string
		var createdAt *time.Time
		var ok bool
		err := row.Scan(&eventID, &e.TaskID, &status, &state, &progress, &errText, &e.Detail, &actor, &e.By, &createdAt, &ok)
		cursorOK = cursorOK && ok
		if eventID != nil {
			e.ID, e.Status, e.State, e.Progress, e.Actor = *eventID, task.Status(*status), *state, *progress, task.Actor(*actor)
			e.Error, e.CreatedAt = *errText, *createdAt
		}
		return e, err
	}, sqlTaskEvents, id, limit, p.OrgID, before)
	if err != nil {
		return nil, translate(err)
	}
	if len(events) == 0 {
		return nil, task.ErrNotFound
	}
	if !cursorOK {
		// Another task's cursor would cut this task's history at a place
		// in that one's, and the page look like the whole of it.
		return nil, task.Invalid("cursor", "is not a cursor of this task's events")
	}
	if events[0].ID == 0 {
		return []task.Event{}, nil
	}
	return events, nil
}

// Cancel cancels a PENDING task at once, or asks the worker running an
// IN_PROGRESS task to stop (task.OnCancel decides). A terminal task is a
// conflict.
func (s *APIStore) Cancel(ctx context.Context, p auth.Principal, id uuid.UUID, trace task.Carrier) (task.Task, task.CancelOutcome, error) {
	var outcome task.CancelOutcome
	t, err := s.transition(ctx, p, id, trace, func(st standing) (task.Transition, error) {
		tr, o, err := task.OnCancel(st.status, st.cancelPending)
		outcome = o
		return tr, err
	})
	return t, outcome, err
}

// Retry puts a FAILED or CANCELLED task back to PENDING with attempt 0 and
// queues it again, under the retrying request's trace. A task of a
// workflow run is retried with its run: its run has already skipped the
// nodes below it, and would not release them when it completed. Once
// retention has deleted the run, the task is retried on its own.
//
// The task's trace becomes the request's, as a retry after a failure starts
// a new trace: the request's span links to the trace it replaces, where the
// failed attempts are, which the task no longer names.
func (s *APIStore) Retry(ctx context.Context, p auth.Principal, id uuid.UUID, trace task.Carrier) (task.Task, error) {
	var previous string
	t, err := s.transition(ctx, p, id, trace, func(st standing) (task.Transition, error) {
		tr, err := task.OnRetry(st.status)
		if err == nil && st.run != nil {
			return "", task.Errorf(task.ErrCodeConflict, "the task is node %s of workflow run %s: retry the run "+
				"(POST /v1/runs/%s/retry), which runs its failed, cancelled and skipped nodes again", st.node, st.run, st.run)
		}
		previous = st.traceparent
		return tr, err
	})
	if err == nil {
		linkTrace(ctx, previous, "previous attempt")
	}
	return t, err
}

// linkTrace links ctx's span, when it records, to the trace of traceparent.
func linkTrace(ctx context.Context, traceparent, why string) {
	linkTraces(ctx, []string{traceparent}, why)
}

// linkTraces links ctx's span, when it records, to each trace of
// traceparents once (the tracer's link limit, 128 by default, bounds
// them).
func linkTraces(ctx context.Context, traceparents []string, why string) {
	span := oteltrace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	seen := map[oteltrace.TraceID]bool{span.SpanContext().TraceID(): true}
	for _, tp := range traceparents {
		sc := oteltrace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(),
			propagation.MapCarrier{"traceparent": tp}))
		if !sc.IsValid() || seen[sc.TraceID()] {
			continue
		}
		seen[sc.TraceID()] = true
		span.AddLink(oteltrace.Link{SpanContext: sc, Attributes: []attribute.KeyValue{attribute.String("conveyor.link", why)}})
	}
}

// transition reads where a task stands, lets decide pick the transition,
// and applies it at the version read, in one transaction of the caller's
// scope; if another writer moved the task meanwhile, it reads again. An
// empty transition changes nothing.
func (s *APIStore) transition(ctx context.Context, p auth.Principal, id uuid.UUID, trace task.Carrier,
	decide func(standing) (task.Transition, error)) (task.Task, error) {
	for range 20 {
		var t task.Task
		var fenced, queued bool
		attempt := func(tx pgx.Tx) error {
			fenced, queued = false, false
			var st standing
			var status string
			var version int
			if err := tx.QueryRow(ctx, sqlTaskStanding, id, p.OrgID).Scan(&status, &version, &st.cancelPending,
				&st.run, &st.node, &st.traceparent); err != nil {
				return translate(err)
			}
			st.status = task.Status(status)
			tr, err := decide(st)
			if err != nil {
				return err
			}
			if tr != "" {
				change := task.Change{TaskID: id, Version: version, Transition: tr, Trace: trace, By: p.Actor()}
				applied, errs, q, err := apply(ctx, tx, []task.Change{change})
				if err == nil {
					err = errs[0]
				}
				if err != nil {
					return err
				}
				if fenced, queued = applied[0].Fenced, q; fenced {
					return nil
				}
			}
			t, err = get(ctx, txRow, tx, p.Scope(), id)
			return err
		}
		// A task of a workflow run locks its run as it settles (migration
		// 007), after the task; a worker's batch that settled a sibling
		// holds the run, then claims this task. PostgreSQL breaks that
		// deadlock by rolling one back whole; this one then runs again.
		err := retryDeadlocks(func() error { return inScope(ctx, s.pool, p.Scope(), attempt) })
		if err != nil {
			return task.Task{}, translate(err)
		}
		if fenced {
			continue
		}
		if queued {
			s.onOutbox()
		}
		call(s.OnEvents)
		return t, nil
	}
	return task.Task{}, task.Errorf(task.ErrCodeUnavailable, "task %s keeps changing; try again", id)
}

// txRow runs a statement in a transaction whose scope is already set.
func txRow(ctx context.Context, tx pgx.Tx, _ auth.Scope, sql string, args ...any) pgx.Row {
	return tx.QueryRow(ctx, sql, args...)
}

// sqlAdmitTypes counts the task types the org has waiting that no worker
// serves — those it submitted before (with a PENDING task still) and the
// unserved ones of this request — and records the request's unserved types
// when the count is within $3. It returns the count, and whether the
// request adds a type to those waiting.
//
// A submission that an existing task answers (its idempotency key is
// bound, or deduplication finds its input, $4 and $5) makes no task and
// takes no place: a client's retry of one that made its task gets that
// task back whatever the org's count.
//
// A type's PENDING tasks are looked up by type and org, the admitted ones
// in tasks_admitted and the others in tasks_waiting, each in an arm of its
// own: no index holds every PENDING task by type, and a search of them all
// read the org's whole backlog for each type the org ever left unserved.
var sqlAdmitTypes = statement("org_task_types.admit", `
WITH req AS (
	SELECT DISTINCT u.type FROM unnest($2::text[], $4::text[], $5::text[]) AS u(type, key, input_hash)
	WHERE NOT EXISTS (SELECT 1 FROM task_types k WHERE k.name = u.type)
		AND NOT EXISTS (SELECT 1 FROM task_idempotency_keys i WHERE i.org_id = $1 AND i.type = u.type AND i.key = u.key)
		AND NOT EXISTS (SELECT 1 FROM task_input_hashes h WHERE h.org_id = $1 AND h.type = u.type AND h.input_hash = u.input_hash)
), waiting AS (
	SELECT o.type FROM org_task_types o
	WHERE o.org_id = $1 AND NOT EXISTS (SELECT 1 FROM task_types k WHERE k.name = o.type)
		AND EXISTS (SELECT 1 FROM tasks t WHERE t.type = o.type AND t.org_id = $1 AND t.`+isPending+` AND t.admitted
			UNION ALL
			SELECT 1 FROM tasks t WHERE t.type = o.type AND t.org_id = $1 AND t.`+isPending+` AND NOT t.admitted)
), total AS (
	SELECT count(*) AS n, count(*) FILTER (WHERE type NOT IN (SELECT type FROM waiting)) AS added
	FROM (SELECT type FROM waiting UNION SELECT type FROM req) x
), ins AS (
	INSERT INTO org_task_types (org_id, type)
	SELECT $1, type FROM req WHERE (SELECT n FROM total) <= $3
	ON CONFLICT DO NOTHING
)
SELECT n, added > 0 FROM total`)

// AdmitTypes refuses submissions that would leave the principal's org
// with more than max task types that no worker serves waiting at once
// (typos, or a client that makes types up): their tasks wait in
// PostgreSQL, parked, until a worker for the type starts, and that wait
// must stay bounded. Only a submission that would make a task of a type
// not already waiting is refused: one an existing task answers, or of a
// type waiting already, is not, even when the org is over the bound (it
// was lowered). Concurrent submissions may overshoot max by a few.
func (s *APIStore) AdmitTypes(ctx context.Context, p auth.Principal, subs []task.Submission, max int) error {
	types := make([]string, len(subs))
	keys := make([]*string, len(subs))
	hashes := make([]*string, len(subs))
	for i, sub := range subs {
		types[i] = sub.Type
		if sub.IdempotencyKey != "" {
			keys[i] = &sub.IdempotencyKey
		}
		if sub.Dedupe {
			hashes[i] = &sub.InputHash
		}
	}
	var n int
	var added bool
	// The count covers the org's tasks whatever their visibility.
	if err := scopedRow(ctx, s.pool, orgWide(p), sqlAdmitTypes, p.OrgID, types, max, keys, hashes).Scan(&n, &added); err != nil {
		return translate(err)
	}
	if added && n > max {
		return task.Invalid("type", "the org would have %d task types that no worker serves waiting, over the limit of %d: "+
			"start workers for them, or cancel their tasks", n, max)
	}
	return nil
}

// KnownTypes lists the task types some worker has declared a queue for.
func (s *APIStore) KnownTypes(ctx context.Context) ([]string, error) {
	rows, err := s.pool.Query(ctx, sqlKnownTypes)
	if err != nil {
		return nil, translate(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	return names, translate(err)
}

// Ping checks that the database answers.
func (s *APIStore) Ping(ctx context.Context) error { return s.pool.Ping(ctx) }

// headersArg is an outbox headers value: never NULL.
func headersArg(h task.Carrier) []byte {
	if h == nil {
		return []byte("{}")
	}
	b, _ := json.Marshal(h) // a map of strings always encodes
	return b
}
