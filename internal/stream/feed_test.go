package stream_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/stream"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// These tests run the hub on a real database, where event ids really do
// commit out of order.

// sqlTouch appends an event to a task the way every writer does: after a
// write of the task row, in the same transaction.
const sqlTouch = `WITH upd AS (UPDATE tasks SET updated_at = now() WHERE id = $1 RETURNING *)
	INSERT INTO task_events (task_id, org_id, status, state, progress, actor)
	SELECT id, org_id, status, state, progress, 'SYSTEM' FROM upd RETURNING id`

func TestFeedHoldsALaterIDUntilAnEarlierOneCommits(t *testing.T) {
	for _, commit := range []bool{true, false} {
		name := map[bool]string{true: "commit", false: "rollback"}[commit]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t)
			ctx := context.Background()
			_, admin := db.Admin(t)
			store := postgres.NewAPIStore(db.Pool, nil)
			first, second := submit(t, store, admin, 1), submit(t, store, admin, 2)

			hub := stream.NewHub(postgres.NewEventFeed(db.Pool), stream.Config{Recheck: time.Millisecond,
				Poll: 10 * time.Millisecond, Encode: func(*task.Event) ([]byte, error) { return nil, nil }},
				slog.New(slog.NewTextHandler(io.Discard, nil)), nil)
			hubCtx, stop := context.WithCancel(ctx)
			defer stop()
			go func() { _ = hub.Run(hubCtx) }()
			sub, _, err := hub.Subscribe(ctx, admin.Scope(), task.EventFilter{})
			require.NoError(t, err)

			// Transaction A takes an id and holds it; B takes the next one
			// and commits.
			txA, err := db.Pool.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = txA.Rollback(ctx) }()
			var idA, idB int64
			require.NoError(t, txA.QueryRow(ctx, sqlTouch, first).Scan(&idA))
			require.NoError(t, db.Pool.QueryRow(ctx, sqlTouch, second).Scan(&idB))
			require.Greater(t, idB, idA)
			hub.Wake()

			select {
			case it := <-sub.Events():
				t.Fatalf("event %d delivered while %d may still commit", it.Event.ID, idA)
			case <-time.After(100 * time.Millisecond):
			}

			want := []int64{idB}
			if commit {
				require.NoError(t, txA.Commit(ctx))
				want = []int64{idA, idB}
			} else {
				require.NoError(t, txA.Rollback(ctx))
			}
			hub.Wake()
			var got []int64
			for len(got) < len(want) {
				select {
				case it := <-sub.Events():
					got = append(got, it.Event.ID)
				case <-time.After(5 * time.Second):
					t.Fatalf("got %v, want %v", got, want)
				}
			}
			require.Equal(t, want, got)
		})
	}
}

func TestParseSnapshot(t *testing.T) {
	s, err := postgres.ParseSnapshot("10:20:15,12")
	require.NoError(t, err)
	require.Equal(t, postgres.Snapshot{Xmin: 10, Xmax: 20, Xip: []uint64{12, 15}}, s)
	require.True(t, s.Finished([]uint64{9, 13, 19}))
	require.False(t, s.Finished([]uint64{12}))
	require.False(t, s.Finished([]uint64{20}))
	s, err = postgres.ParseSnapshot("10:10:")
	require.NoError(t, err)
	require.Empty(t, s.Xip)
	for _, bad := range []string{"", "1:2", "a:2:", "1:b:", "1:2:x"} {
		_, err := postgres.ParseSnapshot(bad)
		require.Error(t, err, bad)
	}
}

func submit(t *testing.T, store *postgres.APIStore, p auth.Principal, n int) uuid.UUID {
	t.Helper()
	out, err := store.Submit(context.Background(), p, task.Submission{Type: "feed.test",
		Payload: []byte(fmt.Sprintf(`{"n":%d}`, n)), Metadata: []byte(`{}`), MaxAttempts: 1}, nil)
	require.NoError(t, err)
	return out.Task.ID
}
