package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/stream"
	"github.com/conveyorhq/conveyor/internal/task"
)

// emptyFeed is a database with no events: a hub settles on it at once.
// down, when set, fails every read, so a hub never settles.
type emptyFeed struct{ down bool }

func (f emptyFeed) Head(context.Context) (int64, postgres.Snapshot, error) {
	if f.down {
		return 0, postgres.Snapshot{}, errors.New("database down")
	}
	return 0, postgres.Snapshot{Xmin: 1, Xmax: 1}, nil
}

func (f emptyFeed) Read(context.Context, int64, int) ([]task.Event, postgres.Snapshot, error) {
	return nil, postgres.Snapshot{Xmin: 1, Xmax: 1}, nil
}

func (emptyFeed) Issued(context.Context) (int64, error) { return 0, nil }

// A stream asked for while the instance shuts down (its hub stopped,
// whether or not it had started) is told so, with the Retry-After that
// the stream limit's 503 sends too, at once rather than after the wait
// for a starting hub.
func TestAStreamDuringShutdownSaysSoWithRetryAfter(t *testing.T) {
	t.Parallel()
	for name, feed := range map[string]emptyFeed{"started": {}, "never started": {down: true}} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			log := slog.New(slog.DiscardHandler)
			hub := stream.NewHub(feed, stream.Config{Encode: EventFrame}, log, nil)
			ctx, stop := context.WithCancel(context.Background())
			stopped := make(chan error, 1)
			go func() { stopped <- hub.Run(ctx) }()
			if !feed.down {
				_, err := hub.Cursor(ctx) // ready
				require.NoError(t, err)
			}
			stop()
			require.NoError(t, <-stopped)

			p := auth.Principal{Kind: auth.KindKey, ID: uuid.New(), OrgID: uuid.New(), Role: auth.Admin}
			h := NewHandler(Config{MaxBodyBytes: 1 << 16}, Deps{Store: nopStore{}, Admin: nopAdmin{}, Auth: DevMode(p),
				Log: log, TracerProvider: noop.NewTracerProvider(), Propagator: propagation.TraceContext{},
				Registry: prometheus.NewRegistry(), Hub: hub})
			for _, path := range []string{"/v1/events/stream", "/v1/tasks/" + uuid.NewString() + "/stream"} {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
				require.Equal(t, http.StatusServiceUnavailable, rec.Code, "%s: %s", path, rec.Body)
				require.Equal(t, "2", rec.Header().Get("Retry-After"), path)
				var doc problem
				require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &doc))
				require.Equal(t, "this instance is shutting down; reconnect", doc.Detail, path)
			}
		})
	}
}
