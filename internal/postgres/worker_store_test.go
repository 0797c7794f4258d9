package postgres_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/registry"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

type storeBundle struct {
	db     *testdb.DB
	worker *postgres.WorkerStore
	maint  *postgres.MaintenanceStore
	api    *postgres.APIStore
	// admin is an admin of the org testdb.TestOrg, the API's caller.
	admin auth.Principal
}

func setupStores(t *testing.T) *storeBundle {
	t.Helper()
	t.Parallel()
	db := testdb.New(t)
	admin := auth.Principal{Kind: auth.KindDev, OrgID: db.Org(t, testdb.TestOrg), OrgSlug: testdb.TestOrg, Role: auth.Admin}
	return &storeBundle{db: db, worker: postgres.NewWorkerStore(db.Pool, nil),
		maint: postgres.NewMaintenanceStore(db.Pool, nil), api: postgres.NewAPIStore(db.Pool, nil), admin: admin}
}

// pending inserts a PENDING task and returns its id.
func (b *storeBundle) pending(t *testing.T, maxAttempts int) uuid.UUID {
	t.Helper()
	id := uuid.Must(uuid.NewV7())
	b.exec(t, `INSERT INTO tasks (id, org_id, type, max_attempts) VALUES ($1, `+testdb.OrgSQL+`, 'demo.noop', $2)`, id, maxAttempts)
	return id
}

func (b *storeBundle) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	_, err := b.db.Pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

func (b *storeBundle) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

func (b *storeBundle) text(t *testing.T, sql string, args ...any) string {
	t.Helper()
	var s string
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&s))
	return s
}

func (b *storeBundle) claim(t *testing.T, id uuid.UUID, worker string) task.Lease {
	t.Helper()
	got, err := b.worker.Claim(context.Background(), []uuid.UUID{id}, worker, time.Hour)
	require.NoError(t, err)
	require.Len(t, got, 1, "claim by %s", worker)
	return task.Lease{TaskID: id, WorkerID: worker, Attempt: got[0].Attempt, Version: got[0].Version}
}

// apply applies one change and returns its outcome.
// taskUpdates counts the updates of tasks' rows so far, and the heap-only
// ones among them (the shared counters, which backends report with a lag,
// and this session's own).
func (b *storeBundle) taskUpdates(t *testing.T) (updates, hot int) {
	t.Helper()
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), `SELECT
		pg_stat_get_tuples_updated(c.oid) + pg_stat_get_xact_tuples_updated(c.oid),
		pg_stat_get_tuples_hot_updated(c.oid) + pg_stat_get_xact_tuples_hot_updated(c.oid)
		FROM pg_class c WHERE c.relname = 'tasks'`).Scan(&updates, &hot))
	return updates, hot
}

func (b *storeBundle) apply(t *testing.T, c task.Change) task.Applied {
	t.Helper()
	out, errs, err := b.worker.Apply(context.Background(), []task.Change{c})
	require.NoError(t, err)
	require.NoError(t, errs[0])
	return out[0]
}

func TestClaimIsExclusiveUnderConcurrency(t *testing.T) {
	b := setupStores(t)
	id := b.pending(t, 3)
	const claimers = 20
	won := make([]bool, claimers)
	var g errgroup.Group
	for i := range claimers {
		g.Go(func() error {
			got, err := b.worker.Claim(context.Background(), []uuid.UUID{id}, fmt.Sprintf("w%d", i), time.Minute)
			won[i] = len(got) == 1
			if won[i] && (got[0].Attempt != 1 || got[0].Status != task.StatusInProgress) {
				return fmt.Errorf("claimed task is %+v", got[0])
			}
			return err
		})
	}
	require.NoError(t, g.Wait())
	winners := 0
	for _, w := range won {
		if w {
			winners++
		}
	}
	require.Equal(t, 1, winners)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM task_events WHERE task_id = $1 AND status = 'IN_PROGRESS'`, id))
}

func TestClaimRespectsLiveLeasesAndTakesExpiredOnes(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	id := b.pending(t, 3)
	first := b.claim(t, id, "w1")

	got, err := b.worker.Claim(ctx, []uuid.UUID{id}, "w2", time.Hour)
	require.NoError(t, err)
	require.Empty(t, got, "a live lease is not taken")

	b.exec(t, `UPDATE tasks SET lease_expires_at = now() - interval '1 second' WHERE id = $1`, id)
	second := b.claim(t, id, "w2")
	require.Equal(t, 2, second.Attempt)

	// The first holder's next write misses, and it learns it lost the task.
	require.True(t, b.apply(t, task.Change{TaskID: id, Version: first.Version, Transition: task.Renew, Lease: time.Hour}).Fenced)
	hold, err := b.worker.Inspect(ctx, id)
	require.NoError(t, err)
	require.False(t, hold.Owns(first))
	require.True(t, hold.Owns(second))
}

func TestFencedWritesFollowTheVersion(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	id := b.pending(t, 3)
	l := b.claim(t, id, "w1")

	got := b.apply(t, task.Change{TaskID: id, Version: l.Version, Transition: task.Progress, Progress: 40, State: "Step 2/5", Lease: time.Hour})
	require.False(t, got.Fenced)
	require.Equal(t, l.Version+1, got.Version)
	l.Version = got.Version
	l.Version = b.apply(t, task.Change{TaskID: id, Version: l.Version, Transition: task.Renew, Lease: time.Hour}).Version

	// A cancel requested through the API moves the version on.
	_, outcome, err := b.api.Cancel(ctx, b.admin, id, nil)
	require.NoError(t, err)
	require.Equal(t, task.CancelRequested, outcome)
	stale := l
	require.True(t, b.apply(t, task.Change{TaskID: id, Version: l.Version, Transition: task.Progress, Progress: 60, Lease: time.Hour}).Fenced)
	hold, err := b.worker.Inspect(ctx, id)
	require.NoError(t, err)
	require.True(t, hold.Owns(l))
	require.True(t, hold.CancelRequested)
	require.Equal(t, "Cancel requested", b.text(t, `SELECT state FROM tasks WHERE id = $1`, id))
	l.Version = hold.Version
	require.False(t, b.apply(t, task.Change{TaskID: id, Version: l.Version, Transition: task.HonourCancel}).Fenced)

	// Nothing written with an old version lands, nor on a terminal task.
	complete := task.Change{TaskID: id, Version: stale.Version, Transition: task.Complete, Result: json.RawMessage(`{}`)}
	require.True(t, b.apply(t, complete).Fenced)
	complete.Version = l.Version + 1
	require.True(t, b.apply(t, complete).Fenced, "terminal")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM tasks WHERE id = $1 AND status = 'CANCELLED' AND progress = 40`, id))
	require.Zero(t, b.count(t, `SELECT count(*) FROM task_results WHERE task_id = $1`, id))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox WHERE task_id = $1 AND kind = 'task.cancel'
		AND task_version = $2`, id, hold.Version), "the broadcast names the version of the request")
}

// A task is only ended CANCELLED while a cancel is pending: a worker that
// acted on a stale broadcast cannot cancel a run nobody cancelled.
func TestHonourCancelNeedsAPendingCancel(t *testing.T) {
	b := setupStores(t)
	id := b.pending(t, 3)
	l := b.claim(t, id, "w1")
	require.True(t, b.apply(t, task.Change{TaskID: id, Version: l.Version, Transition: task.HonourCancel}).Fenced)
	require.Equal(t, "IN_PROGRESS", b.text(t, `SELECT status FROM tasks WHERE id = $1`, id))
}

// Progress never goes backwards within an attempt; a new attempt starts
// from zero.
func TestProgressNeverGoesBackwards(t *testing.T) {
	b := setupStores(t)
	id := b.pending(t, 3)
	l := b.claim(t, id, "w1")
	v := b.apply(t, task.Change{TaskID: id, Version: l.Version, Transition: task.Progress, Progress: 70, State: "a", Lease: time.Hour}).Version
	b.apply(t, task.Change{TaskID: id, Version: v, Transition: task.Progress, Progress: 30, State: "b", Lease: time.Hour})
	require.Equal(t, 70, b.count(t, `SELECT progress FROM tasks WHERE id = $1`, id))
	require.Equal(t, "b", b.text(t, `SELECT state FROM tasks WHERE id = $1`, id))
}

// Lease renewals and progress reports touch no indexed column, so
// PostgreSQL makes them heap-only (HOT) updates: no index grows with them.
func TestRenewalsAndProgressAreHOTUpdates(t *testing.T) {
	b := setupStores(t)
	id := b.pending(t, 3)
	l := b.claim(t, id, "w1")
	// Statistics reach the shared counters when a backend reports them;
	// wait until the claim's update is counted before taking the baseline.
	require.Eventually(t, func() bool { u, _ := b.taskUpdates(t); return u >= 1 }, 10*time.Second, 50*time.Millisecond)
	u0, h0 := b.taskUpdates(t)
	for i := range 20 {
		tr := task.Renew
		if i%2 == 1 {
			tr = task.Progress
		}
		l.Version = b.apply(t, task.Change{TaskID: id, Version: l.Version, Transition: tr, Progress: i, Lease: time.Hour}).Version
	}
	require.Eventually(t, func() bool { u, _ := b.taskUpdates(t); return u-u0 >= 20 }, 10*time.Second, 50*time.Millisecond)
	u1, h1 := b.taskUpdates(t)
	require.Equal(t, u1-u0, h1-h0, "every renewal and progress report was a HOT update")
}

// The same on a backlog submitted at once and claimed in one batch, as a
// busy worker claims it: the claimed versions land on pages with room
// left, so the renewals that follow stay on them.
func TestRenewalsOfABatchClaimedFromADenseBacklogAreHOTUpdates(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	const n = 300
	rows, err := b.db.Pool.Query(ctx, `INSERT INTO tasks (id, org_id, type, payload)
		SELECT gen_random_uuid(), `+testdb.OrgSQL+`, 'demo.noop', jsonb_build_object('i', i)
		FROM generate_series(1, $1) i RETURNING id`, n)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	claimed, err := b.worker.Claim(ctx, ids, "w1", time.Hour)
	require.NoError(t, err)
	require.Len(t, claimed, n)
	// The claim's dead versions go when a visit to their page prunes it,
	// once no snapshot can see them; other tests' transactions (in other
	// databases) can delay that test by seconds, so vacuum takes them now.
	b.exec(t, `VACUUM tasks`)

	require.Eventually(t, func() bool { u, _ := b.taskUpdates(t); return u >= n }, 10*time.Second, 50*time.Millisecond)
	u0, h0 := b.taskUpdates(t)
	renewals := make([]task.Change, n)
	for i, c := range claimed {
		renewals[i] = task.Change{TaskID: c.ID, Version: c.Version, Transition: task.Renew, Lease: time.Hour}
	}
	_, errs, err := b.worker.Apply(ctx, renewals)
	require.NoError(t, err)
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { u, _ := b.taskUpdates(t); return u-u0 >= n }, 10*time.Second, 50*time.Millisecond)
	u1, h1 := b.taskUpdates(t)
	require.GreaterOrEqual(t, float64(h1-h0)/float64(u1-u0), 0.9,
		"renewals of a batch's tasks are heap-only (%d of %d)", h1-h0, u1-u0)
}

// A claim writes entries only in the primary key and tasks_running: the
// org's and the scheduler's indexes hold no running task, so a claimed
// backlog leaves them as they were, and its completion grows only the
// index of an org's tasks by status.
func TestAClaimWritesNoEntryInTheOrgsOrTheSchedulersIndex(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	const n = 4000
	rows, err := b.db.Pool.Query(ctx, `INSERT INTO tasks (id, org_id, type)
		SELECT gen_random_uuid(), `+testdb.OrgSQL+`, 'demo.noop' FROM generate_series(1, $1) RETURNING id`, n)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	pages := func() map[string]int {
		out := map[string]int{}
		for _, index := range []string{"tasks_org_status", "tasks_admitted", "tasks_running"} {
			out[index] = b.count(t, `SELECT pg_relation_size($1::regclass) / current_setting('block_size')::int`, index)
		}
		return out
	}

	before := pages()
	var claimed []task.Task
	for batch := range slices.Chunk(ids, 500) {
		got, err := b.worker.Claim(ctx, batch, "w1", time.Hour)
		require.NoError(t, err)
		claimed = append(claimed, got...)
	}
	require.Len(t, claimed, n)
	running := pages()
	require.Equal(t, before["tasks_org_status"], running["tasks_org_status"], "a claim writes no entry in tasks_org_status")
	require.Equal(t, before["tasks_admitted"], running["tasks_admitted"], "a claim writes no entry in tasks_admitted")
	require.Greater(t, running["tasks_running"], before["tasks_running"],
		"a claim writes an entry in tasks_running (else this test shows nothing)")

	done := make([]task.Change, n)
	for i, c := range claimed {
		done[i] = task.Change{TaskID: c.ID, Version: c.Version, Transition: task.Complete, Result: json.RawMessage(`{}`)}
	}
	_, errs, err := b.worker.Apply(ctx, done)
	require.NoError(t, err)
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Greater(t, pages()["tasks_org_status"], running["tasks_org_status"],
		"a completion writes an entry in tasks_org_status")
}

// Held finds a task its worker runs in the attempt asked about, as a
// claim returned it, and nothing for another worker, another attempt or a
// task not running.
func TestHeldReadsATaskAsItsClaimReturnedIt(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	id := b.pending(t, 3)
	_, ok, err := b.worker.Held(ctx, id, "w1", 1)
	require.NoError(t, err)
	require.False(t, ok, "pending")
	claimed, err := b.worker.Claim(ctx, []uuid.UUID{id}, "w1", time.Hour)
	require.NoError(t, err)
	require.Len(t, claimed, 1)

	got, ok, err := b.worker.Held(ctx, id, "w1", 1)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, claimed[0], got)
	for _, c := range []struct {
		worker  string
		attempt int
	}{{"w2", 1}, {"w1", 2}} {
		_, ok, err := b.worker.Held(ctx, id, c.worker, c.attempt)
		require.NoError(t, err)
		require.False(t, ok, "%s, attempt %d", c.worker, c.attempt)
	}
}

// A cancel accepted after a claim landed, whose answer the worker lost,
// moves the task one version on: Held still answers the version the claim
// left, so that the run the worker adopts meets the cancel (its broadcast
// is newer than the run, its first write is fenced) instead of completing.
func TestHeldAnswersTheClaimsVersionAfterACancel(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	id := b.pending(t, 3)
	claimed, err := b.worker.Claim(ctx, []uuid.UUID{id}, "w1", time.Hour)
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	_, outcome, err := b.api.Cancel(ctx, b.admin, id, nil)
	require.NoError(t, err)
	require.Equal(t, task.CancelRequested, outcome)

	got, ok, err := b.worker.Held(ctx, id, "w1", 1)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, claimed[0].Version, got.Version)
	out := b.apply(t, task.Change{TaskID: id, Version: got.Version, Transition: task.Complete, Result: json.RawMessage(`1`)})
	require.True(t, out.Fenced, "the run's outcome misses its fence: the cancel wins")
}

func TestScheduledRetryWaitsForItsTime(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	id := b.pending(t, 3)
	l := b.claim(t, id, "w1")
	b.apply(t, task.Change{TaskID: id, Version: l.Version, Transition: task.RetryLater, Error: "boom", Delay: time.Hour})

	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox o JOIN tasks t ON t.id = o.task_id
		WHERE o.task_id = $1 AND o.available_at = t.next_run_at AND t.next_run_at > now() + interval '59 minutes'`, id))
	got, err := b.worker.Claim(ctx, []uuid.UUID{id}, "w2", time.Minute)
	require.NoError(t, err)
	require.Empty(t, got, "an early delivery is dropped; the scheduled message brings it")

	b.exec(t, `UPDATE tasks SET next_run_at = now() WHERE id = $1`, id)
	require.Equal(t, 2, b.claim(t, id, "w2").Attempt)
}

// A delivery that comes before its task is due (a duplicate of an earlier
// attempt's message, say) is refused however soon the task is due: a
// retry's backoff of less than a second (the first one, by default, is
// half a second to a second) must not be skipped by a duplicate message.
func TestAClaimRefusesATaskDueWithinTheSecond(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	id := b.pending(t, 3)
	l := b.claim(t, id, "w1")
	b.apply(t, task.Change{TaskID: id, Version: l.Version, Transition: task.RetryLater, Error: "boom",
		Delay: 800 * time.Millisecond})

	got, err := b.worker.Claim(ctx, []uuid.UUID{id}, "w2", time.Minute)
	require.NoError(t, err)
	require.Empty(t, got, "a task due in 800 ms is not claimed yet")

	require.Eventually(t, func() bool {
		got, err := b.worker.Claim(ctx, []uuid.UUID{id}, "w2", time.Minute)
		require.NoError(t, err)
		return len(got) == 1
	}, 5*time.Second, 50*time.Millisecond, "claimed once due")
}

// An outcome PostgreSQL refuses (a result holding \u0000, which jsonb
// cannot store) fails only its own change: the rest of the batch lands.
func TestABadOutcomeFailsAloneInItsBatch(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	good, bad := b.pending(t, 3), b.pending(t, 3)
	lg, lb := b.claim(t, good, "w1"), b.claim(t, bad, "w1")
	out, errs, err := b.worker.Apply(ctx, []task.Change{
		{TaskID: good, Version: lg.Version, Transition: task.Complete, Result: json.RawMessage(`{"ok":true}`)},
		{TaskID: bad, Version: lb.Version, Transition: task.Complete, Result: json.RawMessage(`{"s":"nul\u0000"}`)},
	})
	require.NoError(t, err)
	require.NoError(t, errs[0])
	require.False(t, out[0].Fenced)
	require.Error(t, errs[1])
	require.Equal(t, task.ErrCodeInvalid, task.ErrorCode(errs[1]))
	require.Equal(t, "COMPLETED", b.text(t, `SELECT status FROM tasks WHERE id = $1`, good))
	require.Equal(t, "IN_PROGRESS", b.text(t, `SELECT status FROM tasks WHERE id = $1`, bad))

	// Its holder then fails it, with the reason.
	b.apply(t, task.Change{TaskID: bad, Version: lb.Version, Transition: task.Fail, Error: errs[1].Error()})
	require.Contains(t, b.text(t, `SELECT error FROM tasks WHERE id = $1`, bad), "Unicode")
}

// A result is bounded as PostgreSQL stores it (task.MaxResultBytes): one
// over the bound fails alone in its batch, with a reason that says so,
// also when the worker's encoding was small and jsonb wrote it out longer;
// one at the bound is stored.
func TestAResultOverItsBoundFailsAloneInItsBatch(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	atBound, over, expands := b.pending(t, 3), b.pending(t, 3), b.pending(t, 3)
	la, lo, le := b.claim(t, atBound, "w1"), b.claim(t, over, "w1"), b.claim(t, expands, "w1")
	str := func(n int) json.RawMessage { return json.RawMessage(`"` + strings.Repeat("a", n-2) + `"`) }
	// 4,000 numbers of 5 bytes, which jsonb writes in 301 each: 1.2 MB.
	big := json.RawMessage("[" + strings.Repeat("1e300,", 3999) + "1e300]")
	require.Less(t, len(big), task.MaxResultBytes)
	out, errs, err := b.worker.Apply(ctx, []task.Change{
		{TaskID: atBound, Version: la.Version, Transition: task.Complete, Result: str(task.MaxResultBytes)},
		{TaskID: over, Version: lo.Version, Transition: task.Complete, Result: str(task.MaxResultBytes + 1)},
		{TaskID: expands, Version: le.Version, Transition: task.Complete, Result: big},
	})
	require.NoError(t, err)
	require.NoError(t, errs[0])
	require.False(t, out[0].Fenced)
	require.Equal(t, "COMPLETED", b.text(t, `SELECT status FROM tasks WHERE id = $1`, atBound))
	require.Equal(t, strconv.Itoa(task.MaxResultBytes),
		b.text(t, `SELECT octet_length(payload::text)::text FROM task_results WHERE task_id = $1`, atBound))
	for i, id := range []uuid.UUID{over, expands} {
		require.Error(t, errs[i+1])
		require.Equal(t, task.ErrCodeInvalid, task.ErrorCode(errs[i+1]))
		require.Contains(t, errs[i+1].Error(), "the result is larger than 1048576 bytes as stored")
		require.Equal(t, "IN_PROGRESS", b.text(t, `SELECT status FROM tasks WHERE id = $1`, id))
	}
	require.Equal(t, "0", b.text(t, `SELECT count(*)::text FROM task_results WHERE task_id IN ($1, $2)`, over, expands))
}

func TestWorkerRegistryAndParkedTypes(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	require.NoError(t, b.worker.Register(ctx, registry.Worker{ID: "w1", Hostname: "h", PID: 1, Concurrency: 4, Types: []string{"demo.noop"}}))
	ok, err := b.worker.Heartbeat(ctx, "w1")
	require.NoError(t, err)
	require.True(t, ok)

	id := b.pending(t, 3)
	b.exec(t, `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, available_at)
		VALUES ('task.run', `+testdb.OrgSQL+`, $1, 'demo.noop', 0, 1, 'infinity')`, id)
	require.NoError(t, b.worker.TypesReady(ctx, []string{"demo.noop"}))
	require.Zero(t, b.count(t, `SELECT count(*) FROM outbox WHERE available_at = 'infinity'`), "released")
	require.Equal(t, "demo.noop", b.text(t, `SELECT string_agg(name, ',') FROM task_types`))
	types, err := b.api.KnownTypes(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"demo.noop"}, types)

	b.exec(t, `UPDATE workers SET last_heartbeat_at = now() - interval '1 hour'`)
	n, err := b.maint.ReapWorkers(ctx, time.Minute)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	ok, err = b.worker.Heartbeat(ctx, "w1")
	require.NoError(t, err)
	require.False(t, ok, "a worker removed as dead learns it must register again")
}

// A worker that comes back under the same WORKER_ID (restarted before
// maintenance removed its row, say after a crash) is registered as it is
// now: its types, concurrency and version, not those of its last run. The
// scheduler sizes each type's window from them, and the overview shows
// them.
func TestAWorkerRegisteringAgainIsRecordedAsItIsNow(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	fleet := postgres.NewRegistryStore(b.db.Pool)
	require.NoError(t, b.worker.Register(ctx, registry.Worker{ID: "w1", Hostname: "h1", PID: 1, Concurrency: 4,
		Types: []string{"demo.noop"}, Version: "v1"}))
	before, err := fleet.Fleet(ctx, time.Minute)
	require.NoError(t, err)
	require.Len(t, before.Workers, 1)

	now := registry.Worker{ID: "w1", Hostname: "h2", PID: 2, Concurrency: 8, Types: []string{"demo.noop", "demo.sleep"},
		Version: "v2"}
	require.NoError(t, b.worker.Register(ctx, now))
	after, err := fleet.Fleet(ctx, time.Minute)
	require.NoError(t, err)
	require.Len(t, after.Workers, 1)
	require.Equal(t, now, after.Workers[0].Worker)
	require.True(t, after.Workers[0].StartedAt.After(before.Workers[0].StartedAt), "a new process starts anew")
}

// A worker's completions and its next claims go in one transaction; a
// batch PostgreSQL refuses is written again change by change, so the bad
// outcome fails alone and the claims still land.
func TestApplyAndClaimShareOneCommit(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	held, next := b.pending(t, 3), b.pending(t, 3)
	l := b.claim(t, held, "w1")
	out, errs, got, err := b.worker.ApplyAndClaim(ctx,
		[]task.Change{{TaskID: held, Version: l.Version, Transition: task.Complete, Result: json.RawMessage(`{"ok":true}`)}},
		[]uuid.UUID{next}, "w1", time.Hour)
	require.NoError(t, err)
	require.NoError(t, errs[0])
	require.False(t, out[0].Fenced)
	require.Len(t, got, 1)
	require.Equal(t, next, got[0].ID)
	require.Equal(t, "COMPLETED", b.text(t, `SELECT status FROM tasks WHERE id = $1`, held))
	require.Equal(t, "IN_PROGRESS", b.text(t, `SELECT status FROM tasks WHERE id = $1`, next))
	require.Equal(t, b.text(t, `SELECT xmin::text FROM tasks WHERE id = $1`, held),
		b.text(t, `SELECT xmin::text FROM tasks WHERE id = $1`, next), "one transaction wrote both")

	good, bad, third := next, b.pending(t, 3), b.pending(t, 3)
	lb := b.claim(t, bad, "w1")
	out, errs, got, err = b.worker.ApplyAndClaim(ctx, []task.Change{
		{TaskID: good, Version: got[0].Version, Transition: task.Complete, Result: json.RawMessage(`{}`)},
		{TaskID: bad, Version: lb.Version, Transition: task.Complete, Result: json.RawMessage(`{"s":"nul\u0000"}`)},
	}, []uuid.UUID{third}, "w1", time.Hour)
	require.NoError(t, err)
	require.NoError(t, errs[0])
	require.False(t, out[0].Fenced)
	require.Equal(t, task.ErrCodeInvalid, task.ErrorCode(errs[1]))
	require.Len(t, got, 1, "the claim lands with the good change")
	require.Equal(t, "COMPLETED", b.text(t, `SELECT status FROM tasks WHERE id = $1`, good))
	require.Equal(t, "IN_PROGRESS", b.text(t, `SELECT status FROM tasks WHERE id = $1`, bad))
	require.Equal(t, "IN_PROGRESS", b.text(t, `SELECT status FROM tasks WHERE id = $1`, third))

	// A batch of changes refused whole (here one task changed twice) fails
	// each of its changes, and the claims beside it still land.
	fourth := b.pending(t, 3)
	_, errs, got, err = b.worker.ApplyAndClaim(ctx, []task.Change{
		{TaskID: third, Version: got[0].Version, Transition: task.Progress, Progress: 10},
		{TaskID: third, Version: got[0].Version, Transition: task.Progress, Progress: 20},
	}, []uuid.UUID{fourth}, "w1", time.Hour)
	require.NoError(t, err)
	require.Error(t, errs[0])
	require.Error(t, errs[1])
	require.Len(t, got, 1, "the claim lands beside the refused batch")
	require.Equal(t, "IN_PROGRESS", b.text(t, `SELECT status FROM tasks WHERE id = $1`, fourth))
}
