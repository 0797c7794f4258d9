package postgres_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testdb"
)

// Ids travel in uuid's binary form both ways, alone and in arrays, NULL
// included, and read the same in either protocol.
func TestUUIDsRoundTrip(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	a, b := uuid.New(), uuid.New()

	var got uuid.UUID
	var gotText string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT $1::uuid, $1::uuid::text`, a).Scan(&got, &gotText))
	require.Equal(t, a, got)
	require.Equal(t, a.String(), gotText)

	var arr []uuid.UUID
	var n int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT $1::uuid[], cardinality($1::uuid[])`, []uuid.UUID{a, b}).Scan(&arr, &n))
	require.Equal(t, []uuid.UUID{a, b}, arr)
	require.Equal(t, 2, n)

	var some, none *uuid.UUID
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT $1::uuid, NULL::uuid`, b).Scan(&some, &none))
	require.Equal(t, b, *some)
	require.Nil(t, none)

	var isNull bool
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT $1::uuid IS NULL`, (*uuid.UUID)(nil)).Scan(&isNull))
	require.True(t, isNull)

	err := db.Pool.QueryRow(ctx, `SELECT NULL::uuid`).Scan(&got)
	require.ErrorContains(t, err, "NULL")

	// The simple protocol sends and reads text.
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT $1::uuid`, pgx.QueryExecModeSimpleProtocol, a).Scan(&got))
	require.Equal(t, a, got)
}
