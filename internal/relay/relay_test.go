package relay_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	oteltrace "go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/relay"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/telemetry"
	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

type testBundle struct {
	db      *testdb.DB
	amqpURL string
	tasks   *postgres.APIStore
	// admin is an admin of the org testdb.TestOrg, the API's caller.
	admin auth.Principal
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	db := testdb.New(t)
	admin := auth.Principal{Kind: auth.KindDev, OrgID: db.Org(t, testdb.TestOrg), OrgSlug: testdb.TestOrg, Role: auth.Admin}
	return &testBundle{db: db, amqpURL: testenv.NewVhost(t), tasks: postgres.NewAPIStore(db.Pool, nil), admin: admin}
}

// declare does what a starting worker does for its types: it declares their
// queues and releases the messages parked for want of them.
func (b *testBundle) declare(t *testing.T, types ...string) {
	t.Helper()
	require.NoError(t, b.startWorker(types...))
}

// startWorker is declare for a goroutine other than the test's.
func (b *testBundle) startWorker(types ...string) error {
	conn, err := amqp.Dial(b.amqpURL)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := rabbitmq.DeclareExchanges(ch); err != nil {
		return err
	}
	for _, typ := range types {
		if err := rabbitmq.DeclareTaskQueue(ch, typ); err != nil {
			return err
		}
	}
	return postgres.NewWorkerStore(b.db.Pool, nil).TypesReady(context.Background(), types)
}

type relayOpts struct {
	batchSize    int
	pollInterval time.Duration
	listen       bool
	lanes        int
	// wrap, when set, wraps each lane's publisher.
	wrap func(relay.Publisher) relay.Publisher
	// pack is the most tasks a message carries (1 when unset).
	pack int
	// tp, when set, traces the relay.
	tp *sdktrace.TracerProvider
	// reg, when set, holds the relay's metrics.
	reg *prometheus.Registry
	// logs, when set, takes the relay's JSON log.
	logs io.Writer
	// store, when set, wraps the relay's store.
	store func(relay.Store) relay.Store
}

// startRelay runs a relay (and its NOTIFY listener) until the test ends.
func (b *testBundle) startRelay(t *testing.T, o relayOpts) *relay.Relay {
	t.Helper()
	if o.batchSize == 0 {
		o.batchSize = 100
	}
	if o.pollInterval == 0 {
		o.pollInterval = 50 * time.Millisecond
	}
	if o.pack == 0 {
		o.pack = 1
	}
	if o.tp == nil {
		o.tp = sdktrace.NewTracerProvider()
	}
	if o.reg == nil {
		o.reg = prometheus.NewRegistry()
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if o.logs != nil {
		log = telemetry.NewLogger(o.logs, "info", "json")
	}
	var store relay.Store = postgres.NewRelayStore(b.db.Pool, 50*time.Millisecond, time.Second)
	if o.store != nil {
		store = o.store(store)
	}
	r := relay.New(relay.Config{
		BatchSize: o.batchSize, PollInterval: o.pollInterval, Lanes: o.lanes,
		ConfirmTimeout: 5 * time.Second, ReconnectBackoffMax: 200 * time.Millisecond, StatsInterval: time.Second,
	}, relay.Deps{
		Store: store,
		Broker: relay.BrokerFunc(func(_ context.Context, n int) (relay.Publisher, error) {
			p, err := rabbitmq.DialPublisher(b.amqpURL, n, t.Name(), o.pack)
			if err != nil {
				return nil, err
			}
			if o.wrap != nil {
				return o.wrap(p), nil
			}
			return p, nil
		}),
		Log: log, TracerProvider: o.tp, Propagator: propagation.TraceContext{},
		Metrics: relay.NewMetrics(o.reg),
	})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = r.Run(ctx) }()
	if o.listen {
		l := postgres.NewListener(b.db.URL, postgres.OutboxChannel, r.Wake, log)
		wg.Add(1)
		go func() { defer wg.Done(); _ = l.Run(ctx) }()
	}
	t.Cleanup(func() { cancel(); wg.Wait() })
	return r
}

func (b *testBundle) submit(t *testing.T, typ, payload string, priority int) task.Task {
	t.Helper()
	sub, err := task.NewSubmission(task.SubmitInput{Type: typ, Payload: json.RawMessage(payload), Priority: &priority},
		task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	res, err := b.tasks.Submit(context.Background(), b.admin, sub, task.Carrier{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
	require.NoError(t, err)
	return res.Task
}

func (b *testBundle) outboxCount(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox").Scan(&n))
	return n
}

// waitOutboxEmpty waits for the relay to commit its last deletes (a message
// reaches its queue a moment before its row is gone).
func (b *testBundle) waitOutboxEmpty(t *testing.T) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, func() error {
		if n := b.outboxCount(t); n != 0 {
			return fmtErr("outbox still holds %d rows", n)
		}
		return nil
	})
}

// fillOutbox adds n task.run rows straight into the outbox.
func (b *testBundle) fillOutbox(t *testing.T, n int, typ string) {
	t.Helper()
	_, err := b.db.Pool.Exec(context.Background(), `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, priority)
		SELECT 'task.run', `+testdb.OrgSQL+`, gen_random_uuid(), $2, 0, 1, 5 FROM generate_series(1, $1) g`, n, typ)
	require.NoError(t, err)
}

func TestRelayPublishesTaskAndCancelMessages(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()

	// A worker's control queue, to see the cancel broadcast.
	conn, err := amqp.Dial(b.amqpURL)
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, rabbitmq.DeclareExchanges(ch))
	q, err := ch.QueueDeclare("control-"+t.Name(), false, false, false, false, nil)
	require.NoError(t, err)
	require.NoError(t, ch.QueueBind(q.Name, "", rabbitmq.ControlExchange, false, nil))
	b.declare(t, "demo.sleep", "demo.noop")

	urgent := b.submit(t, "demo.sleep", `{"n":1}`, 9)
	b.submit(t, "demo.sleep", `{"n":2}`, 1)
	running := b.submit(t, "demo.noop", `{}`, 5)
	_, err = b.db.Pool.Exec(ctx, `UPDATE tasks SET status = 'IN_PROGRESS', attempt = 1,
		lease_expires_at = now() + interval '1 minute' WHERE id = $1`, running.ID)
	require.NoError(t, err)
	_, _, err = b.tasks.Cancel(ctx, b.admin, running.ID, task.Carrier{"traceparent": running.Traceparent})
	require.NoError(t, err)

	b.startRelay(t, relayOpts{})
	testenv.Eventually(t, 10*time.Second, func() error {
		if n := b.outboxCount(t); n != 0 {
			return fmtErr("outbox still holds %d rows", n)
		}
		return nil
	})

	msgs := testenv.Drain(t, b.amqpURL, rabbitmq.QueueName("demo.sleep"))
	require.Len(t, msgs, 2)
	first := msgs[0]
	require.EqualValues(t, 9, first.Priority, "the priority queue hands out the urgent task first")
	require.Equal(t, uint8(amqp.Persistent), first.Mode)
	require.Equal(t, "task.run", first.Type)
	require.NotEmpty(t, first.ID)
	var body map[string]any
	require.NoError(t, json.Unmarshal(first.Body, &body))
	require.Equal(t, urgent.ID.String(), body["task_id"])
	require.Equal(t, "demo.sleep", body["type"])
	require.EqualValues(t, 0, body["attempt"])
	require.EqualValues(t, urgent.Version, body["version"])
	traceparent, _ := first.Headers["traceparent"].(string)
	require.True(t, strings.HasPrefix(traceparent, "00-0af7651916cd43dd8448eb211c80319c-"), "the message continues the request's trace: %q", traceparent)
	require.NotEqual(t, urgent.Traceparent, traceparent, "under the relay's own producer span")

	require.Len(t, testenv.Drain(t, b.amqpURL, rabbitmq.QueueName("demo.noop")), 1)
	cancels := testenv.Drain(t, b.amqpURL, q.Name)
	require.Len(t, cancels, 1)
	require.Equal(t, "task.cancel", cancels[0].Type)
	require.NoError(t, json.Unmarshal(cancels[0].Body, &body))
	require.Equal(t, running.ID.String(), body["task_id"])
	cancelled, err := b.tasks.Get(ctx, b.admin, running.ID)
	require.NoError(t, err)
	require.EqualValues(t, cancelled.Version, body["version"], "the broadcast names the version of the request")

	// The broker confirmed each task.run message: the tasks say when.
	var stamped int
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE published_at IS NOT NULL AND status = 'PENDING'`).Scan(&stamped))
	require.Equal(t, 2, stamped)
}

func TestRelayWakesOnNotify(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.declare(t, "demo.sleep")
	// The poll is an hour away: only a NOTIFY can move this message.
	b.startRelay(t, relayOpts{pollInterval: time.Hour, listen: true})
	// The relay catches up once after connecting; let that pass first.
	b.submit(t, "demo.sleep", `{"warmup":true}`, 5)
	testenv.Eventually(t, 10*time.Second, func() error {
		if testenv.QueueDepth(t, b.amqpURL, rabbitmq.QueueName("demo.sleep")) < 1 {
			_, err := b.db.Pool.Exec(context.Background(), "SELECT pg_notify($1, '')", postgres.OutboxChannel)
			require.NoError(t, err)
			return fmtErr("warm-up message not published yet")
		}
		return nil
	})
	before := testenv.QueueDepth(t, b.amqpURL, rabbitmq.QueueName("demo.sleep"))

	notifier := postgres.NewNotifier(b.db.Pool, 0, slog.New(slog.NewTextHandler(io.Discard, nil)), postgres.OutboxChannel)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = notifier.Run(ctx) }()
	store := postgres.NewAPIStore(b.db.Pool, notifier.Poker(postgres.OutboxChannel))
	sub, err := task.NewSubmission(task.SubmitInput{Type: "demo.sleep", Payload: json.RawMessage(`{"n":42}`)}, task.Defaults{MaxAttempts: 1}, "")
	require.NoError(t, err)
	_, err = store.Submit(ctx, b.admin, sub, nil)
	require.NoError(t, err)
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("demo.sleep"), before+1, 10*time.Second)
}

func TestRelaysAtOnceNeverPublishTwice(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 3000
	b.declare(t, "demo.noop")
	b.fillOutbox(t, n, "demo.noop")
	for lanes := range 3 {
		b.startRelay(t, relayOpts{batchSize: 50, lanes: lanes + 1})
	}
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("demo.noop"), n, 60*time.Second)
	b.waitOutboxEmpty(t)
	seen := map[string]bool{}
	for _, m := range testenv.Drain(t, b.amqpURL, rabbitmq.QueueName("demo.noop")) {
		require.False(t, seen[m.ID], "message %s published twice", m.ID)
		seen[m.ID] = true
	}
	require.Len(t, seen, n)
}

// A relay's lanes overlap their batches: while one lane waits for its
// confirms, the next has locked and is publishing the following batch. Each
// lane's first publish here waits until both lanes are publishing at once,
// which one lane at a time never reaches.
func TestLanesPublishBatchesAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 400
	b.declare(t, "demo.noop")
	b.fillOutbox(t, n, "demo.noop")
	var mu sync.Mutex
	inFlight := 0
	both := make(chan struct{})
	b.startRelay(t, relayOpts{batchSize: 100, lanes: 2, wrap: func(p relay.Publisher) relay.Publisher {
		return &meetingPublisher{Publisher: p, arrive: func() {
			mu.Lock()
			defer mu.Unlock()
			if inFlight++; inFlight == 2 {
				close(both)
			}
		}, both: both}
	}})
	select {
	case <-both:
	case <-time.After(20 * time.Second):
		t.Fatal("the lanes never had two batches in flight at once")
	}
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("demo.noop"), n, 60*time.Second)
	b.waitOutboxEmpty(t)
}

// A row committed while a lane waits for the broker's confirms goes out at
// once on the other lane: a NOTIFY wakes a lane that is not in a pass.
func TestANotifyWakesALaneNotInAPass(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.declare(t, "demo.noop")
	q := rabbitmq.QueueName("demo.noop")
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	r := b.startRelay(t, relayOpts{pollInterval: time.Hour, listen: true, lanes: 2, wrap: func(p relay.Publisher) relay.Publisher {
		return &holdingPublisher{Publisher: p, hold: func() {
			first := false
			once.Do(func() { first = true })
			if first {
				// Held past its confirm timeout, if need be: the other
				// lane must not wait for it.
				close(entered)
				select {
				case <-release:
				case <-time.After(30 * time.Second):
				}
			}
		}}
	}})
	testenv.Eventually(t, 10*time.Second, func() error {
		if ready, _, err := r.Ready(context.Background()); !ready {
			return fmtErr("relay not ready: %v", err)
		}
		return nil
	})
	// publish adds a row and wakes the relay until the queue holds depth
	// messages (the listener may not be listening yet).
	publish := func(depth int) {
		b.fillOutbox(t, 1, "demo.noop")
		testenv.Eventually(t, 10*time.Second, func() error {
			if testenv.QueueDepth(t, b.amqpURL, q) < depth {
				_, err := b.db.Pool.Exec(context.Background(), "SELECT pg_notify($1, '')", postgres.OutboxChannel)
				require.NoError(t, err)
				return fmtErr("queue short of %d messages", depth)
			}
			return nil
		})
	}
	b.fillOutbox(t, 1, "demo.noop")
	for deadline := time.Now().Add(10 * time.Second); ; {
		_, err := b.db.Pool.Exec(context.Background(), "SELECT pg_notify($1, '')", postgres.OutboxChannel)
		require.NoError(t, err)
		select {
		case <-entered:
		case <-time.After(50 * time.Millisecond):
			require.True(t, time.Now().Before(deadline), "the first row was never published")
			continue
		}
		break
	}
	publish(1) // while the first lane waits on its held batch
	close(release)
	testenv.WaitForDepth(t, b.amqpURL, q, 2, 10*time.Second)
	b.waitOutboxEmpty(t)
}

// holdingPublisher calls hold before each batch it publishes.
type holdingPublisher struct {
	relay.Publisher
	hold func()
}

func (p *holdingPublisher) Publish(ctx context.Context, msgs []outbox.Message) outbox.Outcome {
	p.hold()
	return p.Publisher.Publish(ctx, msgs)
}

// meetingPublisher holds its first batch until both is closed.
type meetingPublisher struct {
	relay.Publisher
	arrive func()
	both   chan struct{}
	met    bool
}

func (p *meetingPublisher) Publish(ctx context.Context, msgs []outbox.Message) outbox.Outcome {
	if !p.met {
		p.met = true
		p.arrive()
		select {
		case <-p.both:
		case <-ctx.Done():
		}
	}
	return p.Publisher.Publish(ctx, msgs)
}

// A message for a type no worker has declared a queue for is returned by
// the broker and parked in the outbox — not published again and again, and
// no queue is created for it — until a worker for the type starts.
func TestUnroutableMessagesWaitForAWorker(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.declare(t, "demo.sleep")
	orphan := b.submit(t, "no.worker.yet", `{"n":1}`, 5)
	b.startRelay(t, relayOpts{})
	parked := func() (attempts int, lastError string) {
		err := b.db.Pool.QueryRow(context.Background(), `SELECT attempts, coalesce(last_error, '') FROM outbox
			WHERE task_id = $1 AND available_at = 'infinity'`, orphan.ID).Scan(&attempts, &lastError)
		if err != nil {
			return -1, err.Error()
		}
		return attempts, lastError
	}
	testenv.Eventually(t, 10*time.Second, func() error {
		if n, _ := parked(); n != 1 {
			return fmtErr("not parked yet")
		}
		return nil
	})
	// Many relay passes later (these two messages went through), it was
	// published once, and no queue was made for its type.
	for i := range 2 {
		b.submit(t, "demo.sleep", fmt.Sprintf(`{"pass":%d}`, i), 5)
		testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("demo.sleep"), i+1, 10*time.Second)
	}
	attempts, lastError := parked()
	require.Equal(t, 1, attempts)
	require.Contains(t, lastError, "NO_ROUTE")
	require.Equal(t, -1, testenv.QueueDepth(t, b.amqpURL, rabbitmq.QueueName("no.worker.yet")))

	// A worker for the type starts: the message is released and delivered.
	b.declare(t, "no.worker.yet")
	_, err := b.db.Pool.Exec(context.Background(), "SELECT pg_notify($1, '')", postgres.OutboxChannel)
	require.NoError(t, err)
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("no.worker.yet"), 1, 10*time.Second)
	b.waitOutboxEmpty(t)
}

// The relay's log lines about one task's message (parked, publish failed)
// carry the task's trace_id, as every log line of a traced context does:
// the trace a task's JSON links to leads to them, and they to it.
func TestRelayLogsOfATaskCarryItsTrace(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orphan := b.submit(t, "no.worker.yet", `{"n":1}`, 5)
	var logs syncBuffer
	b.startRelay(t, relayOpts{logs: &logs})
	var line map[string]any
	testenv.Eventually(t, 10*time.Second, func() error {
		for _, l := range strings.Split(logs.String(), "\n") {
			if strings.Contains(l, orphan.ID.String()) {
				return json.Unmarshal([]byte(l), &line)
			}
		}
		return fmtErr("no log line names the parked task: %s", logs.String())
	})
	require.Equal(t, "0af7651916cd43dd8448eb211c80319c", line["trace_id"], "%v", line)
}

// syncBuffer is a bytes.Buffer safe for a logger and a test at once.
type syncBuffer struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// conveyor_relay_commit_to_publish_seconds is the relay's lag: a row
// written long before it was due (a task submitted for later, a retry
// after its backoff) is published as soon as it is due, and must not count
// the hour it was meant to wait, which put every scheduled task in the
// histogram's last bucket and the dashboard's p99 at its top.
func TestCommitToPublishCountsFromWhenTheRowWasDue(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.declare(t, "demo.sleep")
	_, err := b.db.Pool.Exec(context.Background(), `INSERT INTO outbox
		(kind, org_id, task_id, task_type, attempt, task_version, priority, created_at, available_at)
		VALUES ('task.run', `+testdb.OrgSQL+`, gen_random_uuid(), 'demo.sleep', 0, 1, 5, now() - interval '1 hour', now())`)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	b.startRelay(t, relayOpts{reg: reg})
	b.waitOutboxEmpty(t)
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == "conveyor_relay_commit_to_publish_seconds" {
			h := f.GetMetric()[0].GetHistogram()
			require.Equal(t, uint64(1), h.GetSampleCount())
			require.Less(t, h.GetSampleSum(), 60.0, "the row was published at once once due")
			return
		}
	}
	t.Fatal("no conveyor_relay_commit_to_publish_seconds")
}

// The PRODUCER span of a task that went out packed with others names the
// message that carried it: the packed exchange it was published to and the
// packed message's id, the id the worker's CONSUMER span of the task
// carries. It named the exchange and the id the task would have had alone.
func TestProducerSpansOfPackedTasksNameTheirMessage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.declare(t, "demo.packed")
	for i := range 3 {
		b.submit(t, "demo.packed", fmt.Sprintf(`{"n":%d}`, i), 5)
	}
	rec := tracetest.NewSpanRecorder()
	b.startRelay(t, relayOpts{pack: 64, tp: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))})
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.PackedQueueName("demo.packed"), 1, 10*time.Second)
	b.waitOutboxEmpty(t)

	conn, err := amqp.Dial(b.amqpURL)
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	require.NoError(t, err)
	msg, ok, err := ch.Get(rabbitmq.PackedQueueName("demo.packed"), true)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, int32(3), msg.Headers[rabbitmq.PackedHeader], "the three tasks went out in one message")

	var producers int
	for _, s := range rec.Ended() {
		if s.SpanKind() != oteltrace.SpanKindProducer {
			continue
		}
		producers++
		attrs := map[attribute.Key]string{}
		for _, kv := range s.Attributes() {
			attrs[kv.Key] = kv.Value.String()
		}
		require.Equal(t, rabbitmq.PackedExchange, attrs["messaging.destination.name"], "span %s", s.Name())
		require.Equal(t, "publish "+rabbitmq.PackedExchange, s.Name())
		require.Equal(t, msg.MessageId, attrs["messaging.message.id"], "the id of the message that carried the task")
	}
	require.Equal(t, 3, producers)
}

// A client submitting a thousand new types creates no queue and no churn:
// every message is parked once.
func TestManyNewTypesCreateNoQueues(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var entries []string
	for i := range 1000 {
		entries = append(entries, fmt.Sprintf("client.type-%d", i))
	}
	_, err := b.db.Pool.Exec(context.Background(), `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version)
		SELECT 'task.run', `+testdb.OrgSQL+`, gen_random_uuid(), t, 0, 1 FROM unnest($1::text[]) t`, entries)
	require.NoError(t, err)
	b.startRelay(t, relayOpts{batchSize: 200})
	testenv.Eventually(t, 30*time.Second, func() error {
		var parked int
		require.NoError(t, b.db.Pool.QueryRow(context.Background(),
			`SELECT count(*) FROM outbox WHERE available_at = 'infinity' AND attempts = 1`).Scan(&parked))
		if parked != 1000 {
			return fmtErr("%d of 1000 parked", parked)
		}
		return nil
	})
	for _, typ := range []string{entries[0], entries[500], entries[999]} {
		require.Equal(t, -1, testenv.QueueDepth(t, b.amqpURL, rabbitmq.QueueName(typ)), "no queue for %s", typ)
	}
}

// Rows that fail a thousand times do not overflow the backoff and poison
// the relay's transaction (undoing the deletes of the confirmed rows beside
// them).
func TestAFailedRowNeverPoisonsItsBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.declare(t, "demo.noop")
	b.fillOutbox(t, 20, "demo.noop")
	// Twenty cancels that fail again, each with two thousand failures
	// behind it already.
	_, err := b.db.Pool.Exec(context.Background(), `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, attempts)
		SELECT 'task.cancel', `+testdb.OrgSQL+`, gen_random_uuid(), 'demo.noop', 1, 2, 2000 FROM generate_series(1, 20)`)
	require.NoError(t, err)
	ctx := context.Background()
	store := postgres.NewRelayStore(b.db.Pool, 50*time.Millisecond, time.Second)
	n, err := store.Relay(ctx, 100, func(_ context.Context, msgs []outbox.Message) outbox.Outcome {
		var out outbox.Outcome
		for _, m := range msgs {
			if m.Kind == outbox.KindCancel {
				out.Fail(m.ID, "no control exchange")
			} else {
				out.Published = append(out.Published, m.ID)
			}
		}
		return out
	})
	require.NoError(t, err)
	require.Equal(t, 40, n)
	var left, backedOff int
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE available_at > now() AND attempts = 2001)
		FROM outbox`).Scan(&left, &backedOff))
	require.Equal(t, 20, left, "the confirmed rows were deleted")
	require.Equal(t, 20, backedOff)
}

func fmtErr(format string, args ...any) error { return fmt.Errorf(format, args...) }

// A lane whose publisher gave up its channel (a nack, a late confirm)
// dials a new one at once, though the broker has not answered the old
// channel's close: a pass on the given-up channel would publish nothing,
// and its rows would wait out the backoff or go out twice.
func TestALaneLeavesAGivenUpChannelAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.declare(t, "demo.noop")
	var mu sync.Mutex
	var pubs []*givingUpPublisher
	b.startRelay(t, relayOpts{wrap: func(p relay.Publisher) relay.Publisher {
		mu.Lock()
		defer mu.Unlock()
		g := &givingUpPublisher{Publisher: p, open: make(chan struct{})}
		pubs = append(pubs, g)
		return g
	}})
	q := rabbitmq.QueueName("demo.noop")
	b.submit(t, "demo.noop", `{"n":1}`, 5)
	testenv.WaitForDepth(t, b.amqpURL, q, 1, 10*time.Second)
	b.submit(t, "demo.noop", `{"n":2}`, 5)
	testenv.WaitForDepth(t, b.amqpURL, q, 2, 10*time.Second)
	b.waitOutboxEmpty(t)

	mu.Lock()
	defer mu.Unlock()
	require.GreaterOrEqual(t, len(pubs), 2, "the lane dialled again")
	require.EqualValues(t, 1, pubs[0].batches.Load(), "no batch went to the channel given up")
}

// givingUpPublisher gives its channel up after its first batch, and the
// broker never answers the close: Err is set, Done stays open.
type givingUpPublisher struct {
	relay.Publisher
	batches atomic.Int32
	open    chan struct{}
}

func (p *givingUpPublisher) Publish(ctx context.Context, msgs []outbox.Message) outbox.Outcome {
	p.batches.Add(1)
	return p.Publisher.Publish(ctx, msgs)
}

func (p *givingUpPublisher) Err() error {
	if p.batches.Load() > 0 {
		return errors.New("a publish was nacked by the broker: publishing on a new channel")
	}
	return nil
}

func (p *givingUpPublisher) Done() <-chan struct{} { return p.open }

// An exchange deleted under the relay takes its bindings with it: the
// relay's publish to it fails, and the relay declares it again on its next
// channel, bound to no queue. The workers' queues are still there, and
// their consumers were not cancelled: the messages must reach them, not
// wait parked until a worker happens to connect again.
func TestADeletedExchangeDoesNotParkTheMessagesOfExistingQueues(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.declare(t, "demo.noop")
	b.startRelay(t, relayOpts{pack: 4})
	single, packed := rabbitmq.QueueName("demo.noop"), rabbitmq.PackedQueueName("demo.noop")
	b.submit(t, "demo.noop", `{"n":0}`, 5)
	testenv.WaitForDepth(t, b.amqpURL, single, 1, 10*time.Second)

	conn, err := amqp.Dial(b.amqpURL)
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	require.NoError(t, err)
	for _, exchange := range []string{rabbitmq.TasksExchange, rabbitmq.PackedExchange} {
		require.NoError(t, ch.ExchangeDelete(exchange, false, false))
	}
	b.submit(t, "demo.noop", `{"n":1}`, 5)
	testenv.WaitForDepth(t, b.amqpURL, single, 2, 10*time.Second)
	b.fillOutbox(t, 3, "demo.noop") // packed together
	testenv.WaitForDepth(t, b.amqpURL, packed, 1, 10*time.Second)
	b.waitOutboxEmpty(t)
}

// A lane whose publisher gave up its channel while the broker blocked the
// connection (a resource alarm held up its confirms) keeps that connection
// until the alarm clears: a new one would be blocked at its first publish
// as well, and each batch left unconfirmed in a blocked connection goes out
// when the alarm clears, though its rows are published again.
func TestALaneWaitsOutAnAlarmOnItsGivenUpConnection(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.declare(t, "demo.noop")
	var blocked atomic.Bool
	blocked.Store(true)
	var dials, dialsBlocked atomic.Int32
	first := make(chan *blockedPublisher, 1)
	b.startRelay(t, relayOpts{wrap: func(p relay.Publisher) relay.Publisher {
		if dials.Add(1) == 1 {
			bp := &blockedPublisher{givingUpPublisher: givingUpPublisher{Publisher: p, open: make(chan struct{})}, blocked: &blocked}
			first <- bp
			return bp
		}
		if blocked.Load() {
			dialsBlocked.Add(1)
		}
		return p
	}})
	bp := <-first
	b.submit(t, "demo.noop", `{"n":1}`, 5)
	// The lane has seen its channel given up and asks, over and over,
	// whether the alarm is over; or it dialled again.
	testenv.Eventually(t, 10*time.Second, func() error {
		if bp.batches.Load() > 0 && (bp.askedAfter.Load() >= 5 || dials.Load() > 1) {
			return nil
		}
		return fmtErr("the lane neither waits nor dialled again")
	})
	require.Zero(t, dialsBlocked.Load(), "the lane dialled again while the broker blocked its connection")
	blocked.Store(false)
	testenv.Eventually(t, 10*time.Second, func() error {
		if dials.Load() < 2 {
			return fmtErr("the lane did not dial again once the alarm cleared")
		}
		return nil
	})
	b.waitOutboxEmpty(t)
}

// blockedPublisher is a givingUpPublisher on a connection the broker
// blocks while blocked is set.
type blockedPublisher struct {
	givingUpPublisher
	blocked *atomic.Bool
	// askedAfter counts the questions about the alarm after the first
	// batch.
	askedAfter atomic.Int32
}

func (p *blockedPublisher) Blocked() bool {
	if p.batches.Load() == 0 {
		return false // the first batch goes out, and is given up
	}
	p.askedAfter.Add(1)
	return p.blocked.Load()
}

// A worker that starts while the relay holds a message of its type it has
// just found no queue for (the broker returned it, and no queue of the type
// existed yet) declares its queue and releases the parked messages of its
// type before the relay has committed the park: the release does not see
// the row, which the relay parks after it. The message must still go out,
// not wait for maintenance's backstop.
func TestAWorkerStartingWhileTheRelayParksGetsTheMessage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.submit(t, "late.worker", `{"n":1}`, 5)
	started := make(chan error, 1)
	var once sync.Once
	b.startRelay(t, relayOpts{wrap: func(p relay.Publisher) relay.Publisher {
		return &afterPublishPublisher{Publisher: p, after: func(out outbox.Outcome) {
			if len(out.Unroutable) > 0 {
				once.Do(func() { started <- b.startWorker("late.worker") })
			}
		}}
	}})
	select {
	case err := <-started:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("the message was never parked")
	}
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("late.worker"), 1, 10*time.Second)
	b.waitOutboxEmpty(t)
}

// afterPublishPublisher calls after with each batch's outcome, before the
// relay commits it.
type afterPublishPublisher struct {
	relay.Publisher
	after func(outbox.Outcome)
}

func (p *afterPublishPublisher) Publish(ctx context.Context, msgs []outbox.Message) outbox.Outcome {
	out := p.Publisher.Publish(ctx, msgs)
	p.after(out)
	return out
}

// A message parked until a worker for its type starts is the normal course
// of things, not a failure: its PRODUCER span, in the task's trace, says it
// was parked, without an error status that would show the trace in red.
func TestAParkedMessageIsNoErrorInItsTrace(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orphan := b.submit(t, "no.worker.yet", `{"n":1}`, 5)
	rec := tracetest.NewSpanRecorder()
	b.startRelay(t, relayOpts{tp: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))})
	var span sdktrace.ReadOnlySpan
	testenv.Eventually(t, 10*time.Second, func() error {
		for _, s := range rec.Ended() {
			for _, kv := range s.Attributes() {
				if kv.Key == "conveyor.task_id" && kv.Value.AsString() == orphan.ID.String() {
					span = s
					return nil
				}
			}
		}
		return fmtErr("no span for the parked task yet")
	})
	require.NotEqual(t, codes.Error, span.Status().Code, "status %v", span.Status())
	var events []string
	for _, e := range span.Events() {
		events = append(events, e.Name)
	}
	require.Contains(t, events, "parked")
}

// While the outbox cannot be measured (the database is unreachable), the
// depth and age gauges keep their last values: the relay counts and logs
// each failed measurement, so that a dashboard or an alert can tell.
func TestAFailedOutboxMeasurementIsCountedAndLogged(t *testing.T) {
	t.Parallel()
	b := setup(t)
	reg := prometheus.NewRegistry()
	var logs syncBuffer
	b.startRelay(t, relayOpts{reg: reg, logs: &logs, store: func(s relay.Store) relay.Store {
		return failingStats{s}
	}})
	testenv.Eventually(t, 10*time.Second, func() error {
		families, err := reg.Gather()
		if err != nil {
			return err
		}
		for _, f := range families {
			if f.GetName() == "conveyor_relay_outbox_stats_failures_total" && f.GetMetric()[0].GetCounter().GetValue() > 0 {
				return nil
			}
		}
		return fmtErr("no failed measurement counted")
	})
	testenv.Eventually(t, 10*time.Second, func() error {
		if !strings.Contains(logs.String(), "the database is down") {
			return fmtErr("no log line says why: %s", logs.String())
		}
		return nil
	})
}

// A broker that answers and refuses the relay (here: AMQP_URL names a
// vhost that does not exist) is not logged as unreachable: the log says
// what the broker refused, so the operator looks at the vhost, not the
// network.
func TestRelayLogsWhatTheBrokerRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.amqpURL += "_missing"
	var logs syncBuffer
	b.startRelay(t, relayOpts{logs: &logs})
	testenv.Eventually(t, 10*time.Second, func() error {
		if !strings.Contains(logs.String(), "retrying") {
			return fmtErr("no failed connection logged: %s", logs.String())
		}
		return nil
	})
	require.NotContains(t, logs.String(), "unreachable")
	require.Contains(t, logs.String(), "refused the vhost")
	require.Contains(t, logs.String(), "NOT_ALLOWED", "the broker's reason is kept")
}

// failingStats is a store that cannot measure the outbox.
type failingStats struct{ relay.Store }

func (failingStats) Stats(context.Context) (outbox.Stats, error) {
	return outbox.Stats{}, errors.New("outbox stats: the database is down")
}

// conveyor_relay_broker_blocked says, as /readyz does, whether the broker
// blocks the relay: while it blocks one lane's connection, another lane's
// pass (the broker has not blocked its connection yet) must not set it
// back to 0.
func TestTheBlockedGaugeHoldsWhileOneLaneIsBlocked(t *testing.T) {
	t.Parallel()
	b := setup(t)
	reg := prometheus.NewRegistry()
	var dials atomic.Int32
	var blockedAnswers, freeAnswers atomic.Int32
	hold := make(chan struct{})
	b.startRelay(t, relayOpts{lanes: 2, reg: reg, wrap: func(p relay.Publisher) relay.Publisher {
		if dials.Add(1) == 1 {
			return &laneBlockedPublisher{Publisher: p, answers: &blockedAnswers, blocked: true, hold: hold}
		}
		return &laneBlockedPublisher{Publisher: p, answers: &freeAnswers}
	}})
	t.Cleanup(func() { close(hold) }) // before the relay stops
	testenv.Eventually(t, 10*time.Second, func() error {
		if blockedAnswers.Load() == 0 {
			return fmtErr("the blocked lane has not asked yet")
		}
		return nil
	})
	// The other lane passes twice more: the gauge was set after the
	// first of them.
	after := freeAnswers.Load()
	testenv.Eventually(t, 10*time.Second, func() error {
		if freeAnswers.Load() < after+2 {
			return fmtErr("the other lane has not passed again")
		}
		return nil
	})
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == "conveyor_relay_broker_blocked" {
			require.Equal(t, 1.0, f.GetMetric()[0].GetGauge().GetValue())
			return
		}
	}
	t.Fatal("no conveyor_relay_broker_blocked")
}

// laneBlockedPublisher answers whether the broker blocks it; a blocked one
// answers once, then holds the question until hold is closed.
type laneBlockedPublisher struct {
	relay.Publisher
	answers *atomic.Int32
	blocked bool
	hold    chan struct{}
}

func (p *laneBlockedPublisher) Blocked() bool {
	if p.blocked && p.answers.Load() > 0 {
		<-p.hold
	}
	p.answers.Add(1)
	return p.blocked
}

// A type whose queue of single messages exists but whose packed queue does
// not (deleted by an operator between the two queues of a switch, or
// declared by a worker older than packing) parks its packed messages: they
// wait for a worker to declare the packed queue, and are not released at
// once because the other queue exists, published again, and parked again
// in a loop.
func TestPackedMessagesWithoutAPackedQueueStayParked(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.declare(t, "demo.noop")
	conn, err := amqp.Dial(b.amqpURL)
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDelete(rabbitmq.PackedQueueName("demo.noop"), false, false, false)
	require.NoError(t, err)

	b.fillOutbox(t, 3, "demo.noop") // packed together
	b.startRelay(t, relayOpts{pack: 4})
	testenv.Eventually(t, 10*time.Second, func() error {
		var n int
		require.NoError(t, b.db.Pool.QueryRow(context.Background(),
			`SELECT count(*) FROM outbox WHERE available_at = 'infinity'`).Scan(&n))
		if n != 3 {
			return fmtErr("%d of 3 rows parked", n)
		}
		return nil
	})
	time.Sleep(time.Second)
	var most int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), `SELECT max(attempts) FROM outbox`).Scan(&most))
	require.LessOrEqual(t, most, 2, "the packed message was published and parked %d times", most)
}

// A PRODUCER span names the task's type and org as well as its id, as the
// worker's CONSUMER span does: an org's messages can be found in the
// tracing backend.
func TestProducerSpanNamesTheTasksTypeAndOrg(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.declare(t, "demo.named")
	tk := b.submit(t, "demo.named", `{}`, 5)
	rec := tracetest.NewSpanRecorder()
	b.startRelay(t, relayOpts{tp: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))})
	b.waitOutboxEmpty(t)
	var attrs map[attribute.Key]string
	require.Eventually(t, func() bool {
		for _, s := range rec.Ended() {
			if s.SpanKind() == oteltrace.SpanKindProducer {
				attrs = map[attribute.Key]string{}
				for _, kv := range s.Attributes() {
					attrs[kv.Key] = kv.Value.String()
				}
				return true
			}
		}
		return false
	}, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, tk.ID.String(), attrs["conveyor.task_id"])
	require.Equal(t, "demo.named", attrs["conveyor.task_type"])
	require.Equal(t, tk.OrgID.String(), attrs["conveyor.org_id"])
}
