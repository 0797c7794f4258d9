// Package httpapi is Conveyor's HTTP adapter: the routes of SPEC 4, the JSON
// shapes of the task and the one table that maps domain errors to statuses.
package httpapi

import (
	"context"
	"log/slog"
	"net/http"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/task"
)

// Store is what the API needs from the database.
type Store interface {
	Submit(ctx context.Context, sub task.Submission, headers task.Carrier) (task.Submitted, error)
	SubmitBatch(ctx context.Context, subs []task.Submission, headers task.Carrier) ([]task.Submitted, error)
	Get(ctx context.Context, id uuid.UUID) (task.Task, error)
	List(ctx context.Context, f task.ListFilter) ([]task.Task, error)
	Events(ctx context.Context, id uuid.UUID, limit int) ([]task.Event, error)
	Cancel(ctx context.Context, id uuid.UUID, headers task.Carrier) (task.Task, task.CancelOutcome, error)
	Retry(ctx context.Context, id uuid.UUID, traceparent string, headers task.Carrier) (task.Task, error)
	Ping(ctx context.Context) error
}

// Config is what the handlers need to know.
type Config struct {
	MaxBodyBytes int64
	Defaults     task.Defaults
	// JaegerUIURL is the base of the trace links in task JSON.
	JaegerUIURL string
}

// Deps are the collaborators of the HTTP handler.
type Deps struct {
	Store          Store
	Log            *slog.Logger
	TracerProvider trace.TracerProvider
	Propagator     propagation.TextMapPropagator
	Registry       *prometheus.Registry
}

// NewHandler returns the API's HTTP handler with every route of SPEC 4.
func NewHandler(cfg Config, deps Deps) http.Handler {
	s := &server{cfg: cfg, Deps: deps, metrics: newMetrics(deps.Registry)}
	return s.routes()
}

type server struct {
	Deps
	cfg     Config
	metrics *metrics
}
