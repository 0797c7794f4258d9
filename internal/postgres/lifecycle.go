package postgres

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"text/template"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/task"
)

// taskColumns are the columns scanTask reads, in its order, named so that a
// CTE returning them can feed enqueue.
const taskColumns = `id, org_id, visibility, type, status, state, progress, priority, payload, metadata,
	coalesce(input_hash, '') AS input_hash, coalesce(idempotency_key, '') AS idempotency_key,
	coalesce(error, '') AS error, attempt, max_attempts, version, coalesce(worker_id, '') AS worker_id,
	lease_expires_at, next_run_at, cancel_requested_at, coalesce(traceparent, '') AS traceparent,
	published_at, created_at, updated_at, started_at, completed_at, job_id, scheduled_at, concurrency_key,
	admitted, coalesce(timeout_ms, 0) AS timeout_ms, coalesce(heartbeat_timeout_ms, 0) AS heartbeat_timeout_ms,
	run_id, coalesce(node, '') AS node, inputs, parent_id, coalesce(child_key, '') AS child_key`

// scanTask reads the taskColumns of a row, then any extra destinations.
func scanTask(row pgx.Row, extra ...any) (task.Task, error) {
	var t task.Task
	var v scanned
	dest := []any{&t.ID, &t.OrgID, &t.Visibility, &t.Type, &v.status, &t.State, &t.Progress, &t.Priority,
		&v.payload, &v.metadata, &t.InputHash, &t.IdempotencyKey, &t.Error, &t.Attempt, &t.MaxAttempts,
		&t.Version, &t.WorkerID, &t.LeaseExpiresAt, &t.NextRunAt, &t.CancelRequestedAt, &t.Traceparent,
		&t.PublishedAt, &t.CreatedAt, &t.UpdatedAt, &t.StartedAt, &t.CompletedAt, &t.JobID, &t.ScheduledAt,
		&t.ConcurrencyKey, &t.Admitted, &v.timeout, &v.heartbeatTimeout, &t.RunID, &t.Node, &v.inputs, &t.ParentID, &t.ChildKey}
	if err := row.Scan(append(dest, extra...)...); err != nil {
		return task.Task{}, err
	}
	v.fill(&t)
	return t, nil
}

// scanned holds the columns of a task that are read in another form than
// the task keeps them.
type scanned struct {
	status                    string
	payload, metadata, inputs []byte
	timeout, heartbeatTimeout int64
}

func (v scanned) fill(t *task.Task) {
	t.Status = task.Status(v.status)
	t.Timeout, t.HeartbeatTimeout = time.Duration(v.timeout)*time.Millisecond, time.Duration(v.heartbeatTimeout)*time.Millisecond
	t.Payload, t.Metadata, t.Inputs = v.payload, v.metadata, v.inputs
}

// enqueue is the one fragment that writes outbox messages: a message for
// every row of the CTE src whose column message names a kind, carrying the
// task's identity at its new version, and the row's trace headers or, when
// it has none, the task's own trace. src has the columns id, type, attempt,
// version, priority, next_run_at, traceparent, message and headers. A
// task.run message becomes available when the task is due. src has org_id
// too.
func enqueue(src string) string {
	return `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, priority, headers, available_at)
	SELECT m.message, m.org_id, m.id, m.type, m.attempt, m.version, m.priority,
		coalesce(m.headers, CASE WHEN nullif(m.traceparent, '') IS NULL THEN '{}'::jsonb
			ELSE jsonb_build_object('traceparent', m.traceparent) END),
		CASE WHEN m.message = '` + string(outbox.KindRun) + `' THEN greatest(m.next_run_at, now()) ELSE now() END
	FROM ` + src + ` m WHERE m.message IS NOT NULL`
}

// The statements that apply changes. Each applies a batch in one statement:
// a change lands only while its task is still at the version the caller
// saw (and in one of the rule's From statuses, and with a cancel pending
// when the rule needs one), bumps the version, and writes the result, the
// event and the outbox message the rule asks for; the statement returns
// the changes that landed with their new versions.
//
// Both are applyTemplate, filled from task.Lifecycle, the one place that
// defines the rules:
//
//   - applyStatements, one per transition ("tasks.apply.complete", …), has
//     its rule written in as constants. PostgreSQL folds a CASE on a
//     constant when it plans the statement, so each plan holds its own
//     rule's effects and nothing else. A batch whose changes share one
//     transition, as most do, runs it.
//   - sqlApplyMixed ("tasks.apply") carries the whole table as a VALUES
//     list that each change joins by its transition, and applies a batch
//     that mixes transitions, still in one statement: in id order, so that
//     two batches that share tasks queue up instead of deadlocking.
var (
	applyStatements = func() map[task.Transition]string {
		m := make(map[task.Transition]string, len(task.Transitions()))
		for _, tr := range task.Transitions() {
			m[tr] = statement("tasks.apply."+string(tr), fill(applyTemplate, ruleConstants(task.Lifecycle[tr])))
		}
		return m
	}()
	sqlApplyMixed = statement("tasks.apply", fill(applyTemplate, ruleColumns()))
)

// fill executes t with values.
func fill(t *template.Template, values map[string]string) string {
	var b strings.Builder
	if err := t.Execute(&b, values); err != nil {
		panic(fmt.Sprintf("%s: %v", t.Name(), err))
	}
	return b.String()
}

// sqlText is s as a SQL text literal, or NULL when empty.
func sqlText(s string) string {
	if s == "" {
		return "NULL::text"
	}
	return "'" + strings.ReplaceAll(s, "'", "''") + "'::text"
}

// fromStatuses is a rule's From as a SQL array literal.
func fromStatuses(r task.Rule) string {
	from := make([]string, len(r.From))
	for i, s := range r.From {
		from[i] = string(s)
	}
	return "'{" + strings.Join(from, ",") + "}'::text[]"
}

// effectNames name the effects in the apply statements.
var effectNames = map[task.Effect]string{task.Keep: "keep", task.Set: "set", task.Clear: "clear",
	task.Fill: "fill", task.GiveBack: "give-back", task.Stamp: "stamp"}

// mustWait asks the scheduler whether the task of the change c must wait:
// a task sent back to its queue does when its job or type is limited or
// paused, or its type in fair mode.
const mustWait = `(SELECT conveyor_must_wait(w.org_id, w.type, w.job_id, w.concurrency_key) FROM tasks w WHERE w.id = c.task_id)`

// ruleConstants is a rule as the constants applyTemplate takes. A task put
// on hold waits for its children; one sent back to its queue may wait for
// the scheduler; no other waits.
func ruleConstants(r task.Rule) map[string]string {
	wait := "false"
	switch {
	case r.Hold:
		wait = "true"
	case r.Message == outbox.KindRun:
		wait = mustWait
	}
	materialized := ""
	if wait == mustWait {
		// The scheduler is asked once per change, before the tasks are
		// joined.
		materialized = "MATERIALIZED "
	}
	b := strconv.FormatBool
	return map[string]string{
		"rules": "", "join": "", "wait": wait, "materialized": materialized,
		"from": fromStatuses(r), "to": sqlText(string(r.To)), "state": sqlText(r.State),
		"actor": sqlText(string(r.Actor)), "message": sqlText(string(r.Message)),
		"attempt": sqlText(effectNames[r.Attempt]), "progress": sqlText(effectNames[r.Progress]),
		"error": sqlText(effectNames[r.Error]), "cancel": sqlText(effectNames[r.Cancel]),
		"event": b(r.Event), "delay": b(r.Delay), "lease": b(r.Lease), "needsCancel": b(r.NeedsCancel),
		"newTrace": b(r.NewTrace), "result": b(r.Result), "beat": b(r.Beat),
	}
}

// ruleColumns is what applyTemplate takes to read every change's rule from
// the table of all of them, joined by transition.
func ruleColumns() map[string]string {
	var rows []string
	for _, tr := range task.Transitions() {
		r := task.Lifecycle[tr]
		rows = append(rows, fmt.Sprintf("(%s, %s, %s, %s, %s, %t, %s, %s, %s, %s, %s, %t, %t, %t, %t, %t, %t, %t)",
			sqlText(string(tr)), fromStatuses(r), sqlText(string(r.To)), sqlText(r.State), sqlText(string(r.Actor)),
			r.Event, sqlText(string(r.Message)), sqlText(effectNames[r.Attempt]), sqlText(effectNames[r.Progress]),
			sqlText(effectNames[r.Error]), sqlText(effectNames[r.Cancel]), r.Delay, r.Lease, r.NeedsCancel,
			r.NewTrace, r.Result, r.Beat, r.Hold))
	}
	return map[string]string{
		"rules": `rule (transition, from_statuses, to_status, state, actor, event, message, attempt_effect,
		progress_effect, error_effect, cancel_effect, delay, lease, needs_cancel, new_trace, stores_result, beat, hold) AS (
	VALUES
		` + strings.Join(rows, ",\n\t\t") + `
), `,
		"join": " JOIN rule USING (transition)",
		"wait": "CASE WHEN hold THEN true WHEN message = '" + string(outbox.KindRun) + "' THEN " + mustWait + " ELSE false END",
		// Each change meets its rule once, here: inlined, a generic plan
		// joined the rules last and scanned all of them again for every
		// task, a third of the statement's time.
		"materialized": "MATERIALIZED ",
		"from":         "c.from_statuses", "to": "c.to_status", "state": "c.state", "actor": "c.actor",
		"event": "c.event", "message": "c.message", "attempt": "c.attempt_effect", "progress": "c.progress_effect",
		"error": "c.error_effect", "cancel": "c.cancel_effect", "delay": "c.delay", "lease": "c.lease",
		"needsCancel": "c.needs_cancel", "newTrace": "c.new_trace", "result": "c.stores_result", "beat": "c.beat",
	}
}

// applyTemplate is the statement that applies changes, its rule in
// {{.name}}: constants for one transition, or columns of the rule each
// change joined ({{.rules}} and {{.join}}).
var applyTemplate = template.Must(template.New("tasks.apply").Option("missingkey=error").Parse(`
WITH {{.rules}}change AS {{.materialized}}(
	SELECT *, {{.wait}} AS wait
	FROM unnest($1::uuid[], $2::int[], $3::text[], $4::int[], $5::text[], $6::text[], $7::text[],
		$8::bigint[], $9::bigint[], $10::text[], $11::text[], $12::text[])
		AS c(task_id, version, transition, progress_in, state_in, error_in, result_in, delay_ms, lease_ms,
			detail, headers, principal){{.join}}
), upd AS (
	UPDATE tasks t SET
		status = {{.to}},
		state = CASE WHEN c.wait AND {{.state}} = '` + task.StateQueued + `' THEN '` + task.StateWaiting + `'
			ELSE coalesce({{.state}}, nullif(c.state_in, ''), t.state) END,
		admitted = CASE WHEN {{.message}} = '` + string(outbox.KindRun) + `' THEN NOT c.wait ELSE t.admitted END,
		heartbeat_at = CASE WHEN {{.beat}} THEN now() WHEN {{.to}} <> ` + lit(task.StatusInProgress) + ` THEN NULL
			ELSE t.heartbeat_at END,
		progress = CASE {{.progress}} WHEN 'set' THEN greatest(t.progress, c.progress_in)
			WHEN 'fill' THEN 100 WHEN 'clear' THEN 0 ELSE t.progress END,
		attempt = CASE {{.attempt}} WHEN 'clear' THEN 0 WHEN 'give-back' THEN t.attempt - 1 ELSE t.attempt END,
		error = CASE {{.error}} WHEN 'set' THEN c.error_in WHEN 'clear' THEN NULL ELSE t.error END,
		cancel_requested_at = CASE {{.cancel}} WHEN 'stamp' THEN now() WHEN 'clear' THEN NULL
			ELSE t.cancel_requested_at END,
		next_run_at = CASE WHEN {{.delay}} THEN now() + c.delay_ms * interval '1 millisecond' ELSE t.next_run_at END,
		lease_expires_at = CASE WHEN {{.to}} <> ` + lit(task.StatusInProgress) + ` THEN NULL
			WHEN {{.lease}} THEN now() + c.lease_ms * interval '1 millisecond' ELSE t.lease_expires_at END,
		worker_id = CASE WHEN {{.to}} = ` + lit(task.StatusPending) + ` THEN NULL ELSE t.worker_id END,
		started_at = CASE WHEN {{.attempt}} = 'clear' THEN NULL ELSE t.started_at END,
		completed_at = CASE WHEN {{.to}} IN (` + litList(task.TerminalStatuses()) + `) THEN now() END,
		traceparent = CASE WHEN {{.newTrace}} AND c.headers::jsonb ? 'traceparent'
			THEN c.headers::jsonb->>'traceparent' ELSE t.traceparent END,
		updated_at = now(),
		version = t.version + 1
	FROM change c
	WHERE t.id = c.task_id AND t.version = c.version AND t.status = ANY ({{.from}})
		AND (NOT {{.needsCancel}} OR t.cancel_requested_at IS NOT NULL)
	RETURNING t.id, t.org_id, t.type, t.status, t.state, t.progress, t.priority, t.attempt, t.version, t.next_run_at,
		t.traceparent, {{.actor}} AS actor, {{.event}} AS event, c.detail::jsonb AS detail,
		CASE WHEN c.wait THEN NULL ELSE {{.message}} END AS message, c.headers::jsonb AS headers,
		{{.result}} AS stores_result, c.result_in, c.principal::jsonb AS principal,
		CASE {{.error}} WHEN 'set' THEN c.error_in END AS error
), result AS (
	INSERT INTO task_results (task_id, org_id, payload)
	SELECT id, org_id, result_in::jsonb FROM upd WHERE stores_result
	ON CONFLICT (task_id) DO UPDATE SET payload = excluded.payload, created_at = now()
), event AS (
	INSERT INTO task_events (task_id, org_id, status, state, progress, actor, detail, principal, error)
	SELECT id, org_id, status, state, progress, actor, detail, principal, error FROM upd WHERE event
), message AS (
	` + enqueue("upd") + `
)
SELECT id, version, message IS NOT NULL FROM upd`))

// errDuplicateChange: one batch named a task twice, which a single UPDATE
// cannot apply in order.
var errDuplicateChange = errors.New("apply: a batch holds two changes of one task")

// apply applies changes on q and returns one Applied per change,
// in order, and whether any outbox message was written. A batch that
// PostgreSQL refuses for its data (a value it cannot store) is applied
// change by change, so one bad change fails alone with its own error, in
// errs; err is a failure of the whole call.
func apply(ctx context.Context, q querier, changes []task.Change) (out []task.Applied, errs []error, queued bool, err error) {
	out, queued, err = applyBatch(ctx, q, changes)
	if err == nil || !isDataError(err) || len(changes) == 1 {
		if err != nil && len(changes) == 1 && isDataError(err) {
			return make([]task.Applied, 1), []error{translate(err)}, false, nil
		}
		return out, make([]error, len(changes)), queued, translate(err)
	}
	out, errs = make([]task.Applied, len(changes)), make([]error, len(changes))
	for i, c := range changes {
		one, q1, err := applyBatch(ctx, q, []task.Change{c})
		switch {
		case isDataError(err):
			errs[i] = translate(err)
		case err != nil:
			return nil, nil, queued, translate(err)
		default:
			out[i], queued = one[0], queued || q1
		}
	}
	return out, errs, queued, nil
}

func applyBatch(ctx context.Context, q querier, changes []task.Change) ([]task.Applied, bool, error) {
	if len(changes) == 0 {
		return nil, false, nil
	}
	a, err := newApplyQuery(changes)
	if err != nil {
		return nil, false, err
	}
	rows, err := q.Query(ctx, a.sql, a.args...)
	if err != nil {
		return nil, false, err
	}
	return a.read(rows)
}

// applyQuery is a batch of changes as one statement: the one of their
// transition when they share one, else the one that mixes them, with the
// changes in id order (two batches that share tasks then queue up instead
// of deadlocking).
type applyQuery struct {
	sql  string
	args []any
	// at is where each task's change sits in the caller's batch.
	at map[uuid.UUID]int
}

func newApplyQuery(changes []task.Change) (applyQuery, error) {
	at := make(map[uuid.UUID]int, len(changes))
	sql := applyStatements[changes[0].Transition]
	for i, c := range changes {
		if _, err := c.Rule(); err != nil {
			return applyQuery{}, err
		}
		if _, dup := at[c.TaskID]; dup {
			return applyQuery{}, errDuplicateChange
		}
		at[c.TaskID] = i
		if c.Transition != changes[0].Transition {
			sql = sqlApplyMixed
		}
	}
	sorted := slices.Clone(changes)
	slices.SortFunc(sorted, func(a, b task.Change) int { return bytes.Compare(a.TaskID[:], b.TaskID[:]) })
	args, err := applyArgs(sorted)
	if err != nil {
		return applyQuery{}, err
	}
	return applyQuery{sql: sql, args: args, at: at}, nil
}

// read reads the changes that landed from the statement's rows: one
// Applied per change, in the caller's order, and whether any wrote an
// outbox message.
func (a applyQuery) read(rows pgx.Rows) ([]task.Applied, bool, error) {
	out := make([]task.Applied, len(a.at))
	for i := range out {
		out[i].Fenced = true
	}
	queued := false
	var id uuid.UUID
	var version int
	var message bool
	_, err := pgx.ForEachRow(rows, []any{&id, &version, &message}, func() error {
		out[a.at[id]] = task.Applied{Version: version}
		queued = queued || message
		return nil
	})
	if err != nil {
		return nil, false, err
	}
	return out, queued, nil
}

// applyArgs is the parameters of the apply statements for changes, one
// array a column.
func applyArgs(changes []task.Change) ([]any, error) {
	n := len(changes)
	var (
		ids         = make([]uuid.UUID, n)
		versions    = make([]int, n)
		transitions = make([]string, n)
		progress    = make([]int, n)
		states      = make([]string, n)
		errTexts    = make([]*string, n)
		results     = make([]*string, n)
		delays      = make([]int64, n)
		leases      = make([]int64, n)
		details     = make([]*string, n)
		headers     = make([]*string, n)
		principals  = make([]*string, n)
	)
	for i, c := range changes {
		ids[i], versions[i], transitions[i] = c.TaskID, c.Version, string(c.Transition)
		progress[i], states[i] = c.Progress, c.State
		errTexts[i] = &changes[i].Error
		if c.Result != nil {
			s := string(c.Result)
			results[i] = &s
		}
		delays[i], leases[i] = c.Delay.Milliseconds(), c.Lease.Milliseconds()
		if c.Detail != nil {
			b, err := json.Marshal(c.Detail)
			if err != nil {
				return nil, fmt.Errorf("task %s: event detail: %w", c.TaskID, err)
			}
			s := string(b)
			details[i] = &s
		}
		if len(c.Trace) > 0 {
			b, _ := json.Marshal(c.Trace) // a map of strings always encodes
			s := string(b)
			headers[i] = &s
		}
		if c.By != nil {
			b, _ := json.Marshal(c.By) // strings and a uuid always encode
			s := string(b)
			principals[i] = &s
		}
	}
	return []any{ids, versions, transitions, progress, states, errTexts, results,
		delays, leases, details, headers, principals}, nil
}

// applyAndWake applies changes and, after the commit, wakes the relays
// when it wrote outbox messages and the stream hubs when a change that
// landed appended an event.
//
// A batch that completes tasks of several workflow runs locks their runs
// (migration 007) in the order of its tasks; two such batches can deadlock.
// PostgreSQL then rolls one back whole, and it is applied again.
func applyAndWake(ctx context.Context, q querier, changes []task.Change, onOutbox, onEvents func()) ([]task.Applied, []error, error) {
	out, errs, queued, err := apply(ctx, q, changes)
	for try := 1; try < maxDeadlockTries && pgCode(err) == codeDeadlock; try++ {
		out, errs, queued, err = apply(ctx, q, changes)
	}
	if queued {
		call(onOutbox)
	}
	if wroteEvents(changes, out, errs) {
		call(onEvents)
	}
	return out, errs, err
}

// wroteEvents reports whether a change that landed appended an event.
func wroteEvents(changes []task.Change, out []task.Applied, errs []error) bool {
	for i, c := range changes {
		if i < len(out) && i < len(errs) && errs[i] == nil && !out[i].Fenced && task.Lifecycle[c.Transition].Event {
			return true
		}
	}
	return false
}

// maxDeadlockTries bounds the tries of a batch that keeps deadlocking.
const maxDeadlockTries = 3

// call calls f, when set.
func call(f func()) {
	if f != nil {
		f()
	}
}
