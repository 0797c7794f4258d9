// Package testdb gives each test its own freshly migrated PostgreSQL
// database, cloned from a template that is migrated once per schema version.
// Tests talk to the real server at TEST_DATABASE_URL (default: the local one).
package testdb

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// DefaultAdminURL is the server the tests use unless TEST_DATABASE_URL says
// otherwise.
const DefaultAdminURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// lockKey serialises template creation and cloning across test processes.
const lockKey = 0x74657374646221

// AdminURL is the URL of the maintenance database tests create theirs on.
func AdminURL() string {
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return u
	}
	return DefaultAdminURL
}

// DB is one test's database.
type DB struct {
	// URL connects to the test's database.
	URL  string
	Name string
	// Pool is connected to it, closed at the end of the test.
	Pool *pgxpool.Pool
}

// New creates a migrated database for t, with the org TestOrg, dropped
// when t ends.
func New(t testing.TB) *DB {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	name := "conveyor_test_" + randomHex(6)
	if err := create(ctx, name); err != nil {
		t.Fatalf("testdb: %v", err)
	}
	db := &DB{URL: withDatabase(AdminURL(), name), Name: name}
	t.Cleanup(func() { Drop(t, name) })
	pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: db.URL})
	if err != nil {
		t.Fatalf("testdb: connect: %v", err)
	}
	db.Pool = pool
	t.Cleanup(pool.Close)
	if _, err := pool.Exec(ctx, `INSERT INTO orgs (slug, name) VALUES ($1, $1)`, TestOrg); err != nil {
		t.Fatalf("testdb: org %s: %v", TestOrg, err)
	}
	return db
}

// TestOrg is the slug of the org every test database has, and OrgSQL the
// SQL expression of its id, for tests that write task rows themselves.
const (
	TestOrg = "test"
	OrgSQL  = "(SELECT id FROM orgs WHERE slug = '" + TestOrg + "')"
)

// NewEmpty returns the URL of a database name that does not exist yet (for
// tests of creation and migration), dropped when t ends.
func NewEmpty(t testing.TB) string {
	t.Helper()
	name := "conveyor_test_" + randomHex(6)
	t.Cleanup(func() { Drop(t, name) })
	return withDatabase(AdminURL(), name)
}

// Drop removes a test database, closing its connections.
func Drop(t testing.TB, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, AdminURL())
	if err != nil {
		t.Logf("testdb: drop %s: %v", name, err)
		return
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		t.Logf("testdb: drop %s: %v", name, err)
	}
}

func create(ctx context.Context, name string) error {
	conn, err := pgx.Connect(ctx, AdminURL())
	if err != nil {
		return fmt.Errorf("connect to %s: %w", AdminURL(), err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", int64(lockKey)); err != nil {
		return err
	}
	defer func() { _, _ = conn.Exec(ctx, "SELECT pg_advisory_unlock($1)", int64(lockKey)) }()

	tmpl, err := templateName()
	if err != nil {
		return err
	}
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", tmpl).Scan(&exists); err != nil {
		return err
	}
	if !exists {
		if err := buildTemplate(ctx, conn, tmpl); err != nil {
			return fmt.Errorf("build template %s: %w", tmpl, err)
		}
	}
	_, err = conn.Exec(ctx, fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s",
		pgx.Identifier{name}.Sanitize(), pgx.Identifier{tmpl}.Sanitize()))
	return err
}

func buildTemplate(ctx context.Context, conn *pgx.Conn, tmpl string) error {
	building := tmpl + "_building"
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{building}.Sanitize()+" WITH (FORCE)"); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{building}.Sanitize()); err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, withDatabase(AdminURL(), building))
	if err != nil {
		return err
	}
	_, err = postgres.Migrate(ctx, pool, slog.New(slog.NewTextHandler(io.Discard, nil)))
	pool.Close()
	if err != nil {
		return err
	}
	_, err = conn.Exec(ctx, fmt.Sprintf("ALTER DATABASE %s RENAME TO %s",
		pgx.Identifier{building}.Sanitize(), pgx.Identifier{tmpl}.Sanitize()))
	return err
}

// templateName changes whenever a migration does, so a stale template is
// never cloned.
func templateName() (string, error) {
	ms, err := postgres.Migrations()
	if err != nil {
		return "", err
	}
	h := sha256.New()
	for _, m := range ms {
		fmt.Fprintf(h, "%d\x00%s\x00%s\x00", m.Version, m.Name, m.SQL)
	}
	return "conveyor_tmpl_" + hex.EncodeToString(h.Sum(nil))[:12], nil
}

func withDatabase(raw, name string) string {
	u, err := url.Parse(raw)
	if err != nil {
		panic(fmt.Sprintf("testdb: bad admin URL %q: %v", raw, err))
	}
	u.Path = "/" + name
	return u.String()
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// WaitForLockWait waits until a session of the database waits for a lock:
// for tests that hold a row and need another transaction queued behind it
// before they go on.
func (db *DB) WaitForLockWait(t testing.TB) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, func() error {
		var waiting int
		if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting); err != nil {
			return err
		}
		if waiting == 0 {
			return fmt.Errorf("no statement waits for a lock yet")
		}
		return nil
	})
}
