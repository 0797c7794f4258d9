package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/google/uuid"
	lru "github.com/hashicorp/golang-lru/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/time/rate"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// Authenticator says who a request's bearer token belongs to.
type Authenticator interface {
	Authenticate(ctx context.Context, header string) (auth.Principal, error)
}

// devAuthenticator is the development mode: every request acts as one
// principal.
type devAuthenticator struct{ p auth.Principal }

func (d devAuthenticator) Authenticate(context.Context, string) (auth.Principal, error) {
	return d.p, nil
}

// DevMode returns an Authenticator that lets every request in as p, an
// admin of one org: for a developer's machine only.
func DevMode(p auth.Principal) Authenticator { return devAuthenticator{p} }

type principalKey struct{}

// principal is the caller of an authenticated request.
func principal(r *http.Request) auth.Principal {
	p, _ := r.Context().Value(principalKey{}).(auth.Principal)
	return p
}

// authenticate lets in only requests whose bearer token names a principal,
// within the principal's rate limit, and takes note of who they are.
func (s *server) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The lookup is bounded like a request, streams' included.
		actx, cancel := r.Context(), context.CancelFunc(func() {})
		if s.cfg.RequestTimeout > 0 {
			actx, cancel = context.WithTimeout(actx, s.cfg.RequestTimeout)
		}
		header, err := credentials(r)
		if err != nil {
			cancel()
			s.writeError(w, r, err)
			return
		}
		p, err := s.lookUp(actx, r, header)
		cancel()
		var limited *tooManyFailures
		switch {
		case errors.As(err, &limited):
			w.Header().Set("Retry-After", limited.retryAfter())
			s.writeProblem(w, r, http.StatusTooManyRequests, "rate_limited", limited.Error())
			return
		case err != nil && errors.Is(r.Context().Err(), context.Canceled):
			// The client left while its credentials were looked up.
			s.writeError(w, r, err)
			return
		case err != nil && auth.ReasonOf(err) == auth.ReasonLookup:
			s.writeError(w, r, task.Errorf(task.ErrCodeUnavailable, "%s", err.Error()))
			return
		case err != nil:
			w.Header().Set("WWW-Authenticate", `Bearer realm="conveyor"`)
			s.writeProblem(w, r, http.StatusUnauthorized, "unauthorized", err.Error())
			return
		}
		if err := s.withinRate(p); err != nil {
			w.Header().Set("Retry-After", err.retryAfter())
			s.writeProblem(w, r, http.StatusTooManyRequests, "rate_limited", err.Error())
			return
		}
		// The request's span names the org, so that an org's traces can
		// be found (its tasks' producer and consumer spans name it too).
		if span := trace.SpanFromContext(r.Context()); span.IsRecording() {
			span.SetAttributes(attribute.String("conveyor.org_id", p.OrgID.String()))
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), principalKey{}, p)))
	})
}

// tooManyRequests refuses a request of a principal past its rate limit.
type tooManyRequests struct {
	wait time.Duration
	kind string
}

func (e *tooManyRequests) Error() string {
	return "too many requests for this " + e.kind + "; retry after the Retry-After header's seconds"
}

// RetryAfter is how long until the principal may make a request again.
func (e *tooManyRequests) RetryAfter() time.Duration { return e.wait }

func (e *tooManyRequests) retryAfter() string { return strconv.Itoa(int(math.Ceil(e.wait.Seconds()))) }

// withinRate takes one of p's requests from its rate limit, or refuses it:
// the API's requests and the dashboard's sign-ins alike, so that the
// sign-in form is no way round the limit.
func (s *server) withinRate(p auth.Principal) *tooManyRequests {
	if wait, ok := s.limits.allow(p.ID); !ok {
		s.metrics.rateLimited.Inc()
		return &tooManyRequests{wait: wait, kind: p.Kind}
	}
	return nil
}

// tooManyFailures refuses, without a lookup, credentials sent from an
// address that has used up its failed authentications.
type tooManyFailures struct{ wait time.Duration }

func (e *tooManyFailures) Error() string {
	return "too many failed authentications from this address; retry after the Retry-After header's seconds"
}

// RetryAfter is how long until the address may fail again.
func (e *tooManyFailures) RetryAfter() time.Duration { return e.wait }

func (e *tooManyFailures) retryAfter() string { return strconv.Itoa(int(math.Ceil(e.wait.Seconds()))) }

// lookUp authenticates header, the credentials of r, within the failed
// authentications r's address may make: past them it answers
// *tooManyFailures before the credentials cost a lookup, but for keys this
// instance has found before (made-up ones are never among them). A refusal
// is counted and logged, and counts against the address unless the
// client sent no credentials or the lookup failed (neither is the client
// guessing). Every way in — the API's requests, the dashboard's sign-in —
// goes through it.
func (s *server) lookUp(ctx context.Context, r *http.Request, header string) (auth.Principal, error) {
	addr := clientAddr(r)
	if wait, over := s.failures.over(addr); over && !s.known(header) {
		s.metrics.rateLimited.Inc()
		return auth.Principal{}, &tooManyFailures{wait: wait}
	}
	p, err := s.Auth.Authenticate(ctx, header)
	if err == nil {
		return p, nil
	}
	if errors.Is(r.Context().Err(), context.Canceled) {
		// The client left while its credentials were looked up: no
		// failed authentication, nor a failed lookup to count.
		return p, err
	}
	s.refused(r, err)
	switch auth.ReasonOf(err) {
	case auth.ReasonLookup, auth.ReasonMissing:
	default:
		s.failures.fail(addr)
	}
	return p, err
}

// refused counts and logs a failed authentication of r (never its
// credentials: the error's message holds none).
func (s *server) refused(r *http.Request, err error) {
	reason := auth.ReasonOf(err)
	s.metrics.authFailures.WithLabelValues(reason).Inc()
	if reason == auth.ReasonLookup {
		s.Log.ErrorContext(r.Context(), "authentication lookup failed", "error", err)
		return
	}
	s.Log.InfoContext(r.Context(), "authentication failed", "reason", reason, "detail", err.Error(),
		"remote", r.RemoteAddr, "method", r.Method, "path", r.URL.Path)
}

// SessionCookie holds the API key of a person signed in to the dashboard
// (HttpOnly, SameSite=Strict): the browser sends it with the dashboard's
// requests and its streams, which cannot carry an Authorization header.
const SessionCookie = "conveyor_session"

// UIHeader must come with every request that changes something and is
// authenticated by the session cookie: a page of another site can make a
// browser send the cookie (SameSite aside) but not a custom header, which
// would need a CORS preflight this API never grants.
const UIHeader = "X-Conveyor-UI"

// credentials is the Authorization header of r, or the session cookie's
// key when there is none.
func credentials(r *http.Request) (string, error) {
	if h := r.Header.Get("Authorization"); h != "" {
		return h, nil
	}
	c, err := r.Cookie(SessionCookie)
	if errors.Is(err, http.ErrNoCookie) || (err == nil && c.Value == "") {
		return "", nil // no credentials: refused as missing
	}
	if err != nil {
		return "", task.Invalid("cookie", "unreadable %s cookie", SessionCookie)
	}
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions:
	default:
		if r.Header.Get(UIHeader) == "" {
			return "", task.Errorf(task.ErrCodeForbidden, "a request authenticated by the dashboard's cookie must carry the %s header", UIHeader)
		}
	}
	return "Bearer " + c.Value, nil
}

// require lets in only principals whose role allows what need does.
func (s *server) require(need auth.Role) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if p := principal(r); !p.Role.Allows(need) {
				s.writeError(w, r, task.Errorf(task.ErrCodeForbidden, "this needs the %s role; this %s has %s", need, p.Kind, p.Role))
				return
			}
			next.ServeHTTP(w, r)
		})
	}
}

// writeProblem answers with a problem document of a status the domain
// errors do not cover.
func (s *server) writeProblem(w http.ResponseWriter, r *http.Request, status int, code, detail string) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(problem{Type: "urn:conveyor:problem:" + code, Title: http.StatusText(status),
		Status: status, Detail: detail, Instance: r.URL.Path})
}

// limiters keeps a token bucket per principal, for the maxBuckets
// principals seen last: one pushed out comes back with a full bucket, which
// only the least recently active principal can have lost.
type limiters struct {
	rate  rate.Limit
	burst int

	mu      sync.Mutex // makes a bucket's lookup and creation one step
	buckets *lru.Cache[uuid.UUID, *rate.Limiter]
}

const maxBuckets = 10_000

func newLimiters(perSecond float64, burst int) *limiters {
	if perSecond <= 0 {
		return nil
	}
	// lru.New fails only for a size below 1.
	buckets, _ := lru.New[uuid.UUID, *rate.Limiter](maxBuckets)
	return &limiters{rate: rate.Limit(perSecond), burst: max(burst, 1), buckets: buckets}
}

// allow takes a token from id's bucket, or says how long until one is
// there. A nil *limiters allows everything.
func (l *limiters) allow(id uuid.UUID) (time.Duration, bool) {
	if l == nil {
		return 0, true
	}
	now := time.Now()
	l.mu.Lock()
	lim, ok := l.buckets.Get(id)
	if !ok {
		lim = rate.NewLimiter(l.rate, l.burst)
		l.buckets.Add(id, lim)
	}
	l.mu.Unlock()
	r := lim.ReserveN(now, 1)
	if d := r.DelayFrom(now); d > 0 {
		r.CancelAt(now)
		return d, false
	}
	return 0, true
}

func (l *limiters) len() int { return l.buckets.Len() }

// known says whether the authenticator vouches, without a lookup, for
// header's credentials having been found before.
func (s *server) known(header string) bool {
	k, ok := s.Auth.(interface{ Known(header string) bool })
	return ok && k.Known(header)
}

// clientAddr is the address of r's peer, without its port: behind a proxy,
// the proxy's (a forwarded-for header is the client's to write).
func clientAddr(r *http.Request) string {
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		return host
	}
	return r.RemoteAddr
}

// failureLimits keeps a token bucket of failed authentications per client
// address, for the maxBuckets addresses that failed last: a bucket is made
// only by a failure, so requests with good credentials neither need one
// nor push one out.
type failureLimits struct {
	rate  rate.Limit
	burst int

	mu      sync.Mutex // makes a bucket's lookup and creation one step
	buckets *lru.Cache[string, *rate.Limiter]
}

func newFailureLimits(perSecond float64, burst int) *failureLimits {
	if perSecond <= 0 {
		return nil
	}
	// lru.New fails only for a size below 1.
	buckets, _ := lru.New[string, *rate.Limiter](maxBuckets)
	return &failureLimits{rate: rate.Limit(perSecond), burst: max(burst, 1), buckets: buckets}
}

// over says whether addr has used up its failures, and how long until it
// may fail again. A nil *failureLimits is never over.
func (l *failureLimits) over(addr string) (time.Duration, bool) {
	if l == nil {
		return 0, false
	}
	l.mu.Lock()
	lim, ok := l.buckets.Get(addr)
	l.mu.Unlock()
	if !ok {
		return 0, false
	}
	tokens := lim.TokensAt(time.Now())
	if tokens >= 1 {
		return 0, false
	}
	return time.Duration((1 - tokens) / float64(l.rate) * float64(time.Second)), true
}

// fail takes a token from addr's bucket.
func (l *failureLimits) fail(addr string) {
	if l == nil {
		return
	}
	l.mu.Lock()
	lim, ok := l.buckets.Get(addr)
	if !ok {
		lim = rate.NewLimiter(l.rate, l.burst)
		l.buckets.Add(addr, lim)
	}
	l.mu.Unlock()
	lim.Allow()
}

func (l *failureLimits) len() int { return l.buckets.Len() }

func newAuthMetrics(reg prometheus.Registerer) (*prometheus.CounterVec, prometheus.Counter) {
	failures := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "conveyor_auth_failures_total",
		Help: "Requests refused for their credentials, by reason (missing, malformed, unknown_key, revoked, expired, invalid_token, unknown_user, oidc_off, lookup_error).",
	}, []string{"reason"})
	limited := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "conveyor_rate_limited_total",
		Help: "Requests refused with 429 by the per-principal rate limit or the per-address limit of failed authentications.",
	})
	reg.MustRegister(failures, limited)
	return failures, limited
}
