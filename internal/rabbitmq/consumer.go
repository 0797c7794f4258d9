package rabbitmq

import (
	"encoding/json"
	"fmt"
	"sync"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/conveyorhq/conveyor/internal/outbox"
)

// Delivery is one task.run message for the worker. Ack it once the claim is
// committed (or the message is dropped); a delivery never acked is
// redelivered when the connection closes.
type Delivery struct {
	Body      outbox.Body
	MessageID string
	Queue     string
	// Headers carry the W3C trace context the relay wrote.
	Headers     map[string]string
	Redelivered bool
	// Err is set when the body could not be read; such a delivery can only
	// be rejected.
	Err error
	d   amqp.Delivery
}

// Ack acknowledges the delivery.
func (d Delivery) Ack() error { return d.d.Ack(false) }

// Requeue hands the delivery back to the broker for another consumer.
func (d Delivery) Requeue() error { return d.d.Nack(false, true) }

// Reject drops a delivery that can never be processed.
func (d Delivery) Reject() error { return d.d.Reject(false) }

// Consumer consumes the task queues of the worker's types on one channel
// (prefetch shared by all of them) and the control broadcasts on another.
type Consumer struct {
	conn       *amqp.Connection
	tasks      *amqp.Channel
	control    *amqp.Channel
	deliveries chan Delivery
	cancels    chan uuid.UUID
	closed     chan struct{}
	done       chan struct{}
	doneOnce   sync.Once
	tags       []string
	stopOnce   sync.Once
	err        error
}

// DialConsumer connects, declares the topology the worker needs (the
// exchanges, a durable queue per type, its own exclusive control queue) and
// starts consuming with at most prefetch unacknowledged task messages.
func DialConsumer(url, name string, types []string, prefetch int) (*Consumer, error) {
	conn, err := dial(url, name)
	if err != nil {
		return nil, err
	}
	c := &Consumer{
		conn: conn, deliveries: make(chan Delivery), cancels: make(chan uuid.UUID, 64),
		closed: make(chan struct{}), done: make(chan struct{}),
	}
	if err := c.open(types, prefetch); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return c, nil
}

func (c *Consumer) open(types []string, prefetch int) error {
	var err error
	if c.tasks, err = c.conn.Channel(); err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	if err := DeclareExchanges(c.tasks); err != nil {
		return err
	}
	// global: RabbitMQ applies the limit to the whole channel, shared by
	// the consumers of every type.
	if err := c.tasks.Qos(prefetch, 0, true); err != nil {
		return fmt.Errorf("set prefetch: %w", err)
	}
	for _, typ := range types {
		if err := DeclareTaskQueue(c.tasks, typ); err != nil {
			return err
		}
		q := QueueName(typ)
		tag := fmt.Sprintf("conveyor-%s-%s", typ, uuid.NewString()[:8])
		msgs, err := c.tasks.Consume(q, tag, false, false, false, false, nil)
		if err != nil {
			return fmt.Errorf("consume %s: %w", q, err)
		}
		c.tags = append(c.tags, tag)
		go func() {
			for m := range msgs {
				select {
				case c.deliveries <- toDelivery(q, m):
				case <-c.done:
					return
				}
			}
		}()
	}
	if c.control, err = c.conn.Channel(); err != nil {
		return fmt.Errorf("open control channel: %w", err)
	}
	q, err := c.control.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		return fmt.Errorf("declare control queue: %w", err)
	}
	if err := c.control.QueueBind(q.Name, "", ControlExchange, false, nil); err != nil {
		return fmt.Errorf("bind control queue: %w", err)
	}
	ctl, err := c.control.Consume(q.Name, "", true, true, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume control queue: %w", err)
	}
	go func() {
		for m := range ctl {
			var b outbox.Body
			if json.Unmarshal(m.Body, &b) != nil || b.TaskID == uuid.Nil {
				continue
			}
			select {
			case c.cancels <- b.TaskID:
			case <-c.done:
				return
			}
		}
	}()
	connClosed := c.conn.NotifyClose(make(chan *amqp.Error, 1))
	go func() {
		if e := <-connClosed; e != nil {
			c.err = e
		}
		close(c.closed)
	}()
	return nil
}

func toDelivery(queue string, m amqp.Delivery) Delivery {
	d := Delivery{MessageID: m.MessageId, Queue: queue, Redelivered: m.Redelivered, d: m,
		Headers: make(map[string]string, len(m.Headers))}
	for k, v := range m.Headers {
		if s, ok := v.(string); ok {
			d.Headers[k] = s
		}
	}
	if err := json.Unmarshal(m.Body, &d.Body); err != nil {
		d.Err = fmt.Errorf("read message body: %w", err)
	} else if d.Body.TaskID == uuid.Nil {
		d.Err = fmt.Errorf("message body has no task_id")
	}
	return d
}

// Deliveries yields the task messages.
func (c *Consumer) Deliveries() <-chan Delivery { return c.deliveries }

// Cancels yields the ids of tasks whose cancellation was broadcast.
func (c *Consumer) Cancels() <-chan uuid.UUID { return c.cancels }

// Closed is closed once the connection is gone; Err then says why.
func (c *Consumer) Closed() <-chan struct{} { return c.closed }

// Err is why the connection closed, once Closed is.
func (c *Consumer) Err() error { return c.err }

// StopConsuming asks the broker to send no more task messages. Messages
// already delivered and not acked go back to the queue when the connection
// closes.
func (c *Consumer) StopConsuming() {
	c.stopOnce.Do(func() {
		for _, tag := range c.tags {
			_ = c.tasks.Cancel(tag, false)
		}
	})
}

// Close closes the connection; unacknowledged deliveries are requeued by
// the broker.
func (c *Consumer) Close() error {
	c.doneOnce.Do(func() { close(c.done) })
	return c.conn.Close()
}
