package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// These tests run the real api, relay and worker binaries against the real
// PostgreSQL (a database per test) and RabbitMQ (a vhost per test), and
// judge by what the database holds afterwards.

type bundle struct {
	dbURL   string
	pool    *pgxpool.Pool
	amqpURL string
	api     string
	// client calls the API with an admin key of the org "test".
	client *http.Client
}

// setup starts an api and a relay on a database and a vhost of the test's
// own, on the shared servers.
func setup(t *testing.T) *bundle {
	t.Helper()
	skipShort(t)
	t.Parallel()
	db := testdb.New(t)
	return setupWith(t, db.URL, db.Pool, testenv.NewVhost(t))
}

func skipShort(t *testing.T) {
	if testing.Short() {
		t.Skip("process-level worker test")
	}
}

// setupWith starts an api and a relay on the given servers; env is added to
// both.
func setupWith(t *testing.T, dbURL string, pool *pgxpool.Pool, amqpURL string, env ...string) *bundle {
	t.Helper()
	b := &bundle{dbURL: dbURL, pool: pool, amqpURL: amqpURL}
	apiAddr := testenv.FreeAddr(t)
	b.api = "http://" + apiAddr
	testenv.Start(t, "api", testenv.Binary(t, "./cmd/api"), append([]string{
		"DATABASE_URL=" + b.dbURL, "API_ADDR=" + apiAddr, "LOG_FORMAT=text", "LOG_LEVEL=warn"}, env...)...)
	testenv.Start(t, "relay", testenv.Binary(t, "./cmd/relay"), append([]string{
		"DATABASE_URL=" + b.dbURL, "AMQP_URL=" + b.amqpURL, "RELAY_ADMIN_ADDR=" + testenv.FreeAddr(t),
		"RELAY_POLL_INTERVAL=100ms", "RELAY_RECONNECT_BACKOFF_MAX=300ms", "LOG_FORMAT=text", "LOG_LEVEL=warn"}, env...)...)
	testenv.WaitHTTP(t, b.api+"/readyz", 30*time.Second)
	token, err := postgres.NewDirectory(pool).Bootstrap(context.Background(), testdb.TestOrg, "worker-tests")
	require.NoError(t, err)
	b.client = &http.Client{Timeout: 30 * time.Second, Transport: testenv.Bearer(token, nil)}
	return b
}

// startWorker starts a worker binary with short leases and intervals, so
// faults heal within seconds. env overrides the defaults.
func (b *bundle) startWorker(t *testing.T, id string, env ...string) *testenv.Process {
	t.Helper()
	base := []string{
		"DATABASE_URL=" + b.dbURL, "AMQP_URL=" + b.amqpURL, "WORKER_ADMIN_ADDR=" + testenv.FreeAddr(t),
		"WORKER_ID=" + id, "WORKER_CONCURRENCY=4", "LEASE_DURATION=3s", "HEARTBEAT_INTERVAL=500ms",
		"MAINTENANCE_INTERVAL=300ms", "LEADER_TTL=2s", "WORKER_DEAD_AFTER=3s",
		"RETRY_BACKOFF_BASE=200ms", "RETRY_BACKOFF_MAX=1s", "PROGRESS_MIN_INTERVAL=50ms",
		"SHUTDOWN_TIMEOUT=5s", "WORKER_RECONNECT_BACKOFF_MAX=300ms", "LOG_FORMAT=text",
	}
	return testenv.Start(t, id, testenv.Binary(t, "./cmd/worker"), append(base, env...)...)
}

// declare does what a starting worker does: it declares the queues of its
// types and releases the messages parked while they had none.
func (b *bundle) declare(t *testing.T, types ...string) {
	t.Helper()
	conn, err := amqp.Dial(b.amqpURL)
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, rabbitmq.DeclareExchanges(ch))
	for _, typ := range types {
		require.NoError(t, rabbitmq.DeclareTaskQueue(ch, typ))
	}
	require.NoError(t, postgres.NewWorkerStore(b.pool, nil).TypesReady(context.Background(), types))
}

// submit posts a task through the API and returns its id.
func (b *bundle) submit(t *testing.T, taskType string, payload map[string]any, maxAttempts int) uuid.UUID {
	t.Helper()
	body, err := json.Marshal(map[string]any{"type": taskType, "payload": payload, "max_attempts": maxAttempts, "dedupe": false})
	require.NoError(t, err)
	resp, err := b.client.Post(b.api+"/v1/tasks", "application/json", bytes.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	var out struct {
		ID uuid.UUID `json:"id"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&out))
	return out.ID
}

func (b *bundle) sleepTask(t *testing.T, steps, stepMS int) uuid.UUID {
	t.Helper()
	return b.submit(t, "demo.sleep", map[string]any{"steps": steps, "step_ms": stepMS}, 3)
}

func (b *bundle) cancel(t *testing.T, id uuid.UUID) int {
	t.Helper()
	resp, err := b.client.Post(b.api+"/v1/tasks/"+id.String()+"/cancel", "application/json", nil)
	require.NoError(t, err)
	resp.Body.Close()
	return resp.StatusCode
}

type taskRow struct {
	Status   string
	State    string
	Progress int
	Attempt  int
	WorkerID string
	Error    string
	Result   []byte
}

func (b *bundle) task(t *testing.T, id uuid.UUID) taskRow {
	t.Helper()
	var r taskRow
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT status, state, progress, attempt,
		coalesce(worker_id, ''), coalesce(error, ''), (SELECT payload FROM task_results WHERE task_id = id)
		FROM tasks WHERE id = $1`, id).Scan(&r.Status, &r.State, &r.Progress, &r.Attempt, &r.WorkerID, &r.Error, &r.Result))
	return r
}

func (b *bundle) waitStatus(t *testing.T, id uuid.UUID, status string, timeout time.Duration) taskRow {
	t.Helper()
	var r taskRow
	testenv.Eventually(t, timeout, func() error {
		if r = b.task(t, id); r.Status != status {
			return fmt.Errorf("task %s is %s (%s, %d%%), want %s", id, r.Status, r.State, r.Progress, status)
		}
		return nil
	})
	return r
}

type event struct {
	Status   string
	State    string
	Progress int
	Actor    string
	Detail   map[string]any
	At       time.Time
}

// events returns a task's history, oldest first.
func (b *bundle) events(t *testing.T, id uuid.UUID) []event {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT status, state, progress, actor, detail, created_at
		FROM task_events WHERE task_id = $1 ORDER BY id`, id)
	require.NoError(t, err)
	defer rows.Close()
	var out []event
	for rows.Next() {
		var e event
		require.NoError(t, rows.Scan(&e.Status, &e.State, &e.Progress, &e.Actor, &e.Detail, &e.At))
		out = append(out, e)
	}
	require.NoError(t, rows.Err())
	return out
}

// count returns how many of the task's events have the status and state.
func count(events []event, status, state string) int {
	n := 0
	for _, e := range events {
		if e.Status == status && (state == "" || e.State == state) {
			n++
		}
	}
	return n
}

// requireOneTerminal checks the task reached exactly one terminal state.
func (b *bundle) requireOneTerminal(t *testing.T, id uuid.UUID) []event {
	t.Helper()
	ev := b.events(t, id)
	terminal := count(ev, "COMPLETED", "") + count(ev, "FAILED", "") + count(ev, "CANCELLED", "")
	require.Equal(t, 1, terminal, "task %s must have exactly one terminal event: %+v", id, ev)
	return ev
}

func (b *bundle) waitUntil(t *testing.T, id uuid.UUID, desc string, cond func(taskRow) bool) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, func() error {
		if r := b.task(t, id); !cond(r) {
			return fmt.Errorf("task %s not yet %s: %+v", id, desc, r)
		}
		return nil
	})
}

// A worker told to declare its queues without priorities does so, and
// runs their tasks; the broker then refuses to declare the queue with
// priorities, as a worker at the default would: every worker of a type
// must agree.
func TestWorkerDeclaresQueuesWithoutPriorities(t *testing.T) {
	b := setup(t)
	b.startWorker(t, "w1", "AMQP_MAX_PRIORITY=0")
	id := b.submit(t, "demo.noop", nil, 1)
	b.waitStatus(t, id, "COMPLETED", 30*time.Second)

	conn, err := amqp.Dial(b.amqpURL)
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	for _, tt := range []struct {
		qs      rabbitmq.Queues
		refused bool
	}{{rabbitmq.Queues{Type: rabbitmq.Classic}, false}, {rabbitmq.ClassicQueues, true}} {
		ch, err := conn.Channel()
		require.NoError(t, err)
		err = rabbitmq.DeclareTaskQueueOf(ch, "demo.noop", tt.qs)
		if tt.refused {
			require.ErrorContains(t, err, "AMQP_MAX_PRIORITY")
			continue
		}
		require.NoError(t, err)
		_ = ch.Close()
	}
}

func TestWorkerRunsTaskReportingProgress(t *testing.T) {
	b := setup(t)
	b.startWorker(t, "w1")
	id := b.sleepTask(t, 10, 100)

	// Progress is visible through the API while the task runs.
	seen := map[int]bool{}
	testenv.Eventually(t, 30*time.Second, func() error {
		resp, err := b.client.Get(b.api + "/v1/tasks/" + id.String())
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		var v struct {
			Status   string `json:"status"`
			Progress int    `json:"progress"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
			return err
		}
		seen[v.Progress] = true
		if v.Status != "COMPLETED" {
			return fmt.Errorf("status %s at %d%%", v.Status, v.Progress)
		}
		return nil
	})
	require.GreaterOrEqual(t, len(seen), 3, "progress observed rising through the API: %v", seen)

	r := b.task(t, id)
	require.Equal(t, 100, r.Progress)
	require.Equal(t, 1, r.Attempt)
	var result struct {
		SleptMS int `json:"slept_ms"`
	}
	require.NoError(t, json.Unmarshal(r.Result, &result))
	require.GreaterOrEqual(t, result.SleptMS, 1000)

	ev := b.requireOneTerminal(t, id)
	require.Equal(t, "PENDING", ev[0].Status)
	require.Equal(t, "Running", ev[1].State)
	require.Equal(t, "COMPLETED", ev[len(ev)-1].Status)
	last := -1
	for _, e := range ev[1 : len(ev)-1] {
		require.Equal(t, "IN_PROGRESS", e.Status)
		require.GreaterOrEqual(t, e.Progress, last, "progress never goes back")
		last = e.Progress
	}
	require.Equal(t, 100, last, "the last report (Step 10/10) landed before completion")
}

func TestWorkerCancelStopsRunningTask(t *testing.T) {
	b := setup(t)
	// Heartbeats too rare to matter: the broadcast, or the handler's next
	// progress report (fenced by the cancel's version), stops it in time.
	b.startWorker(t, "w1", "HEARTBEAT_INTERVAL=15s", "LEASE_DURATION=60s", "WORKER_DEAD_AFTER=60s")
	id := b.sleepTask(t, 100, 100)
	b.waitUntil(t, id, "at step 3", func(r taskRow) bool { return r.Progress >= 3 })

	require.Equal(t, http.StatusAccepted, b.cancel(t, id))
	r := b.waitStatus(t, id, "CANCELLED", 3*time.Second)
	require.Less(t, r.Progress, 100)

	// The handler stopped: nothing more is written, now or later.
	before := b.events(t, id)
	time.Sleep(500 * time.Millisecond) // let a handler that did not stop write again
	ev := b.requireOneTerminal(t, id)
	require.Equal(t, before, ev)
	requested, cancelled := ev[len(ev)-2], ev[len(ev)-1]
	require.Equal(t, "Cancel requested", requested.State)
	require.Equal(t, "CANCELLED", cancelled.Status)
	require.Equal(t, "WORKER", cancelled.Actor)
	t.Logf("cancel request to CANCELLED: %s", cancelled.At.Sub(requested.At))
}

// A handler that reports nothing while it runs writes nothing a cancel
// could fence, and heartbeats are too rare to matter: only the cancel
// broadcast reaching the worker stops it in time.
func TestWorkerCancelBroadcastStopsAQuietHandler(t *testing.T) {
	b := setup(t)
	b.startWorker(t, "w1", "HEARTBEAT_INTERVAL=15s", "LEASE_DURATION=60s", "WORKER_DEAD_AFTER=60s")
	id := b.sleepTask(t, 2, 30_000)
	b.waitUntil(t, id, "running on w1", func(r taskRow) bool { return r.Status == "IN_PROGRESS" && r.WorkerID == "w1" })

	require.Equal(t, http.StatusAccepted, b.cancel(t, id))
	r := b.waitStatus(t, id, "CANCELLED", 3*time.Second)
	require.Zero(t, r.Progress, "stopped within its first step")
	ev := b.requireOneTerminal(t, id)
	require.Equal(t, "WORKER", ev[len(ev)-1].Actor)
}

func TestWorkerCancelWithoutBroadcastCaughtByLeaseRenewal(t *testing.T) {
	b := setup(t)
	b.startWorker(t, "w1")
	id := b.sleepTask(t, 100, 100)
	b.waitUntil(t, id, "running", func(r taskRow) bool { return r.Progress >= 3 })

	// A cancel whose broadcast was lost: the row says so, no message goes.
	_, err := b.pool.Exec(context.Background(), `UPDATE tasks SET cancel_requested_at = now(),
		version = version + 1 WHERE id = $1`, id)
	require.NoError(t, err)
	b.waitStatus(t, id, "CANCELLED", 10*time.Second)
	b.requireOneTerminal(t, id)
}

func TestWorkerCancelledWhilePendingNeverRuns(t *testing.T) {
	b := setup(t)
	b.declare(t, "demo.sleep") // a worker of the type ran before
	id := b.sleepTask(t, 1, 10)
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("demo.sleep"), 1, 30*time.Second)
	require.Equal(t, http.StatusOK, b.cancel(t, id))

	b.startWorker(t, "w1")
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("demo.sleep"), 0, 30*time.Second)
	// The message was consumed and dropped; the task stayed CANCELLED.
	r := b.task(t, id)
	require.Equal(t, "CANCELLED", r.Status)
	require.Equal(t, 0, r.Attempt)
	ev := b.requireOneTerminal(t, id)
	require.Zero(t, count(ev, "IN_PROGRESS", ""), "never ran: %+v", ev)
}

func TestWorkerRetriesWithBackoffThenCompletes(t *testing.T) {
	b := setup(t)
	b.startWorker(t, "w1")
	id := b.submit(t, "demo.sleep", map[string]any{"steps": 1, "step_ms": 10, "fail_times": 2}, 3)
	r := b.waitStatus(t, id, "COMPLETED", 30*time.Second)
	require.Equal(t, 3, r.Attempt)
	require.Empty(t, r.Error, "a completed task carries no error")

	ev := b.requireOneTerminal(t, id)
	require.Equal(t, 3, count(ev, "IN_PROGRESS", "Running"))
	require.Equal(t, 2, count(ev, "PENDING", "Retry scheduled"))
	// Each retry's backoff doubles (200ms, then 400ms, with equal jitter:
	// between half and all of it), and the retry waited it out before it
	// ran (the database keeps whole milliseconds of it).
	backoff := []time.Duration{200 * time.Millisecond, 400 * time.Millisecond}
	retry := 0
	for i, e := range ev {
		if e.State != "Retry scheduled" {
			continue
		}
		require.Contains(t, e.Detail["error"], "failing attempt")
		retryIn, err := time.ParseDuration(fmt.Sprint(e.Detail["retry_in"]))
		require.NoError(t, err, "retry %d: %+v", retry+1, e.Detail)
		require.GreaterOrEqual(t, retryIn, backoff[retry]/2, "retry %d's backoff", retry+1)
		require.LessOrEqual(t, retryIn, backoff[retry], "retry %d's backoff", retry+1)
		next := ev[i+1]
		require.Equal(t, "Running", next.State)
		require.GreaterOrEqual(t, next.At.Sub(e.At), retryIn.Truncate(time.Millisecond), "retry %d ran before its backoff", retry+1)
		retry++
	}
	require.Equal(t, 2, retry)
}

func TestWorkerFailsAfterMaxAttempts(t *testing.T) {
	b := setup(t)
	b.startWorker(t, "w1")
	id := b.submit(t, "demo.sleep", map[string]any{"steps": 1, "step_ms": 1, "fail_times": 99}, 2)
	r := b.waitStatus(t, id, "FAILED", 30*time.Second)
	require.Equal(t, 2, r.Attempt)
	require.Contains(t, r.Error, "failing attempt 2")
	ev := b.requireOneTerminal(t, id)
	require.Equal(t, 2, count(ev, "IN_PROGRESS", "Running"))

	// It stays FAILED: nothing retries it behind our back.
	time.Sleep(time.Second)
	require.Equal(t, "FAILED", b.task(t, id).Status)

	// The retry endpoint revives it; it fails again through both attempts.
	resp, err := b.client.Post(b.api+"/v1/tasks/"+id.String()+"/retry", "application/json", nil)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	testenv.Eventually(t, 30*time.Second, func() error {
		if n := count(b.events(t, id), "FAILED", ""); n != 2 {
			return fmt.Errorf("%d FAILED events", n)
		}
		return nil
	})
	require.Equal(t, 4, count(b.events(t, id), "IN_PROGRESS", "Running"))
}

func TestWorkerRunsDuplicateDeliveryOnce(t *testing.T) {
	b := setup(t)
	b.declare(t, "demo.sleep") // a worker of the type ran before
	id := b.sleepTask(t, 5, 50)
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("demo.sleep"), 1, 30*time.Second)
	// A second message for the same task, as a relay killed between
	// confirm and delete would publish (a pass of its own: not packed with
	// the first).
	_, err := b.pool.Exec(context.Background(), `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, priority)
		SELECT 'task.run', `+testdb.OrgSQL+`, id, type, 0, version, priority FROM tasks WHERE id = $1`, id)
	require.NoError(t, err)
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("demo.sleep"), 2, 30*time.Second)

	b.startWorker(t, "w1")
	b.startWorker(t, "w2")
	b.waitStatus(t, id, "COMPLETED", 30*time.Second)
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("demo.sleep"), 0, 30*time.Second)
	ev := b.requireOneTerminal(t, id)
	require.Equal(t, 1, count(ev, "IN_PROGRESS", "Running"), "one execution: %+v", ev)
	require.Equal(t, 1, b.task(t, id).Attempt)
}

// A duplicate message that arrives after its task completed (a relay
// killed between the broker's confirm and its delete publishes the row
// again, maybe long after) runs nothing: the task is finished once.
func TestWorkerDropsADuplicateDeliveredAfterCompletion(t *testing.T) {
	b := setup(t)
	admin := testenv.FreeAddr(t)
	b.startWorker(t, "w1", "WORKER_ADMIN_ADDR="+admin)
	id := b.sleepTask(t, 1, 10)
	b.waitStatus(t, id, "COMPLETED", 30*time.Second)
	dropped := droppedNotClaimable(t, admin)

	_, err := b.pool.Exec(context.Background(), `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, priority)
		SELECT 'task.run', `+testdb.OrgSQL+`, id, type, 0, 1, priority FROM tasks WHERE id = $1`, id)
	require.NoError(t, err)
	// Either the worker drops the delivery, or it runs the task again.
	testenv.Eventually(t, 30*time.Second, func() error {
		if n := count(b.events(t, id), "IN_PROGRESS", "Running"); n > 1 {
			return nil
		}
		if n := droppedNotClaimable(t, admin); n <= dropped {
			return fmt.Errorf("%v deliveries dropped as not claimable, as before the duplicate", n)
		}
		return nil
	})
	ev := b.requireOneTerminal(t, id)
	require.Equal(t, 1, count(ev, "IN_PROGRESS", "Running"), "one execution: %+v", ev)
	require.Equal(t, 1, b.task(t, id).Attempt)
}

// droppedNotClaimable reads the worker's count of deliveries it acked
// without running because their task was not claimable.
func droppedNotClaimable(t *testing.T, admin string) float64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+admin+"/metrics", nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	metrics, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	for line := range strings.SplitSeq(string(metrics), "\n") {
		if value, ok := strings.CutPrefix(line, `conveyor_worker_deliveries_dropped_total{reason="not_claimable"} `); ok {
			n, err := strconv.ParseFloat(value, 64)
			require.NoError(t, err)
			return n
		}
	}
	return 0
}

func TestWorkerRecoversTasksOfPurgedQueue(t *testing.T) {
	b := setup(t)
	b.declare(t, "demo.sleep") // a worker of the type ran before
	var ids []uuid.UUID
	for range 5 {
		ids = append(ids, b.sleepTask(t, 1, 10))
	}
	// Once every task is published (the relay may have packed some into
	// one message), the broker loses their messages.
	testenv.Eventually(t, 30*time.Second, func() error {
		var n int
		if err := b.pool.QueryRow(context.Background(), `SELECT count(*) FROM tasks WHERE id = ANY($1) AND published_at IS NOT NULL`,
			ids).Scan(&n); err != nil {
			return err
		}
		if n < len(ids) {
			return fmt.Errorf("%d of %d tasks published", n, len(ids))
		}
		return nil
	})
	purged := testenv.PurgeQueue(t, b.amqpURL, rabbitmq.QueueName("demo.sleep")) +
		testenv.PurgeQueue(t, b.amqpURL, rabbitmq.PackedQueueName("demo.sleep"))
	require.Positive(t, purged)

	b.startWorker(t, "w1", "REPUBLISH_AFTER=1s")
	for _, id := range ids {
		b.waitStatus(t, id, "COMPLETED", 30*time.Second)
		ev := b.requireOneTerminal(t, id)
		require.Equal(t, 1, count(ev, "PENDING", "Queued")-1, "republished once by maintenance: %+v", ev)
	}
}

func TestWorkerSIGKILLMidTaskFinishedElsewhere(t *testing.T) {
	b := setup(t)
	w1 := b.startWorker(t, "w1")
	id := b.sleepTask(t, 30, 100)
	b.waitUntil(t, id, "running on w1", func(r taskRow) bool { return r.WorkerID == "w1" && r.Progress >= 10 })
	w1.Signal(syscall.SIGKILL)
	w1.Wait(t, 10*time.Second)

	b.startWorker(t, "w2")
	r := b.waitStatus(t, id, "COMPLETED", 60*time.Second)
	require.Equal(t, "w2", r.WorkerID)
	require.Equal(t, 2, r.Attempt)
	ev := b.requireOneTerminal(t, id)
	require.Equal(t, 2, count(ev, "IN_PROGRESS", "Running"))
	require.Equal(t, 1, count(ev, "PENDING", "Queued")-1, "the expired lease sent it back once: %+v", ev)
}

// A worker frozen past its lease (a stopped process, a VM paused) whose
// task another worker took over cannot write to the task when it wakes,
// while the other still runs it: its writes are fenced by the version the
// takeover moved on, so the task is finished once, by the attempt that
// holds it.
func TestWorkerFrozenPastItsLeaseCannotFinishTheTakenOverTask(t *testing.T) {
	b := setup(t)
	w1 := b.startWorker(t, "w1")
	id := b.sleepTask(t, 8, 1000)
	b.waitUntil(t, id, "running on w1", func(r taskRow) bool { return r.WorkerID == "w1" && r.Progress > 0 })
	w1.Signal(syscall.SIGSTOP)
	defer w1.Signal(syscall.SIGCONT)

	b.startWorker(t, "w2")
	b.waitUntil(t, id, "taken over by w2", func(r taskRow) bool {
		return r.Status == "IN_PROGRESS" && r.WorkerID == "w2" && r.Attempt == 2
	})
	// w1 wakes up ahead of w2 in the task's steps: unfenced, it would
	// finish the task first.
	w1.Signal(syscall.SIGCONT)
	r := b.waitStatus(t, id, "COMPLETED", 60*time.Second)
	require.Equal(t, "w2", r.WorkerID)
	require.Equal(t, 2, r.Attempt)
	ev := b.requireOneTerminal(t, id)
	require.EqualValues(t, 2, ev[len(ev)-1].Detail["attempt"], "finished by the attempt holding the task: %+v", ev)
	require.Equal(t, 2, count(ev, "IN_PROGRESS", "Running"))
}

func TestWorkerMaintenanceMovesToAnotherLeader(t *testing.T) {
	b := setup(t)
	w1 := b.startWorker(t, "w1")
	b.waitLeader(t, "w1")
	b.startWorker(t, "w2")
	w1.Signal(syscall.SIGKILL)
	w1.Wait(t, 10*time.Second)
	b.waitLeader(t, "w2")

	// A task left running by the dead worker is recovered by the new leader.
	id := uuid.Must(uuid.NewV7())
	_, err := b.pool.Exec(context.Background(), `INSERT INTO tasks (id, org_id, type, status, state, attempt, worker_id,
		lease_expires_at, started_at) VALUES ($1, `+testdb.OrgSQL+`, 'demo.noop', 'IN_PROGRESS', 'Running', 1, 'w1', now() - interval '1 second', now())`, id)
	require.NoError(t, err)
	r := b.waitStatus(t, id, "COMPLETED", 30*time.Second)
	require.Equal(t, "w2", r.WorkerID)
	b.requireOneTerminal(t, id)
	// The dead worker left the registry.
	testenv.Eventually(t, 30*time.Second, func() error {
		var ids []string
		require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT array_agg(id ORDER BY id) FROM workers`).Scan(&ids))
		if strings.Join(ids, ",") != "w2" {
			return fmt.Errorf("registry holds %v", ids)
		}
		return nil
	})
}

func (b *bundle) waitLeader(t *testing.T, id string) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, func() error {
		var leader string
		err := b.pool.QueryRow(context.Background(), `SELECT leader_id FROM leaders
			WHERE name = 'maintenance' AND expires_at > now()`).Scan(&leader)
		if err != nil || leader != id {
			return fmt.Errorf("leader %q, want %s: %w", leader, id, err)
		}
		return nil
	})
}

func TestWorkerSIGTERMFinishesOrHandsBack(t *testing.T) {
	b := setup(t)
	w1 := b.startWorker(t, "w1", "SHUTDOWN_TIMEOUT=1500ms")
	short := []uuid.UUID{b.sleepTask(t, 5, 100), b.sleepTask(t, 6, 100)}
	long := []uuid.UUID{b.sleepTask(t, 100, 100), b.sleepTask(t, 101, 100)}
	for _, id := range append(append([]uuid.UUID{}, short...), long...) {
		b.waitUntil(t, id, "running", func(r taskRow) bool { return r.Status == "IN_PROGRESS" })
	}
	w1.Signal(syscall.SIGTERM)
	require.Equal(t, 0, w1.Wait(t, 20*time.Second), "a graceful stop exits 0")

	for _, id := range short {
		require.Equal(t, "COMPLETED", b.task(t, id).Status, "short tasks finish within the grace period")
	}
	for _, id := range long {
		r := b.task(t, id)
		require.Equal(t, "PENDING", r.Status, "long tasks are handed back")
		require.Equal(t, 0, r.Attempt, "a handed-back task keeps its attempts")
	}
	var registered int
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT count(*) FROM workers`).Scan(&registered))
	require.Zero(t, registered, "the worker left the registry")

	b.startWorker(t, "w2", "PROGRESS_MIN_INTERVAL=1s")
	for _, id := range long {
		r := b.waitStatus(t, id, "COMPLETED", 60*time.Second)
		require.Equal(t, "w2", r.WorkerID)
		ev := b.requireOneTerminal(t, id)
		require.Equal(t, 2, count(ev, "IN_PROGRESS", "Running"))
	}
}

// Tasks packed into one message behind a long one do not wait for it: two
// workers of one slot each, and one packed message of a long task and
// four short ones, in that order. The worker that gets it runs the long
// task; once its handler runs long it gives the message back whole, and
// the short tasks complete on the other worker while the long one runs.
func TestPackedTasksDoNotWaitBehindALongOne(t *testing.T) {
	skipShort(t)
	t.Parallel()
	db := testdb.New(t)
	// One lane: one pass over the outbox takes the five rows together.
	b := setupWith(t, db.URL, db.Pool, testenv.NewVhost(t), "RELAY_LANES=1")
	b.declare(t, "demo.sleep") // a worker of the type ran before
	sleep := func(steps, stepMS int) map[string]any {
		return map[string]any{"type": "demo.sleep", "payload": map[string]any{"steps": steps, "step_ms": stepMS},
			"dedupe": false, "delay": "1h"}
	}
	entries := []map[string]any{sleep(40, 250)}
	for range 4 {
		entries = append(entries, sleep(1, 10))
	}
	ids := b.postBatch(t, entries)
	// Due now, and their messages written again in the batch's order (the
	// submission writes them in whatever order its join yields), so that
	// the long task leads the packed message.
	_, err := b.pool.Exec(context.Background(), `UPDATE tasks SET next_run_at = now() WHERE id = ANY($1)`, ids)
	require.NoError(t, err)
	_, err = b.pool.Exec(context.Background(), `WITH gone AS (DELETE FROM outbox WHERE task_id = ANY($1) RETURNING *)
		INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, priority, headers, available_at)
		SELECT g.kind, g.org_id, g.task_id, g.task_type, g.attempt, g.task_version, g.priority, g.headers, now()
		FROM gone g JOIN unnest($1::uuid[]) WITH ORDINALITY AS o(id, n) ON o.id = g.task_id ORDER BY o.n`, ids)
	require.NoError(t, err)
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.PackedQueueName("demo.sleep"), 1, 30*time.Second)
	require.Zero(t, testenv.QueueDepth(t, b.amqpURL, rabbitmq.QueueName("demo.sleep")))

	for i := range 2 {
		b.startWorker(t, fmt.Sprintf("w%d", i+1), "WORKER_CONCURRENCY=1")
	}
	for _, id := range ids[1:] {
		b.waitStatus(t, id, "COMPLETED", 30*time.Second)
		b.requireOneTerminal(t, id)
	}
	require.Equal(t, "IN_PROGRESS", b.task(t, ids[0]).Status, "the short tasks did not wait for the long one")
}

// A worker running a long task of a packed message keeps taking packed
// messages for its other slots: the message was settled once its tasks
// were claimed, so the long one holds none of the packed queue's credit
// (one message here), and the packed queues are paused only while every
// slot runs long.
func TestPackedTasksKeepFlowingBesideALongOne(t *testing.T) {
	skipShort(t)
	t.Parallel()
	db := testdb.New(t)
	b := setupWith(t, db.URL, db.Pool, testenv.NewVhost(t), "RELAY_LANES=1")
	b.declare(t, "demo.sleep")
	b.startWorker(t, "w1", "WORKER_CONCURRENCY=4")
	sleep := func(steps, stepMS int) map[string]any {
		return map[string]any{"type": "demo.sleep", "payload": map[string]any{"steps": steps, "step_ms": stepMS},
			"dedupe": false}
	}
	first := b.postBatch(t, []map[string]any{sleep(40, 250), sleep(1, 10), sleep(1, 10), sleep(1, 10)})
	for _, id := range first[1:] {
		b.waitStatus(t, id, "COMPLETED", 30*time.Second)
	}
	// Running long: more than a second in.
	b.waitUntil(t, first[0], "running long", func(r taskRow) bool { return r.Progress >= 5 })

	var second []map[string]any
	for range 8 {
		second = append(second, sleep(1, 10))
	}
	for _, id := range b.postBatch(t, second) {
		b.waitStatus(t, id, "COMPLETED", 30*time.Second)
		b.requireOneTerminal(t, id)
	}
	require.Equal(t, "IN_PROGRESS", b.task(t, first[0]).Status, "the short tasks did not wait for the long one")
}

// A message never waits behind a long handler while another worker is
// free: two workers of one slot each, one busy with a long task; a short
// task submitted meanwhile completes on the other while the long one runs.
func TestWorkerShortTaskDoesNotWaitBehindALongOne(t *testing.T) {
	b := setup(t)
	admins := []string{testenv.FreeAddr(t), testenv.FreeAddr(t)}
	for i, admin := range admins {
		b.startWorker(t, fmt.Sprintf("w%d", i+1), "WORKER_CONCURRENCY=1", "WORKER_ADMIN_ADDR="+admin)
		testenv.WaitHTTP(t, "http://"+admin+"/readyz", 30*time.Second)
	}
	long := b.sleepTask(t, 40, 250)
	b.waitUntil(t, long, "running", func(r taskRow) bool { return r.Progress >= 5 })
	for i := range 4 {
		short := b.sleepTask(t, 1, 10+i)
		b.waitStatus(t, short, "COMPLETED", 30*time.Second)
		require.NotEqual(t, b.task(t, long).WorkerID, b.task(t, short).WorkerID)
	}
	require.Equal(t, "IN_PROGRESS", b.task(t, long).Status, "the short tasks did not wait for the long one")
}

// A worker that cannot declare its queues (one of its types' queues
// exists with other arguments) is registered with its types all the same:
// the messages parked for its other types must stay parked, not be
// published again at every maintenance pass.
func TestParkedMessagesStayParkedWhileTheirWorkerCannotDeclare(t *testing.T) {
	b := setup(t)
	b.declare(t, "demo.fanout") // classic, as a worker at the default declares
	w := b.startWorker(t, "w1", "AMQP_QUEUE_TYPE=quorum")
	testenv.Eventually(t, 30*time.Second, func() error {
		if !strings.Contains(w.Output(), "AMQP_QUEUE_TYPE") {
			return fmt.Errorf("no hint yet")
		}
		return nil
	})
	id := b.submit(t, "demo.noop", nil, 1)
	time.Sleep(5 * time.Second)
	var attempts int
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT attempts FROM outbox WHERE task_id = $1`, id).Scan(&attempts))
	require.LessOrEqual(t, attempts, 2, "the parked message was published %d times", attempts)
}
