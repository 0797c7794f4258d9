package rabbitmq

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/conveyorhq/conveyor/internal/outbox"
)

// Publisher publishes outbox messages on one confirming channel. It declares
// the exchanges but never a task queue: the queues are the workers'.
type Publisher struct {
	// pack is the most tasks a packed message carries; 1 packs none.
	pack int
	conn *amqp.Connection
	// sock is conn's socket, closed by Close when the broker does not
	// answer its close.
	sock    net.Conn
	ch      *amqp.Channel
	returns chan amqp.Return
	closed  chan struct{}
	err     atomic.Pointer[amqp.Error]
	blocked atomic.Bool
	// probe is the confirm of the second of the messages open sends first,
	// which route nowhere: no batch is written before the broker confirmed
	// it.
	probe *amqp.DeferredConfirmation
}

// DialPublisher connects, declares the exchanges and puts a channel in
// confirm mode. returnBuffer sizes the buffer of returned messages; Publish
// reads returns while it waits for confirms, so any size of at least 1 is
// correct, and the largest batch published at once avoids every wait.
// name is the connection name the broker shows. pack is the most tasks
// one message may carry (see Publish); 1 or less packs none.
func DialPublisher(url string, returnBuffer int, name string, pack int) (*Publisher, error) {
	conn, sock, err := dialSocket(url, name)
	if err != nil {
		return nil, err
	}
	p := &Publisher{pack: max(pack, 1), conn: conn, sock: sock, closed: make(chan struct{})}
	if err := p.open(max(returnBuffer, 1)); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return p, nil
}

func (p *Publisher) open(returnBuffer int) error {
	// Listened for first: the broker may block the connection before the
	// channel is ready.
	blocking := p.conn.NotifyBlocked(make(chan amqp.Blocking, 4))
	go func() {
		for b := range blocking {
			p.blocked.Store(b.Active)
		}
	}()
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
	// A broker under a resource alarm blocks a connection at its first
	// publish, which it still routes, and reads nothing after it; what was
	// written after it waits in the connection's buffers and is routed when
	// the alarm clears, though its publish failed and its rows go out
	// again. Two probes, routed nowhere (no type is empty), go first: a
	// batch waits for the second's confirm (see Publish).
	for range 2 {
		probe, err := ch.PublishWithDeferredConfirm(TasksExchange, "", false, false, amqp.Publishing{MessageId: "probe"})
		if err != nil {
			return fmt.Errorf("probe: %w", err)
		}
		p.probe = probe
	}
	connClosed := p.conn.NotifyClose(make(chan *amqp.Error, 1))
	chClosed := ch.NotifyClose(make(chan *amqp.Error, 1))
	go func() {
		var e *amqp.Error
		select {
		case e = <-connClosed:
		case e = <-chClosed:
		}
		if e == nil {
			e = &amqp.Error{Reason: "closed"}
		}
		// A publisher that gave up on its channel (see Publish) has
		// stored why.
		p.err.CompareAndSwap(nil, e)
		close(p.closed)
	}()
	return nil
}

// Done is closed when the connection or channel is gone; Err says why.
func (p *Publisher) Done() <-chan struct{} { return p.closed }

// Route names where a message goes: task.run messages to the tasks exchange
// under their type, task.cancel broadcasts to the control exchange.
func (p *Publisher) Route(m outbox.Message) (exchange, routingKey string) { return Route(m) }

// Route names where a message goes (see Publisher.Route).
func Route(m outbox.Message) (exchange, routingKey string) {
	if m.Kind == outbox.KindCancel {
		return ControlExchange, ""
	}
	return TasksExchange, m.TaskType
}

// Err is why the publisher closed, or nil while it is open. It is an
// *amqp.Error.
func (p *Publisher) Err() error {
	if e := p.err.Load(); e != nil {
		return e
	}
	return nil
}

// Blocked reports whether the broker is blocking publishers (a memory or
// disk alarm).
func (p *Publisher) Blocked() bool { return p.blocked.Load() }

// closeWait bounds the wait for the broker's answer to a close: a broker
// under a resource alarm reads nothing from a connection it blocked, and
// would hold a relay that is stopping until the alarm clears.
const closeWait = 5 * time.Second

// Close closes the connection, waiting at most closeWait for the broker's
// answer: then it drops the socket. The deadline CloseDeadline sets on the
// socket alone does not bound the wait, as amqp091 moves the read deadline
// on at every heartbeat it receives, and a broker that blocked the
// connection still sends them.
func (p *Publisher) Close() error {
	done := make(chan error, 1)
	go func() { done <- p.conn.CloseDeadline(time.Now().Add(closeWait)) }()
	t := time.NewTimer(closeWait)
	defer t.Stop()
	select {
	case err := <-done:
		return err
	case <-t.C:
		// The reader fails on the closed socket, which ends the close.
		_ = p.sock.Close()
		if err := <-done; err != nil {
			return fmt.Errorf("close connection: the broker did not answer within %s: %w", closeWait, err)
		}
		return fmt.Errorf("close connection: the broker did not answer within %s", closeWait)
	}
}

// Publish sends every message persistent, waits for the broker's confirms
// (at most until ctx ends) and says what became of each message, which is
// in exactly one of the Outcome's sets:
//
//   - Published: the broker confirmed it and routed it somewhere.
//   - Unroutable: a task.run message the broker returned with 312 NO_ROUTE,
//     because no queue is bound for its type: no worker of the type has
//     declared its queue yet.
//   - Failed: any other return, a nack, no confirm before ctx ended, or an
//     error sending it; and a 312 NO_ROUTE return whose type's queue exists
//     but had lost its binding (its exchange was deleted): the publisher
//     binds it again (bindAgain), and the message goes out on a later try.
//
// task.run messages go to the tasks exchange with the task's type as
// routing key, mandatory; task.cancel messages are broadcast on the control
// exchange, not mandatory: with no worker alive there is nobody to tell, and
// the lease reaper ends such a task. The task.run messages of msgs that
// share a type and a priority are packed, up to the publisher's pack a
// message, into messages of several tasks (outbox.EncodePacked) sent to the
// packed exchange instead; a task alone of its kind in msgs goes out as a
// message of its own. The tasks of a packed message share its fate.
//
// Messages of a batch are independent: a message returned, nacked or
// unconfirmed does not affect the others. What still fails the rest of a
// batch is what closes the channel or the connection: a channel exception
// (an exchange deleted under the publisher, a message larger than the
// broker's max_message_size), a lost connection, a socket write that timed
// out. Every message not confirmed by then is Failed, and Done is closed.
//
// A nack also closes Done once the batch is done: the publisher gives up its
// channel, and its owner dials again. RabbitMQ nacks when a queue could not
// take a message, and a channel may not recover: on RabbitMQ 3.10.8 a
// channel that first published to a quorum queue while the queue's leader
// node was down had every later publish to it nacked, long after a new
// leader was elected, while a new channel's publishes were confirmed. So
// does a confirm that did not come before ctx ended: its late confirm and
// return would come on the channel during the next batches.
//
// Nothing is sent before the broker confirmed the connection's probes (see
// open): when ctx ends first, every message is Failed, unsent.
func (p *Publisher) Publish(ctx context.Context, msgs []outbox.Message) outbox.Outcome {
	var out outbox.Outcome
	if reason, ok := p.awaitProbe(ctx); !ok {
		for _, m := range msgs {
			out.Fail(m.ID, reason)
		}
		return out
	}
	units := pack(msgs, p.pack)
	pending := make([]*amqp.DeferredConfirmation, len(units))
	index := make(map[string]int, len(units)) // message id → unit
	failUnit := func(u []outbox.Message, reason string) {
		for _, m := range u {
			out.Fail(m.ID, reason)
		}
	}
	for i, u := range units {
		pub, exchange, key, mandatory := publishing(u)
		if len(u) > 1 {
			if out.Envelopes == nil {
				out.Envelopes = map[int64]outbox.Envelope{}
			}
			for _, m := range u {
				out.Envelopes[m.ID] = outbox.Envelope{Exchange: exchange, MessageID: pub.MessageId}
			}
		}
		dc, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, mandatory, false, pub)
		if err != nil {
			failUnit(u, "publish: "+err.Error())
			continue
		}
		pending[i] = dc
		index[pub.MessageId] = i
	}

	// The broker sends a message's basic.return before its basic.ack, and
	// amqp091 hands the return to the returns channel before it resolves
	// the confirm. Returns are read while waiting: a full returns channel
	// would hold up the connection's reader and, after a few seconds,
	// amqp091 would drop the return and the message would pass for
	// published.
	returned := make(map[int]amqp.Return)
	returns := p.returns
	take := func(r amqp.Return, open bool) {
		if !open {
			// The channel is gone: its closed returns channel would
			// yield zero values forever.
			returns = nil
			return
		}
		// A return of an earlier batch, whose confirm came too late,
		// names no message of this one.
		if i, ok := index[r.MessageId]; ok {
			returned[i] = r
		}
	}
	confirmed := make([]bool, len(units))
	nacked, late := false, false
	for i, dc := range pending {
		if dc == nil {
			continue
		}
	wait:
		for {
			select {
			case <-dc.Done():
				break wait
			case r, open := <-returns:
				take(r, open)
			case <-ctx.Done():
				break wait
			}
		}
		switch {
		case !isDone(dc):
			failUnit(units[i], "confirm: "+ctx.Err().Error())
			late = true
		case dc.Acked():
			confirmed[i] = true
		case p.ch.IsClosed():
			// amqp091 resolves the pending confirms of a closed channel
			// as nacks.
			failUnit(units[i], "not confirmed: channel closed: "+p.closeReason())
		default:
			failUnit(units[i], "nacked by the broker")
			nacked = true
		}
	}
	for drained := false; !drained && returns != nil; {
		select {
		case r, open := <-returns:
			take(r, open)
		default:
			drained = true
		}
	}

	bound := map[[2]string]bool{} // exchange and routing key → bound again
	for i, u := range units {
		if !confirmed[i] {
			continue
		}
		r, wasReturned := returned[i]
		if !wasReturned {
			out.Messages++
		}
		rebound := false
		if wasReturned && r.ReplyCode == amqp.NoRoute {
			k := [2]string{r.Exchange, r.RoutingKey}
			if _, tried := bound[k]; !tried {
				bound[k] = p.bindAgain(r.Exchange, r.RoutingKey)
			}
			rebound = bound[k]
		}
		for _, m := range u {
			switch {
			case !wasReturned:
				out.Published = append(out.Published, m.ID)
			case rebound:
				out.Fail(m.ID, fmt.Sprintf("returned: %d %s: the queue of type %q was bound to no exchange "+
					"(an exchange deleted and declared again): bound it again", r.ReplyCode, r.ReplyText, m.TaskType))
			case r.ReplyCode == amqp.NoRoute:
				out.Unroute(m.ID, fmt.Sprintf("returned: %d %s: no queue for type %q", r.ReplyCode, r.ReplyText, m.TaskType))
			default:
				out.Fail(m.ID, fmt.Sprintf("returned: %d %s", r.ReplyCode, r.ReplyText))
			}
		}
	}
	switch {
	case nacked:
		p.giveUp("a publish was nacked by the broker: publishing on a new channel")
	case late:
		// The late confirms and returns would still come on this channel
		// and meet the next batches: a return that came late could pass a
		// message of a later batch for returned, or crowd out a return of
		// its own.
		p.giveUp("confirms came too late: publishing on a new channel")
	}
	return out
}

// awaitProbe waits until the broker confirmed the connection's probes (see
// open), or ctx ends: then it says why nothing may be written yet. A
// batch written to a connection the broker blocked would be routed once
// the alarm clears, after its rows failed.
func (p *Publisher) awaitProbe(ctx context.Context) (string, bool) {
	select {
	case <-p.probe.Done():
		return "", true
	case <-p.closed:
		return "", true // the publishes fail on the closed channel
	case <-ctx.Done():
	}
	if p.Blocked() {
		return "not sent: the broker blocks the connection (a resource alarm)", false
	}
	return "not sent: the broker has not confirmed the connection's first messages: " + ctx.Err().Error(), false
}

// bindAgain binds the queue that a task.run message returned unroutable
// from exchange under key was meant for, if that queue exists, and reports
// whether it did. A queue loses its binding when its exchange is deleted
// (the publisher declares the exchange again on its next channel), while
// its worker, whose consumer goes on, declares and binds it again only when
// it connects again: the messages of its type would be parked meanwhile.
// The publisher still declares no queue: a passive declare only asks, on
// a channel of its own, which the broker closes when the queue is missing.
func (p *Publisher) bindAgain(exchange, key string) bool {
	var queue string
	switch exchange {
	case TasksExchange:
		queue = QueueName(key)
	case PackedExchange:
		queue = PackedQueueName(key)
	default:
		return false
	}
	ch, err := p.conn.Channel()
	if err != nil {
		return false
	}
	defer func() { _ = ch.Close() }()
	if _, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil); err != nil {
		return false
	}
	return ch.QueueBind(queue, key, exchange, false, nil) == nil
}

// HasQueue reports whether the queues of taskType's messages exist, that
// of single messages and the packed one: a worker of the type has declared
// them. Both are asked for: a packed message parked for want of the packed
// queue, released because the other queue exists, would be published and
// parked again at once, over and over. Like bindAgain it asks on a channel
// of its own for each, which the broker closes when the queue is missing.
// A broker that blocked the connection reads nothing from it and would
// never answer: it gives up when ctx ends.
func (p *Publisher) HasQueue(ctx context.Context, taskType string) bool {
	found := make(chan bool, 1)
	go func() {
		for _, q := range []string{QueueName(taskType), PackedQueueName(taskType)} {
			ch, err := p.conn.Channel()
			if err != nil {
				found <- false
				return
			}
			_, err = ch.QueueDeclarePassive(q, true, false, false, false, nil)
			_ = ch.Close()
			if err != nil {
				found <- false
				return
			}
		}
		found <- true
	}()
	select {
	case ok := <-found:
		return ok
	case <-ctx.Done():
		return false
	}
}

// giveUp gives up the channel for reason: Done closes once it is closed,
// and the owner dials again. The close is not waited for: a broker under
// a resource alarm may not answer it, and the batch's rows must not stay
// locked meanwhile.
func (p *Publisher) giveUp(reason string) {
	p.err.CompareAndSwap(nil, &amqp.Error{Code: amqp.InternalError, Reason: reason})
	go func() { _ = p.ch.Close() }()
}

// pack splits msgs into the messages that go out: each task.run message
// that shares its type and priority with others of msgs is packed with
// them, up to size a message, in the order they come; every other message
// goes alone.
func pack(msgs []outbox.Message, size int) [][]outbox.Message {
	type kind struct {
		taskType string
		priority uint8
	}
	var units [][]outbox.Message
	open := map[kind]int{} // the unit of a kind that still has room
	count := map[kind]int{}
	if size > 1 {
		for _, m := range msgs {
			if m.Kind == outbox.KindRun {
				count[kind{m.TaskType, m.Priority}]++
			}
		}
	}
	for _, m := range msgs {
		k := kind{m.TaskType, m.Priority}
		if m.Kind != outbox.KindRun || count[k] < 2 {
			units = append(units, []outbox.Message{m})
			continue
		}
		i, ok := open[k]
		if !ok || len(units[i]) == size {
			i = len(units)
			open[k] = i
			units = append(units, make([]outbox.Message, 0, min(size, count[k])))
		}
		units[i] = append(units[i], m)
	}
	return units
}

// publishing is the AMQP message of a unit of pack, and where it goes. A
// message's id is its outbox row's; a packed message's is its first
// task's row's, with the tasks' own trace contexts in its body.
func publishing(u []outbox.Message) (pub amqp.Publishing, exchange, key string, mandatory bool) {
	m := u[0]
	exchange, key = Route(m)
	pub = amqp.Publishing{
		MessageId:    strconv.FormatInt(m.ID, 10),
		ContentType:  "application/json",
		DeliveryMode: amqp.Persistent,
		Priority:     m.Priority,
		Timestamp:    m.CreatedAt,
		Type:         string(m.Kind),
	}
	if len(u) > 1 {
		pub.Headers = amqp.Table{PackedHeader: int32(len(u))}
		pub.Body = outbox.EncodePacked(u)
		return pub, PackedExchange, key, true
	}
	pub.Headers = make(amqp.Table, len(m.Headers))
	for k, v := range m.Headers {
		pub.Headers[k] = v
	}
	pub.Body = m.EncodeBody()
	return pub, exchange, key, m.Kind != outbox.KindCancel
}

// PackedHeader is the header of a packed message that says how many tasks
// it carries.
const PackedHeader = "x-conveyor-tasks"

func isDone(dc *amqp.DeferredConfirmation) bool {
	select {
	case <-dc.Done():
		return true
	default:
		return false
	}
}

// closeReason is why the channel or connection closed, as far as known yet.
func (p *Publisher) closeReason() string {
	if e := p.err.Load(); e != nil {
		return e.Error()
	}
	return "closed"
}
