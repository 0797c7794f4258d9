package worker

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/config"
)

// Handlers the worker cannot run are a programming error found at
// start-up, before the worker touches the database: not after it has
// waited for one that is down (for ever), nor after it has migrated one.
func TestRunRefusesBadHandlersBeforeTheDatabase(t *testing.T) {
	t.Parallel()
	cfg := config.Worker{Common: config.Common{
		// Nothing listens there: a database "not ready", waited for.
		DatabaseURL: "postgres://postgres@127.0.0.1:1/conveyor?sslmode=disable", LogLevel: "error", LogFormat: "json",
		ShutdownTimeout: time.Second,
	}, Concurrency: 1}
	fn := func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) { return nil, nil }
	for name, tc := range map[string]struct {
		handlers []conveyor.Handler
		want     string
	}{
		"none":         {nil, "no handlers"},
		"invalid type": {[]conveyor.Handler{{Type: "Not a type!", Func: fn}}, "invalid task type"},
		"nil func":     {[]conveyor.Handler{{Type: "t.nil"}}, "nil handler"},
		"twice":        {[]conveyor.Handler{conveyor.Handle("t.a", fn), conveyor.Handle("t.a", fn)}, "two handlers"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
			defer cancel()
			err := run(ctx, cfg, io.Discard, tc.handlers)
			require.ErrorContains(t, err, tc.want)
			require.NoError(t, ctx.Err(), "the worker waited for the database first")
		})
	}
}
