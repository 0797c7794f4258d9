package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// testBundle is one running API on its own database.
type testBundle struct {
	db     *testdb.DB
	base   string
	client *http.Client
	// token is an admin key of the org "test", sent with every request
	// unless the request names an Authorization of its own.
	token string
}

// setup starts run() on a free port against a fresh database and waits
// until it answers.
func setup(t *testing.T, opts ...func(*config.API)) *testBundle {
	t.Helper()
	db := testdb.New(t)
	b := serve(t, db, opts...)
	b.token, _ = db.Admin(t)
	return b
}

// serve starts run() on a free port against db and waits until it
// answers; its bundle has no token yet.
func serve(t *testing.T, db *testdb.DB, opts ...func(*config.API)) *testBundle {
	t.Helper()
	addr := testenv.FreeAddr(t)
	cfg := config.API{
		Common: config.Common{
			DatabaseURL: db.URL, LogLevel: "warn", LogFormat: "json", ShutdownTimeout: 5 * time.Second,
			MigrationLockTimeout: 5 * time.Second,
		},
		Addr: addr, JaegerUIURL: "http://jaeger.example:16686", MaxBodyBytes: 1 << 20, DefaultMaxAttempts: 3,
		ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second, WriteTimeout: 10 * time.Second,
		IdleTimeout: time.Minute, NotifyDebounce: time.Millisecond, RequestTimeout: 5 * time.Second,
		AuthCacheTTL: 500 * time.Millisecond, RateBurst: 1,
		StreamHeartbeat: 15 * time.Second, StreamMax: 10000, StreamBuffer: 1024, StreamGapTimeout: 10 * time.Second,
	}
	for _, o := range opts {
		o(&cfg)
	}
	require.NoError(t, cfg.Validate())
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- run(ctx, cfg, io.Discard) }()
	// A generous bound: the suite runs many of these servers at once, under
	// the race detector, on two cores, and a large request's CPU is slow.
	b := &testBundle{db: db, base: "http://" + addr, client: &http.Client{Timeout: 30 * time.Second}}
	t.Cleanup(func() {
		// Connections the client dialled but never used count as active
		// for a while during shutdown; close them first.
		b.client.CloseIdleConnections()
		cancel()
		require.NoError(t, <-errc)
	})
	testenv.Eventually(t, 10*time.Second, func() error {
		resp, err := b.client.Get(b.base + "/readyz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("readyz: %d", resp.StatusCode)
		}
		return nil
	})
	return b
}

type response struct {
	status int
	header http.Header
	body   []byte
}

func (r response) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(r.body, &m), string(r.body))
	return m
}

func (b *testBundle) do(t *testing.T, method, path, contentType, body string, header ...string) response {
	t.Helper()
	req, err := http.NewRequest(method, b.base+path, strings.NewReader(body))
	require.NoError(t, err)
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	req.Header.Set("Authorization", "Bearer "+b.token)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	if req.Header.Get("Authorization") == "" {
		delete(req.Header, "Authorization")
	}
	// A live stream that does not end by itself is read for streamWindow.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp, err := b.client.Do(req.WithContext(ctx))
	require.NoError(t, err)
	defer resp.Body.Close()
	live := resp.Header.Get("Content-Type") == "text/event-stream"
	if live {
		time.AfterFunc(streamWindow, cancel)
	}
	data, err := io.ReadAll(resp.Body)
	if !live || !errors.Is(err, context.Canceled) {
		require.NoError(t, err)
	}
	return response{status: resp.StatusCode, header: resp.Header, body: data}
}

// streamWindow is how long do reads a live stream.
const streamWindow = 500 * time.Millisecond

func (b *testBundle) post(t *testing.T, path, body string, header ...string) response {
	t.Helper()
	return b.do(t, http.MethodPost, path, "application/json", body, header...)
}

func (b *testBundle) get(t *testing.T, path string) response {
	t.Helper()
	return b.do(t, http.MethodGet, path, "", "")
}

// counts returns the number of rows of every table a submission writes.
func (b *testBundle) counts(t *testing.T) [3]int {
	t.Helper()
	var c [3]int
	err := b.db.Pool.QueryRow(context.Background(),
		`SELECT (SELECT count(*) FROM tasks), (SELECT count(*) FROM task_events), (SELECT count(*) FROM outbox)`).
		Scan(&c[0], &c[1], &c[2])
	require.NoError(t, err)
	return c
}

func TestSubmitStoresTaskEventAndOutboxRow(t *testing.T) {
	t.Parallel()
	b := setup(t)

	resp := b.post(t, "/v1/tasks", `{"type":"demo.sleep","payload":{"steps":3,"step_ms":100}}`)
	require.Equal(t, http.StatusCreated, resp.status, string(resp.body))
	require.Equal(t, "application/json", resp.header.Get("Content-Type"))
	created := resp.json(t)
	id := created["id"].(string)
	require.Equal(t, "/v1/tasks/"+id, resp.header.Get("Location"))
	require.Equal(t, "PENDING", created["status"])
	require.Equal(t, "Queued", created["state"])
	require.EqualValues(t, 0, created["progress"])
	require.EqualValues(t, 5, created["priority"])
	require.EqualValues(t, 3, created["max_attempts"])
	require.Len(t, created["trace_id"], 32)
	require.NotContains(t, created, "trace_url", "nothing is exported: no trace to link to")
	require.Equal(t, [3]int{1, 1, 1}, b.counts(t))

	var kind, taskID, taskType, traceparent string
	var attempt, version int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(),
		`SELECT kind, task_id::text, task_type, attempt, task_version, headers->>'traceparent' FROM outbox`).
		Scan(&kind, &taskID, &taskType, &attempt, &version, &traceparent))
	require.Equal(t, "task.run", kind)
	require.Equal(t, id, taskID)
	require.Equal(t, "demo.sleep", taskType)
	require.Zero(t, attempt)
	require.EqualValues(t, created["version"], version)
	require.Contains(t, traceparent, created["trace_id"])

	var actor, status string
	require.NoError(t, b.db.Pool.QueryRow(context.Background(),
		`SELECT actor, status FROM task_events WHERE task_id = $1`, id).Scan(&actor, &status))
	require.Equal(t, "API", actor)
	require.Equal(t, "PENDING", status)

	// The same input with its keys in another order and other spacing is
	// the same task.
	dup := b.post(t, "/v1/tasks", "{ \"payload\": {\"step_ms\": 100, \"steps\": 3},\n \"type\": \"demo.sleep\" }")
	require.Equal(t, http.StatusOK, dup.status, string(dup.body))
	require.Equal(t, id, dup.json(t)["id"])
	require.Equal(t, "/v1/tasks/"+id, dup.header.Get("Location"))
	require.Equal(t, [3]int{1, 1, 1}, b.counts(t))

	got := b.get(t, "/v1/tasks/"+id)
	require.Equal(t, http.StatusOK, got.status)
	require.Equal(t, id, got.json(t)["id"])
	require.Equal(t, created["trace_id"], got.json(t)["trace_id"])
}

func TestConcurrentIdenticalSubmitsMakeOneTask(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 50
	var wg sync.WaitGroup
	statuses := make([]int, n)
	ids := make([]string, n)
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			req, _ := http.NewRequest(http.MethodPost, b.base+"/v1/tasks",
				strings.NewReader(`{"type":"demo.sleep","payload":{"steps":1,"step_ms":1}}`))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Authorization", "Bearer "+b.token)
			resp, err := b.client.Do(req)
			if err != nil {
				return
			}
			defer resp.Body.Close()
			var v struct{ ID string }
			_ = json.NewDecoder(resp.Body).Decode(&v)
			statuses[i], ids[i] = resp.StatusCode, v.ID
		}()
	}
	close(start)
	wg.Wait()
	created := 0
	for i := range n {
		require.Contains(t, []int{http.StatusCreated, http.StatusOK}, statuses[i])
		require.Equal(t, ids[0], ids[i])
		if statuses[i] == http.StatusCreated {
			created++
		}
	}
	require.Equal(t, 1, created)
	require.Equal(t, [3]int{1, 1, 1}, b.counts(t))
}

func TestIdempotencyKey(t *testing.T) {
	t.Parallel()
	b := setup(t)

	first := b.post(t, "/v1/tasks", `{"type":"email.send","payload":{"to":"a@example.com","n":1}}`, "Idempotency-Key", "order-42")
	require.Equal(t, http.StatusCreated, first.status, string(first.body))
	require.Equal(t, "order-42", first.json(t)["idempotency_key"])

	again := b.post(t, "/v1/tasks", `{"type":"email.send","payload":{"n":1,"to":"a@example.com"}}`, "Idempotency-Key", "order-42")
	require.Equal(t, http.StatusOK, again.status)
	require.Equal(t, first.json(t)["id"], again.json(t)["id"])

	// The same key with another input is refused and writes nothing.
	before := b.counts(t)
	mismatch := b.post(t, "/v1/tasks", `{"type":"email.send","payload":{"to":"b@example.com"}}`, "Idempotency-Key", "order-42")
	require.Equal(t, http.StatusUnprocessableEntity, mismatch.status)
	require.Equal(t, "application/problem+json", mismatch.header.Get("Content-Type"))
	require.Contains(t, string(mismatch.body), "Idempotency-Key")
	require.Equal(t, before, b.counts(t))

	// Even with dedupe off, a reused key must carry the same input.
	off := b.post(t, "/v1/tasks", `{"type":"email.send","payload":{"to":"c@example.com"},"dedupe":false}`, "Idempotency-Key", "order-42")
	require.Equal(t, http.StatusUnprocessableEntity, off.status)

	// dedupe:false opts out of input deduplication.
	one := b.post(t, "/v1/tasks", `{"type":"email.send","payload":{"to":"z@example.com"},"dedupe":false}`)
	two := b.post(t, "/v1/tasks", `{"type":"email.send","payload":{"to":"z@example.com"},"dedupe":false}`)
	require.Equal(t, http.StatusCreated, one.status)
	require.Equal(t, http.StatusCreated, two.status)
	require.NotEqual(t, one.json(t)["id"], two.json(t)["id"])
}

func TestBadInputGetsAProblemAndWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// A task to address by id, so the counts below start non-zero.
	existing := b.post(t, "/v1/tasks", `{"type":"demo.sleep","payload":{}}`).json(t)["id"].(string)

	bigPayload := `{"type":"demo.sleep","payload":{"blob":"` + strings.Repeat("x", 1<<20) + `"}}`
	var batch strings.Builder
	batch.WriteString(`{"tasks":[`)
	for i := range 1001 {
		if i > 0 {
			batch.WriteString(",")
		}
		fmt.Fprintf(&batch, `{"type":"demo.sleep","payload":{"i":%d}}`, i)
	}
	batch.WriteString(`]}`)

	tests := []struct {
		name, method, path, contentType, body string
		header                                []string
		status                                int
		mention                               string
	}{
		{"malformed JSON", "POST", "/v1/tasks", "application/json", `{"type":`, nil, 400, "malformed"},
		{"trailing garbage", "POST", "/v1/tasks", "application/json", `{"type":"a"} x`, nil, 400, "single JSON value"},
		{"empty body", "POST", "/v1/tasks", "application/json", ``, nil, 400, "empty"},
		{"unknown field", "POST", "/v1/tasks", "application/json", `{"type":"a","colour":"red"}`, nil, 400, "colour"},
		{"wrong content type", "POST", "/v1/tasks", "text/plain", `{"type":"a"}`, nil, 415, "Content-Type"},
		{"no content type", "POST", "/v1/tasks", "", `{"type":"a"}`, nil, 415, "Content-Type"},
		{"body over the limit", "POST", "/v1/tasks", "application/json", bigPayload, nil, 413, "larger than"},
		{"missing type", "POST", "/v1/tasks", "application/json", `{"payload":{}}`, nil, 422, "type"},
		{"invalid type", "POST", "/v1/tasks", "application/json", `{"type":"Demo Sleep"}`, nil, 422, "type"},
		{"type not a string", "POST", "/v1/tasks", "application/json", `{"type":7}`, nil, 422, "type"},
		{"priority too high", "POST", "/v1/tasks", "application/json", `{"type":"a","priority":10}`, nil, 422, "priority"},
		{"priority negative", "POST", "/v1/tasks", "application/json", `{"type":"a","priority":-1}`, nil, 422, "priority"},
		{"priority not integer", "POST", "/v1/tasks", "application/json", `{"type":"a","priority":1.5}`, nil, 422, "priority"},
		{"priority huge", "POST", "/v1/tasks", "application/json", `{"type":"a","priority":1e400}`, nil, 422, "priority"},
		{"payload not an object", "POST", "/v1/tasks", "application/json", `{"type":"a","payload":"{not json"}`, nil, 422, "payload"},
		{"payload array", "POST", "/v1/tasks", "application/json", `{"type":"a","payload":[1,2]}`, nil, 422, "payload"},
		{"payload with NUL", "POST", "/v1/tasks", "application/json", `{"type":"a","payload":{"s":"\u0000"}}`, nil, 422, "rejected"},
		{"max_attempts zero", "POST", "/v1/tasks", "application/json", `{"type":"a","max_attempts":0}`, nil, 422, "max_attempts"},
		{"empty idempotency key", "POST", "/v1/tasks", "application/json", `{"type":"a"}`, []string{"Idempotency-Key", ""}, 422, "Idempotency-Key"},
		{"idempotency key too long", "POST", "/v1/tasks", "application/json", `{"type":"a"}`,
			[]string{"Idempotency-Key", strings.Repeat("k", 256)}, 422, "Idempotency-Key"},
		{"batch with a header key", "POST", "/v1/tasks/batch", "application/json", `{"tasks":[{"type":"a"}]}`,
			[]string{"Idempotency-Key", "k"}, 422, "idempotency_key"},
		{"batch over 1000", "POST", "/v1/tasks/batch", "application/json", batch.String(), nil, 422, "1000"},
		{"empty batch", "POST", "/v1/tasks/batch", "application/json", `{"tasks":[]}`, nil, 422, "tasks"},
		{"batch with one bad entry", "POST", "/v1/tasks/batch", "application/json",
			`{"tasks":[{"type":"ok"},{"type":"NOT OK"}]}`, nil, 422, "tasks[1].type"},
		{"bad UUID", "GET", "/v1/tasks/not-a-uuid", "", "", nil, 400, "UUID"},
		{"unknown id", "GET", "/v1/tasks/0190c8a5-0000-7000-8000-000000000000", "", "", nil, 404, "not found"},
		{"events of unknown id", "GET", "/v1/tasks/0190c8a5-0000-7000-8000-000000000000/events", "", "", nil, 404, "not found"},
		{"cancel unknown id", "POST", "/v1/tasks/0190c8a5-0000-7000-8000-000000000000/cancel", "", "", nil, 404, "not found"},
		{"retry bad UUID", "POST", "/v1/tasks/123/retry", "", "", nil, 400, "UUID"},
		{"list bad status", "GET", "/v1/tasks?status=DONE", "", "", nil, 422, "status"},
		{"list limit too high", "GET", "/v1/tasks?limit=501", "", "", nil, 422, "limit"},
		{"list bad cursor", "GET", "/v1/tasks?cursor=zzz", "", "", nil, 422, "cursor"},
		{"list unknown parameter", "GET", "/v1/tasks?stauts=PENDING", "", "", nil, 400, "stauts"},
		{"events limit too high", "GET", "/v1/tasks/" + existing + "/events?limit=101", "", "", nil, 422, "limit"},
		{"unknown route", "GET", "/v2/tasks", "", "", nil, 404, "no route"},
		{"wrong method", "DELETE", "/v1/tasks/" + existing, "", "", nil, 405, "DELETE"},
	}
	before := b.counts(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := b.do(t, tt.method, tt.path, tt.contentType, tt.body, tt.header...)
			require.Equal(t, tt.status, resp.status, string(resp.body))
			require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"))
			p := resp.json(t)
			require.EqualValues(t, tt.status, p["status"])
			require.NotEmpty(t, p["title"])
			require.Contains(t, p["detail"], tt.mention)
			require.Equal(t, before, b.counts(t), "bad input must write nothing")
		})
	}
}

func TestBatchSubmit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	single := b.post(t, "/v1/tasks", `{"type":"demo.sleep","payload":{"n":0}}`).json(t)

	resp := b.post(t, "/v1/tasks/batch", `{"tasks":[
		{"type":"demo.sleep","payload":{"n":1},"priority":9},
		{"type":"demo.sleep","payload":{"n":0}},
		{"type":"demo.sleep","payload":{"n":1}},
		{"type":"demo.noop","idempotency_key":"k1"},
		{"type":"demo.noop","idempotency_key":"k1"}
	]}`)
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	var out struct {
		Results []struct {
			Result string
			Task   map[string]any
		}
	}
	require.NoError(t, json.Unmarshal(resp.body, &out))
	require.Len(t, out.Results, 5)
	got := []string{}
	for _, r := range out.Results {
		got = append(got, r.Result)
	}
	require.Equal(t, []string{"created", "duplicate", "duplicate", "created", "duplicate"}, got)
	require.Equal(t, single["id"], out.Results[1].Task["id"], "a batch entry can duplicate an earlier task")
	require.Equal(t, out.Results[0].Task["id"], out.Results[2].Task["id"], "an entry can duplicate an earlier entry")
	require.Equal(t, out.Results[3].Task["id"], out.Results[4].Task["id"])
	require.EqualValues(t, 9, out.Results[0].Task["priority"])
	require.Equal(t, [3]int{3, 3, 3}, b.counts(t))

	// A key reused with another input fails the whole batch.
	before := b.counts(t)
	bad := b.post(t, "/v1/tasks/batch", `{"tasks":[{"type":"demo.sleep","payload":{"n":99}},{"type":"demo.noop","payload":{"x":1},"idempotency_key":"k1"}]}`)
	require.Equal(t, http.StatusUnprocessableEntity, bad.status, string(bad.body))
	require.Equal(t, before, b.counts(t))
}

func TestListPagesNewestFirst(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var ids []string
	for i := range 7 {
		typ := "demo.sleep"
		if i%2 == 1 {
			typ = "demo.noop"
		}
		resp := b.post(t, "/v1/tasks", fmt.Sprintf(`{"type":%q,"payload":{"i":%d}}`, typ, i))
		require.Equal(t, http.StatusCreated, resp.status)
		ids = append(ids, resp.json(t)["id"].(string))
	}
	var seen []string
	cursor := ""
	for page := 0; ; page++ {
		path := "/v1/tasks?limit=3"
		if cursor != "" {
			path += "&cursor=" + cursor
		}
		resp := b.get(t, path)
		require.Equal(t, http.StatusOK, resp.status, string(resp.body))
		var out struct {
			Tasks      []struct{ ID string }
			NextCursor string `json:"next_cursor"`
		}
		require.NoError(t, json.Unmarshal(resp.body, &out))
		for _, tk := range out.Tasks {
			seen = append(seen, tk.ID)
		}
		if out.NextCursor == "" {
			break
		}
		cursor = out.NextCursor
		require.Less(t, page, 5)
	}
	want := make([]string, len(ids))
	for i, id := range ids {
		want[len(ids)-1-i] = id
	}
	require.Equal(t, want, seen)

	var byType struct{ Tasks []struct{ Type string } }
	resp := b.get(t, "/v1/tasks?type=demo.noop&status=PENDING")
	require.Equal(t, http.StatusOK, resp.status)
	require.NoError(t, json.Unmarshal(resp.body, &byType))
	require.Len(t, byType.Tasks, 3)
	for _, tk := range byType.Tasks {
		require.Equal(t, "demo.noop", tk.Type)
	}
	var none struct{ Tasks []any }
	require.NoError(t, json.Unmarshal(b.get(t, "/v1/tasks?status=COMPLETED").body, &none))
	require.Empty(t, none.Tasks)
}

func TestCancelAndRetry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	id := b.post(t, "/v1/tasks", `{"type":"demo.sleep","payload":{"steps":10}}`).json(t)["id"].(string)

	cancel := b.post(t, "/v1/tasks/"+id+"/cancel", "")
	require.Equal(t, http.StatusOK, cancel.status, string(cancel.body))
	require.Equal(t, "CANCELLED", cancel.json(t)["status"])
	require.NotNil(t, cancel.json(t)["completed_at"])

	again := b.post(t, "/v1/tasks/"+id+"/cancel", "")
	require.Equal(t, http.StatusConflict, again.status)
	require.Equal(t, "application/problem+json", again.header.Get("Content-Type"))

	retry := b.post(t, "/v1/tasks/"+id+"/retry", "")
	require.Equal(t, http.StatusOK, retry.status, string(retry.body))
	r := retry.json(t)
	require.Equal(t, "PENDING", r["status"])
	require.EqualValues(t, 0, r["attempt"])
	require.Nil(t, r["completed_at"])
	var runs int
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE kind = 'task.run' AND task_id = $1`, id).Scan(&runs))
	require.Equal(t, 2, runs, "retry queues the task again")

	require.Equal(t, http.StatusConflict, b.post(t, "/v1/tasks/"+id+"/retry", "").status, "a PENDING task cannot be retried")

	// A running task is asked to stop: the answer is 202 and a task.cancel
	// message goes to the workers.
	_, err := b.db.Pool.Exec(ctx, `UPDATE tasks SET status = 'IN_PROGRESS', attempt = 1, worker_id = 'w1',
		lease_expires_at = now() + interval '30 seconds', version = version + 1 WHERE id = $1`, id)
	require.NoError(t, err)
	requested := b.post(t, "/v1/tasks/"+id+"/cancel", "")
	require.Equal(t, http.StatusAccepted, requested.status, string(requested.body))
	require.Equal(t, "IN_PROGRESS", requested.json(t)["status"])
	require.NotNil(t, requested.json(t)["cancel_requested_at"])
	require.Equal(t, http.StatusAccepted, b.post(t, "/v1/tasks/"+id+"/cancel", "").status)
	var cancels int
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE kind = 'task.cancel' AND task_id = $1`, id).Scan(&cancels))
	require.Equal(t, 1, cancels, "asking twice broadcasts once")
	require.Equal(t, http.StatusConflict, b.post(t, "/v1/tasks/"+id+"/retry", "").status, "a running task cannot be retried")

	events := b.get(t, "/v1/tasks/"+id+"/events")
	require.Equal(t, http.StatusOK, events.status)
	var ev struct {
		Events []struct {
			ID                   int64
			Status, State, Actor string
		}
	}
	require.NoError(t, json.Unmarshal(events.body, &ev))
	var story []string
	for _, e := range ev.Events {
		story = append(story, e.Status+"/"+e.State)
		require.Equal(t, "API", e.Actor)
	}
	require.Equal(t, []string{"IN_PROGRESS/Cancel requested", "PENDING/Queued", "CANCELLED/Cancelled", "PENDING/Queued"}, story, "newest first")

	limited := b.get(t, "/v1/tasks/"+id+"/events?limit=1")
	require.NoError(t, json.Unmarshal(limited.body, &ev))
	require.Len(t, ev.Events, 1)
}

func TestOpsEndpoints(t *testing.T) {
	t.Parallel()
	b := setup(t)
	require.Equal(t, http.StatusOK, b.get(t, "/healthz").status)
	require.Equal(t, http.StatusOK, b.get(t, "/readyz").status)
	// demo.noop has a worker (it declared its queue); unheard.of has none,
	// and client input alone never makes a metric label.
	_, err := b.db.Pool.Exec(context.Background(), `INSERT INTO task_types (name) VALUES ('demo.noop')`)
	require.NoError(t, err)
	b.post(t, "/v1/tasks", `{"type":"demo.noop"}`)
	b.post(t, "/v1/tasks", `{"type":"unheard.of"}`)
	metrics := b.get(t, "/metrics")
	require.Equal(t, http.StatusOK, metrics.status)
	require.Contains(t, string(metrics.body), `conveyor_tasks_submitted_total{result="created",type="demo.noop"} 1`)
	require.Contains(t, string(metrics.body), `conveyor_tasks_submitted_total{result="created",type="other"} 1`)
	require.NotContains(t, string(metrics.body), `unheard.of`)
	spec := b.get(t, "/openapi.yaml")
	require.Equal(t, http.StatusOK, spec.status)
	require.True(t, bytes.HasPrefix(spec.body, []byte("openapi: 3.1")))
}

// With API_ADMIN_ADDR set, /metrics (which names every org's task types)
// is served there, and no longer on the API's port, which faces clients.
func TestMetricsMoveToTheAdminAddress(t *testing.T) {
	t.Parallel()
	adminAddr := testenv.FreeAddr(t)
	b := setup(t, func(c *config.API) { c.AdminAddr = adminAddr })
	require.Equal(t, http.StatusNotFound, b.get(t, "/metrics").status)
	require.Equal(t, http.StatusOK, b.get(t, "/healthz").status)
	resp, err := b.client.Get("http://" + adminAddr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, string(body), "conveyor_http_request_duration_seconds")
}

// The services take their configuration from the environment: -h prints
// their usage, and an argument they do not take is refused — never ignored
// by starting the service (`api --help` once served on :8080).
func TestServicesAnswerHelpAndRefuseUnknownArguments(t *testing.T) {
	t.Parallel()
	for _, pkg := range []string{"./cmd/api", "./cmd/relay", "./cmd/worker"} {
		bin := testenv.Binary(t, pkg)
		name := pkg[len("./cmd/"):]
		for _, tc := range []struct {
			args   []string
			code   int
			stdout string // a line it holds
			stderr string
		}{
			{args: []string{"--help"}, code: 0, stdout: "usage: " + name + " ["},
			{args: []string{"-h"}, code: 0, stdout: "usage: " + name + " ["},
			{args: []string{"--hlep"}, code: 2, stderr: name + `: unknown argument "--hlep"`},
			{args: []string{"serve", "now"}, code: 2, stderr: name + `: unknown argument "serve"`},
		} {
			t.Run(name+" "+strings.Join(tc.args, " "), func(t *testing.T) {
				t.Parallel()
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				cmd := exec.CommandContext(ctx, bin, tc.args...)
				// Were an argument ignored, the service would start here, on a
				// database and a broker nobody listens for, and never exit.
				cmd.Env = append(os.Environ(), "DATABASE_URL=postgres://postgres@127.0.0.1:1/none?sslmode=disable",
					"AMQP_URL=amqp://guest:guest@127.0.0.1:1/", "API_ADDR=127.0.0.1:0",
					"RELAY_ADMIN_ADDR=127.0.0.1:0", "WORKER_ADMIN_ADDR=127.0.0.1:0")
				var stdout, stderr bytes.Buffer
				cmd.Stdout, cmd.Stderr = &stdout, &stderr
				err := cmd.Run()
				require.NoError(t, ctx.Err(), "it started instead of answering:\n%s", stderr.String())
				code := 0
				if ee, ok := errors.AsType[*exec.ExitError](err); ok {
					code = ee.ExitCode()
				} else {
					require.NoError(t, err)
				}
				require.Equal(t, tc.code, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
				require.Contains(t, stdout.String()+stderr.String(), "see \"Configuration\" in")
				if tc.stdout != "" {
					require.Contains(t, stdout.String(), tc.stdout)
				}
				if tc.stderr != "" {
					require.Contains(t, stderr.String(), tc.stderr)
				}
			})
		}
	}
}
