package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/service"
)

// bootstrap makes an org if it is missing and a new admin key for it, and
// prints the key as the only line on stdout; logs go to stderr. It is how
// the first key of an org comes to be: every later one is made through the
// API with an admin key.
func bootstrap(f bootstrapFlags) func(context.Context, config.Common, io.Writer) error {
	return func(ctx context.Context, cfg config.Common, stdout io.Writer) error {
		return bootstrapOrg(ctx, cfg, f.org, f.name, stdout)
	}
}

// bootstrapOrg is bootstrap once its arguments are checked.
func bootstrapOrg(ctx context.Context, cfg config.Common, org, name string, stdout io.Writer) error {
	rt, err := service.Start(ctx, cfg, os.Stderr, service.Options{Name: "conveyor-bootstrap", MaxConns: 2, Migrate: true})
	if err != nil {
		return err
	}
	defer rt.Close(ctx)
	token, err := postgres.NewDirectory(rt.Pool).Bootstrap(ctx, org, name)
	if err != nil {
		return fmt.Errorf("bootstrap org %q: %w", org, err)
	}
	rt.Log.InfoContext(ctx, "admin key made; it is printed on stdout and stored only as a hash", "org", org, "name", name)
	_, err = fmt.Fprintln(stdout, token)
	return err
}
