package rabbitmq

import (
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/conveyorhq/conveyor/internal/outbox"
)

// ErrClosed is the Err of a consumer its owner closed.
var ErrClosed = errors.New("rabbitmq: consumer closed")

// Consumer consumes the task queues of a worker's types on one channel and
// the control broadcasts on another channel, from an exclusive queue of its
// own. On classic queues the task channel's prefetch is shared by all the
// types; quorum queues support no channel-wide prefetch, so there each
// type's consumer gets the whole credit (see DialConsumer).
//
// A consumer does not recover: once anything it depends on is lost (the
// connection, either channel, a consumer the broker cancelled because its
// queue was deleted or a node went down, a deliveries stream that ended) Done
// is closed, Err says what happened, and the consumer stops forwarding: a
// delivery or cancel already on its way may still be yielded, then none. The
// owner then closes it and dials a new one. Close must be called in every
// case: it ends the consumer's goroutines.
type Consumer struct {
	conn    *amqp.Connection
	qs      Queues
	tasks   *amqp.Channel
	settler *settler // of the tasks channel
	control *amqp.Channel
	// queues maps the consumer tag of each task queue to the queue.
	queues map[string]string

	deliveries chan outbox.Delivery
	cancels    chan outbox.Cancel
	// lost receives the queue whose deliveries stream ended while the
	// consumer was not stopping; the watcher finds out why.
	lost chan string

	done     chan struct{} // closed once, by fail
	failOnce sync.Once
	errMu    sync.Mutex
	err      error

	quit      chan struct{} // closed by Close: the watcher returns
	closeOnce sync.Once
	wg        sync.WaitGroup

	stopOnce sync.Once
	stopping atomic.Bool
}

// DialConsumer connects to a node of url (see ParseURLs), declares the
// topology the worker needs (the exchanges, a durable queue per type as qs
// says, its own exclusive control queue) and starts consuming. name is the
// connection name the broker shows.
//
// prefetch bounds the unacknowledged task messages. On classic queues the
// bound is channel-wide (global QoS): prefetch over all the types. Quorum
// queues refuse a consumer on a channel with global QoS (the broker closes
// the connection with NOT_IMPLEMENTED), so there the bound is per consumer:
// each type's queue may have prefetch messages unacknowledged, and a worker
// of n types may hold up to n times prefetch.
func DialConsumer(url, name string, qs Queues, types []string, prefetch int) (*Consumer, error) {
	conn, err := dial(url, name)
	if err != nil {
		return nil, err
	}
	c := &Consumer{
		conn:       conn,
		qs:         qs,
		queues:     make(map[string]string, len(types)),
		deliveries: make(chan outbox.Delivery),
		cancels:    make(chan outbox.Cancel, 64),
		lost:       make(chan string, len(types)+1),
		done:       make(chan struct{}),
		quit:       make(chan struct{}),
	}
	if err := c.open(types, prefetch); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return c, nil
}

// open sets everything up, then starts the goroutines: a failure before
// that leaves none behind once the connection is closed.
func (c *Consumer) open(types []string, prefetch int) error {
	w := &watcher{c: c, conn: c.conn.NotifyClose(make(chan *amqp.Error, 1))}
	var err error
	if c.tasks, err = c.conn.Channel(); err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	// Listen before consuming, so that no close or cancel goes unheard.
	// The cancel buffers hold one tag per consumer: amqp091 waits a while
	// for a full listener, holding up the connection's reader meanwhile.
	w.tasks = c.tasks.NotifyClose(make(chan *amqp.Error, 1))
	w.tasksCancel = c.tasks.NotifyCancel(make(chan string, len(types)+1))
	if err := DeclareExchanges(c.tasks); err != nil {
		return err
	}
	if err := c.qos(prefetch); err != nil {
		return fmt.Errorf("set prefetch: %w", err)
	}
	streams := make(map[string]<-chan amqp.Delivery, len(types))
	for _, typ := range types {
		if err := DeclareTaskQueueOf(c.tasks, typ, c.qs); err != nil {
			return err
		}
		q := QueueName(typ)
		tag := fmt.Sprintf("conveyor-%s-%s", typ, uuid.NewString()[:8])
		msgs, err := c.tasks.Consume(q, tag, false, false, false, false, nil)
		if err != nil {
			return fmt.Errorf("consume %s: %w", q, err)
		}
		c.queues[tag] = q
		streams[tag] = msgs
	}

	if c.control, err = c.conn.Channel(); err != nil {
		return fmt.Errorf("open control channel: %w", err)
	}
	w.control = c.control.NotifyClose(make(chan *amqp.Error, 1))
	w.controlCancel = c.control.NotifyCancel(make(chan string, 1))
	q, err := c.control.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		return fmt.Errorf("declare control queue: %w", err)
	}
	if err := c.control.QueueBind(q.Name, "", ControlExchange, false, nil); err != nil {
		return fmt.Errorf("bind control queue: %w", err)
	}
	w.controlQueue = q.Name
	ctl, err := c.control.Consume(q.Name, "", true, true, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume control queue: %w", err)
	}

	c.settler = newSettler(c.tasks)
	c.wg.Add(len(streams) + 2)
	for tag, msgs := range streams {
		go c.forward(c.queues[tag], msgs)
	}
	go c.forwardCancels(q.Name, ctl)
	go w.run()
	return nil
}

// forward passes the deliveries of one task queue to Deliveries, one at a
// time: the channel is unbuffered so the caller decides when it takes the
// next one.
func (c *Consumer) forward(queue string, msgs <-chan amqp.Delivery) {
	defer c.wg.Done()
	for {
		select {
		case <-c.done:
			// Not taken, not acked: the broker requeues the message
			// when the connection closes.
			return
		case m, open := <-msgs:
			if !open {
				if !c.stopping.Load() {
					c.lost <- queue
				}
				return
			}
			select {
			case c.deliveries <- toDelivery(queue, m, c.settler):
			case <-c.done:
				return
			}
		}
	}
}

// forwardCancels passes the readable cancel broadcasts to Cancels.
func (c *Consumer) forwardCancels(queue string, msgs <-chan amqp.Delivery) {
	defer c.wg.Done()
	for {
		select {
		case <-c.done:
			return
		case m, open := <-msgs:
			if !open {
				c.lost <- queue
				return
			}
			var b outbox.Body
			if json.Unmarshal(m.Body, &b) != nil || b.TaskID == uuid.Nil {
				continue
			}
			select {
			case c.cancels <- outbox.Cancel{TaskID: b.TaskID, Version: b.Version}:
			case <-c.done:
				return
			}
		}
	}
}

func toDelivery(queue string, m amqp.Delivery, s *settler) outbox.Delivery {
	d := outbox.Delivery{
		MessageID:    m.MessageId,
		Exchange:     m.Exchange,
		Queue:        queue,
		Redelivered:  m.Redelivered,
		Headers:      make(map[string]string, len(m.Headers)),
		Acknowledger: acker{s: s, tag: m.DeliveryTag},
	}
	for k, v := range m.Headers {
		if s, ok := v.(string); ok {
			d.Headers[k] = s
		}
	}
	if err := json.Unmarshal(m.Body, &d.Body); err != nil {
		d.Err = fmt.Errorf("read message body: %w", err)
	} else if d.Body.TaskID == uuid.Nil {
		d.Err = errors.New("message body has no task_id")
	}
	return d
}

// acker settles one delivery through the settler of the channel it came
// from: it keeps the delivery's tag, not the whole amqp.Delivery and its
// body.
type acker struct {
	s   *settler
	tag uint64
}

func (a acker) Ack() error     { return a.s.ack(a.tag) }
func (a acker) Requeue() error { return a.s.nack(a.tag, true) }
func (a acker) Reject() error  { return a.s.nack(a.tag, false) }

// Deliveries yields the task messages. A delivery must be settled (Ack,
// Requeue or Reject) on this consumer while it is open; one never settled
// is redelivered once the connection closes.
func (c *Consumer) Deliveries() <-chan outbox.Delivery { return c.deliveries }

// Cancels yields the cancel broadcasts; unreadable ones are skipped.
func (c *Consumer) Cancels() <-chan outbox.Cancel { return c.cancels }

// Done is closed once the consumer has stopped for good: the connection or
// a channel closed, the broker cancelled a consumer, or Close was called.
// Err then says why.
func (c *Consumer) Done() <-chan struct{} { return c.done }

// Err is why Done was closed, or nil while it is not. Errors from the broker
// wrap its *amqp.Error.
func (c *Consumer) Err() error {
	c.errMu.Lock()
	defer c.errMu.Unlock()
	return c.err
}

// fail records the first cause and closes Done.
func (c *Consumer) fail(err error) {
	c.failOnce.Do(func() {
		c.errMu.Lock()
		c.err = err
		c.errMu.Unlock()
		close(c.done)
	})
}

// SetPrefetch changes how many task messages may be unacknowledged at once.
// On classic queues the limit is channel-wide, shared by the queues of
// every type, and the broker applies it to its next deliveries. On quorum
// queues it is per consumer, and RabbitMQ applies a per-consumer QoS only
// to consumers started after it: the consumers of this connection keep the
// prefetch they were started with, and the new value holds from the next
// connection on.
func (c *Consumer) SetPrefetch(n int) error {
	if err := c.qos(n); err != nil {
		return fmt.Errorf("set prefetch %d: %w", n, err)
	}
	return nil
}

// qos sets the task channel's prefetch: channel-wide (global) on classic
// queues, per consumer on quorum queues, which support nothing else.
func (c *Consumer) qos(n int) error {
	return c.tasks.Qos(n, 0, c.qs.Type != Quorum)
}

// StopConsuming asks the broker to send no more task messages; the control
// consumer keeps running, so cancel broadcasts are still heard while the
// handlers finish. Task messages delivered before the broker stopped are
// still yielded (hand them back with Requeue); messages not settled go back
// to their queue when the connection closes. Stopping does not close Done.
func (c *Consumer) StopConsuming() {
	c.stopOnce.Do(func() {
		c.stopping.Store(true)
		for tag := range c.queues {
			_ = c.tasks.Cancel(tag, false)
		}
	})
}

// Close closes Done (Err is then ErrClosed unless the consumer had already
// stopped), closes the connection, whose unsettled deliveries the broker
// requeues, and returns once every goroutine of the consumer has ended.
// Close is safe to call more than once and concurrently.
func (c *Consumer) Close() error {
	var err error
	c.closeOnce.Do(func() {
		c.fail(ErrClosed)
		close(c.quit)
		// The acks still queued go out before the connection closes:
		// their deliveries are not sent again.
		if c.settler != nil {
			c.settler.close()
		}
		// A connection the broker or the network already closed is
		// not an error of Close.
		if e := c.conn.Close(); e != nil && !errors.Is(e, amqp.ErrClosed) {
			err = fmt.Errorf("rabbitmq: close consumer connection: %w", e)
		}
		c.wg.Wait()
	})
	return err
}

// watcher turns whatever ends the consumer into Err.
type watcher struct {
	c *Consumer
	// The sources, by rank: when several report together, as when a
	// connection dies and takes its channels and consumers with it, the
	// lowest rank names the cause.
	conn, tasks, control       <-chan *amqp.Error
	tasksCancel, controlCancel <-chan string
	controlQueue               string
}

const (
	rankConn = iota
	rankTasks
	rankControl
	rankTasksCancel
	rankControlCancel
	rankLost
)

func (w *watcher) run() {
	defer w.c.wg.Done()
	for {
		var (
			rank  int
			cause error
		)
		select {
		case <-w.c.quit:
			return
		case e, open := <-w.conn:
			rank, cause = rankConn, w.closed(rankConn, e, open)
		case e, open := <-w.tasks:
			rank, cause = rankTasks, w.closed(rankTasks, e, open)
		case e, open := <-w.control:
			rank, cause = rankControl, w.closed(rankControl, e, open)
		case tag, open := <-w.tasksCancel:
			rank, cause = rankTasksCancel, w.cancelled(rankTasksCancel, tag, open)
		case tag, open := <-w.controlCancel:
			rank, cause = rankControlCancel, w.cancelled(rankControlCancel, tag, open)
		case q := <-w.c.lost:
			rank, cause = rankLost, fmt.Errorf("rabbitmq: deliveries of %s ended unexpectedly", q)
		}
		if cause == nil {
			continue
		}
		// amqp091 notifies a connection's listeners before its channels'
		// and a cancel's listeners before it ends the deliveries: what
		// explains this event better is already waiting, if anything.
		for r := rankConn; r < rank; r++ {
			if better := w.poll(r); better != nil {
				cause = better
				break
			}
		}
		w.c.fail(cause)
	}
}

// poll takes the pending event of the source of rank r, if any.
func (w *watcher) poll(r int) error {
	var (
		closes  <-chan *amqp.Error
		cancels <-chan string
	)
	switch r {
	case rankConn:
		closes = w.conn
	case rankTasks:
		closes = w.tasks
	case rankControl:
		closes = w.control
	case rankTasksCancel:
		cancels = w.tasksCancel
	case rankControlCancel:
		cancels = w.controlCancel
	}
	select {
	case e, open := <-closes:
		return w.closed(r, e, open)
	case tag, open := <-cancels:
		return w.cancelled(r, tag, open)
	default:
		return nil
	}
}

var sourceNames = [...]string{rankConn: "connection", rankTasks: "task channel", rankControl: "control channel"}

// closed explains a close notification. amqp091 sends the error of an
// abnormal close, then closes the listener; a listener closed without an
// error means a close this consumer asked for.
func (w *watcher) closed(r int, e *amqp.Error, open bool) error {
	if !open {
		switch r {
		case rankConn:
			w.conn = nil
		case rankTasks:
			w.tasks = nil
		case rankControl:
			w.control = nil
		}
		return fmt.Errorf("rabbitmq: %s closed", sourceNames[r])
	}
	if e == nil {
		return fmt.Errorf("rabbitmq: %s closed", sourceNames[r])
	}
	return fmt.Errorf("rabbitmq: %s closed: %w", sourceNames[r], e)
}

// cancelled explains a basic.cancel from the broker. A cancel listener is
// closed along with its channel, whose close explains itself.
func (w *watcher) cancelled(r int, tag string, open bool) error {
	if !open {
		if r == rankTasksCancel {
			w.tasksCancel = nil
		} else {
			w.controlCancel = nil
		}
		return nil
	}
	if r == rankControlCancel {
		return fmt.Errorf("rabbitmq: consumer of the control queue %s cancelled by the broker", w.controlQueue)
	}
	q, ok := w.c.queues[tag]
	if !ok {
		q = "consumer tag " + tag
	}
	return fmt.Errorf("rabbitmq: consumer of %s cancelled by the broker", q)
}
