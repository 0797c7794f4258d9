package httpapi

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/conveyorhq/conveyor/internal/auth"
)

// countingAuth stands for the database-backed authenticator: each call is
// one lookup; known holds the headers it has found before.
type countingAuth struct {
	valid map[string]auth.Principal
	known map[string]bool

	mu    sync.Mutex
	calls int
}

func (a *countingAuth) Authenticate(_ context.Context, header string) (auth.Principal, error) {
	a.mu.Lock()
	a.calls++
	a.mu.Unlock()
	if p, ok := a.valid[header]; ok {
		return p, nil
	}
	if header == "" {
		return auth.Principal{}, &auth.Error{Reason: auth.ReasonMissing, Message: "authentication required"}
	}
	return auth.Principal{}, &auth.Error{Reason: auth.ReasonUnknownKey, Message: "unknown API key"}
}

func (a *countingAuth) Known(header string) bool { return a.known[header] }

func (a *countingAuth) lookups() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.calls
}

// A flood of made-up credentials from one address reaches the
// authenticator (the database) only for the address's burst of failures;
// then it is answered 429 with Retry-After without a lookup, while keys
// found before still get in from that address, other addresses are not
// refused, requests without credentials do not count, and 0 turns the
// limit off.
func TestFailedAuthenticationsAreBoundedPerAddress(t *testing.T) {
	t.Parallel()
	p := auth.Principal{Kind: auth.KindKey, ID: uuid.New(), OrgID: uuid.New(), Role: auth.Reader}
	serve := func(limit float64) (*countingAuth, func(addr, header string) *httptest.ResponseRecorder) {
		a := &countingAuth{
			valid: map[string]auth.Principal{"Bearer good": p, "Bearer new": p},
			known: map[string]bool{"Bearer good": true},
		}
		h := NewHandler(Config{MaxBodyBytes: 1 << 16, AuthFailureLimit: limit, AuthFailureBurst: 3},
			Deps{Store: nopStore{}, Admin: nopAdmin{}, Auth: a, Log: slog.New(slog.DiscardHandler),
				TracerProvider: noop.NewTracerProvider(), Propagator: propagation.TraceContext{},
				Registry: prometheus.NewRegistry()})
		return a, func(addr, header string) *httptest.ResponseRecorder {
			req := httptest.NewRequest(http.MethodGet, "/v1/tasks", nil)
			req.RemoteAddr = addr
			req.Header.Set("X-Forwarded-For", "192.0.2."+strconv.Itoa(len(addr)))
			if header != "" {
				req.Header.Set("Authorization", header)
			}
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			return rec
		}
	}

	// A thousandth of a failure a second: none comes back during the test.
	a, do := serve(0.001)
	for i := range 20 {
		rec := do("203.0.113.7:"+strconv.Itoa(1000+i), "Bearer cvk_"+uuid.NewString())
		if i < 3 {
			require.Equal(t, http.StatusUnauthorized, rec.Code, i)
			continue
		}
		require.Equal(t, http.StatusTooManyRequests, rec.Code, i)
		wait, err := strconv.Atoi(rec.Header().Get("Retry-After"))
		require.NoError(t, err)
		require.Positive(t, wait)
	}
	require.Equal(t, 3, a.lookups(), "one lookup per failure of the burst, none past it")

	require.Equal(t, http.StatusOK, do("203.0.113.7:2000", "Bearer good").Code, "a key found before still gets in")
	require.Equal(t, http.StatusTooManyRequests, do("203.0.113.7:2001", "Bearer new").Code)
	require.Equal(t, http.StatusUnauthorized, do("198.51.100.1:1", "Bearer cvk_x").Code, "another address")
	for range 10 {
		require.Equal(t, http.StatusUnauthorized, do("198.51.100.2:1", "").Code, "missing credentials are not counted")
	}

	a, do = serve(0)
	for range 20 {
		require.Equal(t, http.StatusUnauthorized, do("203.0.113.7:1", "Bearer cvk_"+uuid.NewString()).Code)
	}
	require.Equal(t, 20, a.lookups())
}

// The dashboard's sign-in is an authentication like any other: its
// failures count against the address, and an address past its failures
// is refused 429 there too, before a lookup (but for keys found before);
// else pasting made-up keys into the form would be a flood the limit does
// not bound.
func TestDashboardSignInIsBoundedPerAddress(t *testing.T) {
	t.Parallel()
	p := auth.Principal{Kind: auth.KindKey, ID: uuid.New(), OrgID: uuid.New(), Role: auth.Reader}
	a := &countingAuth{valid: map[string]auth.Principal{"Bearer good": p}, known: map[string]bool{"Bearer good": true}}
	h := NewHandler(Config{MaxBodyBytes: 1 << 16, AuthFailureLimit: 0.001, AuthFailureBurst: 3},
		Deps{Store: nopStore{}, Admin: nopAdmin{}, Auth: a, Log: slog.New(slog.DiscardHandler),
			TracerProvider: noop.NewTracerProvider(), Propagator: propagation.TraceContext{},
			Registry: prometheus.NewRegistry()})
	signIn := func(addr, key string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/ui/session", strings.NewReader(`{"key":"`+key+`"}`))
		req.RemoteAddr = addr
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(UIHeader, "1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	get := func(addr, header string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodGet, "/v1/tasks", nil)
		req.RemoteAddr = addr
		req.Header.Set("Authorization", header)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}

	for i := range 3 {
		require.Equal(t, http.StatusUnauthorized, signIn("203.0.113.7:1", "cvk_"+uuid.NewString()).Code, i)
	}
	rec := signIn("203.0.113.7:2", "cvk_"+uuid.NewString())
	require.Equal(t, http.StatusTooManyRequests, rec.Code, rec.Body.String())
	wait, err := strconv.Atoi(rec.Header().Get("Retry-After"))
	require.NoError(t, err)
	require.Positive(t, wait)
	require.Equal(t, 3, a.lookups(), "one lookup per failure of the burst, none past it")
	require.Equal(t, http.StatusTooManyRequests, get("203.0.113.7:3", "Bearer cvk_"+uuid.NewString()).Code,
		"the failed sign-ins count for the API too")
	require.Equal(t, http.StatusOK, signIn("203.0.113.7:4", "good").Code, "a key found before still signs in")

	for i := range 3 {
		require.Equal(t, http.StatusUnauthorized, get("198.51.100.1:1", "Bearer cvk_"+uuid.NewString()).Code, i)
	}
	require.Equal(t, http.StatusTooManyRequests, signIn("198.51.100.1:2", "cvk_"+uuid.NewString()).Code,
		"the API's failures count for the sign-in")
}

// Buckets exist only for addresses that failed, and at most maxBuckets.
func TestFailureBucketsAreBounded(t *testing.T) {
	t.Parallel()
	l := newFailureLimits(1, 1)
	_, over := l.over("192.0.2.1")
	require.False(t, over)
	require.Zero(t, l.len(), "looking does not make a bucket")
	for i := range maxBuckets + 100 {
		l.fail(strconv.Itoa(i))
	}
	require.LessOrEqual(t, l.len(), maxBuckets)
}
