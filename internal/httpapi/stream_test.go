package httpapi

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

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

// tokenAuth lets in the principal its header names.
type tokenAuth map[string]auth.Principal

func (a tokenAuth) Authenticate(_ context.Context, header string) (auth.Principal, error) {
	p, ok := a[header]
	if !ok {
		return auth.Principal{}, errors.New("unknown")
	}
	return p, nil
}

// One org (here one key) cannot take every live stream of an instance: past
// its own cap it is told 429 with Retry-After, while another org still gets
// its streams; and a stream it closes is one it may open again.
func TestAnOrgOverItsStreamCapIsRefusedWhileOthersStream(t *testing.T) {
	t.Parallel()
	log := slog.New(slog.DiscardHandler)
	hub := stream.NewHub(emptyFeed{}, stream.Config{Encode: EventFrame}, log, nil)
	ctx, stop := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- hub.Run(ctx) }()
	defer func() { stop(); require.NoError(t, <-stopped) }()

	greedy := auth.Principal{Kind: auth.KindKey, ID: uuid.New(), OrgID: uuid.New(), Role: auth.Reader}
	other := auth.Principal{Kind: auth.KindKey, ID: uuid.New(), OrgID: uuid.New(), Role: auth.Reader}
	h := NewHandler(Config{MaxBodyBytes: 1 << 16, MaxStreams: 10, MaxOrgStreams: 2},
		Deps{Store: nopStore{}, Admin: nopAdmin{}, Auth: tokenAuth{"Bearer greedy": greedy, "Bearer other": other},
			Log: log, TracerProvider: noop.NewTracerProvider(), Propagator: propagation.TraceContext{},
			Registry: prometheus.NewRegistry(), Hub: hub})
	srv := httptest.NewServer(h)
	defer srv.Close()

	open := func(token string) *http.Response {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/v1/events/stream", nil)
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		return resp
	}
	var held []*http.Response
	defer func() {
		for _, resp := range held {
			_ = resp.Body.Close()
		}
	}()
	for range 2 {
		resp := open("greedy")
		held = append(held, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	resp := open("greedy")
	held = append(held, resp) // a stream, should it be one, is never read to its end
	require.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
	var doc problem
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&doc))
	require.Equal(t, "urn:conveyor:problem:too_many_streams", doc.Type)
	require.Equal(t, "5", resp.Header.Get("Retry-After"))

	resp = open("other")
	held = append(held, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode)

	require.NoError(t, held[0].Body.Close())
	require.Eventually(t, func() bool {
		resp := open("greedy")
		if resp.StatusCode != http.StatusOK {
			_ = resp.Body.Close()
			return false
		}
		held = append(held, resp)
		return true
	}, 5*time.Second, 10*time.Millisecond, "the org's closed stream was not given back")
}

// stallingAuth lets the first request in, then answers no check until its
// context ends: a database that stopped answering.
type stallingAuth struct {
	p     auth.Principal
	calls atomic.Int64
}

func (a *stallingAuth) Authenticate(ctx context.Context, _ string) (auth.Principal, error) {
	if a.calls.Add(1) == 1 {
		return a.p, nil
	}
	<-ctx.Done()
	return auth.Principal{}, ctx.Err()
}

// The credentials check at a stream's heartbeat is bounded like a request:
// a database that does not answer must not freeze the stream (no heartbeat,
// no event) until its client gives up on it.
func TestAStreamsCredentialCheckIsBounded(t *testing.T) {
	t.Parallel()
	log := slog.New(slog.DiscardHandler)
	hub := stream.NewHub(emptyFeed{}, stream.Config{Encode: EventFrame}, log, nil)
	ctx, stop := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- hub.Run(ctx) }()
	defer func() { stop(); require.NoError(t, <-stopped) }()

	p := auth.Principal{Kind: auth.KindKey, ID: uuid.New(), OrgID: uuid.New(), Role: auth.Reader}
	h := NewHandler(Config{MaxBodyBytes: 1 << 16, RequestTimeout: 20 * time.Millisecond, StreamHeartbeat: 10 * time.Millisecond},
		Deps{Store: nopStore{}, Admin: nopAdmin{}, Auth: &stallingAuth{p: p},
			Log: log, TracerProvider: noop.NewTracerProvider(), Propagator: propagation.TraceContext{},
			Registry: prometheus.NewRegistry(), Hub: hub})
	srv := httptest.NewServer(h)
	defer srv.Close()

	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, srv.URL+"/v1/events/stream", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer k")
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	lines := bufio.NewScanner(resp.Body)
	for beats := 0; beats < 3; {
		require.True(t, lines.Scan(), "the stream stalled: %v", lines.Err())
		if lines.Text() == ": heartbeat" {
			beats++
		}
	}
}

// slowEventsStore holds one task's events, 1 to total, the last one its
// end, and takes pause for each read after the first: a database slow to
// page through a long history.
type slowEventsStore struct {
	nopStore
	total int64
	pause time.Duration
}

func (s slowEventsStore) EventsBetween(_ context.Context, _ auth.Principal, f task.EventFilter, from, to int64, limit int) ([]task.Event, error) {
	if from > 0 {
		time.Sleep(s.pause)
	}
	var page []task.Event
	for id := from + 1; id <= min(to, s.total) && len(page) < limit; id++ {
		status := task.StatusInProgress
		if id == s.total {
			status = task.StatusFailed
		}
		page = append(page, task.Event{ID: id, TaskID: f.TaskID, Status: status, Type: "t"})
	}
	return page, nil
}

// A stream's catch-up that outlasts the write deadline a stream opens with
// (here: a long history read page by page from a slow database) is not cut
// while its client keeps taking what it is sent: each page gets its own
// deadline, as a live stream's heartbeat does.
func TestALongCatchUpIsNotCutByTheWriteDeadline(t *testing.T) {
	t.Parallel()
	log := slog.New(slog.DiscardHandler)
	hub := stream.NewHub(emptyFeed{}, stream.Config{Encode: EventFrame}, log, nil)
	ctx, stop := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- hub.Run(ctx) }()
	defer func() { stop(); require.NoError(t, <-stopped) }()

	const heartbeat, writeTimeout = 100 * time.Millisecond, time.Second
	store := slowEventsStore{total: 3*streamPage + 1, pause: (heartbeat + writeTimeout) / 2}
	p := auth.Principal{Kind: auth.KindKey, ID: uuid.New(), OrgID: uuid.New(), Role: auth.Reader}
	h := NewHandler(Config{MaxBodyBytes: 1 << 16, StreamHeartbeat: heartbeat, WriteTimeout: writeTimeout},
		Deps{Store: store, Admin: nopAdmin{}, Auth: DevMode(p),
			Log: log, TracerProvider: noop.NewTracerProvider(), Propagator: propagation.TraceContext{},
			Registry: prometheus.NewRegistry(), Hub: hub})
	srv := httptest.NewServer(h)
	defer srv.Close()

	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, srv.URL+"/v1/tasks/"+uuid.NewString()+"/stream", nil)
	require.NoError(t, err)
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	events, ended := 0, false
	lines := bufio.NewScanner(resp.Body)
	for lines.Scan() {
		switch lines.Text() {
		case "event: task":
			events++
		case "event: end":
			ended = true
		}
	}
	require.True(t, ended, "the stream was cut after %d events: %v", events, lines.Err())
	require.EqualValues(t, store.total, events)
}

// An EventSource opened on a URL that carries last_event_id (the
// dashboard's reopened stream) reconnects by itself to that same URL with
// a Last-Event-ID header of the newest event it saw: it resumes from the
// header, and is not refused (a refused EventSource gives up for good).
// A header behind the parameter is no such reconnect, and is refused.
func TestLastEventIDHeaderAheadOfParameter(t *testing.T) {
	get := func(header, query string) (int64, bool, error) {
		r := httptest.NewRequest(http.MethodGet, "/v1/events?last_event_id="+query, nil)
		if header != "" {
			r.Header.Set("Last-Event-ID", header)
		}
		return lastEventID(r)
	}
	after, ok, err := get("42", "7")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, int64(42), after)

	after, ok, err = get("7", "7")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, int64(7), after)

	_, _, err = get("7", "42")
	require.Error(t, err)
}
