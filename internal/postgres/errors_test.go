package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// A binary starting while the database restarts waits for it; one pointed
// at a database that does not exist, or with bad credentials, stops.
func TestTransientTellsWaitingFromGivingUp(t *testing.T) {
	t.Parallel()
	for code, transient := range map[string]bool{
		"57P01": true, "57P03": true, "08006": true, // terminated, starting up, connection failure
		"3D000": false, "28P01": false, "42601": false, // no database, bad password, a broken migration
	} {
		err := fmt.Errorf("start: %w", &pgconn.PgError{Code: code})
		require.Equal(t, transient, postgres.Transient(err), code)
	}
	require.False(t, postgres.Transient(errors.New("parse DATABASE_URL: bad")))

	_, err := postgres.Open(context.Background(), postgres.PoolConfig{URL: testdb.NewEmpty(t)})
	require.False(t, postgres.Transient(err), "a missing database: %v", err)
	_, err = postgres.Open(context.Background(), postgres.PoolConfig{URL: "postgres://postgres@127.0.0.1:1/x?connect_timeout=1"})
	require.True(t, postgres.Transient(err), "nothing listening: %v", err)
}

// A transaction rolled back to break a deadlock runs again; one that
// deadlocks at every try is worth another request, not an internal error.
func TestADeadlockIsTriedAgainThenUnavailable(t *testing.T) {
	t.Parallel()
	deadlock := fmt.Errorf("bulk: %w", &pgconn.PgError{Code: "40P01"})
	calls := 0
	require.NoError(t, postgres.RetryDeadlocks(func() error {
		if calls++; calls == 1 {
			return deadlock
		}
		return nil
	}))
	require.Equal(t, 2, calls)

	calls = 0
	err := postgres.RetryDeadlocks(func() error { calls++; return deadlock })
	var te *task.Error
	require.ErrorAs(t, err, &te)
	require.Equal(t, task.ErrCodeUnavailable, te.Code)
	require.Equal(t, 3, calls)
}

// A batch that loses its race for a key, a deadlock or a serialization
// conflict at every try is worth another request, not an internal error.
func TestAConflictThatOutlastsItsTriesIsUnavailable(t *testing.T) {
	t.Parallel()
	for _, err := range []error{
		fmt.Errorf("submit: %w", postgres.ErrRaced),
		fmt.Errorf("submit: %w", &pgconn.PgError{Code: "40P01"}),
		fmt.Errorf("submit: %w", &pgconn.PgError{Code: "40001"}),
	} {
		var te *task.Error
		require.ErrorAs(t, postgres.Outlasted(err), &te, "%v", err)
		require.Equal(t, task.ErrCodeUnavailable, te.Code, "%v", err)
	}
}

// A statement cut by the server's shutdown or restart is worth another
// request: the API answers 503, and a stream's client reconnects.
func TestAServerShuttingDownIsUnavailable(t *testing.T) {
	t.Parallel()
	for _, code := range []string{"57P01", "57P02", "57P03", "08006"} {
		var te *task.Error
		require.ErrorAs(t, postgres.Translate(fmt.Errorf("read: %w", &pgconn.PgError{Code: code})), &te, code)
		require.Equal(t, task.ErrCodeUnavailable, te.Code, code)
	}
}

// A request whose time runs out before it reaches PostgreSQL, waiting for a
// connection of a busy pool, is the slow database the API answers 503 for,
// not an internal error, whichever statement it was to run.
func TestARequestOutOfTimeWaitingForAConnectionIsUnavailable(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, p := db.Admin(t)
	pool, err := postgres.Open(context.Background(), postgres.PoolConfig{URL: db.URL, MaxConns: 1})
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	store := postgres.NewAPIStore(pool, nil)
	busy, err := pool.Acquire(context.Background())
	require.NoError(t, err)
	defer busy.Release()

	for _, c := range []struct {
		name string
		call func(context.Context) error
	}{
		{"get", func(ctx context.Context) error { _, err := store.Get(ctx, p, uuid.New()); return err }},
		{"cancel", func(ctx context.Context) error { _, _, err := store.Cancel(ctx, p, uuid.New(), nil); return err }},
		{"submit", func(ctx context.Context) error { _, err := store.Submit(ctx, p, noop(t, `{}`), nil); return err }},
		{"list", func(ctx context.Context) error { _, err := store.List(ctx, p, task.ListFilter{Limit: 1}); return err }},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		err := c.call(ctx)
		cancel()
		require.Equal(t, task.ErrCodeUnavailable, task.ErrorCode(err), "%s: %v", c.name, err)
	}
}
