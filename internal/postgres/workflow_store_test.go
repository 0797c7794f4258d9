package postgres_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

const diamondFile = `
jobs:
  - {name: a, type: wf.a}
  - {name: b, type: wf.b}
  - {name: c, type: wf.c}
  - {name: d, type: wf.d}
workflows:
  - name: diamond
    on_failure: %s
    memoize: true
    nodes:
      - {job: a, output_datasets: [raw]}
      - {job: b, depends_on: [a], input_datasets: [raw]}
      - {job: c, depends_on: [a]}
      - {job: d, depends_on: [b, c]}
`

type wfHarness struct {
	t     *testing.T
	db    *testdb.DB
	p     auth.Principal
	store *postgres.JobStore
}

func newWorkflowHarness(t *testing.T, onFailure string) *wfHarness {
	t.Helper()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	applyFile(t, db, admin, fmt.Sprintf(diamondFile, onFailure))
	return &wfHarness{t: t, db: db, p: admin, store: postgres.NewJobStore(db.Pool)}
}

// nodeTasks returns the tasks of a run by node, each node's latest.
func (h *wfHarness) nodeTasks(run uuid.UUID) map[string]task.Task {
	h.t.Helper()
	rows, err := h.db.Pool.Query(context.Background(), `SELECT id, node, status FROM tasks WHERE run_id = $1 ORDER BY id`, run)
	require.NoError(h.t, err)
	defer rows.Close()
	out := map[string]task.Task{}
	for rows.Next() {
		var tk task.Task
		var status string
		require.NoError(h.t, rows.Scan(&tk.ID, &tk.Node, &status))
		tk.Status = task.Status(status)
		out[tk.Node] = tk
	}
	require.NoError(h.t, rows.Err())
	return out
}

// settle claims a node's task and ends it with transition tr.
func (h *wfHarness) settle(id uuid.UUID, tr task.Transition, result string) {
	h.t.Helper()
	ctx := context.Background()
	w := postgres.NewWorkerStore(h.db.Pool, nil)
	claimed, err := w.Claim(ctx, []uuid.UUID{id}, "w1", time.Minute)
	require.NoError(h.t, err)
	require.Len(h.t, claimed, 1, "task %s is claimable", id)
	c := task.Change{TaskID: id, Version: claimed[0].Version, Transition: tr, Error: "boom"}
	if tr == task.Complete {
		c.Result = json.RawMessage(result)
	}
	_, errs, err := w.Apply(ctx, []task.Change{c})
	require.NoError(h.t, err)
	require.NoError(h.t, errs[0])
}

func (h *wfHarness) run(id uuid.UUID) job.Run {
	h.t.Helper()
	r, err := h.store.Run(context.Background(), h.p, id)
	require.NoError(h.t, err)
	return r
}

func nodeStatus(r job.Run) map[string]string {
	out := map[string]string{}
	for _, n := range r.Nodes {
		out[n.Name] = n.Status()
	}
	return out
}

// A diamond runs node by node, each child submitted in the transaction of
// its last parent's completion with the parents' results as inputs; a
// second run with the same inputs is memoized, a forced one runs.
func TestWorkflowDiamondRunsAndMemoizes(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: json.RawMessage(`{"day": "2026-11-23"}`)})
	require.NoError(t, err)
	require.Equal(t, job.RunRunning, run.Status)
	require.Equal(t, map[string]string{"a": "PENDING", "b": "WAITING", "c": "WAITING", "d": "WAITING"}, nodeStatus(run))
	tasks := h.nodeTasks(run.ID)
	require.Len(t, tasks, 1)
	var queued int
	require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE task_id = $1`, tasks["a"].ID).Scan(&queued))
	require.Equal(t, 1, queued, "the first node's task goes out through the outbox")

	h.settle(tasks["a"].ID, task.Complete, `{"rows": 3}`)
	tasks = h.nodeTasks(run.ID)
	require.Len(t, tasks, 3, "b and c follow a at once")
	var inputs []byte
	require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT inputs FROM tasks WHERE id = $1`, tasks["b"].ID).Scan(&inputs))
	require.JSONEq(t, `{"params": {"day": "2026-11-23"}, "parents": {"a": {"rows": 3}}}`, string(inputs))
	var version int64
	require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT input_version FROM task_inputs WHERE task_id = $1 AND input_dataset = 'raw'`,
		tasks["b"].ID).Scan(&version))
	require.Positive(t, version, "b read the version of raw that a wrote")

	h.settle(tasks["b"].ID, task.Complete, `{"b": 1}`)
	require.Len(t, h.nodeTasks(run.ID), 3, "d waits for c")
	h.settle(tasks["c"].ID, task.Complete, `{"c": 1}`)
	tasks = h.nodeTasks(run.ID)
	require.Len(t, tasks, 4)
	h.settle(tasks["d"].ID, task.Complete, `{}`)
	done := h.run(run.ID)
	require.Equal(t, job.RunCompleted, done.Status)
	require.NotNil(t, done.FinishedAt)

	l, err := h.store.Lineage(ctx, h.p, "raw", 10)
	require.NoError(t, err)
	require.Equal(t, []job.DatasetRef{{Workflow: "diamond", Node: "a", Job: "a"}}, l.Producers)
	require.Equal(t, []job.DatasetRef{{Workflow: "diamond", Node: "b", Job: "b"}}, l.Consumers)
	require.Len(t, l.Versions, 1)

	// Same params, same job configs, same dataset versions: nothing runs.
	again, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: json.RawMessage(`{"day": "2026-11-23"}`)})
	require.NoError(t, err)
	require.Equal(t, job.RunCompleted, again.Status)
	require.Equal(t, map[string]string{"a": "MEMOIZED", "b": "MEMOIZED", "c": "MEMOIZED", "d": "MEMOIZED"}, nodeStatus(again))
	require.Empty(t, h.nodeTasks(again.ID), "a memoized run executes no task")
	require.Equal(t, run.ID, *again.Nodes[3].MemoizedFrom)

	// Other params, or forced: it runs.
	other, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: json.RawMessage(`{"day": "2026-11-24"}`)})
	require.NoError(t, err)
	require.Equal(t, "PENDING", nodeStatus(other)["a"])
	forced, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: json.RawMessage(`{"day": "2026-11-23"}`), Force: true})
	require.NoError(t, err)
	require.Equal(t, "PENDING", nodeStatus(forced)["a"])
	require.Len(t, h.nodeTasks(forced.ID), 1)
}

// B and C completing at the same moment, in two transactions, submit D
// exactly once.
func TestWorkflowJoinRacesSubmitOnce(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	for i := range 10 {
		run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: json.RawMessage(fmt.Sprintf(`{"i": %d}`, i))})
		require.NoError(t, err)
		h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
		tasks := h.nodeTasks(run.ID)
		w := postgres.NewWorkerStore(h.db.Pool, nil)
		claimed, err := w.Claim(ctx, []uuid.UUID{tasks["b"].ID, tasks["c"].ID}, "w1", time.Minute)
		require.NoError(t, err)
		require.Len(t, claimed, 2)
		var wg sync.WaitGroup
		for _, c := range claimed {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, errs, err := w.Apply(ctx, []task.Change{{TaskID: c.ID, Version: c.Version, Transition: task.Complete,
					Result: json.RawMessage(`{}`)}})
				require.NoError(t, err)
				require.NoError(t, errs[0])
			}()
		}
		wg.Wait()
		var ds int
		require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE run_id = $1 AND node = 'd'`, run.ID).Scan(&ds))
		require.Equal(t, 1, ds, "run %d", i)
	}
}

// With on_failure stop, a failed node fails the run, skips what had not
// started and cancels what runs; a retry runs again only what did not
// complete.
func TestWorkflowStopsOnFailureAndRetries(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	a := h.nodeTasks(run.ID)["a"].ID
	h.settle(a, task.Complete, `{}`)
	tasks := h.nodeTasks(run.ID)
	h.settle(tasks["b"].ID, task.Fail, "")
	failed := h.run(run.ID)
	require.Equal(t, job.RunFailed, failed.Status)
	require.Contains(t, failed.Error, "b")
	require.Equal(t, map[string]string{"a": "COMPLETED", "b": "FAILED", "c": "PENDING", "d": "SKIPPED"}, nodeStatus(failed))

	n, err := postgres.NewSchedulerStore(h.db.Pool, nil).CancelStopped(ctx, 100)
	require.NoError(t, err)
	require.Equal(t, 1, n, "c, still in flight, is cancelled")
	require.Equal(t, "CANCELLED", nodeStatus(h.run(run.ID))["c"])

	retried, err := h.store.RetryRun(ctx, h.p, run.ID, nil)
	require.NoError(t, err)
	require.Equal(t, job.RunRunning, retried.Status)
	require.Equal(t, map[string]string{"a": "COMPLETED", "b": "PENDING", "c": "PENDING", "d": "WAITING"}, nodeStatus(retried))
	tasks = h.nodeTasks(run.ID)
	require.Equal(t, a, tasks["a"].ID, "a completed: it does not run again")
	h.settle(tasks["b"].ID, task.Complete, `{}`)
	h.settle(tasks["c"].ID, task.Complete, `{}`)
	h.settle(h.nodeTasks(run.ID)["d"].ID, task.Complete, `{}`)
	require.Equal(t, job.RunCompleted, h.run(run.ID).Status)
	var completed int
	require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE run_id = $1 AND status = 'COMPLETED'`, run.ID).Scan(&completed))
	require.Equal(t, 4, completed, "each node completed once")

	_, err = h.store.RetryRun(ctx, h.p, run.ID, nil)
	require.Equal(t, task.ErrCodeConflict, task.ErrorCode(err))
}

// A run's retry is traced as a task's is: the nodes it runs again, and the
// nodes after them, carry the retrying request's trace, not the trace of
// the request (or cron pass) that started the run, whose spans ended long
// before.
func TestWorkflowRetryRunsUnderTheRetrysTrace(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	const (
		started = "00-11111111111111111111111111111111-1111111111111111-01"
		retried = "00-22222222222222222222222222222222-2222222222222222-01"
	)
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Trace: task.Carrier{"traceparent": started}})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
	tasks := h.nodeTasks(run.ID)
	h.settle(tasks["b"].ID, task.Fail, "")
	h.settle(tasks["c"].ID, task.Complete, `{}`)
	require.Equal(t, job.RunFailed, h.run(run.ID).Status)

	_, err = h.store.RetryRun(ctx, h.p, run.ID, task.Carrier{"traceparent": retried})
	require.NoError(t, err)
	traces := func(node string) (string, string) {
		var tp, header string
		require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT coalesce(t.traceparent, ''),
			coalesce((SELECT o.headers->>'traceparent' FROM outbox o WHERE o.task_id = t.id ORDER BY o.id DESC LIMIT 1), '')
			FROM tasks t WHERE t.id = $1`, h.nodeTasks(run.ID)[node].ID).Scan(&tp, &header))
		return tp, header
	}
	tp, header := traces("b")
	require.Equal(t, retried, tp, "the node run again shows the retry's trace")
	require.Equal(t, retried, header, "and its message continues it")
	h.settle(h.nodeTasks(run.ID)["b"].ID, task.Complete, `{}`)
	tp, _ = traces("d")
	require.Equal(t, retried, tp, "a node after it as well")
}

// With on_failure continue, the branch that does not depend on the failed
// node runs to its end; then the run fails.
func TestWorkflowContinuesIndependentBranches(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailContinue)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
	tasks := h.nodeTasks(run.ID)
	h.settle(tasks["b"].ID, task.Fail, "")
	r := h.run(run.ID)
	require.Equal(t, job.RunRunning, r.Status, "c still runs")
	require.Equal(t, "SKIPPED", nodeStatus(r)["d"])
	h.settle(tasks["c"].ID, task.Complete, `{}`)
	r = h.run(run.ID)
	require.Equal(t, job.RunFailed, r.Status)
	require.Equal(t, map[string]string{"a": "COMPLETED", "b": "FAILED", "c": "COMPLETED", "d": "SKIPPED"}, nodeStatus(r))
}

// Cancelling a run cancels its pending tasks and asks its running ones to
// stop; nothing more is submitted.
func TestWorkflowCancel(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
	tasks := h.nodeTasks(run.ID)
	_, err = postgres.NewWorkerStore(h.db.Pool, nil).Claim(ctx, []uuid.UUID{tasks["b"].ID}, "w1", time.Minute)
	require.NoError(t, err)
	r, err := h.store.CancelRun(ctx, h.p, run.ID, nil)
	require.NoError(t, err)
	require.Equal(t, job.RunCancelled, r.Status)
	st := nodeStatus(r)
	require.Equal(t, "CANCELLED", st["c"])
	require.Equal(t, "IN_PROGRESS", st["b"], "b is asked to stop")
	require.Equal(t, task.StateCancelRequested, r.Nodes[1].TaskState)
	require.Equal(t, "SKIPPED", st["d"])
	_, err = h.store.CancelRun(ctx, h.p, run.ID, nil)
	require.Equal(t, task.ErrCodeConflict, task.ErrorCode(err))
	_, err = h.store.RetryRun(ctx, h.p, run.ID, nil)
	require.Equal(t, task.ErrCodeConflict, task.ErrorCode(err), "b is still stopping")
	require.ErrorContains(t, err, "still stopping")
}

// claimedParent submits a fan.parent task and claims it as worker w1.
func claimedParent(t *testing.T, db *testdb.DB, admin auth.Principal, w *postgres.WorkerStore) task.Task {
	t.Helper()
	parent := submitOf(t, db, admin, "fan.parent", "", 1)[0]
	claimed, err := w.Claim(context.Background(), []uuid.UUID{parent}, "w1", time.Minute)
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	return claimed[0]
}

// A handler's children: spawned once per key, the parent waits on hold
// (no slot, no message) and is queued again by its last child's settling.
func TestSpawnedChildrenWakeTheirParent(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	w := postgres.NewWorkerStore(db.Pool, nil)
	p := claimedParent(t, db, admin, w)
	subs := func() []task.Submission {
		var out []task.Submission
		for _, key := range []string{"k1", "k2", "k3"} {
			s, err := task.NewSubmission(task.SubmitInput{Type: "fan.child", Dedupe: new(bool)}, task.Defaults{MaxAttempts: 3}, "")
			require.NoError(t, err)
			s.OrgID, s.ParentID, s.ChildKey = p.OrgID, &p.ID, key
			out = append(out, s)
		}
		return out
	}
	kids, err := w.Spawn(ctx, p, subs(), nil)
	require.NoError(t, err)
	require.Len(t, kids, 3)
	again, err := w.Spawn(ctx, p, subs(), nil)
	require.NoError(t, err)
	require.Equal(t, kids, again, "spawning the same keys again makes nothing new")

	out, _, err := w.Apply(ctx, []task.Change{{TaskID: p.ID, Version: p.Version, Transition: task.Await}})
	require.NoError(t, err)
	require.False(t, out[0].Fenced)
	var state string
	var admittedNow, queued bool
	status := func() {
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT state, admitted,
			EXISTS (SELECT 1 FROM outbox WHERE task_id = $1 AND task_version = t.version) FROM tasks t WHERE id = $1`, p.ID).
			Scan(&state, &admittedNow, &queued))
	}
	status()
	require.Equal(t, task.StateAwaiting, state)
	require.False(t, admittedNow || queued, "a waiting parent holds no slot and has no message")
	st, err := postgres.NewSchedulerStore(db.Pool, nil).Admit(ctx, admitAll)
	require.NoError(t, err)
	require.Zero(t, st.Admitted, "the scheduler leaves a waiting parent alone")

	ids := []uuid.UUID{kids[0].ID, kids[1].ID, kids[2].ID}
	finish(t, db, ids[:2])
	status()
	require.Equal(t, task.StateAwaiting, state, "one child still runs")
	finish(t, db, ids[2:])
	status()
	require.Equal(t, task.StateQueued, state)
	require.True(t, admittedNow && queued, "the last child queued its parent again")
	back, err := w.Claim(ctx, []uuid.UUID{p.ID}, "w2", time.Minute)
	require.NoError(t, err)
	require.Len(t, back, 1)
	require.Equal(t, p.Attempt, back[0].Attempt, "waiting used no attempt")
	states, err := w.Spawn(ctx, back[0], subs(), nil)
	require.NoError(t, err)
	for _, s := range states {
		require.Equal(t, task.StatusCompleted, s.Status)
		require.JSONEq(t, `{}`, string(s.Result))
	}
}

// A handler whose task was lost (its lease expired and the reaper ended
// the attempt: here, out of attempts, FAILED) spawns nothing more: Spawn
// is a write of the held task like any other, and lands only while this
// worker's attempt still holds it. Children of a task already FAILED or
// CANCELLED would run, with their effects, until a sweep stopped them.
func TestSpawnOfALostParentSpawnsNothing(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	w := postgres.NewWorkerStore(db.Pool, nil)
	p := claimedParent(t, db, admin, w)
	// The reaper ends the attempt (the worker, cut off, does not know).
	out, _, err := postgres.NewMaintenanceStore(db.Pool, nil).Apply(ctx, []task.Change{{TaskID: p.ID, Version: p.Version,
		Transition: task.OnLeaseExpired(false, p.Attempt, p.MaxAttempts), Error: "lease expired"}})
	require.NoError(t, err)
	require.False(t, out[0].Fenced)

	sub, err := task.NewSubmission(task.SubmitInput{Type: "fan.child", Dedupe: new(bool)}, task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	sub.OrgID, sub.ParentID, sub.ChildKey = p.OrgID, &p.ID, "k1"
	_, err = w.Spawn(ctx, p, []task.Submission{sub}, nil)
	require.ErrorIs(t, err, task.ErrFenced)
	var children int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE parent_id = $1`, p.ID).Scan(&children))
	require.Zero(t, children, "a lost parent's handler spawned children")
}

// A handler whose task's cancel was accepted (202) but has not reached its
// worker yet spawns nothing either: its children would start work after
// the cancel, and could even complete before a sweep stopped them.
func TestSpawnOfACancelledParentSpawnsNothing(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	w := postgres.NewWorkerStore(db.Pool, nil)
	p := claimedParent(t, db, admin, w)
	_, outcome, err := postgres.NewAPIStore(db.Pool, nil).Cancel(ctx, admin, p.ID, nil)
	require.NoError(t, err)
	require.Equal(t, task.CancelRequested, outcome)

	sub, err := task.NewSubmission(task.SubmitInput{Type: "fan.child", Dedupe: new(bool)}, task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	sub.OrgID, sub.ParentID, sub.ChildKey = p.OrgID, &p.ID, "k1"
	_, err = w.Spawn(ctx, p, []task.Submission{sub}, nil)
	require.ErrorIs(t, err, task.ErrFenced)
	var children int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE parent_id = $1`, p.ID).Scan(&children))
	require.Zero(t, children, "a cancelled parent's handler spawned children")
}

// A parent that went to wait after its last child had settled (a race the
// row lock cannot order) is woken by the scheduler's sweep.
func TestWakeParentsSweep(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	parent := submitOf(t, db, admin, "fan.parent", "", 1)[0]
	w := postgres.NewWorkerStore(db.Pool, nil)
	claimed, err := w.Claim(ctx, []uuid.UUID{parent}, "w1", time.Minute)
	require.NoError(t, err)
	out, _, err := w.Apply(ctx, []task.Change{{TaskID: parent, Version: claimed[0].Version, Transition: task.Await}})
	require.NoError(t, err)
	require.False(t, out[0].Fenced)
	n, err := postgres.NewSchedulerStore(db.Pool, nil).WakeParents(ctx, 10)
	require.NoError(t, err)
	require.Equal(t, 1, n, "no child is left to finish")
	var state string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT state FROM tasks WHERE id = $1`, parent).Scan(&state))
	require.Equal(t, task.StateQueued, state)
}

// A workflow's cron source starts one run per tick, each with its tick as
// its params, however many passes see it.
func TestWorkflowCronStartsOneRunPerTick(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, `
jobs:
  - {name: only, type: wf.only}
workflows:
  - name: ticking
    memoize: true
    source: {kind: cron, schedule: "@every 1s"}
    nodes:
      - {job: only}
`)
	s := postgres.NewSchedulerStore(db.Pool, nil)
	cfg := job.CronConfig{CatchUp: time.Minute, MaxJobs: 10, MaxTicks: 100}
	var first time.Time
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT next_tick_at FROM workflows WHERE name = 'ticking'`).Scan(&first))
	now := first.Add(2500 * time.Millisecond)
	for range 2 {
		_, err := s.Cron(ctx, cfg, now)
		require.NoError(t, err)
	}
	rows, err := db.Pool.Query(ctx, `SELECT scheduled_at, params->>'scheduled_at', status,
		(SELECT count(*) FROM tasks t WHERE t.run_id = r.id) FROM workflow_runs r ORDER BY scheduled_at`)
	require.NoError(t, err)
	var ticks []time.Time
	for rows.Next() {
		var at time.Time
		var param, status string
		var tasks int
		require.NoError(t, rows.Scan(&at, &param, &status, &tasks))
		require.Equal(t, at.UTC().Format(time.RFC3339Nano), param)
		require.Equal(t, job.RunRunning, status)
		require.Equal(t, 1, tasks, "each tick runs its node: the tick is an input")
		ticks = append(ticks, at)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []time.Time{first, first.Add(time.Second), first.Add(2 * time.Second)}, ticks)
}

// expire backdates tasks' completion past retention and runs the
// maintenance leader's retention pass, as it runs every few minutes.
func (h *wfHarness) expire(ids ...uuid.UUID) {
	h.t.Helper()
	ctx := context.Background()
	_, err := h.db.Pool.Exec(ctx, `UPDATE tasks SET completed_at = now() - interval '8 days' WHERE id = ANY ($1)`, ids)
	require.NoError(h.t, err)
	_, err = postgres.NewMaintenanceStore(h.db.Pool, nil).DeleteExpired(ctx, 7*24*time.Hour, 1000)
	require.NoError(h.t, err)
}

// A run that outlives RETENTION (a node waiting more than a week behind a
// limit, a pause or a long timeout) must still finish: retention deleting
// the task of its completed node b must not leave d waiting forever on a
// parent the run can no longer see as completed.
func TestWorkflowRunOutlivingRetentionFinishes(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{"a": 1}`)
	tasks := h.nodeTasks(run.ID)
	h.settle(tasks["b"].ID, task.Complete, `{"b": 1}`)
	// A week later, c is still running; retention passes over a and b.
	h.expire(tasks["a"].ID, tasks["b"].ID)
	h.settle(tasks["c"].ID, task.Complete, `{"c": 1}`)

	r := h.run(run.ID)
	require.Equal(t, job.RunRunning, r.Status)
	d := h.nodeTasks(run.ID)["d"]
	require.NotEqual(t, uuid.Nil, d.ID, "d's parents all completed: d must be submitted (nodes: %v)", nodeStatus(r))
	var inputs []byte
	require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT inputs FROM tasks WHERE id = $1`, d.ID).Scan(&inputs))
	require.JSONEq(t, `{"params": {}, "parents": {"b": {"b": 1}, "c": {"c": 1}}}`, string(inputs))
	h.settle(d.ID, task.Complete, `{}`)
	require.Equal(t, job.RunCompleted, h.run(run.ID).Status)
}

// Retrying a failed run once its completed nodes' tasks are past retention
// must run again what failed (and what lost its result), not leave the run
// RUNNING forever with nothing in flight.
func TestWorkflowRetryAfterRetentionIsNotStuck(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	a := h.nodeTasks(run.ID)["a"].ID
	h.settle(a, task.Complete, `{"a": 1}`)
	tasks := h.nodeTasks(run.ID)
	h.settle(tasks["b"].ID, task.Fail, "")
	_, err = postgres.NewSchedulerStore(h.db.Pool, nil).CancelStopped(ctx, 100)
	require.NoError(t, err)
	require.Equal(t, job.RunFailed, h.run(run.ID).Status)
	// The run is retried eight days later.
	h.expire(a)

	retried, err := h.store.RetryRun(ctx, h.p, run.ID, nil)
	require.NoError(t, err)
	var inFlight int
	require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE run_id = $1 AND status IN ('PENDING', 'IN_PROGRESS')`,
		run.ID).Scan(&inFlight))
	require.Positive(t, inFlight, "a retried RUNNING run has something to run (status %s, nodes %v)",
		retried.Status, nodeStatus(retried))
	for range 4 {
		for node, tk := range h.nodeTasks(run.ID) {
			if tk.Status == task.StatusPending {
				h.settle(tk.ID, task.Complete, `{"`+node+`": 2}`)
			}
		}
	}
	require.Equal(t, job.RunCompleted, h.run(run.ID).Status)
}

// Memoization never crosses orgs. Two orgs apply the same file; each
// removes its workflow while a run of it is under way (the run goes on:
// its nodes were copied). Org B's node c must not take org A's result.
func TestWorkflowMemoizationStaysInItsOrg(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	_, orgB := h.db.Key(t, "other", auth.Admin)
	applyFile(t, h.db, orgB, fmt.Sprintf(diamondFile, job.FailStop))
	jobsOnly, err := job.Parse([]byte(`
jobs:
  - {name: a, type: wf.a}
  - {name: b, type: wf.b}
  - {name: c, type: wf.c}
  - {name: d, type: wf.d}
`))
	require.NoError(t, err)

	start := func(p auth.Principal) uuid.UUID {
		run, err := h.store.StartRun(ctx, p, "diamond", job.RunRequest{})
		require.NoError(t, err)
		_, err = h.store.Apply(ctx, p, jobsOnly, false, true) // the workflow is removed
		require.NoError(t, err)
		h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
		return run.ID
	}
	runA := start(h.p)
	h.settle(h.nodeTasks(runA)["c"].ID, task.Complete, `{"secret": "org A's"}`)

	runB := start(orgB)
	r, err := h.store.Run(ctx, orgB, runB)
	require.NoError(t, err)
	require.Equal(t, "PENDING", nodeStatus(r)["c"], "org B's c runs: org A's result is not org B's to reuse")
}

// A run whose node was memoized reads that node's result from the earlier
// run's task, whatever that run's status: retention must keep the task
// while a run still under way may hand its result to the nodes below.
// Otherwise d, released after retention, runs with null for its memoized
// parent b.
func TestWorkflowMemoizedResultOutlivesRetention(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	first, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(first.ID)["a"].ID, task.Complete, `{"a": 1}`)
	tasks := h.nodeTasks(first.ID)
	h.settle(tasks["b"].ID, task.Complete, `{"b": 1}`)
	h.settle(tasks["c"].ID, task.Complete, `{"c": 1}`)
	h.settle(h.nodeTasks(first.ID)["d"].ID, task.Complete, `{}`)
	require.Equal(t, job.RunCompleted, h.run(first.ID).Status)

	// c's job changes: the next run takes a and b from the first, runs c.
	applyFile(t, h.db, h.p, strings.Replace(fmt.Sprintf(diamondFile, job.FailStop),
		"{name: c, type: wf.c}", "{name: c, type: wf.c, payload: {v: 2}}", 1))
	second, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	require.Equal(t, map[string]string{"a": "MEMOIZED", "b": "MEMOIZED", "c": "PENDING", "d": "WAITING"}, nodeStatus(second))

	// A week later, c is still running; retention passes over the first run.
	firstTasks := h.nodeTasks(first.ID)
	h.expire(firstTasks["a"].ID, firstTasks["b"].ID, firstTasks["c"].ID, firstTasks["d"].ID)
	h.settle(h.nodeTasks(second.ID)["c"].ID, task.Complete, `{"c": 2}`)

	d := h.nodeTasks(second.ID)["d"]
	require.NotEqual(t, uuid.Nil, d.ID, "d's parents are done: d is submitted")
	var inputs []byte
	require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT inputs FROM tasks WHERE id = $1`, d.ID).Scan(&inputs))
	require.JSONEq(t, `{"params": {}, "parents": {"b": {"b": 1}, "c": {"c": 2}}}`, string(inputs))
}

// Siblings a worker completes in one batch (one statement) each write
// their output datasets; the node below them, released as the batch
// settles, must record the versions both wrote, not the ones from before
// the second's trigger ran.
func TestWorkflowBatchedSiblingsRecordTheirDatasetsBeforeTheJoin(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, `
jobs:
  - {name: a, type: wf.a}
  - {name: b, type: wf.b}
  - {name: c, type: wf.c}
  - {name: d, type: wf.d}
workflows:
  - name: join
    nodes:
      - {job: a}
      - {job: b, depends_on: [a], output_datasets: [xb]}
      - {job: c, depends_on: [a], output_datasets: [xc]}
      - {job: d, depends_on: [b, c], input_datasets: [xb, xc]}
`)
	h := &wfHarness{t: t, db: db, p: admin, store: postgres.NewJobStore(db.Pool)}
	run, err := h.store.StartRun(ctx, admin, "join", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
	tasks := h.nodeTasks(run.ID)
	finish(t, db, []uuid.UUID{tasks["b"].ID, tasks["c"].ID})

	d := h.nodeTasks(run.ID)["d"]
	require.NotEqual(t, uuid.Nil, d.ID)
	rows, err := db.Pool.Query(ctx, `SELECT i.input_dataset, i.input_version,
		(SELECT max(v.id) FROM dataset_versions v WHERE v.dataset = i.input_dataset)
		FROM task_inputs i WHERE i.task_id = $1 ORDER BY 1`, d.ID)
	require.NoError(t, err)
	var name string
	var read int64
	var latest *int64
	seen := 0
	_, err = pgx.ForEachRow(rows, []any{&name, &read, &latest}, func() error {
		seen++
		require.NotNil(t, latest, "%s: no version was written", name)
		require.Equal(t, *latest, read, "d read %s at version %d, but its parent wrote %d before d started", name, read, *latest)
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, 2, seen)
}

// A node whose job was removed while its run was under way is skipped and
// fails the run. Once the job is declared again, a retry runs the node
// with it: the node names its job, and the removed job's id must not keep
// it failing with "job b no longer exists".
func TestWorkflowRetryRunsANodeWhoseJobWasDeclaredAgain(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	const file = `
jobs:
  - {name: a, type: wf.a}
  - {name: b, type: wf.b}
workflows:
  - name: pair
    nodes:
      - {job: a}
      - {job: b, depends_on: [a]}
`
	applyFile(t, db, admin, file)
	h := &wfHarness{t: t, db: db, p: admin, store: postgres.NewJobStore(db.Pool)}
	run, err := h.store.StartRun(ctx, admin, "pair", job.RunRequest{})
	require.NoError(t, err)
	onlyA, err := job.Parse([]byte("jobs:\n  - {name: a, type: wf.a}\n"))
	require.NoError(t, err)
	_, err = h.store.Apply(ctx, admin, onlyA, false, true) // b and the workflow are removed
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
	failed := h.run(run.ID)
	require.Equal(t, job.RunFailed, failed.Status)
	require.Contains(t, failed.Error, "job b no longer exists")

	applyFile(t, db, admin, file) // b is back
	retried, err := h.store.RetryRun(ctx, admin, run.ID, nil)
	require.NoError(t, err)
	require.Equal(t, job.RunRunning, retried.Status, "error: %s", retried.Error)
	require.Equal(t, map[string]string{"a": "COMPLETED", "b": "PENDING"}, nodeStatus(retried))
	h.settle(h.nodeTasks(run.ID)["b"].ID, task.Complete, `{}`)
	require.Equal(t, job.RunCompleted, h.run(run.ID).Status)
}

// Retention keeps the children of a parent that has not ended: the parent's
// handler runs again when its last child ends and reads every child's
// outcome by key. A child deleted meanwhile would be spawned, and run, again.
func TestRetentionKeepsTheChildrenOfAParentStillWaiting(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	w := postgres.NewWorkerStore(db.Pool, nil)
	p := claimedParent(t, db, admin, w)
	subs := func() []task.Submission {
		var out []task.Submission
		for _, key := range []string{"early", "late"} {
			s, err := task.NewSubmission(task.SubmitInput{Type: "fan.child", Dedupe: new(bool)}, task.Defaults{MaxAttempts: 3}, "")
			require.NoError(t, err)
			s.OrgID, s.ParentID, s.ChildKey = p.OrgID, &p.ID, key
			out = append(out, s)
		}
		return out
	}
	kids, err := w.Spawn(ctx, p, subs(), nil)
	require.NoError(t, err)
	require.Len(t, kids, 2)
	out, _, err := w.Apply(ctx, []task.Change{{TaskID: p.ID, Version: p.Version, Transition: task.Await}})
	require.NoError(t, err)
	require.False(t, out[0].Fenced)
	finish(t, db, []uuid.UUID{kids[0].ID})
	_, err = db.Pool.Exec(ctx, `UPDATE tasks SET completed_at = now() - interval '8 days' WHERE id = $1`, kids[0].ID)
	require.NoError(t, err)

	n, err := postgres.NewMaintenanceStore(db.Pool, nil).DeleteExpired(ctx, 7*24*time.Hour, 100)
	require.NoError(t, err)
	require.Zero(t, n, "a child of a parent still waiting for its children was deleted")

	finish(t, db, []uuid.UUID{kids[1].ID})
	back, err := w.Claim(ctx, []uuid.UUID{p.ID}, "w2", time.Minute)
	require.NoError(t, err)
	require.Len(t, back, 1)
	states, err := w.Spawn(ctx, back[0], subs(), nil)
	require.NoError(t, err)
	require.Len(t, states, 2)
	for _, s := range states {
		require.Equal(t, task.StatusCompleted, s.Status, s.Key)
	}
}

// A node memoized from a run that had itself memoized it points at the
// task that ran, and names the run of that task: the run its result came
// from. Naming the run in between sends a reader to a run where the node
// did not run (and whose own task list does not hold the task).
func TestWorkflowMemoizedFromNamesTheRunOfItsTask(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	params := json.RawMessage(`{"day": "2026-11-23"}`)
	first, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: params})
	require.NoError(t, err)
	h.settle(h.nodeTasks(first.ID)["a"].ID, task.Complete, `{}`)
	tasks := h.nodeTasks(first.ID)
	h.settle(tasks["b"].ID, task.Complete, `{}`)
	h.settle(tasks["c"].ID, task.Complete, `{}`)
	h.settle(h.nodeTasks(first.ID)["d"].ID, task.Complete, `{}`)
	ran := h.nodeTasks(first.ID)

	second, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: params})
	require.NoError(t, err)
	require.Equal(t, job.RunCompleted, second.Status)
	third, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: params})
	require.NoError(t, err)
	require.Equal(t, job.RunCompleted, third.Status)
	for _, n := range third.Nodes {
		require.Equal(t, job.NodeMemoized, n.State, n.Name)
		require.Equal(t, ran[n.Name].ID, *n.TaskID, n.Name)
		require.Equal(t, first.ID, *n.MemoizedFrom, "node %s: its task %s is of run %s", n.Name, *n.TaskID, first.ID)
	}
}

// A node whose job was removed and declared again while its run waited
// for its parents runs the job declared again: the job of its name exists
// when the node is released, and the run must not fail saying it does not.
func TestWorkflowNodeRunsAJobDeclaredAgainWhileItWaited(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	const file = `
jobs:
  - {name: a, type: wf.a}
  - {name: b, type: wf.b}
workflows:
  - name: pair
    nodes:
      - {job: a}
      - {job: b, depends_on: [a]}
`
	applyFile(t, db, admin, file)
	h := &wfHarness{t: t, db: db, p: admin, store: postgres.NewJobStore(db.Pool)}
	run, err := h.store.StartRun(ctx, admin, "pair", job.RunRequest{})
	require.NoError(t, err)
	onlyA, err := job.Parse([]byte("jobs:\n  - {name: a, type: wf.a}\n"))
	require.NoError(t, err)
	_, err = h.store.Apply(ctx, admin, onlyA, false, true) // b and the workflow are removed
	require.NoError(t, err)
	applyFile(t, db, admin, file) // and declared again, before a completes

	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
	r := h.run(run.ID)
	require.Equal(t, job.RunRunning, r.Status, "error: %s", r.Error)
	require.Equal(t, map[string]string{"a": "COMPLETED", "b": "PENDING"}, nodeStatus(r))
	h.settle(h.nodeTasks(run.ID)["b"].ID, task.Complete, `{}`)
	require.Equal(t, job.RunCompleted, h.run(run.ID).Status)
}

// With on_failure stop, a node that cannot run because its job was
// removed while the run waited stops the run as a failed node does: the
// run fails at once, and the branches beside it are not carried on to an
// end that can only be FAILED.
func TestWorkflowStopsWhenANodesJobWasRemoved(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	_, err = h.db.Pool.Exec(ctx, `DELETE FROM jobs WHERE org_id = $1 AND name = 'c'`, h.p.OrgID)
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)

	failed := h.run(run.ID)
	require.Equal(t, job.RunFailed, failed.Status, "nodes: %v", nodeStatus(failed))
	require.NotNil(t, failed.FinishedAt)
	require.Contains(t, failed.Error, "job c no longer exists")
	require.Equal(t, "SKIPPED", nodeStatus(failed)["c"])
	require.Equal(t, "SKIPPED", nodeStatus(failed)["d"])
	if b := h.nodeTasks(run.ID)["b"]; b.ID != uuid.Nil {
		n, err := postgres.NewSchedulerStore(h.db.Pool, nil).CancelStopped(ctx, 100)
		require.NoError(t, err)
		require.Equal(t, 1, n, "b, still in flight, is cancelled")
	}

	applyFile(t, h.db, h.p, fmt.Sprintf(diamondFile, job.FailStop)) // c is back
	retried, err := h.store.RetryRun(ctx, h.p, run.ID, nil)
	require.NoError(t, err)
	require.Equal(t, job.RunRunning, retried.Status)
	for _, node := range []string{"b", "c"} {
		h.settle(h.nodeTasks(run.ID)[node].ID, task.Complete, `{}`)
	}
	h.settle(h.nodeTasks(run.ID)["d"].ID, task.Complete, `{}`)
	require.Equal(t, job.RunCompleted, h.run(run.ID).Status)
}

// A memoized node hands on its result as if it had just written its
// output datasets again; once another run has written one of them since,
// the data there is no longer what that result was made with, and the
// node runs again. Otherwise a's memo for day 23 is taken while raw holds
// what day 24's a wrote, and b runs on day 24's data under day 23's params
// (its task_inputs then name a version written by the other run).
func TestWorkflowNodeWhoseOutputWasRewrittenRunsAgain(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	complete := func(params string) uuid.UUID {
		run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: json.RawMessage(params)})
		require.NoError(t, err)
		h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{"a": 1}`)
		tasks := h.nodeTasks(run.ID)
		h.settle(tasks["b"].ID, task.Complete, `{"b": 1}`)
		h.settle(tasks["c"].ID, task.Complete, `{"c": 1}`)
		h.settle(h.nodeTasks(run.ID)["d"].ID, task.Complete, `{}`)
		require.Equal(t, job.RunCompleted, h.run(run.ID).Status)
		return run.ID
	}
	complete(`{"day": "2026-11-23"}`)
	again, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: json.RawMessage(`{"day": "2026-11-23"}`)})
	require.NoError(t, err)
	require.Equal(t, map[string]string{"a": "MEMOIZED", "b": "MEMOIZED", "c": "MEMOIZED", "d": "MEMOIZED"}, nodeStatus(again),
		"raw is still what the first run's a wrote")

	complete(`{"day": "2026-11-24"}`) // a writes raw for day 24
	stale, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: json.RawMessage(`{"day": "2026-11-23"}`)})
	require.NoError(t, err)
	require.Equal(t, "PENDING", nodeStatus(stale)["a"], "raw now holds day 24's data: a writes day 23's again")
	h.settle(h.nodeTasks(stale.ID)["a"].ID, task.Complete, `{"a": 1}`)
	var wroteBy uuid.UUID
	require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT v.task_id FROM task_inputs i
		JOIN dataset_versions v ON v.id = i.input_version WHERE i.task_id = $1`, h.nodeTasks(stale.ID)["b"].ID).Scan(&wroteBy))
	require.Equal(t, h.nodeTasks(stale.ID)["a"].ID, wroteBy, "b reads the raw its own run's a wrote")
}

// Retention reads which runs are under way as its statement starts. A run
// started meanwhile that memoized b from a task being deleted then has a
// MEMOIZED node with no task: c's completion released d with null for b's
// result, and the run completed. A node of a running run whose task is
// gone runs again, as a retry runs one (here b, before d).
func TestWorkflowMemoizedTaskDeletedAsTheRunStartsRunsAgain(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	first, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(first.ID)["a"].ID, task.Complete, `{"a": 1}`)
	tasks := h.nodeTasks(first.ID)
	h.settle(tasks["b"].ID, task.Complete, `{"b": 1}`)
	h.settle(tasks["c"].ID, task.Complete, `{"c": 1}`)
	h.settle(h.nodeTasks(first.ID)["d"].ID, task.Complete, `{}`)
	b := tasks["b"].ID
	applyFile(t, h.db, h.p, strings.Replace(fmt.Sprintf(diamondFile, job.FailStop),
		"{name: c, type: wf.c}", "{name: c, type: wf.c, payload: {v: 2}}", 1))

	// Retention starts, sees no run under way, and waits on b's row while
	// the second run starts and memoizes b.
	var second job.Run
	h.expireDuring(b, func() {
		second, err = h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
		require.NoError(t, err)
		require.Equal(t, map[string]string{"a": "MEMOIZED", "b": "MEMOIZED", "c": "PENDING", "d": "WAITING"}, nodeStatus(second))
	})

	h.settle(h.nodeTasks(second.ID)["c"].ID, task.Complete, `{"c": 2}`)
	nodes := h.nodeTasks(second.ID)
	require.Equal(t, uuid.Nil, nodes["d"].ID, "d waits for b's result (nodes: %v)", nodeStatus(h.run(second.ID)))
	require.NotEqual(t, uuid.Nil, nodes["b"].ID, "b runs again")
	h.settle(nodes["b"].ID, task.Complete, `{"b": 2}`)
	d := h.nodeTasks(second.ID)["d"]
	var inputs []byte
	require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT inputs FROM tasks WHERE id = $1`, d.ID).Scan(&inputs))
	require.JSONEq(t, `{"params": {}, "parents": {"b": {"b": 2}, "c": {"c": 2}}}`, string(inputs))
	h.settle(d.ID, task.Complete, `{}`)
	require.Equal(t, job.RunCompleted, h.run(second.ID).Status)
}

// expireDuring puts task id past retention and deletes it as retention
// does, with do run while retention's delete, which has read which runs
// are under way, waits on the task's listing (which it deletes with the
// task, after it read them).
func (h *wfHarness) expireDuring(id uuid.UUID, do func()) {
	h.t.Helper()
	ctx := context.Background()
	_, err := h.db.Pool.Exec(ctx, `UPDATE tasks SET completed_at = now() - interval '8 days' WHERE id = $1`, id)
	require.NoError(h.t, err)
	hold, err := h.db.Pool.Begin(ctx)
	require.NoError(h.t, err)
	defer hold.Rollback(ctx) //nolint:errcheck
	_, err = hold.Exec(ctx, `SELECT 1 FROM task_listing WHERE id = $1 FOR UPDATE`, id)
	require.NoError(h.t, err)
	deleted := make(chan error, 1)
	go func() {
		_, err := postgres.NewMaintenanceStore(h.db.Pool, nil).DeleteExpired(ctx, 7*24*time.Hour, 1000)
		deleted <- err
	}()
	require.Eventually(h.t, func() bool {
		var waiting int
		err := h.db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%DELETE FROM tasks%'`).Scan(&waiting)
		return err == nil && waiting > 0
	}, 10*time.Second, 10*time.Millisecond, "retention waits on the task's listing")
	do()
	require.NoError(h.t, hold.Commit(ctx))
	require.NoError(h.t, <-deleted)
	var left int
	require.NoError(h.t, h.db.Pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE id = $1`, id).Scan(&left))
	require.Zero(h.t, left, "retention deleted the task")
}

// The same race with a retry: retention, having read the run as FAILED,
// deletes b's task once the retry has kept b as completed and released c.
// d then waited for ever on b, with nothing in flight.
func TestWorkflowRetryRacingRetentionIsNotStuck(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{"a": 1}`)
	tasks := h.nodeTasks(run.ID)
	h.settle(tasks["b"].ID, task.Complete, `{"b": 1}`)
	h.settle(tasks["c"].ID, task.Fail, "")
	require.Equal(t, job.RunFailed, h.run(run.ID).Status)

	h.expireDuring(tasks["b"].ID, func() {
		retried, err := h.store.RetryRun(ctx, h.p, run.ID, nil)
		require.NoError(t, err)
		require.Equal(t, map[string]string{"a": "COMPLETED", "b": "COMPLETED", "c": "PENDING", "d": "WAITING"}, nodeStatus(retried))
	})
	h.settle(h.nodeTasks(run.ID)["c"].ID, task.Complete, `{"c": 2}`)
	b := h.nodeTasks(run.ID)["b"]
	require.Equal(t, task.StatusPending, b.Status, "b runs again (nodes: %v)", nodeStatus(h.run(run.ID)))
	h.settle(b.ID, task.Complete, `{"b": 2}`)
	h.settle(h.nodeTasks(run.ID)["d"].ID, task.Complete, `{}`)
	require.Equal(t, job.RunCompleted, h.run(run.ID).Status)
}

// Nodes of one run may write the same dataset (each its part of a table):
// that the other node of the earlier run wrote it after the reused task
// does not make the data another run's, and both are memoized.
func TestWorkflowNodesSharingADatasetAreMemoized(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, `
jobs:
  - {name: a, type: wf.a}
  - {name: b, type: wf.b}
  - {name: c, type: wf.c}
workflows:
  - name: parts
    memoize: true
    nodes:
      - {job: a, output_datasets: [table]}
      - {job: b, output_datasets: [table]}
      - {job: c, depends_on: [a, b], input_datasets: [table]}
`)
	h := &wfHarness{t: t, db: db, p: admin, store: postgres.NewJobStore(db.Pool)}
	first, err := h.store.StartRun(ctx, admin, "parts", job.RunRequest{})
	require.NoError(t, err)
	tasks := h.nodeTasks(first.ID)
	h.settle(tasks["a"].ID, task.Complete, `{}`)
	h.settle(tasks["b"].ID, task.Complete, `{}`)
	h.settle(h.nodeTasks(first.ID)["c"].ID, task.Complete, `{}`)
	again, err := h.store.StartRun(ctx, admin, "parts", job.RunRequest{})
	require.NoError(t, err)
	require.Equal(t, map[string]string{"a": "MEMOIZED", "b": "MEMOIZED", "c": "MEMOIZED"}, nodeStatus(again))
}

// denseFile declares a workflow whose nodes each depend on all the nodes
// before them: n0 to n5, then a, b and c (job x, whose payload is
// payload), then z below everything.
func denseFile(payload string) string {
	var b strings.Builder
	b.WriteString("jobs:\n  - {name: j, type: wf.j}\n  - {name: x, type: wf.x, payload: " + payload + "}\n")
	b.WriteString("workflows:\n  - name: dense\n    on_failure: continue\n    memoize: true\n    nodes:\n")
	var above []string
	node := func(name, job string) {
		fmt.Fprintf(&b, "      - {name: %s, job: %s, depends_on: [%s]}\n", name, job, strings.Join(above, ", "))
	}
	for i := range 6 {
		name := fmt.Sprintf("n%d", i)
		node(name, "j")
		above = append(above, name)
	}
	for _, name := range []string{"a", "b", "c"} {
		node(name, "x")
	}
	above = append(above, "a", "b", "c")
	node("z", "j")
	return b.String()
}

// A run of a dense workflow moves as its nodes' parents settle: one node
// at a time down the chain, then a, b and c together in the order of their
// positions; memoization cascades through every node whose inputs are
// unchanged and stops at the first that changed, and the nodes below a
// failed or skipped one are skipped.
func TestWorkflowDenseGraphRunsAndMemoizesInOrder(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	applyFile(t, db, admin, denseFile("{v: 1}"))
	h := &wfHarness{t: t, db: db, p: admin, store: postgres.NewJobStore(db.Pool)}
	ctx := context.Background()
	params := job.RunRequest{Params: json.RawMessage(`{"day": 1}`)}
	chain := []string{"n0", "n1", "n2", "n3", "n4", "n5"}
	all := append(append([]string{}, chain...), "a", "b", "c", "z")
	outbox := func(run uuid.UUID) []string {
		rows, err := h.db.Pool.Query(ctx, `SELECT t.node FROM outbox o JOIN tasks t ON t.id = o.task_id
			WHERE t.run_id = $1 ORDER BY o.id`, run)
		require.NoError(t, err)
		nodes, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return nodes
	}
	each := func(state string, nodes ...string) map[string]string {
		out := map[string]string{}
		for _, n := range nodes {
			out[n] = state
		}
		return out
	}
	merge := func(ms ...map[string]string) map[string]string {
		out := map[string]string{}
		for _, m := range ms {
			for k, v := range m {
				out[k] = v
			}
		}
		return out
	}

	first, err := h.store.StartRun(ctx, h.p, "dense", params)
	require.NoError(t, err)
	for i, n := range chain {
		r := h.run(first.ID)
		require.Equal(t, merge(each("COMPLETED", chain[:i]...), each("PENDING", n), each("WAITING", all[i+1:]...)),
			nodeStatus(r), "only %s is ready", n)
		h.settle(h.nodeTasks(first.ID)[n].ID, task.Complete, fmt.Sprintf(`{"n": %d}`, i))
	}
	require.Equal(t, merge(each("COMPLETED", chain...), each("PENDING", "a", "b", "c"), each("WAITING", "z")),
		nodeStatus(h.run(first.ID)))
	require.Equal(t, append(append([]string{}, chain...), "a", "b", "c"), outbox(first.ID))
	tasks := h.nodeTasks(first.ID)
	for _, n := range []string{"c", "a", "b"} {
		h.settle(tasks[n].ID, task.Complete, `{"x": "`+n+`"}`)
	}
	h.settle(h.nodeTasks(first.ID)["z"].ID, task.Complete, `{}`)
	require.Equal(t, job.RunCompleted, h.run(first.ID).Status)

	// Nothing changed: every node is memoized, each wave from the one
	// above it, and the run completes as it starts.
	again, err := h.store.StartRun(ctx, h.p, "dense", params)
	require.NoError(t, err)
	require.Equal(t, job.RunCompleted, again.Status)
	require.Equal(t, each("MEMOIZED", all...), nodeStatus(again))
	for _, n := range again.Nodes {
		require.Equal(t, first.ID, *n.MemoizedFrom, n.Name)
	}
	require.Empty(t, h.nodeTasks(again.ID))

	// x changed: the chain is memoized, a, b and c run, in their order,
	// and z waits for all three; their results are as in the first run's,
	// so z is then memoized. Another change that alters their results
	// runs z.
	applyFile(t, db, admin, denseFile("{v: 2}"))
	changed, err := h.store.StartRun(ctx, h.p, "dense", params)
	require.NoError(t, err)
	require.Equal(t, merge(each("MEMOIZED", chain...), each("PENDING", "a", "b", "c"), each("WAITING", "z")),
		nodeStatus(changed))
	require.Equal(t, []string{"a", "b", "c"}, outbox(changed.ID))
	tasks = h.nodeTasks(changed.ID)
	h.settle(tasks["a"].ID, task.Complete, `{"x": "a"}`)
	h.settle(tasks["b"].ID, task.Complete, `{"x": "b"}`)
	require.Equal(t, "WAITING", nodeStatus(h.run(changed.ID))["z"])
	h.settle(tasks["c"].ID, task.Complete, `{"x": "c"}`)
	r := h.run(changed.ID)
	require.Equal(t, job.RunCompleted, r.Status)
	require.Equal(t, "MEMOIZED", nodeStatus(r)["z"], "z's inputs are as in the first run")
	require.Equal(t, first.ID, *r.Nodes[len(r.Nodes)-1].MemoizedFrom)

	applyFile(t, db, admin, denseFile("{v: 3}"))
	other, err := h.store.StartRun(ctx, h.p, "dense", params)
	require.NoError(t, err)
	tasks = h.nodeTasks(other.ID)
	for _, n := range []string{"a", "b", "c"} {
		h.settle(tasks[n].ID, task.Complete, `{"x": "other"}`)
	}
	require.Equal(t, merge(each("MEMOIZED", chain...), each("COMPLETED", "a", "b", "c"), each("PENDING", "z")),
		nodeStatus(h.run(other.ID)), "a result changed: z runs")
	h.settle(h.nodeTasks(other.ID)["z"].ID, task.Complete, `{}`)

	// x is gone: a, b and c are skipped as the cascade reaches them, and z
	// below them.
	_, err = h.db.Pool.Exec(ctx, `DELETE FROM jobs WHERE org_id = $1 AND name = 'x'`, h.p.OrgID)
	require.NoError(t, err)
	gone, err := h.store.StartRun(ctx, h.p, "dense", params)
	require.NoError(t, err)
	require.Equal(t, job.RunFailed, gone.Status)
	require.Equal(t, "node a: job x no longer exists", gone.Error)
	require.Equal(t, merge(each("MEMOIZED", chain...), each("SKIPPED", "a", "b", "c", "z")), nodeStatus(gone))
	require.Empty(t, h.nodeTasks(gone.ID))

	// A node that fails skips every node below it.
	applyFile(t, db, admin, denseFile("{v: 1}"))
	forced, err := h.store.StartRun(ctx, h.p, "dense", job.RunRequest{Params: params.Params, Force: true})
	require.NoError(t, err)
	h.settle(h.nodeTasks(forced.ID)["n0"].ID, task.Complete, `{"n": 0}`)
	h.settle(h.nodeTasks(forced.ID)["n1"].ID, task.Complete, `{"n": 1}`)
	h.settle(h.nodeTasks(forced.ID)["n2"].ID, task.Fail, ``)
	failed := h.run(forced.ID)
	require.Equal(t, job.RunFailed, failed.Status)
	require.Equal(t, "node failed: n2", failed.Error)
	require.Equal(t, merge(each("COMPLETED", "n0", "n1"), each("FAILED", "n2"),
		each("SKIPPED", "n3", "n4", "n5", "a", "b", "c", "z")), nodeStatus(failed))
}

// A retry keeps a completed node only while its output datasets hold what
// its task wrote. Here day 23's run failed at b after a wrote raw; day
// 24's run then wrote raw. Kept, a would hand b day 24's data under day
// 23's params (b's task_inputs would name the version day 24's a wrote);
// it runs again instead, as memoization would refuse it.
func TestWorkflowRetryRunsAgainANodeWhoseOutputWasRewritten(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	day23 := json.RawMessage(`{"day": "2026-11-23"}`)
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: day23})
	require.NoError(t, err)
	first := h.nodeTasks(run.ID)["a"].ID
	h.settle(first, task.Complete, `{"a": 23}`)
	tasks := h.nodeTasks(run.ID)
	h.settle(tasks["c"].ID, task.Complete, `{}`)
	h.settle(tasks["b"].ID, task.Fail, "")
	require.Equal(t, job.RunFailed, h.run(run.ID).Status)

	other, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Params: json.RawMessage(`{"day": "2026-11-24"}`)})
	require.NoError(t, err)
	h.settle(h.nodeTasks(other.ID)["a"].ID, task.Complete, `{"a": 24}`)

	retried, err := h.store.RetryRun(ctx, h.p, run.ID, nil)
	require.NoError(t, err)
	require.Equal(t, map[string]string{"a": "PENDING", "b": "WAITING", "c": "COMPLETED", "d": "WAITING"}, nodeStatus(retried),
		"raw holds day 24's data: a writes day 23's again before b reads it")
	again := h.nodeTasks(run.ID)["a"].ID
	require.NotEqual(t, first, again)
	h.settle(again, task.Complete, `{"a": 23}`)
	var wroteBy uuid.UUID
	require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT v.task_id FROM task_inputs i
		JOIN dataset_versions v ON v.id = i.input_version WHERE i.task_id = $1`, h.nodeTasks(run.ID)["b"].ID).Scan(&wroteBy))
	require.Equal(t, again, wroteBy, "b reads the raw its own run wrote")
}

// A retry that only needs b again keeps a while raw still holds what a
// wrote, even though the run itself is the only writer since.
func TestWorkflowRetryKeepsANodeWhoseOutputIsItsRuns(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	a := h.nodeTasks(run.ID)["a"].ID
	h.settle(a, task.Complete, `{}`)
	tasks := h.nodeTasks(run.ID)
	h.settle(tasks["c"].ID, task.Complete, `{}`)
	h.settle(tasks["b"].ID, task.Fail, "")
	retried, err := h.store.RetryRun(ctx, h.p, run.ID, nil)
	require.NoError(t, err)
	require.Equal(t, map[string]string{"a": "COMPLETED", "b": "PENDING", "c": "COMPLETED", "d": "WAITING"}, nodeStatus(retried))
	require.Equal(t, a, h.nodeTasks(run.ID)["a"].ID)
}

// A run's retry takes the retrying request's trace, as a task's retry
// does; the request's span links to the trace the run had, where its
// earlier tasks are: the run no longer names it.
func TestWorkflowRetryLinksToTheRunsPreviousTrace(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	const original = "4bf92f3577b34da6a3ce929d0e0e4736"
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{Trace: task.Carrier{"traceparent": "00-" + original + "-00f067aa0ba902b7-01"}})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Fail, "")
	require.Equal(t, job.RunFailed, h.run(run.ID).Status)

	rec := tracetest.NewSpanRecorder()
	rctx, span := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)).Tracer("test").Start(ctx, "POST /v1/runs/{id}/retry")
	carrier := task.Carrier{"traceparent": "00-" + span.SpanContext().TraceID().String() + "-" + span.SpanContext().SpanID().String() + "-01"}
	_, err = h.store.RetryRun(rctx, h.p, run.ID, carrier)
	require.NoError(t, err)
	span.End()
	ended := rec.Ended()
	require.Len(t, ended, 1)
	var linked []string
	for _, l := range ended[0].Links() {
		linked = append(linked, l.SpanContext.TraceID().String())
	}
	require.Equal(t, []string{original}, linked, "the retry's span links to the trace the run had")
}

// A run that failed with tasks still in flight has them cancelled by the
// scheduler's next sweep, and cannot be retried until then. Cancelling it
// does that now, as cancelling a running run would, instead of a 409: its
// pending task is cancelled, its running one asked to stop, and the run
// stays FAILED. Once that is done, a cancel is a conflict again.
func TestWorkflowCancelOfAFailedRunStopsItsTasks(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
	tasks := h.nodeTasks(run.ID)
	h.settle(tasks["b"].ID, task.Fail, "")
	require.Equal(t, job.RunFailed, h.run(run.ID).Status)
	_, err = h.store.RetryRun(ctx, h.p, run.ID, nil)
	require.ErrorContains(t, err, "still stopping")

	r, err := h.store.CancelRun(ctx, h.p, run.ID, nil)
	require.NoError(t, err, "c, still pending, is cancelled now")
	require.Equal(t, job.RunFailed, r.Status, "the run failed: it stays so")
	require.Equal(t, "CANCELLED", nodeStatus(r)["c"])
	_, err = h.store.CancelRun(ctx, h.p, run.ID, nil)
	require.Equal(t, task.ErrCodeConflict, task.ErrorCode(err))
	retried, err := h.store.RetryRun(ctx, h.p, run.ID, nil)
	require.NoError(t, err, "nothing is in flight any more")
	require.Equal(t, job.RunRunning, retried.Status)

	// A running task is asked to stop; a second cancel says it was.
	tasks = h.nodeTasks(run.ID)
	_, err = postgres.NewWorkerStore(h.db.Pool, nil).Claim(ctx, []uuid.UUID{tasks["c"].ID}, "w1", time.Minute)
	require.NoError(t, err)
	h.settle(tasks["b"].ID, task.Fail, "")
	r, err = h.store.CancelRun(ctx, h.p, run.ID, nil)
	require.NoError(t, err)
	require.Equal(t, job.RunFailed, r.Status)
	require.Equal(t, "IN_PROGRESS", nodeStatus(r)["c"])
	require.Equal(t, task.StateCancelRequested, r.Nodes[2].TaskState)
	_, err = h.store.CancelRun(ctx, h.p, run.ID, nil)
	require.Equal(t, task.ErrCodeConflict, task.ErrorCode(err))
	require.ErrorContains(t, err, "asked to stop")
}

// whileBumped runs f while another transaction holds task id with its
// version raised, as a worker's progress write does, and commits that
// transaction once f waits for the row: f then finds the version it read
// gone.
func whileBumped[T any](t *testing.T, db *testdb.DB, id uuid.UUID, f func() (T, error)) (T, error) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `UPDATE tasks SET progress = 50, version = version + 1 WHERE id = $1`, id)
	require.NoError(t, err)
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := f()
		done <- result{v, err}
	}()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n))
		return n == 1
	}, 10*time.Second, 10*time.Millisecond, "f waits for the row")
	require.NoError(t, tx.Commit(ctx))
	got := <-done
	return got.v, got.err
}

// A run's cancel that meets a running node's progress write between its
// read and its change reads the node again, as a task's cancel does: the
// node is asked to stop now, not at the scheduler's next sweep.
func TestWorkflowCancelRetriesANodeThatChangedMeanwhile(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
	tasks := h.nodeTasks(run.ID)
	_, err = postgres.NewWorkerStore(h.db.Pool, nil).Claim(ctx, []uuid.UUID{tasks["b"].ID}, "w1", time.Minute)
	require.NoError(t, err)

	r, err := whileBumped(t, h.db, tasks["b"].ID, func() (job.Run, error) { return h.store.CancelRun(ctx, h.p, run.ID, nil) })
	require.NoError(t, err)
	require.Equal(t, job.RunCancelled, r.Status)
	require.Equal(t, "CANCELLED", nodeStatus(r)["c"])
	require.Equal(t, task.StateCancelRequested, r.Nodes[1].TaskState, "b is asked to stop")
}

// So does the scheduler's sweep.
func TestCancelStoppedRetriesATaskThatChangedMeanwhile(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
	tasks := h.nodeTasks(run.ID)
	_, err = postgres.NewWorkerStore(h.db.Pool, nil).Claim(ctx, []uuid.UUID{tasks["c"].ID}, "w1", time.Minute)
	require.NoError(t, err)
	h.settle(tasks["b"].ID, task.Fail, "")
	require.Equal(t, job.RunFailed, h.run(run.ID).Status)

	s := postgres.NewSchedulerStore(h.db.Pool, nil)
	n, err := whileBumped(t, h.db, tasks["c"].ID, func() (int, error) { return s.CancelStopped(ctx, 100) })
	require.NoError(t, err)
	require.Equal(t, 1, n)
	var requested bool
	require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT cancel_requested_at IS NOT NULL FROM tasks WHERE id = $1`,
		tasks["c"].ID).Scan(&requested))
	require.True(t, requested, "c is asked to stop")
}

// A node's handler that fanned out (Reporter.Gather) waits for its
// children with its task PENDING. Cancelling the run stops those children
// with the node, and the run is retried only once they have ended: a node
// run again spawns its children anew, and the earlier ones would do the
// same work beside them.
func TestWorkflowCancelStopsTheChildrenOfItsNodes(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
	w := postgres.NewWorkerStore(h.db.Pool, nil)
	claimed, err := w.Claim(ctx, []uuid.UUID{h.nodeTasks(run.ID)["b"].ID}, "w1", time.Minute)
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	b := claimed[0]
	var subs []task.Submission
	for _, key := range []string{"k1", "k2"} {
		s, err := task.NewSubmission(task.SubmitInput{Type: "fan.child", Dedupe: new(bool)}, task.Defaults{MaxAttempts: 3}, "")
		require.NoError(t, err)
		s.OrgID, s.ParentID, s.ChildKey = b.OrgID, &b.ID, key
		subs = append(subs, s)
	}
	kids, err := w.Spawn(ctx, b, subs, nil)
	require.NoError(t, err)
	require.Len(t, kids, 2)
	running, err := w.Claim(ctx, []uuid.UUID{kids[0].ID}, "w2", time.Minute)
	require.NoError(t, err)
	require.Len(t, running, 1)
	out, _, err := w.Apply(ctx, []task.Change{{TaskID: b.ID, Version: b.Version, Transition: task.Await}})
	require.NoError(t, err)
	require.False(t, out[0].Fenced)

	r, err := h.store.CancelRun(ctx, h.p, run.ID, nil)
	require.NoError(t, err)
	require.Equal(t, job.RunCancelled, r.Status)
	require.Equal(t, "CANCELLED", nodeStatus(r)["b"])
	child := func(id uuid.UUID) (string, bool) {
		var status string
		var asked bool
		require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT status, cancel_requested_at IS NOT NULL FROM tasks WHERE id = $1`,
			id).Scan(&status, &asked))
		return status, asked
	}
	status, _ := child(kids[1].ID)
	require.Equal(t, "CANCELLED", status, "b's pending child is cancelled with the run")
	status, asked := child(kids[0].ID)
	require.Equal(t, "IN_PROGRESS", status)
	require.True(t, asked, "b's running child is asked to stop with the run")

	_, err = h.store.RetryRun(ctx, h.p, run.ID, nil)
	require.Equal(t, task.ErrCodeConflict, task.ErrorCode(err), "b's child still runs")
	require.ErrorContains(t, err, "still stopping")
	_, err = h.store.CancelRun(ctx, h.p, run.ID, nil)
	require.Equal(t, task.ErrCodeConflict, task.ErrorCode(err), "nothing is left to cancel")
	require.ErrorContains(t, err, "asked to stop")

	var version int
	require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT version FROM tasks WHERE id = $1`, running[0].ID).Scan(&version))
	_, errs, err := w.Apply(ctx, []task.Change{{TaskID: running[0].ID, Version: version, Transition: task.HonourCancel}})
	require.NoError(t, err)
	require.NoError(t, errs[0])
	status, _ = child(kids[0].ID)
	require.Equal(t, "CANCELLED", status)
	retried, err := h.store.RetryRun(ctx, h.p, run.ID, nil)
	require.NoError(t, err, "every task of the run has ended")
	require.Equal(t, job.RunRunning, retried.Status)
}

// The children of a node's handler that ended are the node's work too, and
// so are theirs: a child that failed (its parent's sweep is still to come)
// may leave a grandchild in flight. Cancelling the run stops it with the
// rest, and retrying the run waits for it.
func TestWorkflowCancelStopsTheGrandchildrenOfItsNodes(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
	w := postgres.NewWorkerStore(h.db.Pool, nil)
	spawn := func(parent task.Task, key string) task.ChildState {
		t.Helper()
		s, err := task.NewSubmission(task.SubmitInput{Type: "fan.child", Dedupe: new(bool)}, task.Defaults{MaxAttempts: 3}, "")
		require.NoError(t, err)
		s.OrgID, s.ParentID, s.ChildKey = parent.OrgID, &parent.ID, key
		kids, err := w.Spawn(ctx, parent, []task.Submission{s}, nil)
		require.NoError(t, err)
		require.Len(t, kids, 1)
		return kids[0]
	}
	claim := func(id uuid.UUID) task.Task {
		t.Helper()
		claimed, err := w.Claim(ctx, []uuid.UUID{id}, "w1", time.Minute)
		require.NoError(t, err)
		require.Len(t, claimed, 1)
		return claimed[0]
	}
	b := claim(h.nodeTasks(run.ID)["b"].ID)
	child := claim(spawn(b, "k1").ID)
	grandchild := spawn(child, "g1")
	out, _, err := w.Apply(ctx, []task.Change{{TaskID: b.ID, Version: b.Version, Transition: task.Await}})
	require.NoError(t, err)
	require.False(t, out[0].Fenced)
	_, errs, err := w.Apply(ctx, []task.Change{{TaskID: child.ID, Version: child.Version, Transition: task.Fail, Error: "boom"}})
	require.NoError(t, err)
	require.NoError(t, errs[0])

	_, err = h.store.CancelRun(ctx, h.p, run.ID, nil)
	require.NoError(t, err)
	var status string
	require.NoError(t, h.db.Pool.QueryRow(ctx, `SELECT status FROM tasks WHERE id = $1`, grandchild.ID).Scan(&status))
	require.Equal(t, "CANCELLED", status, "the failed child's pending child is cancelled with the run")
}

// A retry of a run waits for a grandchild of a node still in flight.
func TestWorkflowRetryWaitsForTheGrandchildrenOfItsNodes(t *testing.T) {
	t.Parallel()
	h := newWorkflowHarness(t, job.FailStop)
	ctx := context.Background()
	run, err := h.store.StartRun(ctx, h.p, "diamond", job.RunRequest{})
	require.NoError(t, err)
	h.settle(h.nodeTasks(run.ID)["a"].ID, task.Complete, `{}`)
	h.settle(h.nodeTasks(run.ID)["c"].ID, task.Complete, `{}`)
	w := postgres.NewWorkerStore(h.db.Pool, nil)
	claimed, err := w.Claim(ctx, []uuid.UUID{h.nodeTasks(run.ID)["b"].ID}, "w1", time.Minute)
	require.NoError(t, err)
	b := claimed[0]
	s, err := task.NewSubmission(task.SubmitInput{Type: "fan.child", Dedupe: new(bool)}, task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	s.OrgID, s.ParentID, s.ChildKey = b.OrgID, &b.ID, "k1"
	kids, err := w.Spawn(ctx, b, []task.Submission{s}, nil)
	require.NoError(t, err)
	claimed, err = w.Claim(ctx, []uuid.UUID{kids[0].ID}, "w2", time.Minute)
	require.NoError(t, err)
	child := claimed[0]
	g, err := task.NewSubmission(task.SubmitInput{Type: "fan.child", Dedupe: new(bool)}, task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	g.OrgID, g.ParentID, g.ChildKey = child.OrgID, &child.ID, "g1"
	grand, err := w.Spawn(ctx, child, []task.Submission{g}, nil)
	require.NoError(t, err)
	claimed, err = w.Claim(ctx, []uuid.UUID{grand[0].ID}, "w3", time.Minute)
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	// The child fails, and so does b (as its handler does on the child's
	// failure): the run fails with the grandchild still running.
	_, errs, err := w.Apply(ctx, []task.Change{{TaskID: child.ID, Version: child.Version, Transition: task.Fail, Error: "boom"}})
	require.NoError(t, err)
	require.NoError(t, errs[0])
	_, errs, err = w.Apply(ctx, []task.Change{{TaskID: b.ID, Version: b.Version, Transition: task.Fail, Error: "boom"}})
	require.NoError(t, err)
	require.NoError(t, errs[0])
	r, err := h.store.Run(ctx, h.p, run.ID)
	require.NoError(t, err)
	require.Equal(t, job.RunFailed, r.Status)

	_, err = h.store.RetryRun(ctx, h.p, run.ID, nil)
	require.Equal(t, task.ErrCodeConflict, task.ErrorCode(err), "b's grandchild still runs: %v", err)
}
