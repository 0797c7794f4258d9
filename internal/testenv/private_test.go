package testenv_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testenv"
)

// A private PostgreSQL answers, stops, and answers again after a restart.
func TestPrivatePostgresRestarts(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPG(t)
	ctx := context.Background()
	connect := func() error {
		c, err := pgx.Connect(ctx, pg.URL("postgres"))
		if err != nil {
			return err
		}
		return c.Close(ctx)
	}
	require.NoError(t, connect())
	pg.Stop(t)
	require.Error(t, connect(), "stopped")
	pg.Start(t)
	require.NoError(t, connect())
}
