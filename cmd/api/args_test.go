package main

import (
	"bytes"
	"context"
	"errors"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// `api migrate` and `api bootstrap` take their arguments as strictly as the
// services do: help is printed without touching the database, and a word
// they do not take is refused with exit 2 — `api migrate -h` once created
// and migrated the database named in DATABASE_URL, and `api bootstrap --org
// acme extra` made a key as if "extra" were not there.
func TestMigrateAndBootstrapRefuseArgumentsTheyDoNotTake(t *testing.T) {
	t.Parallel()
	bin := testenv.Binary(t, "./cmd/api")
	for _, tc := range []struct {
		args   []string
		code   int
		stdout string
		stderr string
	}{
		{args: []string{"migrate", "-h"}, code: 0, stdout: "usage: api ["},
		{args: []string{"migrate", "--help"}, code: 0, stdout: "usage: api ["},
		{args: []string{"migrate", "now"}, code: 2, stderr: `api migrate: unknown argument "now"`},
		{args: []string{"bootstrap", "--org", "acme", "extra"}, code: 2, stderr: `api bootstrap: unknown argument "extra"`},
		{args: []string{"bootstrap", "--org", "acme", "--label", "x"}, code: 2, stderr: "flag provided but not defined: -label"},
		{args: []string{"bootstrap", "--org", "Not A Slug"}, code: 2, stderr: "--org: give the org's slug"},
		{args: []string{"bootstrap", "--org", "acme", "--name", ""}, code: 2, stderr: "--name: give the key's name"},
		{args: []string{"bootstrap", "--org", "acme", "--name", strings.Repeat("k", 201)}, code: 2, stderr: "--name: give the key's name"},
		{args: []string{"bootstrap", "-h"}, code: 0, stderr: "-org string"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			t.Parallel()
			dbURL := testdb.NewEmpty(t)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, bin, tc.args...)
			cmd.Env = append(os.Environ(), "DATABASE_URL="+dbURL)
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			err := cmd.Run()
			require.NoError(t, ctx.Err())
			code := 0
			if ee, ok := errors.AsType[*exec.ExitError](err); ok {
				code = ee.ExitCode()
			} else {
				require.NoError(t, err)
			}
			require.Equal(t, tc.code, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
			if tc.stdout != "" {
				require.Contains(t, stdout.String(), tc.stdout)
			}
			if tc.stderr != "" {
				require.Contains(t, stderr.String(), tc.stderr)
			}
			require.Empty(t, keyIn(stdout.String()), "no key may be printed")
			require.False(t, databaseExists(t, dbURL), "the database was created")
		})
	}
}

// keyIn is the API key in out, if any.
func keyIn(out string) string {
	for _, f := range strings.Fields(out) {
		if strings.HasPrefix(f, "cvk_") {
			return f
		}
	}
	return ""
}

func databaseExists(t *testing.T, dbURL string) bool {
	t.Helper()
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, testdb.AdminURL())
	require.NoError(t, err)
	defer conn.Close(ctx)
	var exists bool
	require.NoError(t, conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)`,
		strings.TrimPrefix(u.Path, "/")).Scan(&exists))
	return exists
}
