package postgres_test

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// Two callers making the same org at once (two `api bootstrap` runs, two
// APIs starting with AUTH_DISABLED on a new database) both get the org:
// the one whose insert meets the other's row, committed while it waited,
// answers that row's id instead of failing.
func TestEnsureOrgMeetsAnOrgMadeMeanwhile(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	dir := postgres.NewDirectory(db.Pool)

	for _, how := range []struct {
		name   string
		ensure func(slug string) (uuid.UUID, error)
	}{
		{"EnsureOrg", func(slug string) (uuid.UUID, error) { return dir.EnsureOrg(ctx, slug) }},
		{"Bootstrap", func(slug string) (uuid.UUID, error) {
			token, err := dir.Bootstrap(ctx, slug, "racer")
			if err != nil {
				return uuid.Nil, err
			}
			rec, err := dir.KeyByPrefix(ctx, prefixOf(t, token))
			return rec.OrgID, err
		}},
	} {
		slug := "racing-" + strings.ToLower(how.name)
		tx, err := db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		var made uuid.UUID
		require.NoError(t, tx.QueryRow(ctx, `INSERT INTO orgs (slug, name) VALUES ($1, $1) RETURNING id`, slug).Scan(&made))

		type outcome struct {
			id  uuid.UUID
			err error
		}
		done := make(chan outcome, 1)
		go func() {
			id, err := how.ensure(slug)
			done <- outcome{id, err}
		}()
		// The second caller's insert waits for the first one's row.
		db.WaitForLockWait(t)
		require.NoError(t, tx.Commit(ctx))

		got := <-done
		require.NoError(t, got.err, how.name)
		require.Equal(t, made, got.id, how.name)
	}
}

func prefixOf(t *testing.T, token string) string {
	t.Helper()
	prefix, ok := auth.KeyPrefix(token)
	require.True(t, ok, "not a key")
	return prefix
}
