// Package postgres is Conveyor's PostgreSQL adapter: the pool, the embedded
// migrations and every SQL statement the system runs. pgx types do not leave
// this package.
package postgres

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/task"
)

// PoolConfig sizes and tunes a connection pool.
type PoolConfig struct {
	URL      string
	MaxConns int32
	// Tracer, when set, traces every query (OpenTelemetry).
	Tracer pgx.QueryTracer
}

// Open creates the database named in cfg.URL if it is missing, then returns a
// pool connected to it. The pool is checked with a ping.
func Open(ctx context.Context, cfg PoolConfig) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("parse DATABASE_URL: %w", err)
	}
	if cfg.MaxConns > 0 {
		pc.MaxConns = cfg.MaxConns
	}
	pc.ConnConfig.Tracer = cfg.Tracer
	if err := EnsureDatabase(ctx, pc.ConnConfig); err != nil {
		return nil, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("create pool: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("ping database: %w", err)
	}
	return pool, nil
}

// EnsureDatabase creates the database cc names when it does not exist. It is
// safe to call from several processes at once.
func EnsureDatabase(ctx context.Context, cc *pgx.ConnConfig) error {
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err == nil {
		return conn.Close(ctx)
	}
	if pgCode(err) != "3D000" { // invalid_catalog_name
		return fmt.Errorf("connect to database %q: %w", cc.Database, err)
	}
	admin := cc.Copy()
	admin.Database = "postgres"
	adminConn, err := pgx.ConnectConfig(ctx, admin)
	if err != nil {
		return fmt.Errorf("connect to maintenance database to create %q: %w", cc.Database, err)
	}
	defer adminConn.Close(ctx)
	_, err = adminConn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{cc.Database}.Sanitize())
	switch pgCode(err) {
	case "", "42P04", "23505": // created, or another process won the race
		return nil
	default:
		return fmt.Errorf("create database %q: %w", cc.Database, err)
	}
}

// pgCode returns the SQLSTATE of a PostgreSQL error, or "".
func pgCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// translate turns driver errors into domain errors at the boundary.
func translate(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return task.ErrNotFound
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "22P05", "22021", "22P02":
			// unsupported unicode escape (\u0000), bad encoding, bad text
			return &task.Error{Code: task.ErrCodeInvalid, Message: "input rejected by the database: " + pgErr.Message}
		case "23514": // check_violation
			return &task.Error{Code: task.ErrCodeInvalid, Message: "input breaks a rule: " + pgErr.ConstraintName}
		}
	}
	if pgconn.SafeToRetry(err) || pgconn.Timeout(err) {
		return &task.Error{Code: task.ErrCodeUnavailable, Message: "database unavailable, try again"}
	}
	return err
}

// Now is the database clock's idea of the time, for tests and diagnostics.
func Now(ctx context.Context, pool *pgxpool.Pool) (time.Time, error) {
	var now time.Time
	err := pool.QueryRow(ctx, "SELECT now()").Scan(&now)
	return now, err
}
