package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Inspector reads the state of task queues, for the maintenance leader,
// which republishes the lost tasks of a type only while the type's queue
// holds no ready message. It has a connection of its own, dialled on first
// use and again after it was lost; each inspection opens a throwaway
// channel, because asking about a missing queue makes the broker close the
// channel. An Inspector is safe for concurrent use; inspections are
// serialised.
type Inspector struct {
	url, name string

	mu     sync.Mutex
	conn   *amqp.Connection
	closed bool
}

// NewInspector returns an inspector of the broker at url; name is the
// connection name the broker shows. It does not connect yet.
func NewInspector(url, name string) *Inspector {
	return &Inspector{url: url, name: name}
}

// QueueReady says how many messages of taskType's queues (single and
// packed) are ready (not delivered to a consumer), and whether both exist,
// as a worker of the type declares them: a missing queue is not an error
// but exists=false, for no worker of the type has declared it (the
// messages parked for want of it must wait). It asks with a passive
// declare, which neither creates the queue nor changes it.
//
// When ctx ends before the broker answers, the connection is closed (the
// next call dials again) and ctx's error returned. Dialling itself is bounded
// by the dial timeout, not by ctx.
func (i *Inspector) QueueReady(ctx context.Context, taskType string) (ready int, exists bool, err error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.closed {
		return 0, false, errors.New("rabbitmq: inspector closed")
	}
	if err := ctx.Err(); err != nil {
		return 0, false, err
	}
	if i.conn == nil || i.conn.IsClosed() {
		conn, err := dial(i.url, i.name)
		if err != nil {
			return 0, false, err
		}
		i.conn = conn
	}
	conn := i.conn
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()

	exists = true
	for _, q := range []string{QueueName(taskType), PackedQueueName(taskType)} {
		ch, err := conn.Channel()
		if err != nil {
			return 0, false, ctxOr(ctx, fmt.Errorf("inspect %s: open channel: %w", q, err))
		}
		st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		if err != nil {
			// The broker closed the channel with the error; nothing to close.
			var ae *amqp.Error
			if errors.As(err, &ae) && ae.Code == amqp.NotFound {
				if q == PackedQueueName(taskType) {
					// Declared by workers older than packing, or deleted:
					// none ready.
					exists = false
					continue
				}
				return 0, false, nil
			}
			return 0, false, ctxOr(ctx, fmt.Errorf("inspect %s: %w", q, err))
		}
		_ = ch.Close()
		ready += st.Messages
	}
	return ready, exists, nil
}

// ctxOr is ctx's error once ctx has ended (the failure came from closing the
// connection on its account), err otherwise.
func ctxOr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// Close closes the connection, if any; the inspector cannot be used after.
func (i *Inspector) Close() error {
	i.mu.Lock()
	defer i.mu.Unlock()
	i.closed = true
	if i.conn == nil {
		return nil
	}
	if err := i.conn.Close(); err != nil && !errors.Is(err, amqp.ErrClosed) {
		return err
	}
	return nil
}
