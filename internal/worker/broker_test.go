package worker

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/registry"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// brokerBundle is a worker on the in-memory store and a real RabbitMQ
// vhost of the test's own: what it shows depends on how the broker
// hands out its credit.
type brokerBundle struct {
	store     *fakeStore
	w         *Worker
	url       string
	consumers chan *rabbitmq.Consumer
	pub       *rabbitmq.Publisher
}

func setupBroker(t *testing.T, qs rabbitmq.Queues, tc testConfig) *brokerBundle {
	t.Helper()
	if testing.Short() {
		t.Skip("needs RabbitMQ")
	}
	t.Parallel()
	b := &brokerBundle{store: newFakeStore(), url: testenv.NewVhost(t), consumers: make(chan *rabbitmq.Consumer, 16)}
	broker := BrokerFunc(func(_ context.Context, types []string, prefetch int) (Source, error) {
		c, err := rabbitmq.DialConsumer(b.url, "test-worker", qs, types, prefetch, 1)
		if err != nil {
			return nil, err
		}
		b.consumers <- c
		return c, nil
	})
	w, err := New(Config{
		Info:        registry.Worker{ID: "w1"},
		Concurrency: tc.concurrency, Lease: 2 * time.Second, Heartbeat: 100 * time.Millisecond,
		ProgressInterval: 10 * time.Millisecond, BackoffBase: time.Millisecond, BackoffMax: 10 * time.Millisecond,
		ShutdownTimeout: time.Second, MaxRunTime: time.Hour, ReadAhead: tc.readAhead, TasksPerMessage: 1,
		LongAfter: tc.longAfter, ReconnectBackoffMax: 50 * time.Millisecond,
	}, fakeDeps(b.store, nil), tc.handlers)
	require.NoError(t, err)
	w.broker = broker
	w.signals = signals{
		connected: make(signal[struct{}], 16), started: make(signal[uuid.UUID], 100),
		dropped: make(signal[uuid.UUID], 100), finished: make(signal[finished], 100),
		prefetch: make(signal[int], 100),
	}
	b.w = w
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	receive(t, w.signals.connected)
	b.pub, err = rabbitmq.DialPublisher(b.url, 16, "test-relay", 1)
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.pub.Close() })
	return b
}

// publish sends a task.run message of the task, alone.
func (b *brokerBundle) publish(t *testing.T, id uuid.UUID, n int64) {
	t.Helper()
	m := outbox.Message{ID: n, Kind: outbox.KindRun, TaskID: id, TaskType: b.store.get(id).Type, TaskVersion: 1}
	require.Equal(t, []int64{n}, b.pub.Publish(context.Background(), []outbox.Message{m}).Published)
}

// After a reconnect, a task of the earlier connection that runs long
// holds the worker's only slot: the worker can start nothing, so the
// broker must send it nothing. A prefetch cannot say "none" (0 is
// unlimited), and the least, 1, brought the next message, which went
// back and came straight back, over and over, for as long as the long
// task ran.
func TestWorkerSendsNothingBackAndForthWhileEverySlotIsHeldByAnEarlierConnection(t *testing.T) {
	h := newBlocking()
	b := setupBroker(t, rabbitmq.ClassicQueues, testConfig{concurrency: 1, readAhead: 1, longAfter: 50 * time.Millisecond,
		handlers: []conveyor.Handler{conveyor.Handle("t.block", h.handle)}})
	first := receive(t, b.consumers)
	long, next := b.store.add("t.block", 3), b.store.add("t.block", 3)
	b.publish(t, long, 1)
	receive(t, h.entered)
	require.Eventually(t, func() bool { return b.w.long.Load() == 1 }, waitLimit, 5*time.Millisecond)

	// The connection ends under the running task (closed from this side,
	// as a broker restart or a network cut would end it).
	require.NoError(t, first.Close())
	receive(t, b.consumers)
	receive(t, b.w.signals.connected)
	b.publish(t, next, 2)

	// The long task's own message, requeued with the old connection, comes
	// back and is dropped (its task runs here); next waits in its queue.
	time.Sleep(time.Second)
	var m dto.Metric
	require.NoError(t, b.w.metrics.dropped.WithLabelValues("requeued_behind_long_tasks").Write(&m))
	requeued := m.GetCounter().GetValue()
	require.LessOrEqual(t, requeued, 1.0, "deliveries sent back while the only slot ran long")

	close(h.release)
	require.Equal(t, "completed", (&testBundle{w: b.w, outcomes: map[uuid.UUID]string{}}).finished(t, next))
}

// lockedBuffer is a log's output that the worker writes while the test
// reads it.
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

// A worker whose queue exists with other arguments reaches the broker and
// is refused: its log says so, with the broker's reason, instead of
// calling the broker unreachable.
func TestWorkerLogsARefusedQueueDeclarationAsRefused(t *testing.T) {
	if testing.Short() {
		t.Skip("needs RabbitMQ")
	}
	t.Parallel()
	url := testenv.NewVhost(t)
	testenv.DeclareTaskQueue(t, url, "t.refused") // classic, with priorities
	var out lockedBuffer
	deps := fakeDeps(newFakeStore(), nil)
	deps.Log = slog.New(slog.NewTextHandler(&out, nil))
	deps.Broker = BrokerFunc(func(_ context.Context, types []string, prefetch int) (Source, error) {
		return rabbitmq.DialConsumer(url, "test-worker", rabbitmq.QuorumQueues, types, prefetch, 1)
	})
	w, err := New(Config{
		Info:        registry.Worker{ID: "w1"},
		Concurrency: 1, Lease: 2 * time.Second, Heartbeat: 100 * time.Millisecond,
		ProgressInterval: 10 * time.Millisecond, BackoffBase: time.Millisecond, BackoffMax: 10 * time.Millisecond,
		ShutdownTimeout: time.Second, MaxRunTime: time.Hour, TasksPerMessage: 1,
		LongAfter: time.Hour, ReconnectBackoffMax: 50 * time.Millisecond,
	}, deps, []conveyor.Handler{conveyor.Handle("t.refused", func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) { return nil, nil })})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	require.Eventually(t, func() bool { return strings.Contains(out.String(), "retrying") }, waitLimit, 10*time.Millisecond)
	log := out.String()
	require.Contains(t, log, "queue declaration refused by the broker; retrying")
	require.Contains(t, log, "PRECONDITION_FAILED", "the broker's reason is kept")
	require.Contains(t, log, "AMQP_QUEUE_TYPE", "the variables to check are named")
	require.NotContains(t, log, "broker unreachable")
}
