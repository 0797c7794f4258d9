// Package httpapi is Conveyor's HTTP adapter: the routes (routes.go, and
// openapi.yaml, which a test keeps true to them), the JSON shapes of the
// task, and the one table that maps domain errors to statuses.
package httpapi

import (
	"context"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/registry"
	"github.com/conveyorhq/conveyor/internal/stream"
	"github.com/conveyorhq/conveyor/internal/task"
)

// Store is what the API needs from the database. trace is the W3C context
// of the request's span, which becomes the task's trace where the lifecycle
// says so and travels with the outbox message.
//
// Every call acts for a principal: it sees and changes only the rows of the
// principal's org, and of its tasks those the principal may see; any other
// task is task.ErrNotFound.
type Store interface {
	Submit(ctx context.Context, p auth.Principal, sub task.Submission, trace task.Carrier) (task.Submitted, error)
	SubmitBatch(ctx context.Context, p auth.Principal, subs []task.Submission, trace task.Carrier) ([]task.Submitted, error)
	Get(ctx context.Context, p auth.Principal, id uuid.UUID) (task.Task, error)
	// List returns summaries: no payload, metadata or result.
	List(ctx context.Context, p auth.Principal, f task.ListFilter) ([]task.Task, error)
	// Events returns a task's events before the event id before (0: from
	// its newest), newest first, at most limit.
	Events(ctx context.Context, p auth.Principal, id uuid.UUID, limit int, before int64) ([]task.Event, error)
	// EventsBetween returns the events in (after, upto] that pass f,
	// oldest first, at most limit: a stream's catch-up.
	EventsBetween(ctx context.Context, p auth.Principal, f task.EventFilter, after, upto int64, limit int) ([]task.Event, error)
	// OrgReached reports whether p's org has had an event with the id id
	// or a later one, retention's deletions included.
	OrgReached(ctx context.Context, p auth.Principal, id int64) (bool, error)
	Cancel(ctx context.Context, p auth.Principal, id uuid.UUID, trace task.Carrier) (task.Task, task.CancelOutcome, error)
	Retry(ctx context.Context, p auth.Principal, id uuid.UUID, trace task.Carrier) (task.Task, error)
	// Bulk cancels or retries the tasks a filter matches, or counts them.
	Bulk(ctx context.Context, p auth.Principal, b task.Bulk, trace task.Carrier) (task.BulkResult, error)
	// Overview sums up the org's tasks, with the tasks each of workers
	// runs.
	Overview(ctx context.Context, p auth.Principal, workers []string) (task.Overview, error)
	// AdmitTypes refuses submissions that would leave the org with more
	// than max task types no worker serves waiting; one an existing task
	// answers (by its key or its input) makes no task and is let through.
	AdmitTypes(ctx context.Context, p auth.Principal, subs []task.Submission, max int) error
	// KnownTypes lists the types some worker has declared a queue for.
	KnownTypes(ctx context.Context) ([]string, error)
	Ping(ctx context.Context) error
}

// WorkerRegistry is what the API reads of the worker registry: the
// deployment's workers, shared by every org, read outside any org's scope.
type WorkerRegistry interface {
	Fleet(ctx context.Context, liveWithin time.Duration) (registry.Fleet, error)
}

// Config is what the handlers need to know.
type Config struct {
	MaxBodyBytes int64
	Defaults     task.Defaults
	// JaegerUIURL is the base of the trace links in task JSON.
	JaegerUIURL string
	// RequestTimeout bounds the work of one request; past it the request
	// answers 503.
	RequestTimeout time.Duration
	// TrustTraceContext continues a caller's trace (its traceparent). Off,
	// each request starts a trace of its own, linked to the caller's.
	// Baggage from callers is never taken.
	TrustTraceContext bool
	// RateLimit is the requests per second each principal may make, with
	// bursts of RateBurst; 0 turns the limit off.
	RateLimit float64
	RateBurst int
	// AuthFailureLimit is the failed authentications a second each client
	// address may make, with bursts of AuthFailureBurst; past it the
	// address is refused 429 before its credentials are looked up, but
	// for keys this instance has found before. 0 turns the limit off.
	AuthFailureLimit float64
	AuthFailureBurst int
	// MaxUnservedTypes bounds the task types no worker serves that an org
	// may have waiting; 0: no bound.
	MaxUnservedTypes int
	// StreamHeartbeat is how often an idle live stream sends a comment
	// (and checks the caller's credentials again).
	StreamHeartbeat time.Duration
	// MaxStreams bounds the live streams this instance serves at once;
	// 0: no bound.
	MaxStreams int
	// MaxOrgStreams bounds the live streams one org holds on this
	// instance, so that one org cannot take every stream of MaxStreams;
	// 0: no bound.
	MaxOrgStreams int
	// WriteTimeout bounds each write of a live stream: a client that takes
	// nothing for that long is dropped.
	WriteTimeout time.Duration
	// NoMetrics leaves /metrics out of the API's routes: another address
	// serves it.
	NoMetrics bool
}

// Deps are the collaborators of the HTTP handler.
type Deps struct {
	Store          Store
	Admin          AdminStore
	Jobs           JobStore
	Workflows      WorkflowStore
	Auth           Authenticator
	Log            *slog.Logger
	TracerProvider trace.TracerProvider
	Propagator     propagation.TextMapPropagator
	Registry       *prometheus.Registry
	// Hub feeds the live streams; without it they answer 503.
	Hub *stream.Hub
	// Workers lists the workers in the overview; without it the list is
	// empty.
	Workers WorkerRegistry
}

// NewHandler returns the API's HTTP handler with every route of routes.go.
func NewHandler(cfg Config, deps Deps) http.Handler {
	s := &server{cfg: cfg, Deps: deps, metrics: newMetrics(deps.Registry),
		limits:    newLimiters(cfg.RateLimit, cfg.RateBurst),
		failures:  newFailureLimits(cfg.AuthFailureLimit, cfg.AuthFailureBurst),
		overviews: newOverviewShare()}
	s.types = &typeLabels{load: deps.Store.KnownTypes, log: deps.Log}
	return s.routes()
}

type server struct {
	Deps
	cfg     Config
	metrics *metrics
	types   *typeLabels
	limits  *limiters
	// failures bounds the failed authentications of each client address.
	failures *failureLimits
	streams  atomic.Int64 // live streams open
	// orgStreams counts the live streams of each org that has one.
	orgStreams orgStreams
	// overviews shares overviews between the callers that would see the
	// same one.
	overviews *overviewShare
}
