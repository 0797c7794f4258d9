package rabbitmq

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/conveyorhq/conveyor/internal/outbox"
)

// Publisher publishes outbox messages on one confirming channel.
type Publisher struct {
	conn    *amqp.Connection
	ch      *amqp.Channel
	returns chan amqp.Return
	closed  chan struct{}
	err     atomic.Pointer[amqp.Error]
	blocked atomic.Bool
	// declared remembers the task queues declared on this connection.
	declared map[string]bool
}

// DialPublisher connects, declares the exchanges and puts a channel in
// confirm mode. returnBuffer must be at least the largest batch published at
// once.
func DialPublisher(url string, returnBuffer int, name string) (*Publisher, error) {
	conn, err := dial(url, name)
	if err != nil {
		return nil, err
	}
	p := &Publisher{conn: conn, closed: make(chan struct{}), declared: map[string]bool{}}
	if err := p.open(returnBuffer); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return p, nil
}

func (p *Publisher) open(returnBuffer int) error {
	ch, err := p.conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("confirm mode: %w", err)
	}
	if err := DeclareExchanges(ch); err != nil {
		return err
	}
	p.ch = ch
	p.returns = ch.NotifyReturn(make(chan amqp.Return, returnBuffer))
	connClosed := p.conn.NotifyClose(make(chan *amqp.Error, 1))
	chClosed := ch.NotifyClose(make(chan *amqp.Error, 1))
	blocking := p.conn.NotifyBlocked(make(chan amqp.Blocking, 4))
	go func() {
		for b := range blocking {
			p.blocked.Store(b.Active)
		}
	}()
	go func() {
		var e *amqp.Error
		select {
		case e = <-connClosed:
		case e = <-chClosed:
		}
		if e == nil {
			e = &amqp.Error{Reason: "closed"}
		}
		p.err.Store(e)
		close(p.closed)
	}()
	return nil
}

// Closed is closed when the connection or channel is gone; Err says why.
func (p *Publisher) Closed() <-chan struct{} { return p.closed }

// Err is why the publisher closed, or nil while it is open.
func (p *Publisher) Err() error {
	if e := p.err.Load(); e != nil {
		return e
	}
	return nil
}

// Blocked reports whether the broker is blocking publishers (a memory or
// disk alarm).
func (p *Publisher) Blocked() bool { return p.blocked.Load() }

// Close closes the connection.
func (p *Publisher) Close() error { return p.conn.Close() }

// Publish sends every message persistent, waits for the broker's confirms
// (at most until ctx ends) and says which were confirmed. A message the
// broker nacked, returned as unroutable, or did not confirm in time is
// failed. task.run messages are mandatory and go to the tasks exchange, whose
// queue for the type is declared first; task.cancel messages are broadcast on
// the control exchange and not mandatory: with no worker alive there is
// nobody to tell, and the lease reaper ends such a task.
func (p *Publisher) Publish(ctx context.Context, msgs []outbox.Message) outbox.Outcome {
	var out outbox.Outcome
	pending := make([]*amqp.DeferredConfirmation, len(msgs))
	for i, m := range msgs {
		exchange, mandatory := TasksExchange, true
		if m.Kind == outbox.KindCancel {
			exchange, mandatory = ControlExchange, false
		} else if !p.declared[m.RoutingKey] {
			if err := DeclareTaskQueue(p.ch, m.RoutingKey); err != nil {
				out.Fail(m.ID, err.Error())
				continue
			}
			p.declared[m.RoutingKey] = true
		}
		headers := make(amqp.Table, len(m.Headers))
		for k, v := range m.Headers {
			headers[k] = v
		}
		dc, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, m.RoutingKey, mandatory, false, amqp.Publishing{
			MessageId:    strconv.FormatInt(m.ID, 10),
			ContentType:  "application/json",
			DeliveryMode: amqp.Persistent,
			Priority:     m.Priority,
			Timestamp:    m.CreatedAt,
			Type:         string(m.Kind),
			Headers:      headers,
			Body:         m.Body,
		})
		if err != nil {
			out.Fail(m.ID, "publish: "+err.Error())
			continue
		}
		pending[i] = dc
	}
	for i, dc := range pending {
		if dc == nil {
			continue
		}
		acked, err := dc.WaitContext(ctx)
		switch {
		case err != nil:
			out.Fail(msgs[i].ID, "confirm: "+err.Error())
		case !acked:
			out.Fail(msgs[i].ID, "nacked by the broker")
		}
	}
	// The broker sends basic.return before the ack of the same message, so
	// every return of this batch is already buffered. The returns channel
	// is closed when the connection dies: stop there, or the loop would
	// spin on its zero values.
drain:
	for {
		select {
		case r, open := <-p.returns:
			if !open {
				break drain
			}
			id, err := strconv.ParseInt(r.MessageId, 10, 64)
			if err != nil {
				continue
			}
			delete(p.declared, r.RoutingKey) // its queue is gone: declare it again
			out.Fail(id, fmt.Sprintf("returned: %d %s", r.ReplyCode, r.ReplyText))
		default:
			break drain
		}
	}
	for i, dc := range pending {
		if dc == nil {
			continue
		}
		if _, failed := out.Failed[msgs[i].ID]; !failed {
			out.Published = append(out.Published, msgs[i].ID)
		}
	}
	return out
}
