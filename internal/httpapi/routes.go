package httpapi

import (
	"net/http"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/ui"
)

// routes is the API's handler: the router inside the tracing middleware.
func (s *server) routes() http.Handler {
	return otelhttp.NewHandler(s.router(), "conveyor-api",
		otelhttp.WithTracerProvider(s.TracerProvider),
		otelhttp.WithPropagators(s.Propagator),
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string {
			return r.Method + " " + r.URL.Path
		}),
		otelhttp.WithFilter(func(r *http.Request) bool {
			switch r.URL.Path {
			case "/healthz", "/readyz", "/metrics":
				return false
			}
			return true
		}),
		// A caller's traceparent is continued only when trusted; otherwise
		// the request's span is a new root with a link to it.
		otelhttp.WithPublicEndpointFn(func(*http.Request) bool { return !s.cfg.TrustTraceContext }),
	)
}

// router lists every route of the API.
func (s *server) router() chi.Router {
	r := chi.NewRouter()
	r.Use(middleware.Recoverer)
	// HEAD is answered wherever GET is (RFC 9110): by the GET route, whose
	// body the server drops.
	r.Use(middleware.GetHead, s.instrument, s.knownParams(r))
	r.NotFound(s.handleNotFound())
	r.MethodNotAllowed(s.handleMethodNotAllowed(r))

	// Every /v1 route needs a principal; each group, a role. Every request
	// but a live stream is bounded by the request timeout.
	r.Route("/v1", func(r chi.Router) {
		r.Use(noStore, s.authenticate)
		r.Group(func(r chi.Router) {
			r.Use(s.require(auth.Reader))
			r.Get("/tasks/{id}/stream", s.handleTaskStream())
			r.Get("/events/stream", s.handleEventStream())
		})
		r.Group(func(r chi.Router) {
			r.Use(s.timeout, s.require(auth.Reader))
			r.Get("/whoami", s.handleWhoami())
			r.Get("/overview", s.handleOverview())
			r.Get("/tasks", s.handleList())
			r.Get("/tasks/{id}", s.handleGet())
			r.Get("/tasks/{id}/events", s.handleEvents())
			r.Get("/jobs", s.handleListJobs())
			r.Get("/jobs/{name}", s.handleGetJob())
			r.Get("/types", s.handleListTypes())
			r.Get("/workflows", s.handleListWorkflows())
			r.Get("/workflows/{name}", s.handleGetWorkflow())
			r.Get("/workflows/{name}/runs", s.handleListRuns())
			r.Get("/runs", s.handleListRuns())
			r.Get("/runs/{id}", s.handleGetRun())
			r.Get("/lineage", s.handleLineage())
		})
		r.Group(func(r chi.Router) {
			r.Use(s.timeout, s.require(auth.Writer))
			r.Post("/tasks", s.handleSubmit())
			r.Post("/tasks/batch", s.handleSubmitBatch())
			r.Post("/tasks/cancel", s.handleBulk(task.ActionCancel))
			r.Post("/tasks/retry", s.handleBulk(task.ActionRetry))
			r.Post("/tasks/{id}/cancel", s.handleCancel())
			r.Post("/tasks/{id}/retry", s.handleRetry())
			r.Post("/jobs/{name}/trigger", s.handleTriggerJob())
			r.Post("/jobs/{name}/pause", s.handlePauseJob(true))
			r.Post("/jobs/{name}/resume", s.handlePauseJob(false))
			r.Post("/types/{type}/pause", s.handlePauseType(true))
			r.Post("/types/{type}/resume", s.handlePauseType(false))
			r.Post("/workflows/{name}/runs", s.handleStartRun())
			r.Post("/runs/{id}/cancel", s.handleCancelRun())
			r.Post("/runs/{id}/retry", s.handleRetryRun())
		})
		r.Group(func(r chi.Router) {
			r.Use(s.timeout, s.require(auth.Admin))
			r.Post("/jobs/apply", s.handleApplyJobs())
			r.Post("/keys", s.handleCreateKey())
			r.Get("/keys", s.handleListKeys())
			r.Delete("/keys/{id}", s.handleRevokeKey())
			r.Post("/users", s.handleCreateUser())
			r.Get("/users", s.handleListUsers())
			r.Patch("/users/{id}", s.handleUpdateUser())
			r.Delete("/users/{id}", s.handleDeleteUser())
			r.Post("/roles", s.handleCreateRole())
			r.Get("/roles", s.handleListRoles())
			r.Delete("/roles/{slug}", s.handleDeleteRole())
			r.Get("/roles/{slug}/members", s.handleListMembers())
			r.Put("/roles/{slug}/members/{user_id}", s.handleMember(true))
			r.Delete("/roles/{slug}/members/{user_id}", s.handleMember(false))
		})
	})

	// The dashboard: static pages that use the routes above.
	r.Group(func(r chi.Router) {
		r.Use(s.timeout)
		r.Mount("/ui", ui.Handler(ui.Config{Cookie: SessionCookie, Header: UIHeader,
			Authenticate: func(r *http.Request, header string) (auth.Principal, error) {
				p, err := s.lookUp(r.Context(), r, header)
				if err != nil {
					return p, err
				}
				if limited := s.withinRate(p); limited != nil {
					return auth.Principal{}, limited
				}
				return p, nil
			}}))
	})
	r.Group(func(r chi.Router) {
		r.Use(s.timeout)
		r.Get("/healthz", s.handleHealthz())
		r.Get("/readyz", s.handleReadyz())
		r.Get("/openapi.yaml", s.handleOpenAPI())
		if !s.cfg.NoMetrics {
			r.Method(http.MethodGet, "/metrics", promhttp.HandlerFor(s.Registry, promhttp.HandlerOpts{Registry: s.Registry}))
		}
	})
	return r
}

// routePattern is the chi pattern that matched r, so metrics are labelled by
// route rather than by raw path.
func routePattern(r *http.Request) string {
	if rc := chi.RouteContext(r.Context()); rc != nil {
		if p := rc.RoutePattern(); p != "" {
			return p
		}
	}
	return "unmatched"
}

// noStore marks every answer of the API as one no cache may keep. A
// shared cache must not store an answer to a request with an
// Authorization header, but the dashboard's requests carry a cookie
// instead, and an org's tasks must not be served from a cache to whoever
// asks next. A live stream sets its own no-cache.
func noStore(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "no-store")
		next.ServeHTTP(w, r)
	})
}
