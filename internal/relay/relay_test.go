package relay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/relay"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

type testBundle struct {
	db      *testdb.DB
	amqpURL string
	tasks   *postgres.TaskStore
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	db := testdb.New(t)
	return &testBundle{db: db, amqpURL: testenv.NewVhost(t), tasks: postgres.NewTaskStore(db.Pool, nil)}
}

type relayOpts struct {
	batchSize    int
	pollInterval time.Duration
	listen       bool
}

// startRelay runs a relay (and its NOTIFY listener) until the test ends.
func (b *testBundle) startRelay(t *testing.T, o relayOpts) {
	t.Helper()
	if o.batchSize == 0 {
		o.batchSize = 100
	}
	if o.pollInterval == 0 {
		o.pollInterval = 50 * time.Millisecond
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	r := relay.New(relay.Config{
		AMQPURL: b.amqpURL, Name: t.Name(), BatchSize: o.batchSize, PollInterval: o.pollInterval,
		ConfirmTimeout: 5 * time.Second, ReconnectBackoffMax: 200 * time.Millisecond, StatsInterval: time.Second,
	}, postgres.NewOutboxStore(b.db.Pool, 50*time.Millisecond, time.Second), log,
		sdktrace.NewTracerProvider(), propagation.TraceContext{}, relay.NewMetrics(prometheus.NewRegistry()))
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
}

func (b *testBundle) submit(t *testing.T, typ, payload string, priority int) task.Task {
	t.Helper()
	sub, err := task.NewSubmission(task.SubmitInput{Type: typ, Payload: json.RawMessage(payload), Priority: &priority},
		task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	sub.Traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	res, err := b.tasks.Submit(context.Background(), sub, task.Carrier{"traceparent": sub.Traceparent})
	require.NoError(t, err)
	return res.Task
}

func (b *testBundle) outboxCount(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox").Scan(&n))
	return n
}

// fillOutbox adds n task.run rows straight into the outbox.
func (b *testBundle) fillOutbox(t *testing.T, n int, typ string) {
	t.Helper()
	_, err := b.db.Pool.Exec(context.Background(), `INSERT INTO outbox (kind, task_id, routing_key, priority, body)
		SELECT 'task.run', gen_random_uuid(), $2, 5, jsonb_build_object('i', g) FROM generate_series(1, $1) g`, n, typ)
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

	urgent := b.submit(t, "demo.sleep", `{"n":1}`, 9)
	b.submit(t, "demo.sleep", `{"n":2}`, 1)
	running := b.submit(t, "demo.noop", `{}`, 5)
	_, err = b.db.Pool.Exec(ctx, `UPDATE tasks SET status = 'IN_PROGRESS', attempt = 1,
		lease_expires_at = now() + interval '1 minute' WHERE id = $1`, running.ID)
	require.NoError(t, err)
	_, _, err = b.tasks.Cancel(ctx, running.ID, task.Carrier{"traceparent": running.Traceparent})
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
	traceparent, _ := first.Headers["traceparent"].(string)
	require.True(t, strings.HasPrefix(traceparent, "00-0af7651916cd43dd8448eb211c80319c-"), "the message continues the request's trace: %q", traceparent)
	require.NotEqual(t, urgent.Traceparent, traceparent, "under the relay's own producer span")

	require.Len(t, testenv.Drain(t, b.amqpURL, rabbitmq.QueueName("demo.noop")), 1)
	cancels := testenv.Drain(t, b.amqpURL, q.Name)
	require.Len(t, cancels, 1)
	require.Equal(t, "task.cancel", cancels[0].Type)
	require.Contains(t, string(cancels[0].Body), running.ID.String())
}

func TestRelayWakesOnNotify(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// The poll is an hour away: only a NOTIFY can move this message.
	b.startRelay(t, relayOpts{pollInterval: time.Hour, listen: true})
	// The relay catches up once after connecting; let that pass first.
	testenv.Eventually(t, 10*time.Second, func() error {
		if testenv.QueueDepth(t, b.amqpURL, rabbitmq.QueueName("demo.sleep")) < 0 {
			b.submit(t, "demo.sleep", `{"warmup":true}`, 5)
			_, err := b.db.Pool.Exec(context.Background(), "SELECT pg_notify($1, '')", postgres.OutboxChannel)
			require.NoError(t, err)
			return fmtErr("queue not declared yet")
		}
		return nil
	})
	before := testenv.QueueDepth(t, b.amqpURL, rabbitmq.QueueName("demo.sleep"))

	notifier := postgres.NewNotifier(b.db.Pool, 0, slog.New(slog.NewTextHandler(io.Discard, nil)))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = notifier.Run(ctx) }()
	store := postgres.NewTaskStore(b.db.Pool, notifier.Poke)
	sub, err := task.NewSubmission(task.SubmitInput{Type: "demo.sleep", Payload: json.RawMessage(`{"n":42}`)}, task.Defaults{MaxAttempts: 1}, "")
	require.NoError(t, err)
	_, err = store.Submit(ctx, sub, nil)
	require.NoError(t, err)
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("demo.sleep"), before+1, 10*time.Second)
}

func TestRelaysAtOnceNeverPublishTwice(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 3000
	b.fillOutbox(t, n, "demo.noop")
	for range 3 {
		b.startRelay(t, relayOpts{batchSize: 50})
	}
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("demo.noop"), n, 60*time.Second)
	require.Zero(t, b.outboxCount(t))
	seen := map[string]bool{}
	for _, m := range testenv.Drain(t, b.amqpURL, rabbitmq.QueueName("demo.noop")) {
		require.False(t, seen[m.ID], "message %s published twice", m.ID)
		seen[m.ID] = true
	}
	require.Len(t, seen, n)
}

func TestReturnedMessageStaysAndIsRetried(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.submit(t, "demo.sleep", `{"n":1}`, 5)
	b.startRelay(t, relayOpts{})
	queue := rabbitmq.QueueName("demo.sleep")
	testenv.WaitForDepth(t, b.amqpURL, queue, 1, 10*time.Second)

	// Someone deletes the queue: the relay's next publish is unroutable and
	// comes back. The row must stay, with the failure recorded.
	conn, err := amqp.Dial(b.amqpURL)
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDelete(queue, false, false, false)
	require.NoError(t, err)

	second := b.submit(t, "demo.sleep", `{"n":2}`, 5)
	// The relay re-declares the queue on its next try, so the message
	// arrives after one failure.
	testenv.WaitForDepth(t, b.amqpURL, queue, 1, 15*time.Second)
	msgs := testenv.Drain(t, b.amqpURL, queue)
	require.Contains(t, string(msgs[0].Body), second.ID.String())
	require.Zero(t, b.outboxCount(t))
}

func fmtErr(format string, args ...any) error { return fmt.Errorf(format, args...) }
