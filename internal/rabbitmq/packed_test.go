package rabbitmq_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// dialPacking dials a publisher that packs up to pack tasks a message.
func dialPacking(t *testing.T, v vhost, pack int) *rabbitmq.Publisher {
	t.Helper()
	p, err := rabbitmq.DialPublisher(v.url, 16, "test-publisher", pack)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// runMessages are task.run messages of a type and priority, ids from first,
// each with a trace context of its own.
func runMessages(first int64, n int, taskType string, priority uint8) []outbox.Message {
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		m := runMessage(first+int64(i), taskType)
		m.Priority = priority
		m.Headers = map[string]string{"traceparent": fmt.Sprintf("00-0af7651916cd43dd8448eb211c80319c-%016x-01", m.ID)}
		msgs[i] = m
	}
	return msgs
}

// requireStats waits until the queues' "type ready unacked" read want.
func requireStats(t *testing.T, v vhost, want map[string]string) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, func() error {
		got := queueStats(t, v)
		for q, w := range want {
			if got[q] != w {
				return fmt.Errorf("%s: %q, want %q (all: %v)", q, got[q], w, got)
			}
		}
		return nil
	})
}

// The task.run messages of a batch that share a type and a priority go
// out packed, up to the publisher's pack a message, into the type's
// packed queue; the rest go alone. Each task arrives as a delivery of its
// own, with its own body and trace context.
func TestPublisherPacksTasksOfOneTypeAndPriority(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c := dialConsumer(t, v, "a", "b")
	p := dialPacking(t, v, 3)

	msgs := runMessages(1, 4, "a", 5)                 // 1 2 3 packed, 4 alone
	msgs = append(msgs, runMessages(5, 1, "a", 9)...) // alone: another priority
	msgs = append(msgs, runMessages(6, 1, "b", 5)...) // alone: another type
	msgs = append(msgs, outbox.Message{ID: 7, Kind: outbox.KindCancel, TaskID: uuid.New(), TaskType: "a"})
	out := p.Publish(context.Background(), msgs)
	require.ElementsMatch(t, []int64{1, 2, 3, 4, 5, 6, 7}, out.Published, "%+v", out)
	require.Equal(t, 5, out.Messages, "1 2 3 in one message, 4 to 7 each alone")
	requireStats(t, v, map[string]string{
		rabbitmq.PackedQueueName("a"): "classic\t0\t1",
		rabbitmq.QueueName("a"):       "classic\t0\t2",
		rabbitmq.QueueName("b"):       "classic\t0\t1",
	})

	got := map[int64]outbox.Delivery{}
	for range 6 {
		d := next(t, c, c.Deliveries(), "delivery")
		require.NoError(t, d.Err)
		for _, m := range msgs {
			if m.TaskID == d.Body.TaskID {
				got[m.ID] = d
				require.Equal(t, m.Body(), d.Body)
				require.Equal(t, m.Headers, d.Headers, "its own trace context")
			}
		}
	}
	require.Len(t, got, 6)
	for id, d := range got {
		require.Equal(t, id <= 3, d.Packed, "task %d", id)
		if id <= 3 {
			require.Equal(t, "1", d.MessageID, "a packed message's id is its first task's")
			require.Equal(t, rabbitmq.PackedQueueName("a"), d.Queue)
		}
		require.NoError(t, d.Ack())
	}
	requireStats(t, v, map[string]string{
		rabbitmq.PackedQueueName("a"): "classic\t0\t0",
		rabbitmq.QueueName("a"):       "classic\t0\t0",
		rabbitmq.QueueName("b"):       "classic\t0\t0",
	})
	requireOpen(t, c)
}

// A packed message is settled once for all its tasks: acknowledged when
// the last of them is, and requeued as soon as one is requeued, its tasks
// not yet offered then staying unyielded; what its other tasks do after
// that settles nothing (a second settlement would close the channel), nor
// does a task's second settlement.
func TestPackedMessageIsSettledOnceForItsTasks(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c := dialConsumer(t, v, "a")
	p := dialPacking(t, v, 3)
	packed := rabbitmq.PackedQueueName("a")

	require.Len(t, p.Publish(context.Background(), runMessages(1, 3, "a", 5)).Published, 3)
	first := []outbox.Delivery{next(t, c, c.Deliveries(), "task 1"), next(t, c, c.Deliveries(), "task 2")}
	for _, d := range first {
		require.NoError(t, d.Ack())
	}
	require.NoError(t, first[0].Ack(), "a task's second settlement counts for nothing")
	requireStats(t, v, map[string]string{packed: "classic\t0\t1"})
	require.NoError(t, next(t, c, c.Deliveries(), "task 3").Ack())
	requireStats(t, v, map[string]string{packed: "classic\t0\t0"})

	msgs := runMessages(4, 3, "a", 5)
	require.Len(t, p.Publish(context.Background(), msgs).Published, 3)
	d := next(t, c, c.Deliveries(), "task 4")
	require.Equal(t, msgs[0].TaskID, d.Body.TaskID)
	require.False(t, d.Redelivered)
	require.NoError(t, d.Requeue())
	require.NoError(t, d.Ack(), "settles nothing more")

	// The message comes back whole. The forwarder may still hand over the
	// task it was offering when the message was settled (task 5), whose
	// settlement then does nothing; task 6 of the first delivery is never
	// yielded.
	var redelivered []uuid.UUID
	for len(redelivered) < len(msgs) {
		d := next(t, c, c.Deliveries(), "redelivered task")
		if !d.Redelivered {
			require.Equal(t, msgs[1].TaskID, d.Body.TaskID, "only the task on offer comes after the requeue")
		} else {
			redelivered = append(redelivered, d.Body.TaskID)
		}
		require.NoError(t, d.Ack())
	}
	require.Equal(t, []uuid.UUID{msgs[0].TaskID, msgs[1].TaskID, msgs[2].TaskID}, redelivered)
	requireStats(t, v, map[string]string{packed: "classic\t0\t0"})
	requireOpen(t, c)
}

// The tasks of a packed message that no queue takes are all parked.
func TestPackedMessageWithoutAQueueIsUnroutableForEachTask(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	ch := channel(t, v)
	require.NoError(t, rabbitmq.DeclareExchanges(ch))
	out := dialPacking(t, v, 4).Publish(context.Background(), runMessages(1, 3, "nobody", 5))
	require.Empty(t, out.Published)
	require.Empty(t, out.Failed)
	require.Len(t, out.Unroutable, 3)
	for id, reason := range out.Unroutable {
		require.Contains(t, reason, `no queue for type "nobody"`, "task %d", id)
	}
}

// Paused, the packed queues' consumers get nothing new, while single
// messages still arrive; resumed, the packed messages that waited come.
func TestConsumerPausesAndResumesThePackedQueues(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c := dialConsumer(t, v, "a")
	p := dialPacking(t, v, 3)

	require.NoError(t, c.PausePacked())
	require.NoError(t, c.PausePacked(), "pausing twice is pausing")
	require.Len(t, p.Publish(context.Background(), runMessages(1, 3, "a", 5)).Published, 3)
	require.Len(t, p.Publish(context.Background(), runMessages(4, 1, "a", 5)).Published, 1)
	d := next(t, c, c.Deliveries(), "single message")
	require.False(t, d.Packed)
	require.NoError(t, d.Ack())
	select {
	case d := <-c.Deliveries():
		t.Fatalf("delivered while paused: %+v", d.Body)
	case <-time.After(300 * time.Millisecond):
	}
	requireStats(t, v, map[string]string{rabbitmq.PackedQueueName("a"): "classic\t1\t0"})

	require.NoError(t, c.ResumePacked())
	for range 3 {
		d := next(t, c, c.Deliveries(), "packed task after resuming")
		require.True(t, d.Packed)
		require.NoError(t, d.Ack())
	}
	requireStats(t, v, map[string]string{rabbitmq.PackedQueueName("a"): "classic\t0\t0"})
	requireOpen(t, c)
}

// The packed queues' prefetch changes while their consumers run, as the
// single messages' does: a worker's read-ahead moves it.
func TestConsumerSetsThePackedPrefetchWhileConsuming(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c, err := rabbitmq.DialConsumer(v.url, "test-consumer", rabbitmq.ClassicQueues, []string{"a"}, 4, 1)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	p := dialPacking(t, v, 2)
	for i := range 3 {
		require.Len(t, p.Publish(context.Background(), runMessages(int64(1+2*i), 2, "a", 5)).Published, 2)
	}
	var held []outbox.Delivery
	for range 2 {
		held = append(held, next(t, c, c.Deliveries(), "a task of the first packed message"))
	}
	requireStats(t, v, map[string]string{rabbitmq.PackedQueueName("a"): "classic\t2\t1"})

	require.NoError(t, c.SetPackedPrefetch(3))
	for range 4 {
		held = append(held, next(t, c, c.Deliveries(), "a task of the packed messages the new prefetch lets through"))
	}
	requireStats(t, v, map[string]string{rabbitmq.PackedQueueName("a"): "classic\t0\t3"})
	for _, d := range held {
		require.True(t, d.Packed)
		require.NoError(t, d.Ack())
	}
	requireStats(t, v, map[string]string{rabbitmq.PackedQueueName("a"): "classic\t0\t0"})
	requireOpen(t, c)
}
