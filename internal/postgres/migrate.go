package postgres

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"regexp"
	"slices"
	"sort"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/migrations"
)

// migrationLockKey is the advisory lock that serialises migration runners;
// the number is "conveyor" read as ASCII.
const migrationLockKey = 0x636f6e7665796f72

var migrationName = regexp.MustCompile(`^(\d+)_([a-z0-9_]+)\.sql$`)

// ErrSchemaNewer is returned by Migrate when the database holds migrations
// this binary does not know: a newer release migrated it.
var ErrSchemaNewer = errors.New("the database schema is newer than this binary")

// ErrSchemaBehind is returned by CheckSchema while migrations this binary
// needs are not applied yet.
var ErrSchemaBehind = errors.New("the database schema is not migrated to this binary's yet")

// Migration is one embedded schema change.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// Migrations lists the embedded migrations in version order.
func Migrations() ([]Migration, error) {
	entries, err := fs.ReadDir(migrations.FS, ".")
	if err != nil {
		return nil, fmt.Errorf("read migrations: %w", err)
	}
	var out []Migration
	for _, e := range entries {
		m := migrationName.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		version, _ := strconv.Atoi(m[1])
		body, err := fs.ReadFile(migrations.FS, e.Name())
		if err != nil {
			return nil, fmt.Errorf("read migration %s: %w", e.Name(), err)
		}
		out = append(out, Migration{Version: version, Name: m[2], SQL: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	for i := 1; i < len(out); i++ {
		if out[i].Version == out[i-1].Version {
			return nil, fmt.Errorf("two migrations numbered %d", out[i].Version)
		}
	}
	return out, nil
}

// Migrate applies every embedded migration not yet recorded in
// schema_migrations, each in its own transaction, under a session advisory
// lock so that any number of processes may call it at once. It returns the
// versions it applied.
func Migrate(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) ([]int, error) {
	all, err := Migrations()
	if err != nil {
		return nil, err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("acquire connection for migrations: %w", err)
	}
	defer conn.Release()

	// The pool's statement timeout (the API's request timeout) is not a
	// migration's: on a large table a migration runs for minutes, and the
	// other runners wait for the lock as long. The connection gets the
	// pool's timeout back before it returns to the pool.
	if _, err := conn.Exec(ctx, "SET statement_timeout = 0"); err != nil {
		return nil, fmt.Errorf("lift statement timeout for migrations: %w", err)
	}
	defer func() {
		if _, err := conn.Exec(context.WithoutCancel(ctx), "RESET statement_timeout"); err != nil {
			// Never hand the pool a connection without its bound.
			_ = conn.Conn().Close(context.WithoutCancel(ctx))
		}
	}()

	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", int64(migrationLockKey)); err != nil {
		return nil, fmt.Errorf("take migration lock: %w", err)
	}
	defer func() {
		// A fresh context: the lock must go even when ctx is done.
		_, _ = conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", int64(migrationLockKey))
	}()

	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
		version    integer PRIMARY KEY,
		name       text        NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return nil, fmt.Errorf("create schema_migrations: %w", err)
	}
	rows, err := conn.Query(ctx, "SELECT version FROM schema_migrations")
	if err != nil {
		return nil, fmt.Errorf("read schema_migrations: %w", err)
	}
	applied, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, fmt.Errorf("read schema_migrations: %w", err)
	}
	if err := schemaNotNewer(applied, all); err != nil {
		return nil, err
	}
	done := make(map[int]bool, len(applied))
	for _, v := range applied {
		done[v] = true
	}

	var ran []int
	for _, m := range all {
		if done[m.Version] {
			continue
		}
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", m.Version, m.Name)
			return err
		})
		if err != nil {
			return ran, fmt.Errorf("apply migration %03d_%s: %w", m.Version, m.Name, err)
		}
		log.InfoContext(ctx, "applied migration", "version", m.Version, "name", m.Name)
		ran = append(ran, m.Version)
	}
	return ran, nil
}

// schemaNotNewer refuses a database a newer release migrated. This binary's
// statements were written for its own schema: against a newer one they may
// fail, or worse, run and skip what the newer schema expects of them (an
// index a guarantee moved away from, a column a trigger no longer keeps),
// and there is no migration down. An operator rolling back restores the
// database from before the upgrade; one rolling forward runs the new
// release everywhere.
func schemaNotNewer(applied []int, known []Migration) error {
	if len(applied) == 0 {
		return nil
	}
	newest := slices.Max(applied)
	latest := 0
	if len(known) > 0 {
		latest = known[len(known)-1].Version
	}
	if newest > latest {
		return fmt.Errorf("%w: it is at migration %03d, this binary knows migrations up to %03d: run the release that migrated it, or a newer one",
			ErrSchemaNewer, newest, latest)
	}
	return nil
}

// CheckSchema says whether the database's schema is this binary's, for a
// service that does not migrate it (the relay): ErrSchemaBehind while
// migrations remain (the api, a worker or `api migrate` applies them),
// ErrSchemaNewer once a newer release has migrated it.
func CheckSchema(ctx context.Context, pool *pgxpool.Pool) error {
	all, err := Migrations()
	if err != nil {
		return err
	}
	rows, err := pool.Query(ctx, "SELECT version FROM schema_migrations")
	if err != nil {
		return schemaReadError(err)
	}
	applied, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return schemaReadError(err)
	}
	if err := schemaNotNewer(applied, all); err != nil {
		return err
	}
	for _, m := range all {
		if !slices.Contains(applied, m.Version) {
			return fmt.Errorf("%w: migration %03d_%s is not applied", ErrSchemaBehind, m.Version, m.Name)
		}
	}
	return nil
}

func schemaReadError(err error) error {
	if pgCode(err) == codeUndefinedTable {
		return fmt.Errorf("%w: no migration is applied", ErrSchemaBehind)
	}
	return fmt.Errorf("read schema_migrations: %w", err)
}
