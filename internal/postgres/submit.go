package postgres

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/conveyorhq/conveyor/internal/task"
)

// sqlSubmit inserts tasks, each with its first event and its outbox
// message, in one statement: every way a task is made (a submission, a
// batch, the single submissions committed together, a job's trigger or
// tick, a parent's children) goes through it. The submissions travel as an
// array a column and every table is written once for all of them, so a
// batch pays for one statement, not one a task (a statement costs
// PostgreSQL about 300 µs of CPU whatever it holds, docs/performance.md).
//
// Each row is gated on its own (its type's and its job's admission rules)
// and deduplicated by its input hash when it has one: the hash's row goes
// into task_input_hashes first and the task only with it, so the first row
// of an input wins, and a later one, or one whose input is already a
// task's, writes nothing. Rows are written in the order given, which the
// callers make (type, input hash) so that two batches sharing inputs wait
// for each other instead of deadlocking. It returns the tasks it made.
//
// A run_at in the past means now: the task is due from its submission,
// and its next_run_at says so. Kept as sent, a client's zero time
// (0001-01-01) would put the task ahead of every task waiting for
// admission (admitted by next_run_at) and make the overview's oldest wait
// two thousand years long.
var sqlSubmit = statement("tasks.submit", `
WITH u AS MATERIALIZED (
	SELECT u.*, conveyor_must_wait(u.org_id, u.type, u.job_id, u.concurrency_key) AS wait
	FROM unnest($2::uuid[], $3::text[], $4::int[], $5::text[], $6::text[], $7::text[], $8::text[], $9::int[],
		$10::text[], $11::text[], $12::text[], $13::text[], $14::timestamptz[], $15::bigint[], $16::text[],
		$17::bigint[], $18::bigint[], $19::uuid[], $20::timestamptz[], $21::uuid[], $22::text[], $1::uuid[])
		WITH ORDINALITY AS u(id, type, priority, payload, metadata, input_hash, idempotency_key, max_attempts,
			headers, actor, visibility, principal, run_at, delay_ms, concurrency_key, timeout_ms,
			heartbeat_timeout_ms, job_id, scheduled_at, parent_id, child_key, org_id, n)
), hash AS (
	INSERT INTO task_input_hashes (org_id, type, input_hash, task_id)
	SELECT org_id, type, input_hash, id FROM u WHERE input_hash IS NOT NULL ORDER BY n
	ON CONFLICT DO NOTHING
	RETURNING task_id
), ins AS (
	INSERT INTO tasks (id, org_id, type, status, state, priority, payload, metadata, input_hash,
		idempotency_key, max_attempts, traceparent, visibility, next_run_at, concurrency_key, timeout_ms,
		heartbeat_timeout_ms, job_id, scheduled_at, admitted, parent_id, child_key)
	SELECT u.id, u.org_id, u.type, $23, CASE WHEN u.wait THEN '`+task.StateWaiting+`' ELSE $24 END, u.priority,
		u.payload::jsonb, u.metadata::jsonb, u.input_hash, u.idempotency_key, u.max_attempts,
		u.headers::jsonb->>'traceparent', ARRAY(SELECT jsonb_array_elements_text(u.visibility::jsonb)),
		greatest(coalesce(u.run_at, now() + u.delay_ms * interval '1 millisecond'), now()), u.concurrency_key,
		nullif(u.timeout_ms, 0), nullif(u.heartbeat_timeout_ms, 0), u.job_id, u.scheduled_at, NOT u.wait,
		u.parent_id, nullif(u.child_key, '')
	FROM u
	WHERE u.input_hash IS NULL OR u.id IN (SELECT task_id FROM hash)
	ORDER BY u.n
	ON CONFLICT DO NOTHING
	RETURNING `+taskColumns+`
), event AS (
	INSERT INTO task_events (task_id, org_id, status, state, progress, actor, principal)
	SELECT ins.id, ins.org_id, ins.status, ins.state, ins.progress, u.actor, u.principal::jsonb
	FROM ins JOIN u ON u.id = ins.id
), queued AS (
	SELECT ins.*, CASE WHEN ins.admitted THEN $25::text END AS message, u.headers::jsonb AS headers
	FROM ins JOIN u ON u.id = ins.id
), message AS (
	`+enqueue("queued")+`
)
SELECT * FROM ins`)

// submitRows are submissions as sqlSubmit's arguments, a slice a
// column.
type submitRows struct {
	orgs, ids                           []uuid.UUID
	types, payloads, metadata           []string
	priorities, maxAttempts             []int
	inputHashes, keys, principals       []*string
	headers, actors, visibility         []string
	runAt, scheduledAt                  []*time.Time
	delays, timeouts, heartbeatTimeouts []int64
	concurrencyKeys, childKeys          []string
	jobIDs, parentIDs                   []*uuid.UUID
}

// add appends sub under a new task id (the last of ids); by is who asked
// for it (nil for the system), trace the carrier of the request's trace.
func (r *submitRows) add(sub task.Submission, by *task.Principal, trace task.Carrier) error {
	id, err := uuid.NewV7()
	if err != nil {
		return fmt.Errorf("new task id: %w", err)
	}
	var hash, key, principal *string
	if sub.Dedupe {
		hash = &sub.InputHash
	}
	if sub.IdempotencyKey != "" {
		key = &sub.IdempotencyKey
	}
	actor := string(task.Lifecycle[task.Submit].Actor)
	if by == nil {
		// No one asked for it through the API: the scheduler made it.
		actor = string(task.ActorSystem)
	} else {
		b, err := json.Marshal(by)
		if err != nil {
			return fmt.Errorf("submit: principal: %w", err)
		}
		p := string(b)
		principal = &p
	}
	visibility := sub.Visibility
	if visibility == nil {
		visibility = []string{}
	}
	vis, err := json.Marshal(visibility)
	if err != nil {
		return fmt.Errorf("submit: visibility: %w", err)
	}
	r.orgs = append(r.orgs, sub.OrgID)
	r.ids = append(r.ids, id)
	r.types = append(r.types, sub.Type)
	r.priorities = append(r.priorities, sub.Priority)
	r.payloads = append(r.payloads, string(sub.Payload))
	r.metadata = append(r.metadata, string(sub.Metadata))
	r.inputHashes = append(r.inputHashes, hash)
	r.keys = append(r.keys, key)
	r.maxAttempts = append(r.maxAttempts, sub.MaxAttempts)
	r.headers = append(r.headers, string(headersArg(trace)))
	r.actors = append(r.actors, actor)
	r.visibility = append(r.visibility, string(vis))
	r.principals = append(r.principals, principal)
	r.runAt = append(r.runAt, sub.RunAt)
	r.delays = append(r.delays, sub.Delay.Milliseconds())
	r.concurrencyKeys = append(r.concurrencyKeys, sub.ConcurrencyKey)
	r.timeouts = append(r.timeouts, sub.Timeout.Milliseconds())
	r.heartbeatTimeouts = append(r.heartbeatTimeouts, sub.HeartbeatTimeout.Milliseconds())
	r.jobIDs = append(r.jobIDs, sub.JobID)
	r.scheduledAt = append(r.scheduledAt, sub.ScheduledAt)
	r.parentIDs = append(r.parentIDs, sub.ParentID)
	r.childKeys = append(r.childKeys, sub.ChildKey)
	return nil
}

// args are the statement's arguments.
func (r *submitRows) args() []any {
	rule := task.Lifecycle[task.Submit]
	return []any{r.orgs, r.ids, r.types, r.priorities, r.payloads, r.metadata, r.inputHashes, r.keys,
		r.maxAttempts, r.headers, r.actors, r.visibility, r.principals, r.runAt, r.delays, r.concurrencyKeys,
		r.timeouts, r.heartbeatTimeouts, r.jobIDs, r.scheduledAt, r.parentIDs, r.childKeys,
		string(rule.To), rule.State, string(rule.Message)}
}

// collectSubmitted reads the tasks sqlSubmit made, by id.
func collectSubmitted(rows pgx.Rows) (map[uuid.UUID]task.Task, error) {
	made := map[uuid.UUID]task.Task{}
	for rows.Next() {
		t, err := scanTask(rows)
		if err != nil {
			rows.Close()
			return nil, err
		}
		made[t.ID] = t
	}
	return made, rows.Err()
}
