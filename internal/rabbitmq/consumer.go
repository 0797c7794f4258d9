package rabbitmq

import (
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

// Consumer consumes the task queues of a worker's types on one channel
// (paused while the worker can take none: SetPrefetch(0)), their packed
// queues on a second (a prefetch of their own, and paused while every slot
// of the worker runs long), and the control broadcasts on a third, from an
// exclusive queue of its own. On classic queues a task
// channel's prefetch is shared by all the types; quorum queues support no
// channel-wide prefetch, so there each type's consumer gets the whole
// credit (see DialConsumer).
//
// A consumer does not recover: once anything it depends on is lost (the
// connection, any channel, a consumer the broker cancelled because its
// queue was deleted or a node went down, a deliveries stream that ended) Done
// is closed, Err says what happened, and the consumer stops forwarding: a
// delivery or cancel already on its way may still be yielded, then none. The
// owner then closes it and dials a new one. Close must be called in every
// case: it ends the consumer's goroutines.
type Consumer struct {
	conn  *amqp.Connection
	qs    Queues
	tasks *amqp.Channel
	// packed consumes the packed queues, with a prefetch of its own.
	packed  *amqp.Channel
	control *amqp.Channel
	types   []string
	// single and pk are the consumers of the queues of single messages
	// and of the packed queues: they come and go as they are paused and
	// resumed.
	single lane
	pk     lane

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
// prefetch bounds the unacknowledged task messages of the queues of single
// messages (0 or less: none, and they are not consumed until SetPrefetch
// gives them credit), packedPrefetch those of the packed queues, consumed
// on a channel of their own: a packed message carries many tasks, and a worker
// gives them a prefetch of its window divided by how many. On classic
// queues each bound is channel-wide (global QoS): over all the types.
// Quorum queues refuse a consumer on a channel with global QoS (the broker
// closes the connection with NOT_IMPLEMENTED), so there the bound is per
// consumer: each type's queue may have prefetch messages unacknowledged,
// and a worker of n types may hold up to n times prefetch.
//
// The tasks of a packed message arrive as deliveries of their own. The
// message is acknowledged once every one of its tasks was acknowledged or
// rejected (a worker acknowledges each once it is claimed), and requeued
// as soon as one of them is requeued: its other tasks then come back with
// it, and a task still running is not claimable when it does. Tasks of a
// settled message not yet yielded are not yielded.
func DialConsumer(url, name string, qs Queues, types []string, prefetch, packedPrefetch int) (*Consumer, error) {
	conn, err := dial(url, name)
	if err != nil {
		return nil, err
	}
	c := &Consumer{
		conn:       conn,
		qs:         qs,
		types:      types,
		single:     lane{queue: QueueName, tag: "conveyor-"},
		pk:         lane{queue: PackedQueueName, tag: "conveyor-packed-"},
		deliveries: make(chan outbox.Delivery),
		cancels:    make(chan outbox.Cancel, 64),
		lost:       make(chan string, 2*len(types)+1),
		done:       make(chan struct{}),
		quit:       make(chan struct{}),
	}
	if err := c.open(types, prefetch, packedPrefetch); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return c, nil
}

// open sets everything up, then starts the goroutines: a failure before
// that leaves none behind once the connection is closed.
func (c *Consumer) open(types []string, prefetch, packedPrefetch int) error {
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
	if c.packed, err = c.conn.Channel(); err != nil {
		return fmt.Errorf("open packed channel: %w", err)
	}
	w.packed = c.packed.NotifyClose(make(chan *amqp.Error, 1))
	w.packedCancel = c.packed.NotifyCancel(make(chan string, len(types)+1))
	if err := DeclareExchanges(c.tasks); err != nil {
		return err
	}
	if err := c.qos(c.packed, packedPrefetch); err != nil {
		return fmt.Errorf("set packed prefetch: %w", err)
	}
	for _, typ := range types {
		if err := DeclareTaskQueueOf(c.tasks, typ, c.qs); err != nil {
			return err
		}
	}
	c.single.ch, c.pk.ch = c.tasks, c.packed
	// A prefetch of 0 would be no limit at all: a consumer that may take
	// nothing yet starts paused instead.
	var streams map[string]<-chan amqp.Delivery
	if prefetch > 0 {
		if err := c.qos(c.tasks, prefetch); err != nil {
			return fmt.Errorf("set prefetch: %w", err)
		}
		if streams, err = c.consume(&c.single); err != nil {
			return err
		}
	} else {
		c.single.paused = true
	}
	packedStreams, err := c.consume(&c.pk)
	if err != nil {
		return err
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

	c.single.s = newSettler(c.tasks)
	c.pk.s = newSettler(c.packed)
	c.wg.Add(len(streams) + len(packedStreams) + 2)
	for q, msgs := range streams {
		go c.forward(q, msgs, &c.single, c.single.gen)
	}
	for q, msgs := range packedStreams {
		go c.forward(q, msgs, &c.pk, c.pk.gen)
	}
	go c.forwardCancels(q.Name, ctl)
	go w.run()
	return nil
}

// lane is the consumers of one channel's queues, one a type: paused or
// not, and the generation of the consumers now running, which their
// forwarders carry (a forwarder of an earlier one ends quietly).
type lane struct {
	ch    *amqp.Channel
	s     *settler
	queue func(taskType string) string
	tag   string // the consumer tags' prefix

	// op orders pause and resume.
	op     sync.Mutex
	mu     sync.Mutex
	paused bool
	closed bool
	gen    int
	tags   map[string]string // consumer tag → queue
}

// queueOf is the queue of a consumer tag of the lane, if it is one of its
// consumers now running.
func (l *lane) queueOf(tag string) (string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	q, ok := l.tags[tag]
	return q, ok
}

// consume starts a consumer on each queue of the lane, as its current
// generation, and returns their deliveries by queue.
func (c *Consumer) consume(l *lane) (map[string]<-chan amqp.Delivery, error) {
	streams := make(map[string]<-chan amqp.Delivery, len(c.types))
	tags := make(map[string]string, len(c.types))
	for _, typ := range c.types {
		q := l.queue(typ)
		tag := fmt.Sprintf("%s%s-%s", l.tag, typ, uuid.NewString()[:8])
		msgs, err := l.ch.Consume(q, tag, false, false, false, false, nil)
		if err != nil {
			return nil, fmt.Errorf("consume %s: %w", q, err)
		}
		tags[tag] = q
		streams[q] = msgs
	}
	l.mu.Lock()
	l.tags = tags
	l.mu.Unlock()
	return streams, nil
}

// PausePacked asks the broker to send no more packed messages: it cancels
// the packed queues' consumers. What the broker sent before is still
// yielded. A worker pauses them while every slot runs a long handler: the
// packed queues' prefetch stays as it was set, so a packed message that
// arrived then could only go back to its queue and, with credit left,
// straight back to the worker.
func (c *Consumer) PausePacked() error {
	if err := c.pause(&c.pk); err != nil {
		return fmt.Errorf("rabbitmq: pause packed consumers: %w", err)
	}
	return nil
}

// ResumePacked consumes the packed queues again after PausePacked.
func (c *Consumer) ResumePacked() error {
	if err := c.resume(&c.pk); err != nil {
		return fmt.Errorf("rabbitmq: resume packed consumers: %w", err)
	}
	return nil
}

// pause cancels the consumers of a lane.
func (c *Consumer) pause(l *lane) error {
	l.op.Lock()
	defer l.op.Unlock()
	l.mu.Lock()
	if l.paused || l.closed {
		l.mu.Unlock()
		return nil
	}
	l.paused = true
	l.gen++
	tags := l.tags
	l.tags = nil
	l.mu.Unlock()
	for tag := range tags {
		if err := l.ch.Cancel(tag, false); err != nil {
			// The consumers not cancelled run on: keep them known.
			l.mu.Lock()
			if l.tags == nil {
				l.tags = map[string]string{}
			}
			for t, q := range tags {
				l.tags[t] = q
			}
			l.mu.Unlock()
			return err
		}
		delete(tags, tag)
	}
	return nil
}

// resume consumes the queues of a paused lane again.
func (c *Consumer) resume(l *lane) error {
	l.op.Lock()
	defer l.op.Unlock()
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.paused || l.closed || c.stopping.Load() {
		return nil
	}
	l.mu.Unlock()
	streams, err := c.consume(l)
	l.mu.Lock()
	if err != nil {
		return err
	}
	l.paused = false
	l.gen++
	if l.closed {
		return nil // Close came meanwhile; the connection takes the consumers with it
	}
	if c.stopping.Load() {
		// StopConsuming came meanwhile: it did not see these consumers.
		for tag := range l.tags {
			_ = l.ch.Cancel(tag, false)
		}
		l.tags = nil
		return nil
	}
	c.wg.Add(len(streams))
	for q, msgs := range streams {
		go c.forward(q, msgs, l, l.gen)
	}
	return nil
}

// current reports whether a forwarder of the given generation of a lane
// belongs to the consumers now running.
func (l *lane) current(gen int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return !l.paused && gen == l.gen
}

// forward passes the deliveries of one task queue to Deliveries, one at a
// time: the channel is unbuffered so the caller decides when it takes the
// next one. l is the queue's lane, whose settler settles them; gen is the
// generation of the lane's consumers this one belongs to.
func (c *Consumer) forward(queue string, msgs <-chan amqp.Delivery, l *lane, gen int) {
	defer c.wg.Done()
	s := l.s
	for {
		select {
		case <-c.done:
			// Not taken, not acked: the broker requeues the message
			// when the connection closes.
			return
		case m, open := <-msgs:
			if !open {
				if !c.stopping.Load() && l.current(gen) {
					c.lost <- queue
				}
				return
			}
			if _, packed := m.Headers[PackedHeader]; packed {
				if !c.forwardPacked(queue, m, s) {
					return
				}
				continue
			}
			select {
			case c.deliveries <- toDelivery(queue, m, s):
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
			b, err := outbox.DecodeBody(m.Body)
			if err != nil || b.TaskID == uuid.Nil {
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

// forwardPacked passes the tasks of a packed message to Deliveries, each a
// delivery of its own, until the message is settled (one of its tasks was
// requeued). It reports false when the consumer stopped.
func (c *Consumer) forwardPacked(queue string, m amqp.Delivery, s *settler) bool {
	tasks, err := outbox.DecodePacked(m.Body)
	if err == nil && len(tasks) == 0 {
		err = errors.New("no task")
	}
	if err != nil {
		d := toDelivery(queue, m, s)
		d.Err = fmt.Errorf("read packed message body: %w", err)
		select {
		case c.deliveries <- d:
			return true
		case <-c.done:
			return false
		}
	}
	p := &packedMessage{s: s, tag: m.DeliveryTag, left: len(tasks), settled: make(chan struct{})}
	for _, t := range tasks {
		d := outbox.Delivery{
			Body:         t.Body,
			MessageID:    m.MessageId,
			Exchange:     m.Exchange,
			Queue:        queue,
			Redelivered:  m.Redelivered,
			Headers:      t.Headers,
			Packed:       true,
			Acknowledger: &packedAcker{p: p},
		}
		if t.TaskID == uuid.Nil {
			d.Err = errors.New("packed task has no task_id")
		}
		// A settled message offers nothing more; the task already on offer
		// when it was settled may still be taken (select picks at random
		// between ready cases), and its settlement then does nothing.
		select {
		case <-p.settled:
			return true
		default:
		}
		select {
		case c.deliveries <- d:
		case <-p.settled:
			return true
		case <-c.done:
			return false
		}
	}
	return true
}

// packedMessage settles a packed message once for all its tasks:
// acknowledged once every task was acknowledged or rejected, requeued as
// soon as one is requeued. Later settlements of its tasks do nothing, and
// so does a task's second settlement.
type packedMessage struct {
	s   *settler
	tag uint64

	mu   sync.Mutex
	left int
	// settled is closed once the message is settled.
	settled chan struct{}
}

func (p *packedMessage) settle(requeue bool) error {
	p.mu.Lock()
	select {
	case <-p.settled:
		p.mu.Unlock()
		return nil
	default:
	}
	p.left--
	if !requeue && p.left > 0 {
		p.mu.Unlock()
		return nil
	}
	close(p.settled)
	p.mu.Unlock()
	if requeue {
		return p.s.nack(p.tag, true)
	}
	return p.s.ack(p.tag)
}

// packedAcker settles one task of a packed message, once.
type packedAcker struct {
	p    *packedMessage
	done atomic.Bool
}

func (a *packedAcker) Ack() error     { return a.settle(false) }
func (a *packedAcker) Requeue() error { return a.settle(true) }
func (a *packedAcker) Reject() error  { return a.settle(false) }

func (a *packedAcker) settle(requeue bool) error {
	if a.done.Swap(true) {
		return nil
	}
	return a.p.settle(requeue)
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
	var err error
	if d.Body, err = outbox.DecodeBody(m.Body); err != nil {
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
// prefetch they were started with, and the new value holds for those
// started after a pause, or from the next connection on.
//
// n of 0 or less pauses the consumers of single messages: AMQP has no
// prefetch that lets nothing through (0 is no limit), and with the least,
// 1, a worker that could start nothing got a message it could only send
// back, and got it straight back, over and over. What the broker sent
// before is still yielded. A positive n consumes them again.
func (c *Consumer) SetPrefetch(n int) error {
	if n <= 0 {
		if err := c.pause(&c.single); err != nil {
			return fmt.Errorf("rabbitmq: pause consumers: %w", err)
		}
		return nil
	}
	if err := c.qos(c.tasks, n); err != nil {
		return fmt.Errorf("set prefetch %d: %w", n, err)
	}
	if err := c.resume(&c.single); err != nil {
		return fmt.Errorf("rabbitmq: resume consumers: %w", err)
	}
	return nil
}

// SetPackedPrefetch changes how many packed messages may be unacknowledged
// at once, as SetPrefetch does for single messages.
func (c *Consumer) SetPackedPrefetch(n int) error {
	if err := c.qos(c.packed, n); err != nil {
		return fmt.Errorf("set packed prefetch %d: %w", n, err)
	}
	return nil
}

// qos sets a task channel's prefetch: channel-wide (global) on classic
// queues, per consumer on quorum queues, which support nothing else.
func (c *Consumer) qos(ch *amqp.Channel, n int) error {
	return ch.Qos(n, 0, c.qs.Type != Quorum)
}

// StopConsuming asks the broker to send no more task messages; the control
// consumer keeps running, so cancel broadcasts are still heard while the
// handlers finish. Task messages delivered before the broker stopped are
// still yielded (hand them back with Requeue); messages not settled go back
// to their queue when the connection closes. Stopping does not close Done.
func (c *Consumer) StopConsuming() {
	c.stopOnce.Do(func() {
		c.stopping.Store(true)
		for _, l := range []*lane{&c.single, &c.pk} {
			l.mu.Lock()
			tags := l.tags
			l.tags = nil
			l.mu.Unlock()
			for tag := range tags {
				_ = l.ch.Cancel(tag, false)
			}
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
		for _, l := range []*lane{&c.single, &c.pk} {
			l.mu.Lock()
			l.closed = true
			l.mu.Unlock()
		}
		// The acks still queued go out before the connection closes:
		// their deliveries are not sent again.
		for _, s := range []*settler{c.single.s, c.pk.s} {
			if s != nil {
				s.close()
			}
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
	conn, tasks, packed, control             <-chan *amqp.Error
	tasksCancel, packedCancel, controlCancel <-chan string
	controlQueue                             string
}

const (
	rankConn = iota
	rankTasks
	rankPacked
	rankControl
	rankTasksCancel
	rankPackedCancel
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
		case e, open := <-w.packed:
			rank, cause = rankPacked, w.closed(rankPacked, e, open)
		case e, open := <-w.control:
			rank, cause = rankControl, w.closed(rankControl, e, open)
		case tag, open := <-w.tasksCancel:
			rank, cause = rankTasksCancel, w.cancelled(rankTasksCancel, tag, open)
		case tag, open := <-w.packedCancel:
			rank, cause = rankPackedCancel, w.cancelled(rankPackedCancel, tag, open)
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
	case rankPacked:
		closes = w.packed
	case rankControl:
		closes = w.control
	case rankTasksCancel:
		cancels = w.tasksCancel
	case rankPackedCancel:
		cancels = w.packedCancel
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

var sourceNames = [...]string{rankConn: "connection", rankTasks: "task channel", rankPacked: "packed channel",
	rankControl: "control channel"}

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
		case rankPacked:
			w.packed = nil
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
		switch r {
		case rankTasksCancel:
			w.tasksCancel = nil
		case rankPackedCancel:
			w.packedCancel = nil
		default:
			w.controlCancel = nil
		}
		return nil
	}
	if r == rankControlCancel {
		return fmt.Errorf("rabbitmq: consumer of the control queue %s cancelled by the broker", w.controlQueue)
	}
	q, ok := w.c.single.queueOf(tag)
	if !ok {
		q, ok = w.c.pk.queueOf(tag)
	}
	if !ok {
		q = "consumer tag " + tag
	}
	return fmt.Errorf("rabbitmq: consumer of %s cancelled by the broker", q)
}
