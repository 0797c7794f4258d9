package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/service"
	"github.com/conveyorhq/conveyor/internal/task"
)

// bootstrap makes an org if it is missing and a new admin key for it, and
// prints the key as the only line on stdout; logs go to stderr. It is how
// the first key of an org comes to be: every later one is made through the
// API with an admin key.
func bootstrap(ctx context.Context, cfg config.Common, stdout io.Writer) error {
	fs := flag.NewFlagSet("api bootstrap", flag.ContinueOnError)
	fs.SetOutput(os.Stderr)
	org := fs.String("org", "", "the org's slug ("+task.SlugPattern+"); made if missing")
	name := fs.String("name", "bootstrap", "the new admin key's name")
	if err := fs.Parse(os.Args[2:]); err != nil {
		if errors.Is(err, flag.ErrHelp) { // -h: the usage is printed
			return nil
		}
		return err
	}
	if !regexp.MustCompile(task.SlugPattern).MatchString(*org) {
		return errors.New("--org: give the org's slug, matching " + task.SlugPattern)
	}
	rt, err := service.Start(ctx, cfg, os.Stderr, service.Options{Name: "conveyor-bootstrap", MaxConns: 2, Migrate: true})
	if err != nil {
		return err
	}
	defer rt.Close(ctx)
	token, err := postgres.NewDirectory(rt.Pool).Bootstrap(ctx, *org, *name)
	if err != nil {
		return fmt.Errorf("bootstrap org %q: %w", *org, err)
	}
	rt.Log.InfoContext(ctx, "admin key made; it is printed on stdout and stored only as a hash", "org", *org, "name", *name)
	_, err = fmt.Fprintln(stdout, token)
	return err
}
