package main

import (
	"context"
	"io"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/telemetry"
)

// migrate creates the database if needed, applies the pending migrations
// and returns; the API does the same at start-up.
func migrate(ctx context.Context, cfg config.Common, stdout io.Writer) error {
	log := telemetry.NewLogger(stdout, cfg.LogLevel, cfg.LogFormat).With("service", "conveyor-migrate")
	pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: cfg.DatabaseURL, MaxConns: 2})
	if err != nil {
		return err
	}
	defer pool.Close()
	applied, err := postgres.Migrate(ctx, pool, log)
	if err != nil {
		return err
	}
	log.InfoContext(ctx, "migrations done", "applied", len(applied))
	return nil
}
