package postgres_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// submitAtOnce submits every submission from its own goroutine, all
// released together, and returns the outcomes in order.
func submitAtOnce(t *testing.T, store *postgres.APIStore, ps []auth.Principal, subs []task.Submission) ([]task.Submitted, []error) {
	t.Helper()
	out, errs := make([]task.Submitted, len(subs)), make([]error, len(subs))
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range subs {
		wg.Go(func() {
			<-start
			out[i], errs[i] = store.Submit(context.Background(), ps[i], subs[i], nil)
		})
	}
	close(start)
	wg.Wait()
	return out, errs
}

func noop(t *testing.T, payload string) task.Submission {
	t.Helper()
	sub, err := task.NewSubmission(task.SubmitInput{Type: "demo.noop", Payload: json.RawMessage(payload)},
		task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	return sub
}

// noops are n submissions of different inputs.
func noops(t *testing.T, n int) []task.Submission {
	t.Helper()
	subs := make([]task.Submission, n)
	for i := range subs {
		subs[i] = noop(t, fmt.Sprintf(`{"i": %d}`, i))
	}
	return subs
}

// adminStore is a fresh database, its org's admin, and the API's store.
func adminStore(t *testing.T) (*testdb.DB, auth.Principal, *postgres.APIStore) {
	t.Helper()
	db := testdb.New(t)
	_, p := db.Admin(t)
	return db, p, postgres.NewAPIStore(db.Pool, nil)
}

func repeat[T any](v T, n int) []T {
	out := make([]T, n)
	for i := range out {
		out[i] = v
	}
	return out
}

// Single submissions made at once share transactions, and each still gets
// its task, its first event and its message.
func TestConcurrentSubmitsCommitTogether(t *testing.T) {
	t.Parallel()
	db, p, store := adminStore(t)
	const n = 64
	subs := noops(t, n)
	out, errs := submitAtOnce(t, store, repeat(p, n), subs)
	ids := map[uuid.UUID]bool{}
	for i := range out {
		require.NoError(t, errs[i])
		require.True(t, out[i].Created)
		require.Equal(t, task.StatusPending, out[i].Task.Status)
		require.JSONEq(t, string(subs[i].Payload), string(out[i].Task.Payload), "each caller gets its own task")
		ids[out[i].Task.ID] = true
	}
	require.Len(t, ids, n)

	ctx := context.Background()
	var tasks, transactions, events, messages int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT xmin::text),
		(SELECT count(*) FROM task_events), (SELECT count(*) FROM outbox) FROM tasks`).
		Scan(&tasks, &transactions, &events, &messages))
	require.Equal(t, []int{n, n, n}, []int{tasks, events, messages})
	require.Less(t, transactions, n, "some submissions were committed together")
}

// The same input submitted many times at once makes one task, which every
// caller gets.
func TestConcurrentDuplicateSubmitsMakeOneTask(t *testing.T) {
	t.Parallel()
	db, p, store := adminStore(t)
	const n = 24
	out, errs := submitAtOnce(t, store, repeat(p, n), repeat(noop(t, `{"same": true}`), n))
	created := 0
	for i := range out {
		require.NoError(t, errs[i])
		require.Equal(t, out[0].Task.ID, out[i].Task.ID)
		if out[i].Created {
			created++
		}
	}
	require.Equal(t, 1, created)
	var tasks, messages int
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`SELECT count(*), (SELECT count(*) FROM outbox) FROM tasks`).Scan(&tasks, &messages))
	require.Equal(t, []int{1, 1}, []int{tasks, messages})
}

// A submission PostgreSQL refuses fails alone: the others made with it
// are written.
func TestGroupedSubmitFailsAlone(t *testing.T) {
	t.Parallel()
	db, p, store := adminStore(t)
	const n = 32
	subs := noops(t, n)
	// Past the API's validation, as a bug might let one through: the
	// schema's type rule refuses it.
	subs[n/2].Type = "Not A Type"
	out, errs := submitAtOnce(t, store, repeat(p, n), subs)
	for i := range out {
		if i == n/2 {
			require.Error(t, errs[i])
			continue
		}
		require.NoError(t, errs[i])
		require.True(t, out[i].Created)
	}
	var tasks int
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM tasks`).Scan(&tasks))
	require.Equal(t, n-1, tasks)
}

// Submissions of two orgs at once are written each in its own org: a
// group holds one caller's scope.
func TestConcurrentSubmitsOfTwoOrgs(t *testing.T) {
	t.Parallel()
	db, a, store := adminStore(t)
	_, b := db.Key(t, "other", auth.Admin)
	const n = 40
	ps, subs := make([]auth.Principal, n), noops(t, n)
	for i := range ps {
		ps[i] = a
		if i%2 == 1 {
			ps[i] = b
		}
	}
	out, errs := submitAtOnce(t, store, ps, subs)
	for i := range out {
		require.NoError(t, errs[i])
		require.Equal(t, ps[i].OrgID, out[i].Task.OrgID)
	}
	var inA, inB, transactions int
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE org_id = $1),
		count(*) FILTER (WHERE org_id = $2), count(DISTINCT xmin::text) FROM tasks`, a.OrgID, b.OrgID).
		Scan(&inA, &inB, &transactions))
	require.Equal(t, []int{n / 2, n / 2}, []int{inA, inB})
	// A group of two orgs would fail row-level security's check and run
	// each submission again alone: groups formed, so they held one org.
	require.Less(t, transactions, n)
}

// A caller whose context ends after a group has taken its submission gets
// the group's outcome, not an error that would hide a task written after
// it: a group's transaction outlives any one caller.
func TestASubmitTakenByAGroupAnswersWhatTheGroupWrote(t *testing.T) {
	t.Parallel()
	db, p, store := adminStore(t)
	ctx := context.Background()
	a1, a2, b, c := noop(t, `{"a": 1}`), noop(t, `{"a": 2}`), noop(t, `{"b": 1}`), noop(t, `{"c": 1}`)
	// hold keeps the inputs' hashes taken, uncommitted, until it rolls
	// back: a submission of one of them waits for it.
	hold := func(subs ...task.Submission) func() {
		tx, err := db.Pool.Begin(ctx)
		require.NoError(t, err)
		for _, s := range subs {
			_, err := tx.Exec(ctx, `INSERT INTO task_input_hashes (org_id, type, input_hash, task_id) VALUES ($1, $2, $3, $4)`,
				p.OrgID, s.Type, s.InputHash, uuid.New())
			require.NoError(t, err)
		}
		return func() { require.NoError(t, tx.Rollback(ctx)) }
	}
	releaseA, releaseB := hold(a1, a2), hold(b)
	type outcome struct {
		res task.Submitted
		err error
	}
	submitIn := func(ctx context.Context, sub task.Submission) chan outcome {
		done := make(chan outcome, 1)
		go func() {
			res, err := store.Submit(ctx, p, sub, nil)
			done <- outcome{res, err}
		}()
		return done
	}
	// Both of the store's groups in flight wait for the a's...
	doneA1, doneA2 := submitIn(ctx, a1), submitIn(ctx, a2)
	time.Sleep(100 * time.Millisecond)
	// ...while b, whose caller gives up soon, and c queue up. Once the a's
	// are written, b and c go together and wait for b's hash, past b's
	// caller's deadline.
	bctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	doneB, doneC := submitIn(bctx, b), submitIn(ctx, c)
	time.Sleep(200 * time.Millisecond)
	releaseA()
	for _, d := range []chan outcome{doneA1, doneA2} {
		require.NoError(t, (<-d).err)
	}
	<-bctx.Done()
	time.Sleep(100 * time.Millisecond)
	releaseB()
	gotB, gotC := <-doneB, <-doneC
	require.NoError(t, gotC.err)
	// What b's caller heard is what happened. (On a loaded machine c may
	// not have queued in time, and b then goes alone, under its own
	// context: refused, and nothing written.)
	var n int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE input_hash = $1`, b.InputHash).Scan(&n))
	if gotB.err != nil {
		require.Zero(t, n, "b's caller was answered %v, yet its task was written", gotB.err)
		return
	}
	require.True(t, gotB.res.Created)
	require.Equal(t, 1, n)
}
