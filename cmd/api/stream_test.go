package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/httpapi"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// The live streams as the API serves them, without workers: submissions
// and cancels make the events. (cmd/worker's stream tests run them against
// real workers.)

// openStream GETs path with the bearer token and returns the response and
// a reader of its lines; both end with the test.
func (b *testBundle) openStream(t *testing.T, path, token string) (*http.Response, *bufio.Scanner) {
	t.Helper()
	return b.openStreamWith(t, path, "Authorization", "Bearer "+token)
}

// openStreamWith is openStream with the credentials in the given header
// (the dashboard's cookie, say), and any more headers given as pairs.
func (b *testBundle) openStreamWith(t *testing.T, path string, header ...string) (*http.Response, *bufio.Scanner) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, b.base+path, nil)
	require.NoError(t, err)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	// A hub starts once the transactions running as it starts have ended,
	// or after its gap timeout: those of the whole PostgreSQL cluster,
	// which other packages' tests share (some hold a transaction open for
	// seconds), so a new API may answer "starting; try again" for a while.
	// A client tries again, as this does.
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := (&http.Client{}).Do(req.Clone(ctx))
		require.NoError(t, err)
		if resp.StatusCode == http.StatusServiceUnavailable && time.Now().Before(deadline) {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if strings.Contains(string(body), "live streams are starting") {
				time.Sleep(200 * time.Millisecond)
				continue
			}
			resp.Body = io.NopCloser(bytes.NewReader(body))
		}
		t.Cleanup(func() { resp.Body.Close() })
		return resp, bufio.NewScanner(resp.Body)
	}
}

// nextData returns the data of the stream's next event (not its ready
// frame), failing after 5s.
func nextData(t *testing.T, lines *bufio.Scanner) string {
	t.Helper()
	got := make(chan string, 1)
	go func() {
		event := ""
		for lines.Scan() {
			if name, ok := strings.CutPrefix(lines.Text(), "event: "); ok {
				event = name
			}
			if data, ok := strings.CutPrefix(lines.Text(), "data: "); ok && event != "ready" {
				got <- data
				return
			}
		}
		got <- ""
	}()
	select {
	case data := <-got:
		require.NotEmpty(t, data, "the stream ended")
		return data
	case <-time.After(5 * time.Second):
		t.Fatal("no event within 5s")
		return ""
	}
}

func TestOrgStreamStartsNowAndFilters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	before := b.post(t, "/v1/tasks", `{"type":"stream.before","payload":{}}`)
	require.Equal(t, http.StatusCreated, before.status)

	resp, lines := b.openStream(t, "/v1/events/stream?type=stream.watched&status=CANCELLED", b.token)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
	require.Equal(t, "no-cache", resp.Header.Get("Cache-Control"))

	other := b.post(t, "/v1/tasks", `{"type":"stream.other","payload":{}}`)
	watched := b.post(t, "/v1/tasks", `{"type":"stream.watched","payload":{}}`)
	require.Equal(t, http.StatusCreated, watched.status)
	id := watched.json(t)["id"].(string)
	b.post(t, "/v1/tasks/"+other.json(t)["id"].(string)+"/cancel", "")
	require.Equal(t, http.StatusOK, b.post(t, "/v1/tasks/"+id+"/cancel", "").status)

	data := nextData(t, lines)
	require.Contains(t, data, id, "the first event through the filters is the watched task's cancel")
	require.Contains(t, data, `"status":"CANCELLED"`)
	require.Contains(t, data, `"type":"stream.watched"`)
	require.NotContains(t, data, before.json(t)["id"].(string))
}

func TestStreamRefusesBadInput(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.post(t, "/v1/tasks", `{"type":"stream.bad","payload":{}}`).json(t)["id"].(string)
	for _, c := range []struct{ path, header string }{
		{"/v1/tasks/" + id + "/stream", "x"},
		{"/v1/tasks/" + id + "/stream", "-1"},
		{"/v1/tasks/" + id + "/stream?last_event_id=1.5", ""},
		{"/v1/events/stream", "99999999999999999999"},
		{"/v1/events/stream?status=DONE", ""},
		{"/v1/events/stream?type=Not%20a%20type", ""},
		{"/v1/events/stream?tipe=x", ""},
	} {
		resp := b.do(t, http.MethodGet, c.path, "", "", "Last-Event-ID", c.header)
		require.Contains(t, []int{http.StatusBadRequest, http.StatusUnprocessableEntity}, resp.status, "%s %q: %s", c.path, c.header, resp.body)
		require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"))
	}
	resp := b.do(t, http.MethodGet, "/v1/tasks/01900000-0000-7000-8000-000000000000/stream", "", "")
	require.Equal(t, http.StatusNotFound, resp.status)
}

// The Last-Event-ID header and the last_event_id parameter, given both:
// a header ahead of the parameter is an EventSource reconnecting by itself
// to the URL it was opened with, and resumes; one behind it is refused.
func TestStreamTakesTheHeaderOfAReconnectingEventSource(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.post(t, "/v1/tasks", `{"type":"stream.twice","payload":{"n":1}}`)
	b.post(t, "/v1/tasks", `{"type":"stream.twice","payload":{"n":2}}`)
	var first, last int64
	require.NoError(t, b.db.Pool.QueryRow(context.Background(),
		"SELECT min(id), max(id) FROM task_events").Scan(&first, &last))
	require.Less(t, first, last)
	query := "/v1/events/stream?last_event_id=" + strconv.FormatInt(first, 10)

	resp := b.do(t, http.MethodGet, "/v1/events/stream?last_event_id="+strconv.FormatInt(last, 10), "", "",
		"Last-Event-ID", strconv.FormatInt(first, 10))
	require.Equal(t, http.StatusBadRequest, resp.status, string(resp.body))
	require.Contains(t, resp.json(t)["detail"], "behind")

	for _, header := range []int64{first, last} {
		opened, lines := b.openStreamWith(t, query, "Authorization", "Bearer "+b.token,
			"Last-Event-ID", strconv.FormatInt(header, 10))
		require.Equal(t, http.StatusOK, opened.StatusCode, "header %d", header)
		for lines.Scan() && !strings.HasPrefix(lines.Text(), "id: ") {
		}
		// The ready frame names where the stream resumes.
		require.Equal(t, "id: "+strconv.FormatInt(header, 10), lines.Text(), "resumes after the header's id")
	}
}

// A stream outlives no credential: at the next heartbeat after its key is
// revoked, it ends.
func TestStreamOfARevokedKeyEnds(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *config.API) { c.StreamHeartbeat = 100 * time.Millisecond })
	key := b.post(t, "/v1/keys", `{"name":"watcher","role":"reader"}`)
	require.Equal(t, http.StatusCreated, key.status)
	resp, lines := b.openStream(t, "/v1/events/stream", key.json(t)["secret"].(string))
	require.Equal(t, http.StatusOK, resp.StatusCode)

	require.Equal(t, http.StatusOK, b.do(t, http.MethodDelete, "/v1/keys/"+key.json(t)["id"].(string), "", "").status)
	require.Contains(t, streamComments(t, lines, "the stream of a revoked key is still open"), ": credentials no longer valid")
}

// streamComments reads the stream to its end and returns its comment
// lines, failing if it is still open after 5s.
func streamComments(t *testing.T, lines *bufio.Scanner, why string) []string {
	t.Helper()
	ended := make(chan []string, 1)
	go func() {
		var comments []string
		for lines.Scan() {
			if strings.HasPrefix(lines.Text(), ":") {
				comments = append(comments, lines.Text())
			}
		}
		ended <- comments
	}()
	select {
	case comments := <-ended:
		return comments
	case <-time.After(5 * time.Second):
		t.Fatal(why)
		return nil
	}
}

// The dashboard's streams carry its session cookie, not an Authorization
// header; the check at each heartbeat takes the cookie, as the request's
// own authentication did, and the stream stays open.
func TestAStreamOfTheDashboardsCookieOutlivesItsHeartbeats(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *config.API) { c.StreamHeartbeat = 50 * time.Millisecond })
	resp, lines := b.openStreamWith(t, "/v1/events/stream?type=stream.cookie", "Cookie", httpapi.SessionCookie+"="+b.token)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	time.Sleep(500 * time.Millisecond) // ten heartbeats
	created := b.post(t, "/v1/tasks", `{"type":"stream.cookie","payload":{}}`)
	require.Equal(t, http.StatusCreated, created.status)
	require.Contains(t, nextData(t, lines), created.json(t)["id"].(string))
}

// A stream filters by the scope it opened with; when its caller's scope
// changes (here an admin, who sees every task, demoted to reader), it ends
// at the next heartbeat, and the client's reconnect opens one in the new
// scope.
func TestAStreamEndsWhenItsCallersScopeChanges(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	b := setup(t, withOIDC(iss), func(c *config.API) {
		c.StreamHeartbeat, c.AuthCacheTTL = 50*time.Millisecond, 50*time.Millisecond
	})
	user := b.post(t, "/v1/users", `{"external_id":"watcher","email":"watcher@example.com","role":"admin"}`)
	require.Equal(t, http.StatusCreated, user.status, string(user.body))
	resp, lines := b.openStream(t, "/v1/events/stream", iss.Token(t, map[string]any{"sub": "watcher", "aud": oidcAudience}))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	time.Sleep(200 * time.Millisecond) // heartbeats that find the scope unchanged
	require.Equal(t, http.StatusOK, b.do(t, http.MethodPatch, "/v1/users/"+user.json(t)["id"].(string),
		"application/json", `{"role":"reader"}`).status)
	require.Contains(t, streamComments(t, lines, "the stream of a demoted admin is still open"),
		": the credentials' scope changed; reconnect")
}

// A Last-Event-ID ahead of every stored event names no event a stream
// sent: it is refused, rather than opening a stream that skips everything
// up to that id (a task's stream then never sent its end, its terminal
// event being "already sent").
func TestStreamRefusesALastEventIDAheadOfEveryEvent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.post(t, "/v1/tasks", `{"type":"stream.ahead","payload":{}}`).json(t)["id"].(string)
	for _, path := range []string{"/v1/tasks/" + id + "/stream", "/v1/events/stream"} {
		for _, c := range []struct{ query, header string }{{"", "1099511627776"}, {"?last_event_id=1099511627776", ""}} {
			resp := b.do(t, http.MethodGet, path+c.query, "", "", "Last-Event-ID", c.header)
			require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s%s: %s", path, c.query, resp.body)
			require.Equal(t, "last_event_id", resp.json(t)["field"], path)
		}
	}

	// The newest event's own id is where a client that got it resumes:
	// the stream opens and sends what comes next, to the task's end.
	var newest int64
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), "SELECT max(id) FROM task_events").Scan(&newest))
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, b.base+"/v1/tasks/"+id+"/stream", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+b.token)
	req.Header.Set("Last-Event-ID", strconv.FormatInt(newest, 10))
	resp, err := (&http.Client{}).Do(req)
	require.NoError(t, err)
	t.Cleanup(func() { resp.Body.Close() })
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, http.StatusOK, b.post(t, "/v1/tasks/"+id+"/cancel", "").status)
	require.Contains(t, nextData(t, bufio.NewScanner(resp.Body)), `"status":"CANCELLED"`)
}

// Event ids come from one sequence that every org shares: a resume after
// an id only another org's activity reached (here an event being written,
// its id handed out) is refused as one after no id of the caller's own,
// and the answer tells nothing of how far the other org has gone.
func TestStreamResumeTellsNothingOfAnotherOrgsEvents(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.post(t, "/v1/tasks", `{"type":"stream.mine","payload":{}}`)
	other, _ := b.db.Key(t, "other", auth.Writer)
	require.Equal(t, http.StatusCreated, b.post(t, "/v1/tasks", `{"type":"stream.theirs","payload":{}}`,
		"Authorization", "Bearer "+other).status)
	var theirs int64
	require.NoError(t, b.db.Pool.QueryRow(context.Background(),
		"SELECT nextval(pg_get_serial_sequence('task_events', 'id'))").Scan(&theirs))
	resp := b.do(t, http.MethodGet, "/v1/events/stream", "", "", "Last-Event-ID", strconv.FormatInt(theirs, 10))
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, string(resp.body))
	require.Equal(t, "last_event_id", resp.json(t)["field"])
}

// An id ahead of this instance's hub may be where another instance's org
// stream started (its hub a little ahead): the resume waits a moment for
// this hub to reach it, and opens, rather than refusing an id a stream
// sent. Here the id is another org's event, committed while the resume
// waits.
func TestStreamResumeWaitsForTheHubToReachAnIDJustAhead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	other, _ := b.db.Key(t, "other", auth.Writer)
	theirs := b.post(t, "/v1/tasks", `{"type":"stream.theirs","payload":{}}`, "Authorization", "Bearer "+other).json(t)["id"].(string)
	ctx := context.Background()
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var ahead int64
	require.NoError(t, tx.QueryRow(ctx, `INSERT INTO task_events (task_id, org_id, status, state, progress, actor)
		SELECT id, org_id, status, state, 0, 'SYSTEM' FROM tasks WHERE id = $1 RETURNING id`, theirs).Scan(&ahead))

	rctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, b.base+"/v1/events/stream", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+b.token)
	req.Header.Set("Last-Event-ID", strconv.FormatInt(ahead, 10))
	type answer struct {
		resp *http.Response
		err  error
	}
	opened := make(chan answer, 1)
	go func() {
		resp, err := (&http.Client{}).Do(req)
		opened <- answer{resp, err}
	}()
	time.Sleep(100 * time.Millisecond) // the resume is waiting (if it is not yet, it waits less)
	require.NoError(t, tx.Commit(ctx))
	select {
	case a := <-opened:
		require.NoError(t, a.err)
		defer a.resp.Body.Close()
		require.Equal(t, http.StatusOK, a.resp.StatusCode)
	case <-time.After(10 * time.Second):
		t.Fatal("the resume did not answer")
	}
}

// Retention deletes finished tasks with their events, the newest ones too
// once nothing newer was written. A client that got those events still
// resumes after the last of them, and an API that starts now (a restart,
// another instance) starts its hub below that id: the id names an event a
// stream sent, not one past every event, and the stream opens.
func TestStreamResumesAfterItsNewestEventsExpired(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.post(t, "/v1/tasks", `{"type":"stream.expired","payload":{}}`).json(t)["id"].(string)
	require.Equal(t, http.StatusOK, b.post(t, "/v1/tasks/"+id+"/cancel", "").status)
	ctx := context.Background()
	var last int64
	require.NoError(t, b.db.Pool.QueryRow(ctx, "SELECT max(id) FROM task_events").Scan(&last))
	_, err := b.db.Pool.Exec(ctx, "DELETE FROM tasks WHERE id = $1", id) // as retention does
	require.NoError(t, err)

	restarted := serve(t, b.db)
	resp, lines := restarted.openStreamWith(t, "/v1/events/stream?type=stream.expired",
		"Authorization", "Bearer "+b.token, "Last-Event-ID", strconv.FormatInt(last, 10))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	next := b.post(t, "/v1/tasks", `{"type":"stream.expired","payload":{}}`).json(t)["id"].(string)
	require.Contains(t, nextData(t, lines), next)
}

// A task's end that a transaction commits after the gap timeout is behind
// the hub's cursor by then, and the hub never delivers it: the task's own
// stream still sends it, and ends, rather than wait for ever.
func TestTaskStreamGetsAnEndCommittedAfterTheGapTimeout(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *config.API) {
		c.StreamGapTimeout, c.StreamHeartbeat = 200*time.Millisecond, 100*time.Millisecond
	})
	id := b.post(t, "/v1/tasks", `{"type":"stream.late","payload":{}}`).json(t)["id"].(string)
	resp, lines := b.openStream(t, "/v1/tasks/"+id+"/stream", b.token)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, nextData(t, lines), `"PENDING"`)

	// The task's end, written as a cancel writes it (the row, then its
	// event), by a transaction that stays open.
	ctx := context.Background()
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `UPDATE tasks SET status = 'CANCELLED', state = 'Cancelled', completed_at = now(),
		version = version + 1 WHERE id = $1`, id)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO task_events (task_id, org_id, status, state, progress, actor)
		SELECT id, org_id, status, state, 0, 'SYSTEM' FROM tasks WHERE id = $1`, id)
	require.NoError(t, err)

	// A later event commits, and reaches the org's stream once the hub has
	// passed the open transaction's id.
	_, feed := b.openStream(t, "/v1/events/stream?type=stream.other", b.token)
	other := b.post(t, "/v1/tasks", `{"type":"stream.other","payload":{}}`).json(t)["id"].(string)
	require.Contains(t, nextData(t, feed), other)
	require.NoError(t, tx.Commit(ctx))

	require.Contains(t, nextData(t, lines), `"CANCELLED"`)
}

// A live stream checks its caller's credentials at every heartbeat, for as
// long as it is open (hours, for the dashboard): the checks are not traced,
// or the stream's trace would gain database spans every heartbeat. Not
// parallel: the exporter reads its endpoint from the environment.
func TestStreamHeartbeatsAddNoSpansToItsTrace(t *testing.T) {
	otlp := testenv.NewOTLPReceiver(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.Endpoint)
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
	const heartbeats = 10
	b := setup(t, func(c *config.API) {
		c.StreamHeartbeat = 20 * time.Millisecond
		c.AuthCacheTTL = time.Millisecond // each check reads the key
		c.OTLPEndpoint = otlp.Endpoint
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, b.base+"/v1/events/stream", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+b.token)
	resp, err := (&http.Client{}).Do(req)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	lines := bufio.NewScanner(resp.Body)
	seen := 0
	for seen < heartbeats && lines.Scan() {
		if lines.Text() == ": heartbeat" {
			seen++
		}
	}
	require.Equal(t, heartbeats, seen, "the stream ended early")
	cancel()
	resp.Body.Close()

	var server testenv.Span
	testenv.Eventually(t, 10*time.Second, func() error {
		for _, s := range otlp.Spans() {
			if s.Name == "GET /v1/events/stream" {
				server = s
				return nil
			}
		}
		return fmt.Errorf("no span of the stream's request yet")
	})
	var queries []string
	lookups := 0
	for _, s := range otlp.Trace(server.TraceID) {
		if s.SpanID != server.SpanID {
			queries = append(queries, s.Name)
		}
		if s.Name == "api_keys.by_prefix" {
			lookups++
		}
	}
	require.NotZero(t, lookups, "the request's own authentication is traced: %v", queries)
	require.Less(t, lookups, heartbeats/2, "the stream's trace grows with its heartbeats: %v", queries)
}

// Another instance's hub may have passed a gap in the ids (a transaction
// holding an id open) this one still waits at, for up to the gap timeout:
// a resume after the id that instance's org stream started from (here
// another org's event, past the gap) waits for this hub to pass the gap
// too, and opens, rather than refusing an id a stream sent.
func TestStreamResumeWaitsOutAGapTheHubHoldsAt(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *config.API) { c.StreamGapTimeout = 3 * time.Second })
	b.post(t, "/v1/tasks", `{"type":"stream.mine","payload":{}}`)
	other, _ := b.db.Key(t, "other", auth.Writer)
	theirs := b.post(t, "/v1/tasks", `{"type":"stream.theirs","payload":{}}`, "Authorization", "Bearer "+other).json(t)["id"].(string)
	ctx := context.Background()
	const insert = `INSERT INTO task_events (task_id, org_id, status, state, progress, actor)
		SELECT id, org_id, status, state, 0, 'SYSTEM' FROM tasks WHERE id = $1 RETURNING id`
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var held, ahead int64
	require.NoError(t, tx.QueryRow(ctx, insert, theirs).Scan(&held))
	require.NoError(t, b.db.Pool.QueryRow(ctx, insert, theirs).Scan(&ahead))
	require.Greater(t, ahead, held)

	opened, _ := b.openStreamWith(t, "/v1/events/stream", "Authorization", "Bearer "+b.token,
		"Last-Event-ID", strconv.FormatInt(ahead, 10))
	require.Equal(t, http.StatusOK, opened.StatusCode)
}
