package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// lockedBuffer is a log sink safe for the API's writes and the test's
// reads at once.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// A client that leaves while its request waits on the database is no
// failure of the server: the request is recorded as nginx's 499 (client
// closed request), not as a 500, and logged below ERROR.
func TestAClientThatLeavesIsNoServerError(t *testing.T) {
	t.Parallel()
	var cfg config.API
	b := setup(t, capture(&cfg))
	var logs lockedBuffer
	api := b.another(t, cfg, &logs)
	id := b.post(t, "/v1/tasks", `{"type":"demo.noop"}`).json(t)["id"].(string)

	// Hold the task's row, so that its cancel waits on the lock.
	ctx := context.Background()
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE`, id)
	require.NoError(t, err)

	reqCtx, leave := context.WithCancel(ctx)
	req, err := http.NewRequestWithContext(reqCtx, http.MethodPost, api.base+"/v1/tasks/"+id+"/cancel", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+b.token)
	done := make(chan error, 1)
	go func() {
		resp, err := api.client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	waitForALockWait(t, b)
	leave()
	require.ErrorIs(t, <-done, context.Canceled)

	series := func(code string) string {
		return `conveyor_http_request_duration_seconds_count{code="` + code + `",method="POST",route="/v1/tasks/{id}/cancel"}`
	}
	testenv.Eventually(t, 10*time.Second, func() error {
		m := string(api.get(t, "/metrics").body)
		if metricValue(m, series("499")) == "" && metricValue(m, series("500")) == "" && metricValue(m, series("503")) == "" {
			return fmt.Errorf("the request is not recorded yet")
		}
		return nil
	})
	m := string(api.get(t, "/metrics").body)
	require.Equal(t, "1", metricValue(m, series("499")), "%s", m)
	require.Empty(t, metricValue(m, series("500")))
	require.Empty(t, metricValue(m, series("503")))
	require.NotContains(t, logs.String(), `"level":"ERROR"`)
}

// Nor is a client that leaves while its key is looked up a failed
// authentication: nothing is counted as a lookup error, nor logged as one.
func TestAClientThatLeavesDuringAuthenticationIsNoLookupFailure(t *testing.T) {
	t.Parallel()
	var cfg config.API
	b := setup(t, capture(&cfg))
	var logs lockedBuffer
	api := b.another(t, cfg, &logs)
	key, _ := b.db.Key(t, "test", auth.Reader) // never looked up: not cached

	// Hold every read of the keys, so that the lookup waits.
	ctx := context.Background()
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)

	reqCtx, leave := context.WithCancel(ctx)
	req, err := http.NewRequestWithContext(reqCtx, http.MethodGet, api.base+"/v1/whoami", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+key)
	done := make(chan error, 1)
	go func() {
		resp, err := api.client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	waitForALockWait(t, b)
	leave()
	require.ErrorIs(t, <-done, context.Canceled)

	series := `conveyor_http_request_duration_seconds_count{code="499",method="GET",route="/v1/*"}`
	testenv.Eventually(t, 10*time.Second, func() error {
		if metricValue(string(api.get(t, "/metrics").body), series) == "" {
			return fmt.Errorf("the request is not recorded as 499 yet")
		}
		return nil
	})
	require.NoError(t, tx.Rollback(ctx))
	m := string(api.get(t, "/metrics").body)
	require.Empty(t, metricValue(m, `conveyor_auth_failures_total{reason="lookup_error"}`), "%s", m)
	require.NotContains(t, logs.String(), `"level":"ERROR"`)
}

// waitForALockWait waits until a statement of b's database waits on a
// lock.
func waitForALockWait(t *testing.T, b *testBundle) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, func() error {
		var waiting int
		if err := b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting); err != nil {
			return err
		}
		if waiting == 0 {
			return fmt.Errorf("no statement waits on a lock yet")
		}
		return nil
	})
}

// An API key's expires_at that is no time is refused as run_at is: a 422
// naming the field, not a 400 "malformed JSON".
func TestKeyExpiryThatIsNoTimeNamesItsField(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, v := range []string{`"tomorrow"`, `"2026-13-01T00:00:00Z"`, `42`} {
		resp := b.post(t, "/v1/keys", `{"name":"k","role":"reader","expires_at":`+v+`}`)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", v, resp.body)
		require.Equal(t, "expires_at", resp.json(t)["field"], v)
	}
}

// HEAD is answered wherever GET is (RFC 9110 9.3.2): the GET's status and
// headers, without a body.
func TestHeadIsAnsweredWhereGetIs(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.post(t, "/v1/tasks", `{"type":"demo.noop"}`).json(t)["id"].(string)
	for _, path := range []string{"/healthz", "/readyz", "/v1/tasks/" + id, "/v1/tasks?limit=1", "/openapi.yaml", "/metrics"} {
		get := b.get(t, path)
		head := b.do(t, http.MethodHead, path, "", "")
		require.Equal(t, get.status, head.status, "HEAD %s: %s", path, head.body)
		require.Equal(t, get.header.Get("Content-Type"), head.header.Get("Content-Type"), path)
		require.Empty(t, head.body, path)
	}
	require.Equal(t, http.StatusNotFound, b.do(t, http.MethodHead, "/v1/tasks/"+strings.Repeat("0", 8)+"-0000-0000-0000-000000000000", "", "").status)
	require.Equal(t, http.StatusBadRequest, b.do(t, http.MethodHead, "/v1/tasks?limt=1", "", "").status,
		"a HEAD's query is checked as its GET's")
	// A method the path is not served with still names HEAD among those
	// it is.
	put := b.do(t, http.MethodPut, "/healthz", "", "")
	require.Equal(t, http.StatusMethodNotAllowed, put.status)
	require.Equal(t, "GET, HEAD", put.header.Get("Allow"))
}

// A dataset name no node could declare is refused, as a workflow's nodes
// are, rather than answered as a dataset nothing declares.
func TestLineageRefusesANameNoDatasetHas(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, name := range []string{"-dash", "has%20space", strings.Repeat("a", 300), "%C3%A9t%C3%A9"} {
		resp := b.get(t, "/v1/lineage?dataset="+name)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", name, resp.body)
		require.Equal(t, "dataset", resp.json(t)["field"])
	}
	require.Equal(t, http.StatusOK, b.get(t, "/v1/lineage?dataset=a.b/c:d-e_f").status)
}

// A header that must hold one value and is given twice is refused, as a
// query parameter given twice is: the request is ambiguous.
func TestIdempotencyKeyGivenTwiceIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	send := func(keys ...string) response {
		req, err := http.NewRequest(http.MethodPost, b.base+"/v1/tasks", strings.NewReader(`{"type":"demo.noop"}`))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+b.token)
		req.Header["Idempotency-Key"] = keys
		resp, err := b.client.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return response{status: resp.StatusCode, header: resp.Header, body: body}
	}
	before := b.counts(t)
	twice := send("k1", "k2")
	require.Equal(t, http.StatusBadRequest, twice.status, string(twice.body))
	require.Contains(t, twice.json(t)["detail"], "Idempotency-Key")
	require.Equal(t, http.StatusBadRequest, send("k1", "k1").status, "the same value twice is still two")
	require.Equal(t, before, b.counts(t), "a refused submission writes nothing")
	require.Equal(t, http.StatusCreated, send("k1").status)

	// So is a stream's Last-Event-ID.
	req, err := http.NewRequest(http.MethodGet, b.base+"/v1/events/stream", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+b.token)
	req.Header["Last-Event-Id"] = []string{"1", "2"}
	resp, err := b.client.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
}

// A keyed retry of a submission that made its task gets that task back
// even when its type no longer counts as waiting and the org is at its
// bound of unserved types: it makes no task, so takes no place. So does an
// identical submission that deduplication answers.
func TestARetryThatMakesNoTaskPassesTheUnservedTypeBound(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *config.API) { c.MaxUnservedTypes = 1 })
	first := b.post(t, "/v1/tasks", `{"type":"typo.one"}`, "Idempotency-Key", "k1")
	require.Equal(t, http.StatusCreated, first.status, string(first.body))
	id := first.json(t)["id"].(string)
	// Its only task is no longer PENDING: typo.one takes no place now.
	require.Equal(t, http.StatusOK, b.post(t, "/v1/tasks/"+id+"/cancel", ``).status)
	require.Equal(t, http.StatusCreated, b.post(t, "/v1/tasks", `{"type":"typo.two"}`).status)

	again := b.post(t, "/v1/tasks", `{"type":"typo.one"}`, "Idempotency-Key", "k1")
	require.Equal(t, http.StatusOK, again.status, string(again.body))
	require.Equal(t, id, again.json(t)["id"])
	dup := b.post(t, "/v1/tasks", `{"type":"typo.one"}`)
	require.Equal(t, http.StatusOK, dup.status, string(dup.body))
	require.Equal(t, id, dup.json(t)["id"])
	batch := b.post(t, "/v1/tasks/batch", `{"tasks":[{"type":"typo.one","idempotency_key":"k1"}]}`)
	require.Equal(t, http.StatusOK, batch.status, string(batch.body))

	// A submission that would make a task of typo.one is still refused.
	before := b.counts(t)
	fresh := b.post(t, "/v1/tasks", `{"type":"typo.one","payload":{"n":2}}`)
	require.Equal(t, http.StatusUnprocessableEntity, fresh.status, string(fresh.body))
	require.Equal(t, before, b.counts(t))
}

// An org over its bound of unserved types (the bound was lowered) may
// still submit tasks of the types it has waiting: they take no new place.
func TestALoweredUnservedTypeBoundStillTakesWaitingTypes(t *testing.T) {
	t.Parallel()
	var cfg config.API
	b := setup(t, func(c *config.API) { c.MaxUnservedTypes = 2 }, capture(&cfg))
	require.Equal(t, http.StatusCreated, b.post(t, "/v1/tasks", `{"type":"typo.one"}`).status)
	require.Equal(t, http.StatusCreated, b.post(t, "/v1/tasks", `{"type":"typo.two"}`).status)

	cfg.MaxUnservedTypes = 1
	lowered := b.another(t, cfg, io.Discard)
	more := lowered.post(t, "/v1/tasks", `{"type":"typo.one","payload":{"n":2}}`)
	require.Equal(t, http.StatusCreated, more.status, string(more.body))
	refused := lowered.post(t, "/v1/tasks", `{"type":"typo.three"}`)
	require.Equal(t, http.StatusUnprocessableEntity, refused.status, string(refused.body))
}

// Runs listed by a workflow name no workflow can have are refused, as the
// other names are (a task type filter, GET /v1/workflows/{name}), rather
// than answered with no runs; a valid name lists its runs, if any, even
// of a workflow since removed.
func TestRunsOfANameNoWorkflowHasAreRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	filter := b.get(t, "/v1/runs?workflow=-bad")
	require.Equal(t, http.StatusUnprocessableEntity, filter.status, string(filter.body))
	require.Equal(t, "workflow", filter.json(t)["field"])
	path := b.get(t, "/v1/workflows/-bad/runs")
	require.Equal(t, http.StatusNotFound, path.status, string(path.body))
	require.Contains(t, path.json(t)["detail"], "workflow")
	require.Equal(t, http.StatusOK, b.get(t, "/v1/runs?workflow=gone").status)
	require.Equal(t, http.StatusOK, b.get(t, "/v1/workflows/gone/runs").status)
	limit := b.get(t, "/v1/runs?limit=201")
	require.Equal(t, http.StatusUnprocessableEntity, limit.status)
	require.Contains(t, limit.json(t)["detail"], `got "201"`)
}

// A route that makes something each call and honours no Idempotency-Key
// refuses one, as a batch does, rather than ignore it: a client retrying
// with it would believe its retries safe while each made another task or
// run.
func TestRoutesThatTakeNoIdempotencyKeyRefuseOne(t *testing.T) {
	t.Parallel()
	b := setup(t)
	require.Equal(t, http.StatusOK, b.apply(t, "", "application/yaml", diamondJobs).status)
	before := b.counts(t)
	for _, path := range []string{"/v1/jobs/a/trigger", "/v1/workflows/diamond/runs"} {
		resp := b.post(t, path, ``, "Idempotency-Key", "k1")
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", path, resp.body)
		require.Equal(t, "Idempotency-Key", resp.json(t)["field"], path)
	}
	require.Equal(t, before, b.counts(t), "nothing was made")
	require.Equal(t, http.StatusCreated, b.post(t, "/v1/jobs/a/trigger", ``).status)
}

// HEAD on a live stream answers the stream's headers and ends: it opens no
// stream that would hold a slot, and the connection, with nothing to send.
func TestHeadOnAStreamOpensNone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.post(t, "/v1/tasks", `{"type":"demo.noop"}`).json(t)["id"].(string)
	for _, path := range []string{"/v1/events/stream", "/v1/tasks/" + id + "/stream"} {
		head := b.do(t, http.MethodHead, path, "", "")
		require.Equal(t, http.StatusOK, head.status, path)
		require.Equal(t, "text/event-stream", head.header.Get("Content-Type"), path)
	}
	testenv.Eventually(t, 5*time.Second, func() error {
		if n := metricValue(string(b.get(t, "/metrics").body), "conveyor_stream_subscribers"); n != "0" {
			return fmt.Errorf("%s streams open", n)
		}
		return nil
	})
}
