package rabbitmq_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
)

const wait = 15 * time.Second

func dialConsumer(t *testing.T, v vhost, types ...string) *rabbitmq.Consumer {
	t.Helper()
	c, err := rabbitmq.DialConsumer(v.url, "test-consumer", rabbitmq.ClassicQueues, types, 4, 4)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// dialPublisher dials a publisher that packs nothing.
func dialPublisher(t *testing.T, v vhost) *rabbitmq.Publisher {
	t.Helper()
	return dialPacking(t, v, 1)
}

func runMessage(id int64, taskType string) outbox.Message {
	return outbox.Message{
		ID: id, Kind: outbox.KindRun, TaskID: uuid.New(), TaskType: taskType,
		Attempt: 2, TaskVersion: 5, Priority: 3,
		Headers:   map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		CreatedAt: time.Now().Truncate(time.Second),
	}
}

// next waits for the next value of ch, failing t if c stops first.
func next[T any](t *testing.T, c *rabbitmq.Consumer, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-c.Done():
		t.Fatalf("%s: consumer stopped: %v", what, c.Err())
	case <-time.After(wait):
		t.Fatalf("%s: nothing within %s", what, wait)
	}
	var zero T
	return zero
}

// requireOpen fails t if c has stopped.
func requireOpen(t *testing.T, c *rabbitmq.Consumer) {
	t.Helper()
	select {
	case <-c.Done():
		t.Fatalf("consumer stopped: %v", c.Err())
	default:
		require.NoError(t, c.Err())
	}
}

// Task messages arrive as outbox deliveries whose body, headers and queue
// are read, and whose acknowledger settles them; unreadable bodies arrive
// with Err set.
func TestConsumerDeliversTaskMessages(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c := dialConsumer(t, v, "a", "b")
	p := dialPublisher(t, v)

	ma, mb := runMessage(1, "a"), runMessage(2, "b")
	out := p.Publish(context.Background(), []outbox.Message{ma, mb})
	require.ElementsMatch(t, []int64{1, 2}, out.Published, "%+v", out)

	got := map[string]outbox.Delivery{}
	for range 2 {
		d := next(t, c, c.Deliveries(), "delivery")
		require.NoError(t, d.Err)
		got[d.MessageID] = d
	}
	for id, m := range map[string]outbox.Message{"1": ma, "2": mb} {
		d := got[id]
		require.Equal(t, m.Body(), d.Body)
		require.Equal(t, rabbitmq.QueueName(m.TaskType), d.Queue)
		require.Equal(t, m.Headers, d.Headers)
		require.False(t, d.Redelivered)
		require.NoError(t, d.Ack())
	}

	ch := channel(t, v)
	for _, body := range []string{`not json`, `{"task_id":"00000000-0000-0000-0000-000000000000","type":"a"}`} {
		require.NoError(t, ch.Publish(rabbitmq.TasksExchange, "a", false, false, amqp.Publishing{Body: []byte(body)}))
		d := next(t, c, c.Deliveries(), "unreadable delivery")
		require.Error(t, d.Err, body)
		require.NoError(t, d.Reject())
	}

	// A requeued delivery comes back, marked redelivered.
	mr := runMessage(3, "a")
	require.Equal(t, []int64{3}, p.Publish(context.Background(), []outbox.Message{mr}).Published)
	d := next(t, c, c.Deliveries(), "delivery")
	require.NoError(t, d.Requeue())
	d = next(t, c, c.Deliveries(), "redelivery")
	require.Equal(t, "3", d.MessageID)
	require.True(t, d.Redelivered)
	require.NoError(t, d.Ack())
	requireOpen(t, c)
}

// A queue delivers what waits in it by priority, as many priorities as it
// keeps apart: higher ones count as its highest, and a queue without
// priorities delivers in publication order.
func TestQueuesDeliverByTheirPriorities(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		qs   rabbitmq.Queues
		want []string // message ids, published with priorities 0, 5, 9
	}{
		{"all", rabbitmq.ClassicQueues, []string{"3", "2", "1"}},
		{"four", rabbitmq.Queues{Type: rabbitmq.Classic, MaxPriority: 4}, []string{"2", "3", "1"}},
		{"none", rabbitmq.Queues{Type: rabbitmq.Classic}, []string{"1", "2", "3"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			v := newVhost(t)
			ch := channel(t, v)
			require.NoError(t, rabbitmq.DeclareExchanges(ch))
			require.NoError(t, rabbitmq.DeclareTaskQueueOf(ch, "a", tt.qs))
			var msgs []outbox.Message
			for i, priority := range []uint8{0, 5, 9} {
				m := runMessage(int64(i+1), "a")
				m.Priority = priority
				msgs = append(msgs, m)
			}
			require.Len(t, dialPublisher(t, v).Publish(context.Background(), msgs).Published, 3)

			c, err := rabbitmq.DialConsumer(v.url, "test-consumer", tt.qs, []string{"a"}, 1, 1)
			require.NoError(t, err)
			t.Cleanup(func() { _ = c.Close() })
			var got []string
			for range msgs {
				d := next(t, c, c.Deliveries(), "delivery")
				got = append(got, d.MessageID)
				require.NoError(t, d.Ack())
			}
			require.Equal(t, tt.want, got)
		})
	}
}

// StopConsuming ends the task consumers without closing Done, and cancel
// broadcasts are still heard.
func TestConsumerStopConsumingKeepsControl(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c := dialConsumer(t, v, "a")
	p := dialPublisher(t, v)

	c.StopConsuming()
	c.StopConsuming() // idempotent

	run := runMessage(1, "a")
	cancel := runMessage(2, "a")
	cancel.Kind, cancel.TaskVersion = outbox.KindCancel, 9
	out := p.Publish(context.Background(), []outbox.Message{run, cancel})
	require.ElementsMatch(t, []int64{1, 2}, out.Published, "%+v", out)

	got := next(t, c, c.Cancels(), "cancel")
	require.Equal(t, outbox.Cancel{TaskID: cancel.TaskID, Version: 9}, got)

	// The task message stays in its queue, not delivered.
	in := rabbitmq.NewInspector(v.url, "test-inspector")
	defer func() { _ = in.Close() }()
	eventually(t, wait, func() error {
		ready, _, err := in.QueueReady(context.Background(), "a")
		if err == nil && ready != 1 {
			err = fmt.Errorf("ready %d, want 1", ready)
		}
		return err
	})
	select {
	case d := <-c.Deliveries():
		t.Fatalf("delivery after StopConsuming: %+v", d)
	default:
	}
	requireOpen(t, c)
}

// A cancel broadcast reaches every worker, with the version it cancels;
// unreadable broadcasts are skipped.
func TestCancelBroadcastReachesEveryConsumer(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c1 := dialConsumer(t, v, "a")
	c2 := dialConsumer(t, v, "b")
	p := dialPublisher(t, v)

	ch := channel(t, v)
	require.NoError(t, ch.Publish(rabbitmq.ControlExchange, "", false, false, amqp.Publishing{Body: []byte("garbage")}))

	m := runMessage(7, "a")
	m.Kind, m.TaskVersion = outbox.KindCancel, 4
	out := p.Publish(context.Background(), []outbox.Message{m})
	require.Equal(t, []int64{7}, out.Published, "%+v", out)

	for _, c := range []*rabbitmq.Consumer{c1, c2} {
		require.Equal(t, outbox.Cancel{TaskID: m.TaskID, Version: 4}, next(t, c, c.Cancels(), "cancel"))
	}
}

// Deleting a consumed queue makes the broker cancel its consumer: Done
// closes and Err names the queue.
func TestConsumerDoneWhenQueueDeleted(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c := dialConsumer(t, v, "x", "y")

	_, err := channel(t, v).QueueDelete(rabbitmq.QueueName("x"), false, false, false)
	require.NoError(t, err)

	within(t, c.Done(), wait, "Done")
	require.ErrorContains(t, c.Err(), "consumer of conveyor.task.x cancelled by the broker")
	require.NoError(t, c.Close())
	require.ErrorContains(t, c.Err(), "cancelled by the broker", "Close keeps the first cause")
}

// Deleting the worker's control queue cancels the control consumer: a worker
// that could no longer hear cancels must not look healthy.
func TestConsumerDoneWhenControlQueueDeleted(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c := dialConsumer(t, v, "x")

	q := controlQueue(t, v)
	ctl(t, "delete_queue", "-p", v.name, q)

	within(t, c.Done(), wait, "Done")
	require.ErrorContains(t, c.Err(), "consumer of the control queue "+q+" cancelled by the broker")
}

// A connection the broker closes closes Done; Err carries the broker's
// reason.
func TestConsumerDoneWhenBrokerClosesConnection(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c := dialConsumer(t, v, "x")

	ctl(t, "close_all_connections", "-p", v.name, "test closes the connection")

	within(t, c.Done(), wait, "Done")
	require.ErrorContains(t, c.Err(), "rabbitmq: connection closed")
	var ae *amqp.Error
	require.ErrorAs(t, c.Err(), &ae)
	require.Equal(t, amqp.ConnectionForced, ae.Code)
	require.NoError(t, c.Close(), "closing a connection the broker closed is no error")
}

// A channel exception on the task channel (here: a delivery rejected
// twice, 406 PRECONDITION_FAILED unknown delivery tag) closes Done. (Two
// acks would not do: the consumer's settler sends acks of a contiguous run
// of tags as one frame.)
func TestConsumerDoneWhenTaskChannelFails(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c := dialConsumer(t, v, "x")
	p := dialPublisher(t, v)

	require.Equal(t, []int64{1}, p.Publish(context.Background(), []outbox.Message{runMessage(1, "x")}).Published)
	d := next(t, c, c.Deliveries(), "delivery")
	require.NoError(t, d.Reject())
	require.NoError(t, d.Reject()) // asynchronous: the broker answers by closing the channel

	within(t, c.Done(), wait, "Done")
	require.ErrorContains(t, c.Err(), "rabbitmq: task channel closed")
	var ae *amqp.Error
	require.ErrorAs(t, c.Err(), &ae)
	require.Equal(t, amqp.PreconditionFailed, ae.Code)
}

// Close by the owner closes Done with ErrClosed, and every way a consumer
// ends leaves no goroutine behind once it is closed. Not parallel: the
// goroutine count is the whole test binary's, and parallel tests only start
// once the sequential ones are over.
func TestConsumerCloseEndsGoroutines(t *testing.T) {
	for _, tc := range []struct {
		name    string
		end     func(t *testing.T, v vhost)
		wantErr string
	}{
		{name: "closed by the owner", wantErr: rabbitmq.ErrClosed.Error()},
		{
			name: "queue deleted",
			end: func(t *testing.T, v vhost) {
				conn, err := amqp.Dial(v.url)
				require.NoError(t, err)
				defer func() { _ = conn.Close() }()
				ch, err := conn.Channel()
				require.NoError(t, err)
				_, err = ch.QueueDelete(rabbitmq.QueueName("x"), false, false, false)
				require.NoError(t, err)
			},
			wantErr: "consumer of conveyor.task.x cancelled by the broker",
		},
		{
			name:    "connection closed by the broker",
			end:     func(t *testing.T, v vhost) { ctl(t, "close_all_connections", "-p", v.name, "test") },
			wantErr: "rabbitmq: connection closed",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := newVhost(t)
			runtime.GC()
			baseline := runtime.NumGoroutine()

			c, err := rabbitmq.DialConsumer(v.url, "test-consumer", rabbitmq.ClassicQueues, []string{"x", "y"}, 4, 4)
			require.NoError(t, err)
			require.Greater(t, runtime.NumGoroutine(), baseline)
			if tc.end != nil {
				tc.end(t, v)
				within(t, c.Done(), wait, "Done")
			}
			require.NoError(t, c.Close())
			require.NoError(t, c.Close(), "second Close")
			within(t, c.Done(), wait, "Done")
			require.ErrorContains(t, c.Err(), tc.wantErr)
			if tc.end == nil {
				require.True(t, errors.Is(c.Err(), rabbitmq.ErrClosed))
			}
			eventually(t, wait, func() error {
				if n := runtime.NumGoroutine(); n > baseline {
					buf := make([]byte, 1<<16)
					return fmt.Errorf("%d goroutines, baseline %d:\n%s", n, baseline, buf[:runtime.Stack(buf, true)])
				}
				return nil
			})
		})
	}
}

// A prefetch of 0 lets no single message through (in AMQP it would be no
// limit at all): the consumers of single messages pause, and consume again
// once SetPrefetch gives them credit. A consumer dialled with 0 starts
// paused. Packed messages are not concerned.
func TestConsumerTakesNoSingleMessageAtPrefetchZero(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c, err := rabbitmq.DialConsumer(v.url, "test-consumer", rabbitmq.ClassicQueues, []string{"a"}, 0, 4)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	p := dialPublisher(t, v)
	require.Len(t, p.Publish(context.Background(), []outbox.Message{runMessage(1, "a"), runMessage(2, "a")}).Published, 2)
	nothing := func(what string) {
		t.Helper()
		select {
		case d := <-c.Deliveries():
			t.Fatalf("%s: delivered %s", what, d.MessageID)
		case <-time.After(300 * time.Millisecond):
		}
	}
	nothing("dialled with no credit")
	requireStats(t, v, map[string]string{rabbitmq.QueueName("a"): "classic\t2\t0"})

	require.NoError(t, c.SetPrefetch(1))
	d := next(t, c, c.Deliveries(), "delivery once given credit")
	require.Equal(t, "1", d.MessageID)
	require.NoError(t, c.SetPrefetch(0))
	require.NoError(t, d.Requeue())
	nothing("paused")
	requireStats(t, v, map[string]string{rabbitmq.QueueName("a"): "classic\t2\t0"})

	require.NoError(t, c.SetPrefetch(2))
	for range 2 {
		require.NoError(t, next(t, c, c.Deliveries(), "delivery after resuming").Ack())
	}
	requireStats(t, v, map[string]string{rabbitmq.QueueName("a"): "classic\t0\t0"})
	requireOpen(t, c)
}
