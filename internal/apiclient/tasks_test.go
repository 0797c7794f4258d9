package apiclient_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

// The filter goes as a query to a listing and as an object to a bulk
// action, with the fields given only: an expected count of 0 is one.
func TestFiltersAndBulkBodies(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var got []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, r.Method+" "+r.URL.Path+" "+r.URL.RawQuery+" "+string(body))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/v1/tasks":
			_, _ = w.Write([]byte(`{"tasks":[]}`))
		case "/v1/tasks/retry":
			_, _ = w.Write([]byte(`{"matched":3,"retried":2,"skipped":1,"more":true}`))
		default:
			_, _ = w.Write([]byte(`{"matched":0}`))
		}
	}))
	t.Cleanup(srv.Close)
	c, err := apiclient.New(apiclient.Config{URL: srv.URL})
	require.NoError(t, err)

	after := time.Date(2026, 11, 23, 11, 0, 0, 500, time.UTC)
	before := time.Date(2026, 11, 23, 12, 0, 0, 0, time.FixedZone("", 3600))
	f := apiclient.TaskFilter{Status: "FAILED", Type: "demo.sleep", CreatedAfter: after, CreatedBefore: before, Q: "team=a b"}
	_, err = c.Tasks(t.Context(), apiclient.ListFilter{TaskFilter: f, Limit: 10, Cursor: "c1"})
	require.NoError(t, err)
	res, err := c.RetryTasks(t.Context(), apiclient.BulkRequest{Filter: f, Expected: new(0)})
	require.NoError(t, err)
	require.Equal(t, apiclient.BulkResult{Matched: 3, Retried: 2, Skipped: 1, More: true}, withoutDocument(res))
	res, err = c.CancelTasks(t.Context(), apiclient.BulkRequest{DryRun: true})
	require.NoError(t, err)
	require.JSONEq(t, `{"matched":0}`, string(res.JSON()))

	require.Equal(t, []string{
		"GET /v1/tasks created_after=2026-11-23T11%3A00%3A00.0000005Z&created_before=2026-11-23T12%3A00%3A00%2B01%3A00" +
			"&cursor=c1&limit=10&q=team%3Da+b&status=FAILED&type=demo.sleep ",
		`POST /v1/tasks/retry  {"filter":{"status":"FAILED","type":"demo.sleep","created_after":"2026-11-23T11:00:00.0000005Z",` +
			`"created_before":"2026-11-23T12:00:00+01:00","q":"team=a b"},"expected":0}`,
		`POST /v1/tasks/cancel  {"filter":{},"dry_run":true}`,
	}, got)
}

func withoutDocument(r apiclient.BulkResult) apiclient.BulkResult {
	r.Document = apiclient.Document{}
	return r
}

// The overview decodes, a null leader as none.
func TestOverview(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		require.Equal(t, "/v1/overview", r.URL.Path)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"counts":{"PENDING":1},"last_hour":{"minutes":[{"minute":"2026-11-23T11:01:00Z","completed":2,"failed":1}],
			"completed":2,"failed":1,"throughput_per_minute":0.0333},"types":[{"type":"t","pending":1,"scheduled":0,"running":0,
			"oldest_pending_age_seconds":1.5}],"outbox":{"depth":4,"oldest_age_seconds":0.25,"parked":2},"workers":[{"id":"w1",
			"hostname":"h","types":["t"],"concurrency":2,"version":"v1","last_heartbeat_at":"2026-11-23T11:59:58Z",
			"running":[{"id":"x","type":"t"}]}],"leader":null}`))
	}))
	t.Cleanup(srv.Close)
	c, err := apiclient.New(apiclient.Config{URL: srv.URL})
	require.NoError(t, err)

	o, err := c.Overview(t.Context())
	require.NoError(t, err)
	require.Equal(t, map[string]int{"PENDING": 1}, o.Counts)
	require.Equal(t, apiclient.LastHour{Minutes: []apiclient.Minute{{Minute: time.Date(2026, 11, 23, 11, 1, 0, 0, time.UTC),
		Completed: 2, Failed: 1}}, Completed: 2, Failed: 1, ThroughputPerMinute: 0.0333}, o.LastHour)
	require.Equal(t, []apiclient.Queue{{Type: "t", Pending: 1, OldestPendingAgeSeconds: 1.5}}, o.Queues)
	require.Equal(t, apiclient.Outbox{Depth: 4, OldestAgeSeconds: 0.25, Parked: 2}, o.Outbox)
	require.Equal(t, []apiclient.Worker{{ID: "w1", Hostname: "h", Types: []string{"t"}, Concurrency: 2, Version: "v1",
		LastHeartbeatAt: time.Date(2026, 11, 23, 11, 59, 58, 0, time.UTC), Running: []apiclient.RunningTask{{ID: "x", Type: "t"}}}},
		o.Workers)
	require.Empty(t, o.Leader)
}

// A proxy that redirects (http to https, an old host to a new one) with
// 301, 302 or 303 would turn a POST into a GET of the same path, its body
// dropped: a submission would then read the listing of GET /v1/tasks as
// its task, and succeed without submitting anything. A write that is
// redirected is an error that says where to.
func TestARedirectedWriteIsNotFollowedAsAGet(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var got []string
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Method+" "+r.URL.Path)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		switch r.Method + " " + r.URL.Path {
		case "GET /v1/tasks":
			_, _ = w.Write([]byte(`{"tasks":[]}`))
		case "GET /v1/tasks/t1":
			_, _ = w.Write([]byte(`{"id":"t1","status":"PENDING"}`))
		default:
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(`{"id":"t1","status":"PENDING"}`))
		}
	}))
	t.Cleanup(api.Close)
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, api.URL+r.URL.Path, http.StatusMovedPermanently)
	}))
	t.Cleanup(proxy.Close)
	c, err := apiclient.New(apiclient.Config{URL: proxy.URL})
	require.NoError(t, err)

	_, _, err = c.Submit(t.Context(), apiclient.SubmitRequest{Type: "demo.noop"}, "")
	require.Error(t, err, "a redirected submission reported a success")
	require.Equal(t, http.StatusMovedPermanently, apiclient.StatusOf(err))
	require.ErrorContains(t, err, api.URL+"/v1/tasks")
	// A read may follow a redirect: it reads the same thing there.
	task, err := c.Task(t.Context(), "t1")
	require.NoError(t, err)
	require.Equal(t, "t1", task.ID)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"GET /v1/tasks/t1"}, got)
}
