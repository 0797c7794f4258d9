package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

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

// A conflict with concurrent work that outlasts a store's tries is worth
// another request, not an internal error: the transaction was rolled
// back whole.
func TestAConflictRolledBackIsUnavailableNotInternal(t *testing.T) {
	t.Parallel()
	for _, code := range []string{"40P01", "40001"} { // deadlock, serialization failure
		err := postgres.Translate(fmt.Errorf("bulk: %w", &pgconn.PgError{Code: code}))
		var te *task.Error
		require.ErrorAs(t, err, &te, code)
		require.Equal(t, task.ErrCodeUnavailable, te.Code, code)
	}
}
