package rabbitmq_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
)

// A missing queue is exists=false without error, and the inspector goes on
// working after the broker closed the channel of that question; a queue's
// ready messages are counted.
func TestQueueReady(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	in := rabbitmq.NewInspector(v.url, "test-inspector")
	defer func() { _ = in.Close() }()
	ctx := context.Background()

	ready, exists, err := in.QueueReady(ctx, "missing")
	require.NoError(t, err)
	require.False(t, exists)
	require.Zero(t, ready)

	declareQueue(t, v, "three")
	ready, exists, err = in.QueueReady(ctx, "three")
	require.NoError(t, err)
	require.True(t, exists)
	require.Zero(t, ready)

	p := dialPublisher(t, v)
	out := p.Publish(ctx, []outbox.Message{runMessage(1, "three"), runMessage(2, "three"), runMessage(3, "three")})
	require.Len(t, out.Published, 3, "%+v", out)
	eventually(t, wait, func() error {
		ready, exists, err := in.QueueReady(ctx, "three")
		if err == nil && (!exists || ready != 3) {
			err = fmt.Errorf("ready %d exists %v, want 3 true", ready, exists)
		}
		return err
	})

	// A type whose packed queue is missing has its ready messages
	// counted, but is not declared: a packed message parked for want of
	// that queue must wait.
	_, err = channel(t, v).QueueDelete(rabbitmq.PackedQueueName("three"), false, false, false)
	require.NoError(t, err)
	ready, exists, err = in.QueueReady(ctx, "three")
	require.NoError(t, err)
	require.False(t, exists)
	require.Equal(t, 3, ready)

	canceled, cancel := context.WithCancel(ctx)
	cancel()
	_, _, err = in.QueueReady(canceled, "three")
	require.ErrorIs(t, err, context.Canceled)

	require.NoError(t, in.Close())
	_, _, err = in.QueueReady(ctx, "three")
	require.Error(t, err, "closed inspector")
}
