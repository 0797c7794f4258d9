package postgres

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/task"
)

// The API's statements on workflows, their runs and dataset lineage. A
// run's progress itself happens in the database (migration 007: a trigger
// on tasks settling); these statements start runs, read them, and stop or
// resume them.

const workflowColumns = `id, definition, config_hash, next_tick_at, created_at, updated_at`

const workflowsOfOrg = `SELECT ` + workflowColumns + ` FROM workflows WHERE org_id = $1 ORDER BY name`

var sqlWorkflowsList = statement("workflows.list", workflowsOfOrg)

var sqlWorkflowsLock = statement("workflows.lock", workflowsOfOrg+` FOR UPDATE`)

var sqlWorkflowGet = statement("workflows.get", `SELECT `+workflowColumns+` FROM workflows WHERE org_id = $1 AND name = $2`)

var sqlWorkflowInsert = statement("workflows.insert", `
INSERT INTO workflows (org_id, name, definition, config_hash, schedule, timezone, missed, active, next_tick_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`)

// sqlWorkflowUpdate rewrites a workflow; its cursor moves only when its
// schedule changed ($10).
var sqlWorkflowUpdate = statement("workflows.update", `
UPDATE workflows SET definition = $3, config_hash = $4, schedule = $5, timezone = $6, missed = $7, active = $8,
	next_tick_at = CASE WHEN $10 THEN $9 ELSE next_tick_at END, updated_at = now()
WHERE org_id = $1 AND name = $2`)

var sqlWorkflowDelete = statement("workflows.delete", `DELETE FROM workflows WHERE org_id = $1 AND name = $2`)

// sqlRunInsert starts a run; a cron tick's run is made once ($11).
var sqlRunInsert = statement("workflow_runs.insert", `
INSERT INTO workflow_runs (id, org_id, workflow_id, workflow, on_failure, memoize, force, params, traceparent,
	scheduled_at, principal)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
ON CONFLICT DO NOTHING`)

// sqlRunNodes copies a workflow's nodes into its run, each with the job
// it names as the run starts.
var sqlRunNodes = statement("run_nodes.insert", `
INSERT INTO run_nodes (run_id, node, org_id, position, job_id, job, depends_on, input_datasets, output_datasets)
SELECT $1, n.name, $2, n.position, j.id, n.job, coalesce(n.depends_on, '{}'), coalesce(n.input_datasets, '{}'),
	coalesce(n.output_datasets, '{}')
FROM jsonb_to_recordset($3::jsonb) AS n(name text, job text, position integer, depends_on text[],
	input_datasets text[], output_datasets text[])
LEFT JOIN jobs j ON j.org_id = $2 AND j.name = n.job`)

var sqlRunAdvance = statement("workflow_runs.advance", `SELECT conveyor_advance_run($1)`)

const runColumns = `r.id, r.workflow, r.status, r.on_failure, r.memoize, r.force, r.params, r.scheduled_at,
	coalesce(r.error, ''), r.created_at, r.updated_at, r.finished_at, coalesce(r.traceparent, '')`

var sqlRunGet = statement("workflow_runs.get", `SELECT `+runColumns+` FROM workflow_runs r WHERE r.org_id = $1 AND r.id = $2`)

// runsListSQL lists a workflow's runs (all the org's with workflow
// empty), newest first, before the cursor after when it is set. Like the
// listing of tasks it is written per call, with a condition for each
// filter set: the org's runs are walked in workflow_runs_org, one
// workflow's in workflow_runs_list (migration 017).
func runsListSQL(org uuid.UUID, workflow string, after uuid.UUID, limit int) (string, []any) {
	w := &where{}
	w.and("r.org_id = " + w.arg(org))
	if workflow != "" {
		w.and("r.workflow = " + w.arg(workflow))
	}
	if after != uuid.Nil {
		w.and("r.id < " + w.arg(after))
	}
	n := w.arg(limit)
	return named(nameRunsList, `SELECT `+runColumns+` FROM workflow_runs r
WHERE `+w.String()+`
ORDER BY r.id DESC LIMIT `+n), w.args
}

const nameRunsList = "workflow_runs.list"

var _ = statement(nameRunsList, widest(runsListSQL(uuid.Max, "w", uuid.Max, 1)))

// sqlRunGraph reads a run's nodes with their tasks. A submitted node whose
// task retention has deleted shows the status its task ended with, which
// the node kept (migration 020), not SUBMITTED as if it never ran.
var sqlRunGraph = statement("run_nodes.graph", `
SELECT n.node, n.job, n.depends_on, n.input_datasets, n.output_datasets, n.state, n.task_id, n.memoized_from,
	coalesce(t.status, CASE WHEN n.state = '`+job.NodeSubmitted+`' THEN n.task_status END, ''),
	coalesce(t.state, ''), coalesce(t.progress, 0), coalesce(t.attempt, 0)
FROM run_nodes n LEFT JOIN tasks t ON t.id = n.task_id
WHERE n.run_id = $1 ORDER BY n.position`)

// sqlRunStop cancels a running run and skips its nodes not submitted; it
// returns whether the run was running.
var sqlRunStop = statement("workflow_runs.cancel", `
WITH run AS (
	UPDATE workflow_runs SET status = 'CANCELLED', finished_at = now(), updated_at = now()
	WHERE org_id = $1 AND id = $2 AND status = 'RUNNING' RETURNING id
), skipped AS (
	UPDATE run_nodes SET state = 'SKIPPED' WHERE run_id = (SELECT id FROM run) AND state = 'WAITING'
)
SELECT count(*) > 0 FROM run`)

// sqlRunResume puts a failed or cancelled run back to RUNNING, once no
// task of it is in flight any more: its nodes that did not complete wait
// again, to run anew, and so do those whose task retention has deleted
// since (their result is gone: the nodes below them could not read it),
// and those one of whose output datasets another run has written since
// (the nodes below would read that run's data under this run's params;
// memoization refuses such a node for the same reason). Each of those
// nodes runs the org's job of its name as it is now: a job removed while
// the run was under way (the node was skipped) and declared again since
// has another id. No task of the run may be in flight, nor a child one of
// its nodes' handlers spawned: a node run again spawns its children anew,
// and the earlier ones would do the same work beside them. It returns
// whether the run was resumed, and the trace the run had.
var sqlRunResume = statement("workflow_runs.resume", `
WITH RECURSIVE prev AS (
	SELECT traceparent FROM workflow_runs WHERE org_id = $1 AND id = $2
), `+runTree("$2")+`, run AS (
	UPDATE workflow_runs SET status = 'RUNNING', error = NULL, finished_at = NULL, updated_at = now(),
		traceparent = coalesce(nullif($3::text, ''), traceparent)
	WHERE org_id = $1 AND id = $2 AND status IN ('FAILED', 'CANCELLED')
		AND NOT EXISTS (SELECT 1 FROM tasks t JOIN tree USING (id) WHERE t.status IN (`+inFlight+`))
	RETURNING id
), reset AS (
	UPDATE run_nodes n SET state = 'WAITING', task_id = NULL, memo_key = NULL, memoized_from = NULL,
		job_id = coalesce((SELECT j.id FROM jobs j WHERE j.org_id = n.org_id AND j.name = n.job), n.job_id)
	WHERE n.run_id = (SELECT id FROM run) AND (n.state = 'SKIPPED' OR (n.state = 'SUBMITTED'
		AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = n.task_id AND t.status IN ('FAILED', 'CANCELLED')))
		OR (n.state IN ('SUBMITTED', 'MEMOIZED') AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = n.task_id))
		OR (n.state IN ('SUBMITTED', 'MEMOIZED') AND EXISTS (SELECT 1 FROM unnest(n.output_datasets) AS o(name)
			WHERE EXISTS (SELECT 1 FROM dataset_versions v WHERE v.org_id = n.org_id AND v.dataset = o.name
				AND v.id > coalesce((SELECT max(w.id) FROM dataset_versions w
					WHERE w.task_id = n.task_id AND w.dataset = o.name), 0)
				AND v.run_id IS DISTINCT FROM n.run_id
				AND v.run_id IS DISTINCT FROM (SELECT t.run_id FROM tasks t WHERE t.id = n.task_id)))))
)
SELECT count(*) > 0, coalesce((SELECT traceparent FROM prev), '') FROM run`)

// runTree is a recursive query's term "tree": the ids of the tasks of the
// run whose id is the placeholder run, and of the children their handlers
// spawned (Reporter.Gather), and theirs, whatever their status. A node's
// handler that fanned out waits for its children with its task PENDING,
// or has ended while they still run: they are the node's work. So are the
// children of a child that ended (failed, say) while they still run,
// until the scheduler's sweep cancels them: the walk goes through ended
// tasks too (tasks_child reads a parent's children of every status).
func runTree(run string) string {
	return `tree (id) AS (
	SELECT id FROM tasks WHERE run_id = ` + run + `
	UNION
	SELECT c.id FROM tasks c JOIN tree p ON c.parent_id = p.id)`
}

// sqlRunTasksInFlight reads the tasks of a run ($1) still in flight, and
// the children in flight of its nodes' handlers, with a pending cancel's
// absence: what a cancel of the run does to them (as sqlStoppedRunTasks).
var sqlRunTasksInFlight = statement("tasks.of_run_in_flight", `
WITH RECURSIVE `+runTree("$1")+`
SELECT t.id, t.status, t.version, t.cancel_requested_at IS NOT NULL FROM tasks t JOIN tree USING (id)
WHERE t.status IN (`+inFlight+`) AND NOT (t.status = `+lit(task.StatusInProgress)+` AND t.cancel_requested_at IS NOT NULL)
ORDER BY t.id LIMIT $2`)

// sqlRunBusy tells whether a task of a run ($1), or a child of one of its
// nodes' handlers, is still in flight.
var sqlRunBusy = statement("tasks.run_busy", `
WITH RECURSIVE `+runTree("$1")+`
SELECT EXISTS (SELECT 1 FROM tasks t JOIN tree USING (id) WHERE t.status IN (`+inFlight+`))`)

// sqlStoppedRunTasks reads the tasks still in flight whose run stopped or
// whose parent task ended without completing, and a pending cancel's
// absence: what a cancel of theirs would do. The search starts from the
// tasks in flight that have a run or a parent (two small partial indexes)
// and reads each one's run or parent by key: the stopped runs and the
// finished tasks only grow, and a plan that scanned them (as a join may,
// on stale statistics, while a backlog burns down) read thousands of rows
// at every pass.
var sqlStoppedRunTasks = statement("tasks.orphans", `
SELECT t.id, t.status, t.version, t.cancel_requested_at IS NOT NULL FROM tasks t
WHERE t.status IN (`+inFlight+`) AND NOT (t.status = `+lit(task.StatusInProgress)+` AND t.cancel_requested_at IS NOT NULL)
	AND t.id IN (
		SELECT c.id FROM tasks c
		WHERE c.run_id IS NOT NULL AND c.status IN (`+inFlight+`)
			AND (SELECT r.status FROM workflow_runs r WHERE r.id = c.run_id) IN ('`+job.RunFailed+`', '`+job.RunCancelled+`')
		UNION ALL
		SELECT c.id FROM tasks c
		WHERE c.parent_id IS NOT NULL AND c.status IN (`+inFlight+`)
			AND (SELECT p.status FROM tasks p WHERE p.id = c.parent_id)
				IN (`+litList([]task.Status{task.StatusFailed, task.StatusCancelled})+`))
ORDER BY t.id LIMIT $1`)

// inFlight lists the statuses of a task not yet finished.
var inFlight = litList([]task.Status{task.StatusPending, task.StatusInProgress})

// sqlWakeParents queues again the parents waiting for children none of
// which is left to finish: the settling of the last one queues its parent
// itself, unless it raced with the parent's going to wait.
var sqlWakeParents = statement("tasks.wake_parents", `
SELECT count(*) FILTER (WHERE conveyor_wake_parent(p.id)) FROM (
	SELECT id FROM tasks p WHERE status = `+lit(task.StatusPending)+` AND state = '`+task.StateAwaiting+`'
		AND NOT EXISTS (SELECT 1 FROM tasks c WHERE c.parent_id = p.id AND c.status IN (`+inFlight+`))
	ORDER BY id LIMIT $1) p`)

var sqlLineageRefs = statement("workflows.lineage", `
SELECT w.name, n->>'name', n->>'job', coalesce(n->'output_datasets' ? $2, false),
	coalesce(n->'input_datasets' ? $2, false)
FROM workflows w CROSS JOIN LATERAL jsonb_array_elements(w.definition->'nodes') n
WHERE w.org_id = $1 AND (n->'output_datasets' ? $2 OR n->'input_datasets' ? $2)
ORDER BY w.name, n->>'name'`)

var sqlDatasetVersions = statement("dataset_versions.latest", `
SELECT id, run_id, node, task_id, created_at FROM dataset_versions
WHERE org_id = $1 AND dataset = $2 ORDER BY id DESC LIMIT $3`)

// Workflows lists the org's workflows.
func (s *JobStore) Workflows(ctx context.Context, p auth.Principal) ([]job.StoredWorkflow, error) {
	out, err := scopedRows(ctx, s.pool, p.Scope(), scanWorkflow, sqlWorkflowsList, p.OrgID)
	return out, translate(err)
}

// Workflow returns one workflow of the org by name, or a not-found error
// naming it.
func (s *JobStore) Workflow(ctx context.Context, p auth.Principal, name string) (job.StoredWorkflow, error) {
	if task.ValidateType(name) != nil {
		// No workflow has a name of another form (nor one PostgreSQL refuses).
		return job.StoredWorkflow{}, missing("workflow", name)
	}
	out, err := scopedRows(ctx, s.pool, p.Scope(), scanWorkflow, sqlWorkflowGet, p.OrgID, name)
	if err != nil {
		return job.StoredWorkflow{}, translate(err)
	}
	if len(out) == 0 {
		return job.StoredWorkflow{}, missing("workflow", name)
	}
	return out[0], nil
}

func scanWorkflow(row pgx.CollectableRow) (job.StoredWorkflow, error) {
	var w job.StoredWorkflow
	var def []byte
	if err := row.Scan(&w.ID, &def, &w.ConfigHash, &w.NextTickAt, &w.CreatedAt, &w.UpdatedAt); err != nil {
		return job.StoredWorkflow{}, err
	}
	if err := json.Unmarshal(def, &w.Definition); err != nil {
		return job.StoredWorkflow{}, fmt.Errorf("workflow %s: stored definition: %w", w.ID, err)
	}
	return w, nil
}

// writeWorkflow inserts w, or updates it over old; its schedule's cursor
// is handled as a job's.
func writeWorkflow(ctx context.Context, tx pgx.Tx, org uuid.UUID, w job.Workflow, old *job.Workflow, now time.Time) error {
	def, err := json.Marshal(w)
	if err != nil {
		return err
	}
	schedule, tz, missed, next, err := cursor(w.Source, now)
	if err != nil {
		return err
	}
	args := []any{org, w.Name, def, w.Hash(), schedule, tz, missed, w.Active, next}
	if old == nil {
		_, err = tx.Exec(ctx, sqlWorkflowInsert, args...)
		return err
	}
	o := old.Normalized()
	_, err = tx.Exec(ctx, sqlWorkflowUpdate, append(args, scheduleMoved(o.Source, w.Source, o.Active, w.Active))...)
	return err
}

// cursor returns the columns of a source's schedule and its first tick
// after now (all empty without a source).
func cursor(src *job.Source, now time.Time) (schedule *string, tz, missed string, next *time.Time, err error) {
	tz, missed = job.DefaultTimezone, job.MissedRunOnce
	if src == nil {
		return nil, tz, missed, nil, nil
	}
	sched, err := job.Schedule(src.Schedule, src.Timezone)
	if err != nil {
		return nil, "", "", nil, err
	}
	n := sched.Next(now)
	return &src.Schedule, src.Timezone, src.Missed, &n, nil
}

// scheduleMoved reports whether a schedule's cursor must start again: the
// source came or went, its schedule or time zone changed, or the
// activity did.
func scheduleMoved(old, cur *job.Source, oldActive, active bool) bool {
	return (old == nil) != (cur == nil) || oldActive != active ||
		(old != nil && cur != nil && (old.Schedule != cur.Schedule || old.Timezone != cur.Timezone))
}

// StartRun starts a run of the named workflow: it records the run and its
// nodes and submits (or memoizes) the nodes without parents, in one
// transaction.
func (s *JobStore) StartRun(ctx context.Context, p auth.Principal, name string, req job.RunRequest) (job.Run, error) {
	if task.ValidateType(name) != nil {
		return job.Run{}, missing("workflow", name)
	}
	params, err := runParams(req.Params)
	if err != nil {
		return job.Run{}, err
	}
	id, err := uuid.NewV7()
	if err != nil {
		return job.Run{}, err
	}
	var run job.Run
	err = inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, sqlWorkflowGet, p.OrgID, name)
		if err != nil {
			return err
		}
		wfs, err := pgx.CollectRows(rows, scanWorkflow)
		if err != nil {
			return err
		}
		if len(wfs) == 0 {
			return missing("workflow", name)
		}
		principal, _ := json.Marshal(p.Actor()) // strings and a uuid always encode
		if _, err := startRun(ctx, tx, p.OrgID, wfs[0], id, params, req.Force, req.Trace["traceparent"], nil, principal); err != nil {
			return err
		}
		run, err = readRun(ctx, tx, p.OrgID, id)
		return err
	})
	if err != nil {
		return job.Run{}, translate(err)
	}
	call(s.OnOutbox)
	call(s.OnChange)
	return run, nil
}

// runParams checks a run's params: a JSON object ({} when left out).
func runParams(raw json.RawMessage) (json.RawMessage, error) {
	return task.JSONObject(raw, "params")
}

// startRun records run id of wf with its nodes and moves it forward. A run
// of a cron tick that was already made is not made again: made is false.
func startRun(ctx context.Context, tx pgx.Tx, org uuid.UUID, wf job.StoredWorkflow, id uuid.UUID, params json.RawMessage,
	force bool, traceparent string, scheduledAt *time.Time, principal []byte) (made bool, err error) {
	d := wf.Definition.Normalized()
	type node struct {
		job.Node
		Position int `json:"position"`
	}
	order := d.Order()
	nodes := make([]node, len(order))
	for i, n := range order {
		nodes[i] = node{Node: n, Position: i}
	}
	doc, err := json.Marshal(nodes)
	if err != nil {
		return false, err
	}
	var principalArg any
	if principal != nil {
		principalArg = string(principal)
	}
	tag, err := tx.Exec(ctx, sqlRunInsert, id, org, wf.ID, d.Name, d.OnFailure, d.Memoize, force, params,
		nullIfEmpty(traceparent), scheduledAt, principalArg)
	if err != nil || tag.RowsAffected() == 0 {
		return false, err
	}
	if _, err := tx.Exec(ctx, sqlRunNodes, id, org, doc); err != nil {
		return false, err
	}
	_, err = tx.Exec(ctx, sqlRunAdvance, id)
	return err == nil, err
}

func nullIfEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// Run reads a run of the org with its graph.
func (s *JobStore) Run(ctx context.Context, p auth.Principal, id uuid.UUID) (job.Run, error) {
	var run job.Run
	err := inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		var err error
		run, err = readRun(ctx, tx, p.OrgID, id)
		return err
	})
	return run, translate(err)
}

func readRun(ctx context.Context, q querier, org, id uuid.UUID) (job.Run, error) {
	rows, err := q.Query(ctx, sqlRunGet, org, id)
	if err != nil {
		return job.Run{}, err
	}
	runs, err := pgx.CollectRows(rows, scanRun)
	if err != nil {
		return job.Run{}, err
	}
	if len(runs) == 0 {
		return job.Run{}, task.Errorf(task.ErrCodeNotFound, "run not found")
	}
	run := runs[0]
	rows, err = q.Query(ctx, sqlRunGraph, id)
	if err != nil {
		return job.Run{}, err
	}
	run.Nodes, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (job.RunNode, error) {
		var n job.RunNode
		err := row.Scan(&n.Name, &n.Job, &n.DependsOn, &n.InputDatasets, &n.OutputDatasets, &n.State, &n.TaskID,
			&n.MemoizedFrom, &n.TaskStatus, &n.TaskState, &n.Progress, &n.Attempt)
		return n, err
	})
	return run, err
}

func scanRun(row pgx.CollectableRow) (job.Run, error) {
	var r job.Run
	var params []byte
	err := row.Scan(&r.ID, &r.Workflow, &r.Status, &r.OnFailure, &r.Memoize, &r.Force, &params, &r.ScheduledAt,
		&r.Error, &r.CreatedAt, &r.UpdatedAt, &r.FinishedAt, &r.Traceparent)
	r.Params = params
	return r, err
}

// Runs lists the org's runs of a workflow ("" for all), newest first,
// older than the cursor after when it is set.
func (s *JobStore) Runs(ctx context.Context, p auth.Principal, workflow string, after uuid.UUID, limit int) ([]job.Run, error) {
	sql, args := runsListSQL(p.OrgID, workflow, after, limit)
	out, err := scopedRows(ctx, s.pool, p.Scope(), scanRun, sql, args...)
	return out, translate(err)
}

// CancelRun cancels a running run: nodes not yet submitted are skipped,
// its pending tasks cancelled, its running ones asked to stop, and so are
// the children its nodes' handlers spawned. A run that
// already ended is a conflict, unless tasks of it are still in flight and
// not yet asked to stop (it failed, and the scheduler has not cancelled
// them yet): they are, and the run keeps its status.
func (s *JobStore) CancelRun(ctx context.Context, p auth.Principal, id uuid.UUID, trace task.Carrier) (job.Run, error) {
	var run job.Run
	var queued bool
	cancel := func(tx pgx.Tx) error {
		queued = false
		var stopped bool
		if err := tx.QueryRow(ctx, sqlRunStop, p.OrgID, id).Scan(&stopped); err != nil {
			return err
		}
		if !stopped {
			cur, err := readRun(ctx, tx, p.OrgID, id)
			if err != nil {
				return err
			}
			if cur.Status == job.RunCompleted {
				return task.Errorf(task.ErrCodeConflict, "run is %s and cannot be cancelled", cur.Status)
			}
			// A run that failed (or was cancelled) with tasks still in
			// flight has them cancelled by the scheduler's next sweep, and
			// cannot be retried until then: a cancel does that now.
			var n int
			if n, queued, err = cancelStopped(ctx, tx, &id, maxRunCancel, trace, p.Actor()); err != nil {
				return err
			}
			if n == 0 {
				var busy bool
				if err := tx.QueryRow(ctx, sqlRunBusy, id).Scan(&busy); err != nil {
					return err
				}
				if busy {
					return task.Errorf(task.ErrCodeConflict, "run is %s and cannot be cancelled; its tasks still "+
						"running were asked to stop and end when their workers hear of it", cur.Status)
				}
				return task.Errorf(task.ErrCodeConflict, "run is %s and cannot be cancelled", cur.Status)
			}
			run, err = readRun(ctx, tx, p.OrgID, id)
			return err
		}
		var err error
		if _, queued, err = cancelStopped(ctx, tx, &id, maxRunCancel, trace, p.Actor()); err != nil {
			return err
		}
		run, err = readRun(ctx, tx, p.OrgID, id)
		return err
	}
	// The cancel holds the run and then settles its tasks; a worker's
	// batch settling one of them holds the task and then waits for the run
	// (migration 007). PostgreSQL breaks that deadlock by rolling one back
	// whole; the cancel then runs again.
	err := retryDeadlocks(func() error { return inScope(ctx, s.pool, p.Scope(), cancel) })
	if err != nil {
		return job.Run{}, translate(err)
	}
	if queued {
		call(s.OnOutbox)
	}
	call(s.OnEvents)
	return run, nil
}

// maxRunCancel bounds the tasks one cancel of a run changes at once; the
// scheduler cancels any left over.
const maxRunCancel = 1000

// cancelStopped cancels up to limit tasks in flight of run and children
// in flight of its nodes' handlers (or, with run nil, of every stopped run
// and of every parent that ended without completing), each with the transition a client's cancel would apply,
// fenced at the version read. A task that another writer moved meanwhile
// (a worker writing progress) is read again, as a task's cancel does,
// rather than left to the next sweep. It returns how many changed and
// whether it wrote outbox messages.
func cancelStopped(ctx context.Context, q querier, run *uuid.UUID, limit int, trace task.Carrier, by *task.Principal) (int, bool, error) {
	n, queued := 0, false
	for range 20 {
		changed, fenced, q1, err := cancelStoppedOnce(ctx, q, run, limit-n, trace, by)
		if err != nil {
			return 0, false, err
		}
		n, queued = n+changed, queued || q1
		if fenced == 0 || n >= limit {
			break
		}
	}
	return n, queued, nil
}

// cancelStoppedOnce is one pass of cancelStopped: it answers how many
// tasks changed and how many were fenced.
func cancelStoppedOnce(ctx context.Context, q querier, run *uuid.UUID, limit int, trace task.Carrier, by *task.Principal) (int, int, bool, error) {
	sql, args := sqlStoppedRunTasks, []any{limit}
	if run != nil {
		sql, args = sqlRunTasksInFlight, []any{*run, limit}
	}
	rows, err := q.Query(ctx, sql, args...)
	if err != nil {
		return 0, 0, false, err
	}
	var changes []task.Change
	var st task.Standing
	var status string
	if _, err := pgx.ForEachRow(rows, []any{&st.ID, &status, &st.Version, &st.CancelPending}, func() error {
		tr, _, err := task.OnCancel(task.Status(status), st.CancelPending)
		if err == nil && tr != "" {
			changes = append(changes, task.Change{TaskID: st.ID, Version: st.Version, Transition: tr, Trace: trace, By: by,
				Detail: map[string]any{"reason": "its run or parent task stopped"}})
		}
		return nil
	}); err != nil {
		return 0, 0, false, err
	}
	if len(changes) == 0 {
		return 0, 0, false, nil
	}
	applied, errs, queued, err := apply(ctx, q, changes)
	if err != nil {
		return 0, 0, false, err
	}
	n, fenced := 0, 0
	for i, e := range errs {
		if e != nil {
			return 0, 0, false, e
		}
		if applied[i].Fenced {
			fenced++
		} else {
			n++
		}
	}
	return n, fenced, queued, nil
}

// RetryRun resumes a failed or cancelled run whose tasks have all ended:
// its nodes that did not complete (failed, cancelled or skipped) run
// again, those that completed keep their results (unless another run has
// written one of their output datasets since: they run again, before the
// nodes below read it). trace, the retrying request's, becomes the run's: the nodes it runs carry it, as a retried
// task carries its retry's, and the request's span links to the trace
// the run had, where its earlier tasks are, which it no longer names.
func (s *JobStore) RetryRun(ctx context.Context, p auth.Principal, id uuid.UUID, trace task.Carrier) (job.Run, error) {
	var run job.Run
	var previous string
	err := inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		var resumed bool
		if err := tx.QueryRow(ctx, sqlRunResume, p.OrgID, id, trace["traceparent"]).Scan(&resumed, &previous); err != nil {
			return err
		}
		if !resumed {
			cur, err := readRun(ctx, tx, p.OrgID, id)
			if err != nil {
				return err
			}
			if cur.Status != job.RunFailed && cur.Status != job.RunCancelled {
				return task.Errorf(task.ErrCodeConflict, "run is %s; only FAILED or CANCELLED runs can be retried", cur.Status)
			}
			return task.Errorf(task.ErrCodeConflict, "run is still stopping: a task of it is still in flight; "+
				"retry once it has ended (POST /v1/runs/%s/cancel stops its tasks now)", id)
		}
		if _, err := tx.Exec(ctx, sqlRunAdvance, id); err != nil {
			return err
		}
		var err error
		run, err = readRun(ctx, tx, p.OrgID, id)
		return err
	})
	if err != nil {
		return job.Run{}, translate(err)
	}
	linkTrace(ctx, previous, "previous run")
	call(s.OnOutbox)
	call(s.OnChange)
	call(s.OnEvents)
	return run, nil
}

// Lineage tells which workflow nodes produce and consume a dataset, and
// its latest versions (at most limit).
func (s *JobStore) Lineage(ctx context.Context, p auth.Principal, dataset string, limit int) (job.Lineage, error) {
	l := job.Lineage{Dataset: dataset, Producers: []job.DatasetRef{}, Consumers: []job.DatasetRef{}, Versions: []job.DatasetVersion{}}
	err := inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, sqlLineageRefs, p.OrgID, dataset)
		if err != nil {
			return err
		}
		var ref job.DatasetRef
		var produces, consumes bool
		if _, err := pgx.ForEachRow(rows, []any{&ref.Workflow, &ref.Node, &ref.Job, &produces, &consumes}, func() error {
			if produces {
				l.Producers = append(l.Producers, ref)
			}
			if consumes {
				l.Consumers = append(l.Consumers, ref)
			}
			return nil
		}); err != nil {
			return err
		}
		rows, err = tx.Query(ctx, sqlDatasetVersions, p.OrgID, dataset, limit)
		if err != nil {
			return err
		}
		var v job.DatasetVersion
		var node *string
		_, err = pgx.ForEachRow(rows, []any{&v.Version, &v.RunID, &node, &v.TaskID, &v.CreatedAt}, func() error {
			v.Node = ""
			if node != nil {
				v.Node = *node
			}
			l.Versions = append(l.Versions, v)
			return nil
		})
		return err
	})
	return l, translate(err)
}
