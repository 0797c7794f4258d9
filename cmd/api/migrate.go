package main

import (
	"context"
	"io"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/service"
)

// migrate creates the database if it is missing — the one place that does —
// applies the pending migrations and returns.
func migrate(ctx context.Context, cfg config.Common, stdout io.Writer) error {
	if err := postgres.EnsureDatabaseURL(ctx, cfg.DatabaseURL); err != nil {
		return err
	}
	rt, err := service.Start(ctx, cfg, stdout, service.Options{Name: "conveyor-migrate", MaxConns: 2, Migrate: true})
	if err != nil {
		return err
	}
	defer rt.Close(ctx)
	rt.Log.InfoContext(ctx, "migrations done")
	return nil
}
