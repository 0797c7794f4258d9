package postgres_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	oteltrace "go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

var admitAll = job.AdmitConfig{MinWindow: 64, DeadAfter: time.Minute, MaxGroups: 1000, MaxAdmit: 1000}

func applyFile(t *testing.T, db *testdb.DB, p auth.Principal, file string) {
	t.Helper()
	f, err := job.Parse([]byte(file))
	require.NoError(t, err)
	_, err = postgres.NewJobStore(db.Pool).Apply(context.Background(), p, f, false, false)
	require.NoError(t, err)
}

func submitOf(t *testing.T, db *testdb.DB, p auth.Principal, typ, key string, n int) []uuid.UUID {
	t.Helper()
	store := postgres.NewAPIStore(db.Pool, nil)
	var ids []uuid.UUID
	for range n {
		sub, err := task.NewSubmission(task.SubmitInput{Type: typ, ConcurrencyKey: key, Dedupe: new(bool)},
			task.Defaults{MaxAttempts: 3}, "")
		require.NoError(t, err)
		res, err := store.Submit(context.Background(), p, sub, nil)
		require.NoError(t, err)
		ids = append(ids, res.Task.ID)
	}
	return ids
}

// admitted returns which of ids are admitted and not finished, and checks
// that exactly those have a task.run message waiting.
func admitted(t *testing.T, db *testdb.DB, ids []uuid.UUID) map[uuid.UUID]bool {
	t.Helper()
	out := map[uuid.UUID]bool{}
	rows, err := db.Pool.Query(context.Background(), `SELECT id, admitted,
		EXISTS (SELECT 1 FROM outbox o WHERE o.task_id = t.id AND o.kind = 'task.run') FROM tasks t WHERE id = ANY ($1) AND status IN ('PENDING', 'IN_PROGRESS')`, ids)
	require.NoError(t, err)
	var id uuid.UUID
	var ok, queued bool
	_, err = pgx.ForEachRow(rows, []any{&id, &ok, &queued}, func() error {
		require.Equal(t, ok, queued, "task %s: admitted %t but message %t", id, ok, queued)
		if ok {
			out[id] = true
		}
		return nil
	})
	require.NoError(t, err)
	return out
}

// finish runs admitted tasks to completion, as a worker would.
func finish(t *testing.T, db *testdb.DB, ids []uuid.UUID) {
	t.Helper()
	ctx := context.Background()
	w := postgres.NewWorkerStore(db.Pool, nil)
	claimed, err := w.Claim(ctx, ids, "w1", time.Minute)
	require.NoError(t, err)
	require.Len(t, claimed, len(ids))
	changes := make([]task.Change, len(claimed))
	for i, c := range claimed {
		changes[i] = task.Change{TaskID: c.ID, Version: c.Version, Transition: task.Complete, Result: json.RawMessage(`{}`)}
	}
	_, errs, err := w.Apply(ctx, changes)
	require.NoError(t, err)
	for _, e := range errs {
		require.NoError(t, e)
	}
}

func keys(m map[uuid.UUID]bool) []uuid.UUID {
	var out []uuid.UUID
	for id := range m {
		out = append(out, id)
	}
	return out
}

// A type limit holds its tasks back until a slot is free; a per-key limit
// holds back only the tasks of a busy key; and a claim refuses a task not
// admitted, whatever message reaches it.
func TestAdmissionKeepsLimits(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, "types:\n  - type: lim.total\n    max_concurrency: 2\n  - type: lim.keyed\n    max_concurrency_per_key: 1\n")
	total := submitOf(t, db, admin, "lim.total", "", 5)
	a := submitOf(t, db, admin, "lim.keyed", "a", 3)
	b := submitOf(t, db, admin, "lim.keyed", "b", 1)
	free := submitOf(t, db, admin, "lim.free", "", 2)
	require.Len(t, admitted(t, db, free), 2, "an unlimited type's tasks are admitted as they are written")
	require.Empty(t, admitted(t, db, append(append(total, a...), b...)), "limited tasks wait for the scheduler")
	claimed, err := postgres.NewWorkerStore(db.Pool, nil).Claim(ctx, total, "w1", time.Minute)
	require.NoError(t, err)
	require.Empty(t, claimed, "a task not admitted is never claimed")

	s := postgres.NewSchedulerStore(db.Pool, nil)
	st, err := s.Admit(ctx, admitAll)
	require.NoError(t, err)
	require.Equal(t, 4, st.Admitted)
	first := admitted(t, db, total)
	require.Len(t, first, 2, "two slots")
	require.Len(t, admitted(t, db, a), 1, "one per key")
	require.Len(t, admitted(t, db, b), 1)
	require.True(t, first[total[0]] && first[total[1]], "the oldest first")

	// Nothing more until a slot is freed; then the next in line.
	st, err = s.Admit(ctx, admitAll)
	require.NoError(t, err)
	require.Zero(t, st.Admitted)
	finish(t, db, keys(first)[:1])
	st, err = s.Admit(ctx, admitAll)
	require.NoError(t, err)
	require.Equal(t, 1, st.Admitted)
	require.Len(t, admitted(t, db, total), 2, "one finished, one admitted in its place")
	var done int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE id = ANY ($1) AND status = 'COMPLETED'`, total).Scan(&done))
	require.Equal(t, 1, done)
}

// Admission takes turns between orgs: a type in fair mode admits a small
// org's tasks before the rest of a big org's backlog.
func TestAdmissionTakesTurnsBetweenOrgs(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, big := db.Key(t, "big", auth.Admin)
	_, small := db.Key(t, "small", auth.Admin)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `INSERT INTO task_types (name) VALUES ('fair.t')`)
	require.NoError(t, err)
	window := admitAll
	window.Window = 10
	s := postgres.NewSchedulerStore(db.Pool, nil)

	// The big org fills the queue past the window: the type goes into
	// fair mode and new tasks wait.
	first := submitOf(t, db, big, "fair.t", "", 11)
	require.Len(t, admitted(t, db, first), 11)
	st, err := s.Admit(ctx, window)
	require.NoError(t, err)
	require.Equal(t, []string{"fair.t"}, st.Fair)
	backlog := submitOf(t, db, big, "fair.t", "", 30)
	trickle := submitOf(t, db, small, "fair.t", "", 3)
	require.Empty(t, admitted(t, db, append(backlog, trickle...)))

	// Ten of the first run; one still queued leaves room for nine: the
	// small org's three go in with six of the big org's.
	finish(t, db, first[:10])
	st, err = s.Admit(ctx, window)
	require.NoError(t, err)
	require.Equal(t, 9, st.Admitted)
	require.Len(t, admitted(t, db, trickle), 3, "the small org is not starved")
	require.Len(t, admitted(t, db, backlog), 6)

	// Once the backlog is through and the queue short, the type admits
	// directly again.
	for range 10 {
		rows, err := db.Pool.Query(ctx, `SELECT id FROM tasks WHERE admitted AND status = 'PENDING'`)
		require.NoError(t, err)
		queued, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
		require.NoError(t, err)
		if len(queued) > 0 {
			finish(t, db, queued)
		}
		if st, err = s.Admit(ctx, window); err == nil && len(st.Fair) == 0 {
			break
		}
		require.NoError(t, err)
	}
	require.Empty(t, st.Fair)
	require.Len(t, admitted(t, db, submitOf(t, db, small, "fair.t", "", 1)), 1)
}

// A type in fair mode with nothing waiting is counted at most every
// RecountAfter: until then its last count stands. A type that admits
// directly is counted on every pass (a flood turns fair mode on at once),
// and so is a type with tasks waiting, as its room decides how many go in.
func TestAdmissionRecountsAQueueAfterItsInterval(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, org := db.Key(t, "org", auth.Admin)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `INSERT INTO task_types (name) VALUES ('recount.t')`)
	require.NoError(t, err)
	cfg := admitAll
	cfg.Window, cfg.RecountAfter = 10, time.Hour
	s := postgres.NewSchedulerStore(db.Pool, nil)
	admit := func() job.AdmitStats {
		t.Helper()
		st, err := s.Admit(ctx, cfg)
		require.NoError(t, err)
		return st
	}

	require.Empty(t, admit().Fair)
	first := submitOf(t, db, org, "recount.t", "", 11)
	require.Len(t, admitted(t, db, first), 11)
	require.Equal(t, []string{"recount.t"}, admit().Fair, "a type that admits directly is counted on every pass")

	finish(t, db, first[:10])
	require.Equal(t, []string{"recount.t"}, admit().Fair, "in fair mode with nothing waiting, the last count (11) stands")
	cfg.RecountAfter = 0
	require.Empty(t, admit().Fair, "counted again: one queued, the type admits directly")

	// Back in fair mode with 12 queued, just counted; two tasks wait and
	// five finish: the pass counts again and finds room for both.
	cfg.RecountAfter = time.Hour
	second := submitOf(t, db, org, "recount.t", "", 11)
	require.Equal(t, []string{"recount.t"}, admit().Fair)
	waiting := submitOf(t, db, org, "recount.t", "", 2)
	require.Empty(t, admitted(t, db, waiting))
	finish(t, db, second[:5])
	st := admit()
	require.Equal(t, 2, st.Admitted)
	require.Len(t, admitted(t, db, waiting), 2)
}

// A cron job makes one task per tick however many passes run at once, and
// ticks missed for longer than the catch-up window follow the job's policy.
func TestCronMakesEachTickOnce(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, `jobs:
  - name: every-second
    type: cron.t
    source: {kind: cron, schedule: "@every 1s"}
  - name: skipper
    type: cron.t
    source: {kind: cron, schedule: "@every 1s", missed: skip}
  - name: once
    type: cron.t
    source: {kind: cron, schedule: "@every 1s", missed: run_once}
`)
	now := time.Now().Truncate(time.Second)
	// Pretend every-second's cursor is 10s old (within the catch-up
	// window) and the others' 100s old (beyond it).
	_, err := db.Pool.Exec(ctx, `UPDATE jobs SET next_tick_at = $1::timestamptz - CASE name WHEN 'every-second' THEN interval '10 seconds'
		ELSE interval '100 seconds' END`, now)
	require.NoError(t, err)

	s := postgres.NewSchedulerStore(db.Pool, nil)
	cfg := job.CronConfig{CatchUp: 30 * time.Second, MaxJobs: 100, MaxTicks: 1000}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			_, err := s.Cron(ctx, cfg, now)
			require.NoError(t, err)
		})
	}
	wg.Wait()

	count := func(name string) (n, distinct int) {
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT scheduled_at) FROM tasks t
			JOIN jobs j ON j.id = t.job_id WHERE j.name = $1`, name).Scan(&n, &distinct))
		return n, distinct
	}
	n, distinct := count("every-second")
	require.Equal(t, 11, n, "the ticks of the last ten seconds and now, each once")
	require.Equal(t, n, distinct)
	n, _ = count("skipper")
	require.Equal(t, 31, n, "missed ticks skipped: only those within the catch-up window")
	n, _ = count("once")
	require.Equal(t, 32, n, "missed ticks run once: the latest missed one, and those within the window")

	// The cursors moved past now: the same instant again makes nothing.
	st, err := s.Cron(ctx, cfg, now)
	require.NoError(t, err)
	require.Zero(t, st.Made)
	var next time.Time
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT min(next_tick_at) FROM jobs`).Scan(&next))
	require.Equal(t, now.Add(time.Second), next.Truncate(time.Second))

	// A cursor moved back (a deposed leader's stale view) makes no tick
	// twice: each tick's task is unique.
	_, err = db.Pool.Exec(ctx, `UPDATE jobs SET next_tick_at = next_tick_at - interval '5 seconds'`)
	require.NoError(t, err)
	st, err = s.Cron(ctx, cfg, now)
	require.NoError(t, err)
	require.Zero(t, st.Made)
	n, distinct = count("every-second")
	require.Equal(t, 11, n)
	require.Equal(t, n, distinct)
}

// A nightly job at 02:30 New York time runs once on the night the clocks
// spring forward over 02:30, and once on the night they fall back over
// 01:30-02:00 and a 01:30 job's time happens twice.
func TestCronNightlyJobRunsOnceOnTheDaysTheClocksChange(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, `jobs:
  - name: spring
    type: cron.t
    source: {kind: cron, schedule: "30 2 * * *", timezone: America/New_York}
  - name: fall
    type: cron.t
    source: {kind: cron, schedule: "30 1 * * *", timezone: America/New_York}
`)
	_, err := db.Pool.Exec(ctx, `UPDATE jobs SET next_tick_at = CASE name WHEN 'spring' THEN timestamptz '2024-03-09T07:30:00Z'
		ELSE timestamptz '2024-11-02T05:30:00Z' END`)
	require.NoError(t, err)
	s := postgres.NewSchedulerStore(db.Pool, nil)
	cfg := job.CronConfig{CatchUp: time.Hour, MaxJobs: 100, MaxTicks: 1000}
	// A pass every ten minutes through both days.
	for _, day := range []time.Time{time.Date(2024, 3, 9, 7, 0, 0, 0, time.UTC), time.Date(2024, 11, 2, 5, 0, 0, 0, time.UTC)} {
		for now := day; now.Before(day.Add(50 * time.Hour)); now = now.Add(10 * time.Minute) {
			_, err := s.Cron(ctx, cfg, now)
			require.NoError(t, err)
		}
	}
	ticks := func(name string, month time.Month) (out []time.Time) {
		rows, err := db.Pool.Query(ctx, `SELECT t.scheduled_at FROM tasks t JOIN jobs j ON j.id = t.job_id
			WHERE j.name = $1 AND extract(month FROM t.scheduled_at AT TIME ZONE 'UTC') = $2 ORDER BY 1`, name, int(month))
		require.NoError(t, err)
		out, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (time.Time, error) {
			var at time.Time
			return at, r.Scan(&at)
		})
		require.NoError(t, err)
		for i := range out {
			out[i] = out[i].UTC()
		}
		return out
	}
	utc := func(s string) time.Time {
		at, err := time.Parse(time.RFC3339, s)
		require.NoError(t, err)
		return at
	}
	require.Equal(t, []time.Time{utc("2024-03-09T07:30:00Z"), utc("2024-03-10T07:30:00Z"), utc("2024-03-11T06:30:00Z")}, ticks("spring", time.March),
		"02:30 did not exist on 10 March: the tick comes as the clocks jump past it")
	require.Equal(t, []time.Time{utc("2024-11-02T05:30:00Z"), utc("2024-11-03T05:30:00Z"), utc("2024-11-04T06:30:00Z")}, ticks("fall", time.November),
		"01:30 happened twice on 3 November: one tick")
}

// After a downtime with more missed ticks than one pass reads (MaxTicks),
// missed: run_once still makes a single task for the missed ticks (the
// latest), not one per pass.
func TestCronRunOnceAfterLongDowntimeMakesOneTask(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, `jobs:
  - name: once
    type: cron.t
    source: {kind: cron, schedule: "@every 1s", missed: run_once}
`)
	now := time.Now().Truncate(time.Second)
	// Down for an hour: 3600 ticks, all but the last 30 missed.
	_, err := db.Pool.Exec(ctx, `UPDATE jobs SET next_tick_at = $1::timestamptz - interval '3600 seconds'`, now)
	require.NoError(t, err)
	s := postgres.NewSchedulerStore(db.Pool, nil)
	cfg := job.CronConfig{CatchUp: 30 * time.Second, MaxJobs: 100, MaxTicks: 1000}
	for range 10 {
		st, err := s.Cron(ctx, cfg, now)
		require.NoError(t, err)
		if st.Jobs == 0 {
			break
		}
	}
	var n, missed int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE scheduled_at < $1::timestamptz - interval '30 seconds')
		FROM tasks`, now).Scan(&n, &missed))
	require.Equal(t, 1, missed, "run_once: one task for all the missed ticks")
	require.Equal(t, 32, n, "the latest missed tick, and the 31 within the catch-up window")
}

// A job whose stored schedule no longer parses (its time zone left the
// system's database) is tried again a minute later, and meanwhile holds up
// none of the jobs due after it, however few a pass reads.
func TestCronJobWithAnUnreadableScheduleHoldsUpNoOther(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, `jobs:
  - name: broken
    type: cron.broken
    source: {kind: cron, schedule: "@every 1s"}
  - name: fine
    type: cron.fine
    source: {kind: cron, schedule: "@every 1s"}
`)
	now := time.Now().Truncate(time.Second)
	_, err := db.Pool.Exec(ctx, `UPDATE jobs SET timezone = 'Mars/Olympus_Mons', next_tick_at = $1::timestamptz - interval '10 seconds'
		WHERE name = 'broken'`, now)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `UPDATE jobs SET next_tick_at = $1::timestamptz - interval '5 seconds' WHERE name = 'fine'`, now)
	require.NoError(t, err)

	s := postgres.NewSchedulerStore(db.Pool, nil)
	cfg := job.CronConfig{CatchUp: time.Minute, MaxJobs: 1, MaxTicks: 1000}
	st, err := s.Cron(ctx, cfg, now)
	require.NoError(t, err)
	require.Len(t, st.Errors, 1, "the broken job's schedule is reported")
	_, err = s.Cron(ctx, cfg, now)
	require.NoError(t, err)
	var fine, broken int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE type = 'cron.fine'),
		count(*) FILTER (WHERE type = 'cron.broken') FROM tasks`).Scan(&fine, &broken))
	require.Equal(t, 6, fine, "the job due after the broken one ticked")
	require.Zero(t, broken)
	var next time.Time
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT next_tick_at FROM jobs WHERE name = 'broken'`).Scan(&next))
	require.WithinDuration(t, now.Add(time.Minute), next, time.Second, "read again a minute later")
}

// A limit set (or lowered) while tasks of its type are already admitted and
// queued holds: no more of them start than the limit allows.
func TestLimitSetWhileTasksQueuedHolds(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	queued := submitOf(t, db, admin, "late.t", "", 5)
	require.Len(t, admitted(t, db, queued), 5, "no limit yet: admitted as written")
	applyFile(t, db, admin, "types:\n  - type: late.t\n    max_concurrency: 1\n")
	_, err := postgres.NewSchedulerStore(db.Pool, nil).Admit(ctx, admitAll)
	require.NoError(t, err)
	claimed, err := postgres.NewWorkerStore(db.Pool, nil).Claim(ctx, queued, "w1", time.Minute)
	require.NoError(t, err)
	require.LessOrEqual(t, len(claimed), 1, "max_concurrency 1: at most one runs")

	// The same for a job's limit.
	applyFile(t, db, admin, "jobs:\n  - name: resize\n    type: late.j\n")
	store := postgres.NewJobStore(db.Pool)
	var ids []uuid.UUID
	for range 3 {
		tk, err := store.Trigger(ctx, admin, "resize", nil, "", nil)
		require.NoError(t, err)
		ids = append(ids, tk.ID)
	}
	require.Len(t, admitted(t, db, ids), 3)
	applyFile(t, db, admin, "jobs:\n  - name: resize\n    type: late.j\n    max_concurrency: 1\n")
	_, err = postgres.NewSchedulerStore(db.Pool, nil).Admit(ctx, admitAll)
	require.NoError(t, err)
	claimed, err = postgres.NewWorkerStore(db.Pool, nil).Claim(ctx, ids, "w1", time.Minute)
	require.NoError(t, err)
	require.Len(t, claimed, 1, "the job's max_concurrency 1: one runs")
}

// Under a type's limit, the waiting tasks of an org are admitted by
// priority, then age, whatever their concurrency keys: a key that sorts
// first does not go ahead of an older or more urgent task of another key.
func TestAdmissionOrderIgnoresKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, "types:\n  - type: order.t\n    max_concurrency: 1\n")
	store := postgres.NewAPIStore(db.Pool, nil)
	submit := func(key string, priority int) uuid.UUID {
		sub, err := task.NewSubmission(task.SubmitInput{Type: "order.t", ConcurrencyKey: key, Priority: &priority,
			Dedupe: new(bool)}, task.Defaults{MaxAttempts: 3}, "")
		require.NoError(t, err)
		res, err := store.Submit(ctx, admin, sub, nil)
		require.NoError(t, err)
		return res.Task.ID
	}
	oldest := submit("zz", 5)
	urgent := submit("yy", 9)
	later := []uuid.UUID{submit("aa", 5), submit("aa", 5)}
	all := append([]uuid.UUID{oldest, urgent}, later...)
	s := postgres.NewSchedulerStore(db.Pool, nil)
	_, err := s.Admit(ctx, admitAll)
	require.NoError(t, err)
	require.Equal(t, map[uuid.UUID]bool{urgent: true}, admitted(t, db, all), "the most urgent first")
	finish(t, db, []uuid.UUID{urgent})
	_, err = s.Admit(ctx, admitAll)
	require.NoError(t, err)
	require.Equal(t, map[uuid.UUID]bool{oldest: true}, admitted(t, db, all), "then the oldest")
}

// A backlog of waiting tasks spread over more groups (type, org, key) than
// a pass reads, all held back by their limits, does not hold up the tasks
// of other groups, of another org: they are admitted in a later pass.
func TestAdmissionReachesGroupsPastMaxGroups(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, a := db.Key(t, "a", auth.Admin)
	_, b := db.Key(t, "b", auth.Admin)
	ctx := context.Background()
	applyFile(t, db, a, "types:\n  - type: a.keyed\n    max_concurrency_per_key: 1\n")
	applyFile(t, db, b, "types:\n  - type: b.t\n    max_concurrency: 1\n")
	api := postgres.NewAPIStore(db.Pool, nil)
	batch := func() {
		subs := make([]task.Submission, admitAll.MaxGroups)
		for i := range subs {
			sub, err := task.NewSubmission(task.SubmitInput{Type: "a.keyed", ConcurrencyKey: fmt.Sprintf("customer-%04d", i),
				Dedupe: new(bool)}, task.Defaults{MaxAttempts: 3}, "")
			require.NoError(t, err)
			subs[i] = sub
		}
		_, err := api.SubmitBatch(ctx, a, subs, nil)
		require.NoError(t, err)
	}
	s := postgres.NewSchedulerStore(db.Pool, nil)
	// Org a: one task running per customer, one more waiting for each.
	batch()
	st, err := s.Admit(ctx, admitAll)
	require.NoError(t, err)
	require.Equal(t, admitAll.MaxGroups, st.Admitted)
	batch()
	// Org b's one task, under a limit with a slot free.
	mine := submitOf(t, db, b, "b.t", "", 1)
	for range 3 {
		_, err := s.Admit(ctx, admitAll)
		require.NoError(t, err)
	}
	require.Len(t, admitted(t, db, mine), 1, "org b's task has a free slot: it is admitted")
}

// A pause that lands while an admission pass is under way still holds the
// job's tasks back: the pass does not admit, after the pause, a task it
// picked before it.
func TestPauseDuringAdmissionPassHolds(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, "jobs:\n  - name: gated\n    type: gated.t\n    max_concurrency: 5\n")
	jobs := postgres.NewJobStore(db.Pool)
	tk, err := jobs.Trigger(ctx, admin, "gated", nil, "", nil)
	require.NoError(t, err)
	require.False(t, tk.Admitted)

	// Hold the task's row so that the pass, once it has picked the task,
	// waits at its admission.
	blocker, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = blocker.Rollback(ctx) }()
	_, err = blocker.Exec(ctx, `SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE`, tk.ID)
	require.NoError(t, err)
	admitDone := make(chan error, 1)
	go func() {
		_, err := postgres.NewSchedulerStore(db.Pool, nil).Admit(ctx, admitAll)
		admitDone <- err
	}()
	waiting := func(event string) bool {
		var n int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND wait_event = $1`, event).Scan(&n))
		return n > 0
	}
	require.Eventually(t, func() bool { return waiting("transactionid") || waiting("tuple") }, 10*time.Second, 10*time.Millisecond,
		"the pass waits at the task's row")

	pauseDone := make(chan error, 1)
	go func() { pauseDone <- jobs.PauseJob(ctx, admin, "gated", true) }()
	select {
	case err := <-pauseDone:
		require.NoError(t, err)
		pauseDone <- nil
	case <-time.After(500 * time.Millisecond): // the pause waits for the pass
	}
	require.NoError(t, blocker.Rollback(ctx))
	require.NoError(t, <-admitDone)
	require.NoError(t, <-pauseDone)

	claimed, err := postgres.NewWorkerStore(db.Pool, nil).Claim(ctx, []uuid.UUID{tk.ID}, "w1", time.Minute)
	require.NoError(t, err)
	require.Empty(t, claimed, "the job is paused: its task does not start")
}

// A submission whose statement began before a pause committed read its
// type as not paused and admits its task, which it commits after the
// pause's own withdrawal. The pause answers once such submissions have
// ended, and takes their tasks back too: no task of a paused type starts
// after the pause has answered.
func TestPauseHoldsBackASubmissionThatBeganBeforeIt(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	sub, err := task.NewSubmission(task.SubmitInput{Type: "demo.noop", Payload: json.RawMessage(`{"n":1}`)},
		task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)

	// Hold the input's hash: the submission, its statement begun, waits
	// at it.
	blocker, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = blocker.Rollback(ctx) }()
	_, err = blocker.Exec(ctx, `INSERT INTO task_input_hashes (org_id, type, input_hash, task_id)
		VALUES ($1, $2, $3, gen_random_uuid())`, admin.OrgID, sub.Type, sub.InputHash)
	require.NoError(t, err)
	var made task.Submitted
	submitted := make(chan error, 1)
	go func() {
		var err error
		made, err = postgres.NewAPIStore(db.Pool, nil).Submit(ctx, admin, sub, nil)
		submitted <- err
	}()
	db.WaitForLockWait(t)

	paused := make(chan error, 1)
	// The API's pool, whose sessions take the tenant role.
	jobs := postgres.NewJobStore(tenantPool(t, db))
	go func() { paused <- jobs.PauseType(ctx, admin, sub.Type, true) }()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM type_limits WHERE type = $1 AND paused_at IS NOT NULL`,
			sub.Type).Scan(&n))
		return n == 1
	}, 10*time.Second, 5*time.Millisecond, "the pause commits")
	require.NoError(t, blocker.Rollback(ctx))
	require.NoError(t, <-submitted)
	require.NoError(t, <-paused)
	require.True(t, made.Created)

	claimed, err := postgres.NewWorkerStore(db.Pool, nil).Claim(ctx, []uuid.UUID{made.Task.ID}, "w1", time.Minute)
	require.NoError(t, err)
	require.Empty(t, claimed, "the type was paused when the pause answered: its task does not start")
}

// A cron tick's task is a submission like any other: it carries the trace
// of the scheduler's pass that made it (its trace_id, its trace_url), and
// its task.run message carries that trace to the relay and the worker. So
// do the tasks of a workflow's cron run. Without it each of the task's
// messages (and every republish of it) started a trace of its own at the
// relay, and the task showed no trace at all.
func TestCronTicksCarryTheTraceOfTheirPass(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	applyFile(t, db, admin, `
jobs:
  - name: ticking
    type: cron.traced
    source: {kind: cron, schedule: "@every 1s"}
  - {name: only, type: wf.traced}
workflows:
  - name: ticking-flow
    source: {kind: cron, schedule: "@every 1s"}
    nodes:
      - {job: only}
`)
	traceID, _ := oteltrace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	spanID, _ := oteltrace.SpanIDFromHex("00f067aa0ba902b7")
	pass := oteltrace.NewSpanContext(oteltrace.SpanContextConfig{TraceID: traceID, SpanID: spanID,
		TraceFlags: oteltrace.FlagsSampled})
	ctx := oteltrace.ContextWithSpanContext(context.Background(), pass)
	now := time.Now().Truncate(time.Second)
	_, err := db.Pool.Exec(ctx, `UPDATE jobs SET next_tick_at = $1::timestamptz - interval '2 seconds'`, now)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `UPDATE workflows SET next_tick_at = $1::timestamptz - interval '1 second'`, now)
	require.NoError(t, err)

	st, err := postgres.NewSchedulerStore(db.Pool, nil).Cron(ctx, job.CronConfig{CatchUp: time.Minute, MaxJobs: 10, MaxTicks: 100}, now)
	require.NoError(t, err)
	require.Equal(t, 5, st.Made, "three ticks of the job, two runs of the workflow")

	rows, err := db.Pool.Query(ctx, `SELECT t.type, coalesce(t.traceparent, ''), coalesce(o.headers->>'traceparent', '')
		FROM tasks t JOIN outbox o ON o.task_id = t.id AND o.kind = 'task.run'`)
	require.NoError(t, err)
	var typ, traceparent, header string
	seen := map[string]int{}
	_, err = pgx.ForEachRow(rows, []any{&typ, &traceparent, &header}, func() error {
		seen[typ]++
		require.Contains(t, traceparent, traceID.String(), "a %s task carries the trace of the pass that made it", typ)
		require.Contains(t, header, traceID.String(), "its message carries it to the relay")
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, map[string]int{"cron.traced": 3, "wf.traced": 2}, seen)

	// The workflow's runs name that trace, the one their nodes joined.
	runs, err := postgres.NewJobStore(db.Pool).Runs(ctx, admin, "ticking-flow", uuid.Nil, 10)
	require.NoError(t, err)
	require.Len(t, runs, 2)
	for _, r := range runs {
		require.Contains(t, r.Traceparent, traceID.String(), "run %s names the trace of the pass that made it", r.ID)
		read, err := postgres.NewJobStore(db.Pool).Run(ctx, admin, r.ID)
		require.NoError(t, err)
		require.Equal(t, r.Traceparent, read.Traceparent, "read alone, run %s names the same trace", r.ID)
	}
}

// The scheduler runs a cron pass several times a second: a pass starts its
// trace (CronConfig.Trace) only when it finds a job's or a workflow's tick
// due, before it writes, and the ticks' tasks carry that trace. A pass that
// finds nothing due starts none.
func TestCronPassStartsItsTraceOnlyWhenSomethingIsDue(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	applyFile(t, db, admin, `
jobs:
  - name: ticking
    type: cron.lazy
    source: {kind: cron, schedule: "@every 1h"}
  - {name: only, type: wf.lazy}
workflows:
  - name: ticking-flow
    source: {kind: cron, schedule: "@every 1h"}
    nodes:
      - {job: only}
`)
	traceID, _ := oteltrace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	spanID, _ := oteltrace.SpanIDFromHex("00f067aa0ba902b7")
	pass := oteltrace.NewSpanContext(oteltrace.SpanContextConfig{TraceID: traceID, SpanID: spanID,
		TraceFlags: oteltrace.FlagsSampled})
	started := 0
	cfg := job.CronConfig{CatchUp: time.Minute, MaxJobs: 10, MaxTicks: 100,
		Trace: func(ctx context.Context) context.Context {
			started++
			return oteltrace.ContextWithSpanContext(ctx, pass)
		}}
	ctx := context.Background()
	s := postgres.NewSchedulerStore(db.Pool, nil)
	now := time.Now().Truncate(time.Second)
	_, err := db.Pool.Exec(ctx, `UPDATE jobs SET next_tick_at = $1::timestamptz + interval '1 hour'`, now)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `UPDATE workflows SET next_tick_at = $1::timestamptz + interval '1 hour'`, now)
	require.NoError(t, err)
	st, err := s.Cron(ctx, cfg, now)
	require.NoError(t, err)
	require.Zero(t, st.Made)
	require.Zero(t, started, "nothing due: no trace")

	for _, table := range []string{"jobs", "workflows"} {
		_, err = db.Pool.Exec(ctx, `UPDATE jobs SET next_tick_at = $1::timestamptz + interval '1 hour'`, now)
		require.NoError(t, err)
		_, err = db.Pool.Exec(ctx, `UPDATE workflows SET next_tick_at = $1::timestamptz + interval '1 hour'`, now)
		require.NoError(t, err)
		_, err = db.Pool.Exec(ctx, `UPDATE `+table+` SET next_tick_at = $1::timestamptz`, now)
		require.NoError(t, err)
		started = 0
		st, err = s.Cron(ctx, cfg, now)
		require.NoError(t, err)
		require.Equal(t, 1, st.Made, "the tick of the %s", table)
		require.Equal(t, 1, started, "a tick of the %s is due: the pass starts its trace once", table)
	}
	rows, err := db.Pool.Query(ctx, `SELECT t.type, coalesce(t.traceparent, '') FROM tasks t`)
	require.NoError(t, err)
	seen := map[string]string{}
	var typ, traceparent string
	_, err = pgx.ForEachRow(rows, []any{&typ, &traceparent}, func() error {
		seen[typ] = traceparent
		return nil
	})
	require.NoError(t, err)
	require.Len(t, seen, 2)
	for typ, tp := range seen {
		require.Contains(t, tp, traceID.String(), "the %s task carries the pass's trace", typ)
	}
}

// A paused job's schedule does not tick, and on resume the ticks it missed
// while paused follow its missed policy, however short the pause: skip
// makes no task for them and run_once one, for the latest. The catch-up
// window covers a scheduler that was down, not a pause someone asked for.
func TestResumedJobFollowsItsMissedPolicy(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, `jobs:
  - name: skipper
    type: resume.t
    source: {kind: cron, schedule: "@every 10s", missed: skip}
  - name: once
    type: resume.t
    source: {kind: cron, schedule: "@every 10s", missed: run_once}
`)
	jobs := postgres.NewJobStore(db.Pool)
	require.NoError(t, jobs.PauseJob(ctx, admin, "skipper", true))
	require.NoError(t, jobs.PauseJob(ctx, admin, "once", true))
	// Paused for 45 seconds, well within the catch-up window: the ticks of
	// 45, 35, 25, 15 and 5 seconds ago passed while the jobs were paused.
	base := time.Now().Truncate(time.Second)
	_, err := db.Pool.Exec(ctx, `UPDATE jobs SET next_tick_at = $1::timestamptz - interval '45 seconds'`, base)
	require.NoError(t, err)
	s := postgres.NewSchedulerStore(db.Pool, nil)
	cfg := job.CronConfig{CatchUp: time.Minute, MaxJobs: 100, MaxTicks: 1000}
	st, err := s.Cron(ctx, cfg, time.Now())
	require.NoError(t, err)
	require.Zero(t, st.Made, "a paused job's schedule does not tick")

	require.NoError(t, jobs.PauseJob(ctx, admin, "skipper", false))
	require.NoError(t, jobs.PauseJob(ctx, admin, "once", false))
	_, err = s.Cron(ctx, cfg, time.Now())
	require.NoError(t, err)
	made := func(name string) []time.Time {
		rows, err := db.Pool.Query(ctx, `SELECT t.scheduled_at FROM tasks t JOIN jobs j ON j.id = t.job_id
			WHERE j.name = $1 ORDER BY 1`, name)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[time.Time])
		require.NoError(t, err)
		return out
	}
	require.Empty(t, made("skipper"), "missed: skip: no task for the ticks of the pause")
	once := made("once")
	require.Len(t, once, 1, "missed: run_once: one task for the ticks of the pause")
	require.WithinDuration(t, base.Add(-5*time.Second), once[0], 0, "for the latest of them")
}

// A job whose stored schedule could not be read is read again a minute
// later, at a cursor that is no tick of its schedule: once the schedule
// reads again, it makes tasks for its own ticks only, not one at the
// moment of the retry.
func TestCronAfterAnUnreadableScheduleMakesOnlyItsTicks(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, `jobs:
  - name: fives
    type: cron.fives
    source: {kind: cron, schedule: "*/5 * * * * *"}
`)
	// Half way between two ticks.
	now := time.Now().Truncate(5 * time.Second).Add(2500 * time.Millisecond)
	_, err := db.Pool.Exec(ctx, `UPDATE jobs SET timezone = 'Mars/Olympus_Mons', next_tick_at = $1::timestamptz - interval '1 second'`, now)
	require.NoError(t, err)
	s := postgres.NewSchedulerStore(db.Pool, nil)
	cfg := job.CronConfig{CatchUp: time.Minute, MaxJobs: 10, MaxTicks: 1000}
	st, err := s.Cron(ctx, cfg, now)
	require.NoError(t, err)
	require.Len(t, st.Errors, 1)

	// The time zone reads again (a worker with the newer time zone
	// database leads).
	_, err = db.Pool.Exec(ctx, `UPDATE jobs SET timezone = 'UTC'`)
	require.NoError(t, err)
	_, err = s.Cron(ctx, cfg, now.Add(70*time.Second))
	require.NoError(t, err)
	rows, err := db.Pool.Query(ctx, `SELECT scheduled_at FROM tasks ORDER BY 1`)
	require.NoError(t, err)
	ticks, err := pgx.CollectRows(rows, pgx.RowTo[time.Time])
	require.NoError(t, err)
	require.NotEmpty(t, ticks)
	for _, at := range ticks {
		require.True(t, at.Truncate(5*time.Second).Equal(at), "%s is no tick of */5 * * * * *", at.Format(time.RFC3339Nano))
	}
}

// Applying the same file again changes nothing, also when a job's payload
// holds numbers that PostgreSQL writes back otherwise (1e-7 as 0.0000001,
// 1e21 in full): the stored definition went through jsonb, and compared as
// read back, it showed the job as updated on every apply.
func TestApplyAgainWithPayloadNumbersIsUnchanged(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	f, err := job.Parse([]byte(`jobs:
  - name: tuned
    type: tuned.t
    payload: {threshold: 1e-7, budget: 1e21, scale: 2.5}
    source: {kind: cron, schedule: "0 2 * * *", timezone: Europe/Paris}
`))
	require.NoError(t, err)
	store := postgres.NewJobStore(db.Pool)
	_, err = store.Apply(ctx, admin, f, false, false)
	require.NoError(t, err)
	for _, dryRun := range []bool{true, false} {
		changes, err := store.Apply(ctx, admin, f, dryRun, false)
		require.NoError(t, err)
		require.Equal(t, []job.Change{{Op: job.OpUnchanged, Kind: job.KindJob, Name: "tuned"}}, changes,
			"dry run %t: the same file again changes nothing", dryRun)
	}
}

// An "@every" schedule's ticks are its cursor plus whole intervals: a pass
// that comes late (a failover, a slow database) makes the late tick and
// keeps the ones after it where they were, instead of starting the
// interval again from the late pass and moving every tick to come.
func TestCronEveryKeepsItsTicksAfterALatePass(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, `jobs:
  - name: tens
    type: cron.tens
    source: {kind: cron, schedule: "@every 10s"}
`)
	base := time.Now().UTC().Truncate(time.Second)
	_, err := db.Pool.Exec(ctx, `UPDATE jobs SET next_tick_at = $1`, base)
	require.NoError(t, err)
	s := postgres.NewSchedulerStore(db.Pool, nil)
	cfg := job.CronConfig{CatchUp: time.Minute, MaxJobs: 10, MaxTicks: 1000}
	// The first pass comes 1.5 s late, the next one on time.
	_, err = s.Cron(ctx, cfg, base.Add(1500*time.Millisecond))
	require.NoError(t, err)
	_, err = s.Cron(ctx, cfg, base.Add(10*time.Second+200*time.Millisecond))
	require.NoError(t, err)
	rows, err := db.Pool.Query(ctx, `SELECT scheduled_at FROM tasks ORDER BY 1`)
	require.NoError(t, err)
	ticks, err := pgx.CollectRows(rows, pgx.RowTo[time.Time])
	require.NoError(t, err)
	require.Equal(t, []time.Time{base, base.Add(10 * time.Second)}, inUTC(ticks), "one task every 10 s from the cursor")
	var next time.Time
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT next_tick_at FROM jobs`).Scan(&next))
	require.True(t, base.Add(20*time.Second).Equal(next), "next tick %s", next)
}

func inUTC(ts []time.Time) []time.Time {
	out := make([]time.Time, len(ts))
	for i, t := range ts {
		out[i] = t.UTC()
	}
	return out
}

// A job at its limit with a backlog holds up nothing else: the other
// waiting tasks of its type, org and key, behind the job's in admission
// order, are admitted while the job's slot is taken.
func TestAdmissionPassesOverAFullJobsBacklog(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, "jobs:\n  - name: slow\n    type: hol.t\n    max_concurrency: 1\n"+
		"types:\n  - type: hol.t\n    max_concurrency: 10\n")
	jobs := postgres.NewJobStore(db.Pool)
	var backlog []uuid.UUID
	for range 40 {
		tk, err := jobs.Trigger(ctx, admin, "slow", nil, "", nil)
		require.NoError(t, err)
		backlog = append(backlog, tk.ID)
	}
	plain := submitOf(t, db, admin, "hol.t", "", 2)
	cfg := admitAll
	cfg.MaxAdmit = 16
	s := postgres.NewSchedulerStore(db.Pool, nil)
	for range 3 {
		_, err := s.Admit(ctx, cfg)
		require.NoError(t, err)
	}
	require.Len(t, admitted(t, db, backlog), 1, "the job's limit: one at a time")
	require.Len(t, admitted(t, db, plain), 2, "the type has free slots: the tasks behind the job's are admitted")
}

// In fair mode, an org whose flood spreads over more concurrency keys than
// a pass reads groups does not crowd another org out of the passes: the
// other org's task, with the fewest in flight, goes in the next pass.
func TestFairModeServesAnOrgBehindAFloodOfKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, one := db.Key(t, "one", auth.Admin)
	_, two := db.Key(t, "two", auth.Admin)
	// The flood comes from the org whose groups the waiting index reads
	// first.
	flood, small := one, two
	if bytes.Compare(two.OrgID[:], one.OrgID[:]) < 0 {
		flood, small = two, one
	}
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `INSERT INTO task_types (name) VALUES ('fair.k')`)
	require.NoError(t, err)
	cfg := admitAll
	cfg.Window, cfg.MaxGroups = 10, 8
	s := postgres.NewSchedulerStore(db.Pool, nil)
	first := submitOf(t, db, flood, "fair.k", "", 11)
	st, err := s.Admit(ctx, cfg)
	require.NoError(t, err)
	require.Equal(t, []string{"fair.k"}, st.Fair)
	for i := range 40 {
		submitOf(t, db, flood, "fair.k", fmt.Sprintf("customer-%02d", i), 1)
	}
	mine := submitOf(t, db, small, "fair.k", "", 1)
	require.Empty(t, admitted(t, db, mine))

	// Two slots free: the small org, with nothing in flight, takes one.
	finish(t, db, first[:3])
	_, err = s.Admit(ctx, cfg)
	require.NoError(t, err)
	require.Len(t, admitted(t, db, mine), 1, "the small org's task goes in at its turn")
}

// A type in fair mode admits directly again once its queue is short and no
// task it could admit waits: a task scheduled for tomorrow, which waits
// for its time and not for a turn, does not keep it in fair mode.
func TestFairModeEndsWithOnlyLaterTasksWaiting(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, org := db.Key(t, "org", auth.Admin)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `INSERT INTO task_types (name) VALUES ('fair.later')`)
	require.NoError(t, err)
	cfg := admitAll
	cfg.Window = 10
	s := postgres.NewSchedulerStore(db.Pool, nil)
	first := submitOf(t, db, org, "fair.later", "", 11)
	st, err := s.Admit(ctx, cfg)
	require.NoError(t, err)
	require.Equal(t, []string{"fair.later"}, st.Fair)
	sub, err := task.NewSubmission(task.SubmitInput{Type: "fair.later", Delay: "24h", Dedupe: new(bool)},
		task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	tomorrow, err := postgres.NewAPIStore(db.Pool, nil).Submit(ctx, org, sub, nil)
	require.NoError(t, err)
	require.Empty(t, admitted(t, db, []uuid.UUID{tomorrow.Task.ID}))

	finish(t, db, first)
	st, err = s.Admit(ctx, cfg)
	require.NoError(t, err)
	require.Empty(t, st.Fair, "the queue is empty and nothing due waits")
	require.Len(t, admitted(t, db, submitOf(t, db, org, "fair.later", "", 1)), 1, "admitted as it is written")
}

// A pass that finds the scheduler's lock held (a pause, an apply, another
// leader's pass) says so, rather than answer as a pass that found no type
// in fair mode.
func TestAdmissionPassSaysWhenTheLockWasHeld(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, org := db.Key(t, "org", auth.Admin)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `INSERT INTO task_types (name) VALUES ('busy.t')`)
	require.NoError(t, err)
	cfg := admitAll
	cfg.Window = 2
	s := postgres.NewSchedulerStore(db.Pool, nil)
	submitOf(t, db, org, "busy.t", "", 3)
	st, err := s.Admit(ctx, cfg)
	require.NoError(t, err)
	require.Equal(t, []string{"busy.t"}, st.Fair)
	require.False(t, st.Busy)

	// A pause holds the lock for its transaction.
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT pg_advisory_xact_lock(`+fmt.Sprint(0x636f6e76)+`)`)
	require.NoError(t, err)
	st, err = s.Admit(ctx, cfg)
	require.NoError(t, err)
	require.True(t, st.Busy, "the pass could not look")
	require.NoError(t, tx.Rollback(ctx))

	st, err = s.Admit(ctx, cfg)
	require.NoError(t, err)
	require.False(t, st.Busy)
	require.Equal(t, []string{"busy.t"}, st.Fair, "still in fair mode")
}

// A running task whose worker died is not taken over by a claim while its
// job is paused, nor while a limit holds its job or type: a message of it
// still in the queue (one of an earlier admission, say) reaching a worker
// between the lease's expiry and the reaper's pass would start its next
// attempt at once, after the pause had answered, and skip the backoff
// and the scheduler. The reaper queues it again, to wait as the pause or
// the limit says.
func TestAClaimTakesNoExpiredTaskOverWhileItsJobIsPausedOrLimited(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	ctx := context.Background()
	applyFile(t, db, admin, `jobs:
  - {name: paused, type: take.over}
  - {name: limited, type: take.over, max_concurrency: 1}
types:
  - {type: take.typed, max_concurrency: 5}
`)
	jobs := postgres.NewJobStore(db.Pool)
	w := postgres.NewWorkerStore(db.Pool, nil)
	var ids []uuid.UUID
	for _, name := range []string{"paused", "limited"} {
		made, err := jobs.Trigger(ctx, admin, name, nil, "", nil)
		require.NoError(t, err)
		ids = append(ids, made.ID)
	}
	ids = append(ids, submitOf(t, db, admin, "take.typed", "", 1)...)
	_, err := postgres.NewSchedulerStore(db.Pool, nil).Admit(ctx, admitAll)
	require.NoError(t, err)
	claimed, err := w.Claim(ctx, ids, "w1", time.Minute)
	require.NoError(t, err)
	require.Len(t, claimed, len(ids))
	require.NoError(t, jobs.PauseJob(ctx, admin, "paused", true))

	// w1 dies: its leases run out.
	_, err = db.Pool.Exec(ctx, `UPDATE tasks SET lease_expires_at = now() - interval '1 second' WHERE id = ANY ($1)`, ids)
	require.NoError(t, err)
	taken, err := w.Claim(ctx, ids, "w2", time.Minute)
	require.NoError(t, err)
	var types []string
	for _, c := range taken {
		types = append(types, c.Type)
	}
	require.Empty(t, types, "no attempt starts but through the scheduler")
}

// submitAt submits n tasks of typ with a priority.
func submitAt(t *testing.T, db *testdb.DB, p auth.Principal, typ string, priority, n int) []uuid.UUID {
	t.Helper()
	store := postgres.NewAPIStore(db.Pool, nil)
	var ids []uuid.UUID
	for range n {
		sub, err := task.NewSubmission(task.SubmitInput{Type: typ, Priority: &priority, Dedupe: new(bool)},
			task.Defaults{MaxAttempts: 3}, "")
		require.NoError(t, err)
		res, err := store.Submit(context.Background(), p, sub, nil)
		require.NoError(t, err)
		ids = append(ids, res.Task.ID)
	}
	return ids
}

// In fair mode, a waiting task waits only for the queued tasks it would
// not overtake in the broker: those as urgent, or more. After a flood of
// priority 0, admitted directly before fair mode came on, an urgent task
// goes in at once, not once the flood has fallen below the window; and
// the most urgent waiting task is admitted first, whatever its org.
func TestFairModeAdmitsAnUrgentTaskPastALessUrgentQueue(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, one := db.Key(t, "one", auth.Admin)
	_, two := db.Key(t, "two", auth.Admin)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `INSERT INTO task_types (name) VALUES ('fair.prio')`)
	require.NoError(t, err)
	cfg := admitAll
	cfg.Window = 10
	s := postgres.NewSchedulerStore(db.Pool, nil)
	admit := func() job.AdmitStats {
		t.Helper()
		st, err := s.Admit(ctx, cfg)
		require.NoError(t, err)
		return st
	}

	flood := submitAt(t, db, one, "fair.prio", 0, 30)
	require.Len(t, admitted(t, db, flood), 30, "admitted directly, before fair mode")
	require.Equal(t, []string{"fair.prio"}, admit().Fair)
	urgent := submitAt(t, db, two, "fair.prio", 9, 1)
	later := submitAt(t, db, two, "fair.prio", 0, 1)
	require.Empty(t, admitted(t, db, append(urgent, later...)), "in fair mode, new tasks wait")

	st := admit()
	require.Equal(t, 1, st.Admitted)
	require.Len(t, admitted(t, db, urgent), 1, "thirty queued tasks of priority 0 hold back no task of priority 9")
	require.Empty(t, admitted(t, db, later), "a task of priority 0 waits behind the thirty")

	// Room for one more of priority 0 (eight of the flood and the urgent
	// task queued): the org with the fewer tasks in flight waits with a
	// task of priority 0, the other with a more urgent one, which goes
	// first and takes that room.
	finish(t, db, flood[:22])
	mid := submitAt(t, db, one, "fair.prio", 5, 1)
	st = admit()
	require.Equal(t, 1, st.Admitted)
	require.Len(t, admitted(t, db, mid), 1, "priority 5 before priority 0")
	require.Empty(t, admitted(t, db, later))
}
