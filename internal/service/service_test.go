package service_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/service"
	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// A collector that accepts connections and never answers (a black-holed
// OTEL_EXPORTER_OTLP_ENDPOINT) must not hold a stopping process long past
// SHUTDOWN_TIMEOUT: the flush of the last spans is bounded.
func TestCloseBoundsTheFlushOfTraces(t *testing.T) {
	// t.Setenv: not parallel.
	silent, _ := testenv.SilentAddr(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+silent)
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
	db := testdb.New(t)
	cfg := config.Common{DatabaseURL: db.URL, LogLevel: "error", LogFormat: "json",
		ShutdownTimeout: time.Second, OTLPEndpoint: "http://" + silent}
	ctx, cancel := context.WithCancel(context.Background())
	rt, err := service.Start(ctx, cfg, io.Discard, service.Options{Name: "conveyor-test"})
	require.NoError(t, err)
	_, span := rt.TracerProvider.Tracer("test").Start(ctx, "work")
	span.End()
	cancel() // SIGTERM
	start := time.Now()
	rt.Close(ctx)
	require.Less(t, time.Since(start), 8*time.Second, "Close waited on a collector that never answers")
}

// A collector that refuses the spans is an operator's to see in the logs,
// which are JSON: OpenTelemetry's own errors went to stderr in Go's plain
// log format, a line no log pipeline parses, with no level.
func TestTraceExportErrorsAreLoggedAsJSON(t *testing.T) {
	// t.Setenv: not parallel.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	endpoint := "http://" + ln.Addr().String()
	require.NoError(t, ln.Close()) // nothing listens there: connections are refused
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
	db := testdb.New(t)
	cfg := config.Common{DatabaseURL: db.URL, LogLevel: "info", LogFormat: "json",
		ShutdownTimeout: time.Second, OTLPEndpoint: endpoint}
	var out syncBuffer
	rt, err := service.Start(context.Background(), cfg, &out, service.Options{Name: "conveyor-test"})
	require.NoError(t, err)
	_, span := rt.TracerProvider.Tracer("test").Start(context.Background(), "work")
	span.End()
	rt.Close(context.Background()) // flushes the span: its export fails
	var found bool
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		if line == "" {
			continue
		}
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), "not JSON: %s", line)
		if rec["level"] == "WARN" && strings.Contains(fmt.Sprint(rec["error"]), "connection refused") {
			found = true
		}
	}
	require.True(t, found, "no JSON warning of the failed export in:\n%s", out.String())
}

// syncBuffer is a bytes.Buffer safe for a logger's writes from other
// goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// A worker may start before any api, on a database nothing has migrated
// yet (or one an older release migrated): it brings the schema up itself.
// Its connections plan the hot statements as they connect, so they must
// only connect once the schema is there.
func TestStartMigratesBeforeItsPoolsWarmUp(t *testing.T) {
	t.Parallel()
	url := testdb.NewEmpty(t)
	ctx := context.Background()
	require.NoError(t, postgres.EnsureDatabaseURL(ctx, url))
	cfg := config.Common{DatabaseURL: url, LogLevel: "error", LogFormat: "json", ShutdownTimeout: time.Second}
	rt, err := service.Start(ctx, cfg, io.Discard, service.Options{Name: "conveyor-test",
		Plans: postgres.PlansGeneric, WarmUp: postgres.WorkerHotStatements, BackgroundPool: true, Migrate: true})
	require.NoError(t, err)
	defer rt.Close(ctx)
	var applied int
	require.NoError(t, rt.Pool.QueryRow(ctx, "SELECT count(*) FROM schema_migrations").Scan(&applied))
	all, err := postgres.Migrations()
	require.NoError(t, err)
	require.Equal(t, len(all), applied)
}

// A service that does not migrate (the relay) and starts before the
// schema is there waits for the api or a worker to migrate it, instead of
// exiting on its first statement.
func TestStartWaitsForTheSchema(t *testing.T) {
	t.Parallel()
	url := testdb.NewEmpty(t)
	ctx := context.Background()
	require.NoError(t, postgres.EnsureDatabaseURL(ctx, url))
	cfg := config.Common{DatabaseURL: url, LogLevel: "info", LogFormat: "json", ShutdownTimeout: time.Second}
	var out syncBuffer
	type started struct {
		rt  *service.Runtime
		err error
	}
	done := make(chan started, 1)
	go func() {
		rt, err := service.Start(ctx, cfg, &out, service.Options{Name: "conveyor-test",
			Plans: postgres.PlansGeneric, WarmUp: postgres.RelayHotStatements})
		done <- started{rt, err}
	}()
	testenv.Eventually(t, 30*time.Second, func() error {
		select {
		case s := <-done:
			done <- s
			return nil
		default:
		}
		if !strings.Contains(out.String(), "not migrated") {
			return fmt.Errorf("not waiting for the schema yet:\n%s", out.String())
		}
		return nil
	})
	select {
	case s := <-done:
		require.NoError(t, s.err, "started before the schema was there")
		s.rt.Close(ctx)
		t.Fatal("started before the schema was there")
	default:
	}

	pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: url, MaxConns: 1})
	require.NoError(t, err)
	_, err = postgres.Migrate(ctx, pool, slog.New(slog.NewTextHandler(io.Discard, nil)))
	pool.Close()
	require.NoError(t, err)
	select {
	case s := <-done:
		require.NoError(t, s.err)
		s.rt.Close(ctx)
	case <-time.After(30 * time.Second):
		t.Fatal("not started once the schema was there")
	}
}

// MIGRATION_LOCK_TIMEOUT is the lock_timeout of the migrations a binary
// applies as it starts.
func TestStartMigratesWithTheConfiguredLockTimeout(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	// Migration 020 is missing again, and a transaction left open writes
	// workflow_runs, on which 020 first builds an index.
	_, err := db.Pool.Exec(ctx, "DELETE FROM schema_migrations WHERE version = 20")
	require.NoError(t, err)
	blocker, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = blocker.Rollback(ctx) }()
	_, err = blocker.Exec(ctx, "LOCK TABLE workflow_runs IN ROW EXCLUSIVE MODE")
	require.NoError(t, err)

	cfg := config.Common{DatabaseURL: db.URL, LogLevel: "info", LogFormat: "json", ShutdownTimeout: time.Second,
		MigrationLockTimeout: 50 * time.Millisecond}
	var out syncBuffer
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		rt, err := service.Start(sctx, cfg, &out, service.Options{Name: "conveyor-test", Migrate: true})
		if rt != nil {
			rt.Close(ctx)
		}
		done <- err
	}()
	testenv.Eventually(t, 20*time.Second, func() error {
		for _, line := range strings.Split(out.String(), "\n") {
			if strings.Contains(line, "migration waiting for a lock") {
				if !strings.Contains(line, `"lock_timeout":"50ms"`) {
					return fmt.Errorf("the migration waited with another lock_timeout: %s", line)
				}
				return nil
			}
		}
		return fmt.Errorf("no wait logged yet:\n%s", out.String())
	})
	cancel()
	require.Error(t, <-done, "stopped while the migration waits")
}
