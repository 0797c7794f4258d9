package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// Two payloads that differ as JSON values are never merged into one task,
// whatever a 64-bit float would make of their numbers. Only the spellings
// the README lists (white space, key order, string escapes, trailing zeros
// of a fraction) are the same input.
func TestDedupeNeverMergesDifferentPayloads(t *testing.T) {
	t.Parallel()
	b := setup(t)
	submit := func(payload string) (int, string) {
		resp := b.post(t, "/v1/tasks", `{"type":"billing.charge","payload":`+payload+`}`)
		require.Contains(t, []int{http.StatusCreated, http.StatusOK}, resp.status, string(resp.body))
		return resp.status, resp.json(t)["id"].(string)
	}
	for _, pair := range [][2]string{
		{`{"account":9007199254740992}`, `{"account":9007199254740993}`},
		{`{"x":0.3}`, `{"x":0.30000000000000001}`},
		{`{"n":100}`, `{"n":1e2}`},
		{`{"big":123456789012345678901234567890}`, `{"big":123456789012345678901234567891}`},
	} {
		s1, id1 := submit(pair[0])
		s2, id2 := submit(pair[1])
		require.Equal(t, http.StatusCreated, s1, pair[0])
		require.Equal(t, http.StatusCreated, s2, "%s must not be merged with %s", pair[1], pair[0])
		require.NotEqual(t, id1, id2)
	}
	for _, pair := range [][2]string{
		{`{"amount":1}`, `{"amount":1.0}`},
		{`{"a":1,"b":"A"}`, `{ "b" : "\u0041", "a" : 1 }`},
	} {
		_, id1 := submit(pair[0])
		s2, id2 := submit(pair[1])
		require.Equal(t, http.StatusOK, s2, "%s is the same input as %s", pair[1], pair[0])
		require.Equal(t, id1, id2)
	}
}

// An Idempotency-Key is bound to the task its first request got and to that
// request: the same request with the key always gets the same answer, even
// when that task was found by its input; another request with the key is
// always a 422.
func TestIdempotencyKeyAnswersAlwaysTheSame(t *testing.T) {
	t.Parallel()
	b := setup(t)
	t0 := b.post(t, "/v1/tasks", `{"type":"t.k","payload":{"n":1}}`)
	require.Equal(t, http.StatusCreated, t0.status)
	id0 := t0.json(t)["id"]

	keyed := b.post(t, "/v1/tasks", `{"type":"t.k","payload":{"n":1}}`, "Idempotency-Key", "k1")
	require.Equal(t, http.StatusOK, keyed.status, string(keyed.body))
	require.Equal(t, id0, keyed.json(t)["id"])

	other := b.post(t, "/v1/tasks", `{"type":"t.k","payload":{"n":2}}`, "Idempotency-Key", "k1")
	require.Equal(t, http.StatusUnprocessableEntity, other.status, "the key is taken by the first request: %s", other.body)

	again := b.post(t, "/v1/tasks", `{"type":"t.k","payload":{"n":1}}`, "Idempotency-Key", "k1")
	require.Equal(t, http.StatusOK, again.status, string(again.body))
	require.Equal(t, id0, again.json(t)["id"])

	// The key covers the whole request, not only the payload.
	prio := b.post(t, "/v1/tasks", `{"type":"t.k","payload":{"n":1},"priority":9}`, "Idempotency-Key", "k1")
	require.Equal(t, http.StatusUnprocessableEntity, prio.status)
	require.Equal(t, [3]int{1, 1, 1}, b.counts(t))
}

// Concurrent requests with one key and different bodies: exactly one wins,
// and every request with the winner's body gets the winner's task.
func TestConcurrentKeyedSubmitsAgree(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 30
	var wg sync.WaitGroup
	statuses, ids := make([]int, n), make([]string, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp := b.post(t, "/v1/tasks", fmt.Sprintf(`{"type":"t.k","payload":{"v":%d}}`, i%2), "Idempotency-Key", "race")
			statuses[i] = resp.status
			if resp.status < 300 {
				ids[i] = resp.json(t)["id"].(string)
			}
		}()
	}
	wg.Wait()
	var winner string
	for i := range n {
		if statuses[i] < 300 {
			if winner == "" {
				winner = ids[i]
			}
			require.Equal(t, winner, ids[i])
		} else {
			require.Equal(t, http.StatusUnprocessableEntity, statuses[i])
		}
	}
	require.NotEmpty(t, winner)
	require.Equal(t, [3]int{1, 1, 1}, b.counts(t))
}

// Batches with overlapping inputs in opposite orders, sent at once, wait
// for each other instead of deadlocking: every one succeeds.
func TestOverlappingBatchesDoNotDeadlock(t *testing.T) {
	t.Parallel()
	b := setup(t)
	entries := func(reverse bool, round int) string {
		var parts []string
		for i := range 40 {
			j := i
			if reverse {
				j = 39 - i
			}
			parts = append(parts, fmt.Sprintf(`{"type":"t.batch","payload":{"round":%d,"i":%d},"idempotency_key":"r%d-%d"}`, round, j, round, j))
		}
		return `{"tasks":[` + strings.Join(parts, ",") + `]}`
	}
	for round := range 10 {
		var wg sync.WaitGroup
		statuses := make([]int, 4)
		for k := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp := b.post(t, "/v1/tasks/batch", entries(k%2 == 1, round))
				statuses[k] = resp.status
				if resp.status != http.StatusOK {
					t.Logf("round %d batch %d: %d %s", round, k, resp.status, resp.body)
				}
			}()
		}
		wg.Wait()
		require.Equal(t, []int{200, 200, 200, 200}, statuses, "round %d", round)
	}
	require.Equal(t, [3]int{400, 400, 400}, b.counts(t))
}

// A listing carries summaries: no payload, metadata or result, so a page
// of 500 large tasks stays small.
func TestListReturnsSummaries(t *testing.T) {
	t.Parallel()
	b := setup(t)
	big := strings.Repeat("x", 100<<10)
	for i := range 5 {
		resp := b.post(t, "/v1/tasks", fmt.Sprintf(`{"type":"t.big","payload":{"i":%d,"blob":%q},"metadata":{"blob":%q}}`, i, big, big))
		require.Equal(t, http.StatusCreated, resp.status)
	}
	list := b.get(t, "/v1/tasks?limit=500")
	require.Equal(t, http.StatusOK, list.status)
	require.Less(t, len(list.body), 10<<10, "5 summaries, not 1 MB of payloads")
	require.NotContains(t, string(list.body), `"payload"`)
	require.NotContains(t, string(list.body), `"metadata"`)
	tasks := list.json(t)["tasks"].([]any)
	require.Len(t, tasks, 5)
	id := tasks[0].(map[string]any)["id"].(string)
	require.Contains(t, string(b.get(t, "/v1/tasks/"+id).body), big, "the task's own GET has its payload")
	require.Equal(t, http.StatusUnprocessableEntity, b.get(t, "/v1/tasks?limit=501").status)
}

// A request stuck behind a lock answers 503 when its time is up instead of
// holding its connection and its database session.
func TestRequestTimeout(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *config.API) { c.RequestTimeout = 500 * time.Millisecond })
	// Under a loaded test run, the submit itself may run out of its half
	// second (and write nothing): it is asked again.
	var created response
	for range 20 {
		if created = b.post(t, "/v1/tasks", `{"type":"t.lock"}`); created.status != http.StatusServiceUnavailable {
			break
		}
	}
	// 200: a submit that timed out after its commit, found again by its input.
	require.Contains(t, []int{http.StatusCreated, http.StatusOK}, created.status, string(created.body))
	id := created.json(t)["id"].(string)
	ctx := context.Background()
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE`, id)
	require.NoError(t, err)

	resp := b.post(t, "/v1/tasks/"+id+"/cancel", "")
	require.Equal(t, http.StatusServiceUnavailable, resp.status, string(resp.body))
	require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"))
	require.NoError(t, tx.Rollback(ctx))
	var status string
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT status FROM tasks WHERE id = $1`, id).Scan(&status))
	require.Equal(t, "PENDING", status, "nothing was half-written")
	// With the lock gone the same request goes through. Under a loaded
	// test run (-race, two cores) half a second can pass without any lock,
	// and a timed-out request wrote nothing: it is asked again.
	require.Eventually(t, func() bool {
		return b.post(t, "/v1/tasks/"+id+"/cancel", "").status == http.StatusOK
	}, 10*time.Second, 50*time.Millisecond)
}

// A caller's trace context is not trusted by default: the task gets a trace
// of its own (linked to the caller's), and the caller's baggage goes
// nowhere. With API_TRUST_TRACE_CONTEXT the caller's trace is continued.
func TestClientTraceHeaders(t *testing.T) {
	t.Parallel()
	const callerTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	headers := []string{"traceparent", "00-" + callerTrace + "-00f067aa0ba902b7-01", "baggage", "user=secret,tenant=other"}
	for _, trust := range []bool{false, true} {
		b := setup(t, func(c *config.API) { c.TrustTraceContext = trust })
		resp := b.post(t, "/v1/tasks", `{"type":"t.trace"}`, headers...)
		require.Equal(t, http.StatusCreated, resp.status)
		got := resp.json(t)["trace_id"]
		if trust {
			require.Equal(t, callerTrace, got)
		} else {
			require.NotEqual(t, callerTrace, got)
			require.Len(t, got, 32)
		}
		var stored string
		require.NoError(t, b.db.Pool.QueryRow(context.Background(), `SELECT headers::text FROM outbox`).Scan(&stored))
		require.NotContains(t, stored, "baggage")
		require.NotContains(t, stored, "secret")
	}
}

// A task's trace_url leads to a trace Jaeger has: with nothing exported
// (no OTEL endpoint) the task keeps its trace_id, for logs, but gets no
// link to a trace never sent; with an exporter it does, and so does a
// caller's trace continued with its sampled flag. A trusted caller's trace
// that its own sampler dropped is recorded by no one: no link either.
func TestTraceURLOnlyForRecordedTraces(t *testing.T) {
	t.Parallel()
	const caller = "4bf92f3577b34da6a3ce929d0e0e4736"
	for _, c := range []struct {
		name        string
		export      bool
		traceparent string
		link        bool
	}{
		{name: "not exported", export: false},
		{name: "exported", export: true, link: true},
		{name: "caller sampled", export: true, traceparent: "00-" + caller + "-00f067aa0ba902b7-01", link: true},
		{name: "caller not sampled", export: true, traceparent: "00-" + caller + "-00f067aa0ba902b7-00"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, func(cfg *config.API) {
				cfg.TrustTraceContext = true
				if c.export {
					// Turns export on, as the variable does: spans are
					// sampled; whether their export succeeds does not
					// matter here.
					cfg.OTLPEndpoint = "http://" + testenv.FreeAddr(t)
				}
			})
			var headers []string
			if c.traceparent != "" {
				headers = []string{"traceparent", c.traceparent}
			}
			resp := b.post(t, "/v1/tasks", `{"type":"t.trace"}`, headers...)
			require.Equal(t, http.StatusCreated, resp.status, string(resp.body))
			created := resp.json(t)
			id := created["trace_id"].(string)
			require.Len(t, id, 32)
			got := b.get(t, "/v1/tasks/"+created["id"].(string)).json(t)
			for _, v := range []map[string]any{created, got} {
				if c.link {
					require.Equal(t, "http://jaeger.example:16686/trace/"+id, v["trace_url"])
				} else {
					require.NotContains(t, v, "trace_url")
				}
			}
		})
	}
}

// A batch whose entry reuses an idempotency key with another request is
// refused whole, and the problem names that entry's idempotency_key: a
// batch carries no Idempotency-Key header, so naming the header leaves the
// client to guess which of up to 1000 entries is at fault.
func TestBatchKeyMismatchNamesTheEntryAtFault(t *testing.T) {
	t.Parallel()
	b := setup(t)
	require.Equal(t, http.StatusCreated,
		b.post(t, "/v1/tasks", `{"type":"rv.k","payload":{"n":1}}`, "Idempotency-Key", "K").status)
	before := b.counts(t)

	for _, c := range []struct{ name, body, field string }{
		{"bound before", `{"tasks":[{"type":"rv.k","payload":{"n":2}},{"type":"rv.k","payload":{"n":3},"idempotency_key":"K"}]}`,
			"tasks[1].idempotency_key"},
		{"within the batch", `{"tasks":[{"type":"rv.k","payload":{"n":5},"idempotency_key":"Z"},{"type":"rv.k","payload":{"n":4}},` +
			`{"type":"rv.k","payload":{"n":6},"idempotency_key":"Z"}]}`, "tasks[2].idempotency_key"},
	} {
		resp := b.post(t, "/v1/tasks/batch", c.body)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", c.name, resp.body)
		require.Equal(t, c.field, resp.json(t)["field"], "%s: %s", c.name, resp.body)
		require.Equal(t, before, b.counts(t), c.name)
	}

	// The single submission still names its header.
	single := b.post(t, "/v1/tasks", `{"type":"rv.k","payload":{"n":7}}`, "Idempotency-Key", "K")
	require.Equal(t, http.StatusUnprocessableEntity, single.status, string(single.body))
	require.Equal(t, "Idempotency-Key", single.json(t)["field"])
}

// A duplicate submission answers the existing task as its GET does: a
// COMPLETED task with its result, whether found by its input, by its
// idempotency key, or in a batch.
func TestDuplicateOfACompletedTaskCarriesItsResult(t *testing.T) {
	t.Parallel()
	b := setup(t)
	first := b.post(t, "/v1/tasks", `{"type":"rv.r","payload":{"n":1}}`, "Idempotency-Key", "R")
	require.Equal(t, http.StatusCreated, first.status, string(first.body))
	id := first.json(t)["id"].(string)
	b.exec(t, `UPDATE tasks SET status = 'COMPLETED', state = 'Completed', progress = 100, attempt = 1,
		completed_at = now(), version = version + 1 WHERE id = $1`, id)
	b.exec(t, `INSERT INTO task_results (task_id, org_id, payload) SELECT id, org_id, '{"answer":42}' FROM tasks WHERE id = $1`, id)
	got := b.get(t, "/v1/tasks/"+id)
	require.Equal(t, map[string]any{"answer": float64(42)}, got.json(t)["result"], "the task's own GET has the result")

	byInput := b.post(t, "/v1/tasks", `{"type":"rv.r","payload":{"n":1}}`)
	require.Equal(t, http.StatusOK, byInput.status, string(byInput.body))
	require.Equal(t, id, byInput.json(t)["id"])
	require.Equal(t, map[string]any{"answer": float64(42)}, byInput.json(t)["result"], "found by its input")

	byKey := b.post(t, "/v1/tasks", `{"type":"rv.r","payload":{"n":1}}`, "Idempotency-Key", "R")
	require.Equal(t, http.StatusOK, byKey.status, string(byKey.body))
	require.Equal(t, map[string]any{"answer": float64(42)}, byKey.json(t)["result"], "found by its key")

	batch := b.post(t, "/v1/tasks/batch", `{"tasks":[{"type":"rv.r","payload":{"n":1}},{"type":"rv.r","payload":{"n":1},"idempotency_key":"R"}]}`)
	require.Equal(t, http.StatusOK, batch.status, string(batch.body))
	var out struct {
		Results []struct {
			Result string
			Task   map[string]any
		}
	}
	require.NoError(t, json.Unmarshal(batch.body, &out))
	for i, r := range out.Results {
		require.Equal(t, "duplicate", r.Result)
		require.Equal(t, map[string]any{"answer": float64(42)}, r.Task["result"], "batch entry %d", i)
	}
}

// A keyed request that leaves max_attempts out is the same request whatever
// default the instance answering it has: an operator changing
// TASK_DEFAULT_MAX_ATTEMPTS, or two instances of a rolling deploy that
// differ in it, must not turn a client's retry into a 422.
func TestIdempotencyKeyOutlivesAChangedDefaultMaxAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t)
	first := b.post(t, "/v1/tasks", `{"type":"rv.m","payload":{"n":1}}`, "Idempotency-Key", "M")
	require.Equal(t, http.StatusCreated, first.status, string(first.body))
	batch := b.post(t, "/v1/tasks/batch", `{"tasks":[{"type":"rv.m","payload":{"n":2},"idempotency_key":"B"}]}`)
	require.Equal(t, http.StatusOK, batch.status, string(batch.body))

	other := serve(t, b.db, func(c *config.API) { c.DefaultMaxAttempts = 5 })
	other.token = b.token
	again := other.post(t, "/v1/tasks", `{"type":"rv.m","payload":{"n":1}}`, "Idempotency-Key", "M")
	require.Equal(t, http.StatusOK, again.status, string(again.body))
	require.Equal(t, first.json(t)["id"], again.json(t)["id"])
	require.EqualValues(t, 3, again.json(t)["max_attempts"], "the task the key names, as it was made")
	againBatch := other.post(t, "/v1/tasks/batch", `{"tasks":[{"type":"rv.m","payload":{"n":2},"idempotency_key":"B"}]}`)
	require.Equal(t, http.StatusOK, againBatch.status, string(againBatch.body))
	require.Contains(t, string(againBatch.body), `"result":"duplicate"`)

	// Stating max_attempts is still part of the request.
	stated := other.post(t, "/v1/tasks", `{"type":"rv.m","payload":{"n":1},"max_attempts":7}`, "Idempotency-Key", "M")
	require.Equal(t, http.StatusUnprocessableEntity, stated.status, string(stated.body))

	// A key bound before, whose request was hashed with the default
	// filled in, still answers its request.
	sub, err := task.NewSubmission(task.SubmitInput{Type: "rv.m", Payload: json.RawMessage(`{"n":1}`), IdempotencyKey: "M"},
		task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	require.NotEqual(t, sub.RequestHash, sub.DefaultedRequestHash)
	b.exec(t, `UPDATE task_idempotency_keys SET request_hash = $1 WHERE key = 'M'`, sub.DefaultedRequestHash)
	old := b.post(t, "/v1/tasks", `{"type":"rv.m","payload":{"n":1}}`, "Idempotency-Key", "M")
	require.Equal(t, http.StatusOK, old.status, string(old.body))
	require.Equal(t, first.json(t)["id"], old.json(t)["id"])
}
