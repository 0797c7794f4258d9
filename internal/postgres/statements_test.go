package postgres_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// Every statement the adapter runs is checked against the migrated schema:
// PostgreSQL parses and plans it (a misspelt column, a wrong type, a
// dropped table fail here, not in production).
func TestEveryStatementPreparesAgainstTheSchema(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	conn, err := db.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	names := map[string]bool{}
	for _, st := range postgres.Statements() {
		require.False(t, names[st.Name], "two statements named %s", st.Name)
		names[st.Name] = true
		require.Equal(t, st.Name, postgres.StatementName(st.SQL))
		_, err := conn.Conn().Prepare(ctx, st.Name, st.SQL)
		require.NoError(t, err, "%s:\n%s", st.Name, st.SQL)
	}
	require.Greater(t, len(names), 20)
}

// The schema's list of statuses is the lifecycle's.
func TestSchemaStatusesAreTheLifecycles(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	var def string
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT pg_get_constraintdef(oid) FROM pg_constraint
		WHERE conrelid = 'tasks'::regclass AND pg_get_constraintdef(oid) LIKE '%status = ANY%' AND pg_get_constraintdef(oid) NOT LIKE '%completed_at%'`).Scan(&def))
	for _, s := range task.Statuses {
		require.Contains(t, def, "'"+string(s)+"'")
	}
	require.Equal(t, len(task.Statuses), strings.Count(def, "::text"), def)
}

// The schema's task-type rule is the one package task defines.
func TestSchemaTypePatternIsTheDomains(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	var def string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT pg_get_constraintdef(oid) FROM pg_constraint
		WHERE conrelid = 'task_types'::regclass AND pg_get_constraintdef(oid) LIKE '%~%'`).Scan(&def))
	require.Contains(t, def, task.TypePattern, "task_types")
	// A task's type is checked by its column's domain.
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c
		JOIN pg_attribute a ON a.atttypid = c.contypid
		WHERE a.attrelid = 'tasks'::regclass AND a.attname = 'type'`).Scan(&def))
	require.Contains(t, def, task.TypePattern, "tasks.type")
}
