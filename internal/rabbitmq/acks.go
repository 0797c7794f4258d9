package rabbitmq

import (
	"slices"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// settler settles the deliveries of one channel, acknowledging those that
// were settled at about the same time with one frame where it can.
//
// A delivery tag counts the channel's deliveries from 1, over all its
// consumers. An ack with multiple set settles every unsettled delivery up
// to its tag, so it may only name a tag below which every delivery has been
// settled by its owner (and whose own delivery is still unacknowledged):
// the settler keeps that frontier.
//
// Acks queued within ackGather of each other (a worker's batch of outcomes
// settles its deliveries together) are sent together: those at or below
// the frontier as one frame. An ack above it waits up to ackHold for the
// frontier to pass it (the delivery before it is usually in the next
// batch), then goes out alone, so that a delivery behind a long task keeps
// its prefetch credit no longer than that. Requeues and rejections go out
// alone and at once.
type settler struct {
	ch   amqp.Acknowledger
	acks chan uint64
	// gather and hold are ackGather and ackHold (shorter in tests).
	gather, hold time.Duration

	mu sync.Mutex
	// frontier: every delivery tagged up to it is settled.
	frontier uint64
	// The settled tags above the frontier, as runs of consecutive tags:
	// runs maps each run's first tag to its last, ends its last to its
	// first. A delivery whose task runs for hours holds the frontier back
	// while thousands of later ones are settled each second; kept one by
	// one they grew by tens of MiB a million, kept as runs there are
	// about as many as deliveries still unsettled.
	runs map[uint64]uint64
	ends map[uint64]uint64

	// held are the acks not sent yet, each with when it goes out alone;
	// only the run loop (and close, after it) touches them.
	held map[uint64]time.Time

	// closeMu orders close after every ack being queued.
	closeMu sync.RWMutex
	closed  bool
	quit    chan struct{}
	done    chan struct{}
}

const (
	ackGather = time.Millisecond
	ackHold   = 20 * time.Millisecond
)

func newSettler(ch amqp.Acknowledger) *settler {
	s := &settler{ch: ch, acks: make(chan uint64, 1024), gather: ackGather, hold: ackHold,
		runs: map[uint64]uint64{}, ends: map[uint64]uint64{}, held: map[uint64]time.Time{},
		quit: make(chan struct{}), done: make(chan struct{})}
	go s.run()
	return s
}

// ack queues an acknowledgement; the settler sends it with the others that
// are queued. After close it goes out alone.
func (s *settler) ack(tag uint64) error {
	s.closeMu.RLock()
	defer s.closeMu.RUnlock()
	if s.closed {
		return s.ch.Ack(tag, false)
	}
	s.acks <- tag
	return nil
}

// nack requeues or rejects a delivery at once. The tag counts as settled
// only once its frame is sent, so no ack with multiple can cover it first.
func (s *settler) nack(tag uint64, requeue bool) error {
	err := s.ch.Nack(tag, false, requeue)
	s.mark(tag)
	return err
}

// mark records a settled tag and moves the frontier past every settled tag
// that follows it.
func (s *settler) mark(tags ...uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, t := range tags {
		if t <= s.frontier {
			continue
		}
		if _, ok := s.runs[t]; ok {
			continue
		}
		if _, ok := s.ends[t]; ok {
			continue
		}
		// Join the runs that end just before it and start just after it.
		first, last := t, t
		if f, ok := s.ends[t-1]; ok {
			delete(s.ends, t-1)
			first = f
		}
		if l, ok := s.runs[t+1]; ok {
			delete(s.runs, t+1)
			last = l
		}
		s.runs[first], s.ends[last] = last, first
	}
	// Runs are never adjacent, so the frontier passes one run at most.
	if last, ok := s.runs[s.frontier+1]; ok {
		delete(s.runs, s.frontier+1)
		delete(s.ends, last)
		s.frontier = last
	}
}

// run sends the queued acknowledgements until close.
func (s *settler) run() {
	defer close(s.done)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var batch []uint64
	for {
		batch = batch[:0]
		var due <-chan time.Time
		if next, ok := s.nextDue(); ok {
			timer.Reset(time.Until(next))
			due = timer.C
		}
		select {
		case <-s.quit:
			return
		case t := <-s.acks:
			batch = s.collect(append(batch, t), timer)
		case <-due:
		}
		s.flush(batch, time.Now())
	}
}

// collect adds to batch the acks queued within the gathering time.
func (s *settler) collect(batch []uint64, timer *time.Timer) []uint64 {
	timer.Reset(s.gather)
	for {
		select {
		case t := <-s.acks:
			batch = append(batch, t)
		case <-timer.C:
			return batch
		case <-s.quit:
			return batch
		}
	}
}

// nextDue is when the first held ack must go out alone.
func (s *settler) nextDue() (time.Time, bool) {
	var first time.Time
	for _, due := range s.held {
		if first.IsZero() || due.Before(first) {
			first = due
		}
	}
	return first, !first.IsZero()
}

// flush settles batch: it sends, as one multiple ack, every held ack at or
// below the frontier, and alone those held past their time.
func (s *settler) flush(batch []uint64, now time.Time) {
	s.mark(batch...)
	s.mu.Lock()
	frontier := s.frontier
	s.mu.Unlock()
	for _, t := range batch {
		s.held[t] = now.Add(s.hold)
	}
	// The multiple ack names the highest held tag at or below the
	// frontier: one still unacknowledged at the broker (RabbitMQ refuses a
	// multiple ack whose own tag is settled), with nothing unsettled below.
	var upTo uint64
	var alone []uint64
	for t, due := range s.held {
		switch {
		case t <= frontier:
			upTo = max(upTo, t)
			delete(s.held, t)
		case !due.After(now):
			// A delivery still unsettled comes before this one, and this
			// ack has waited for it long enough.
			alone = append(alone, t)
			delete(s.held, t)
		}
	}
	slices.Sort(alone)
	for _, t := range alone {
		_ = s.ch.Ack(t, false)
	}
	if upTo > 0 {
		_ = s.ch.Ack(upTo, true)
	}
}

// close sends what is queued and held, and stops the settler.
func (s *settler) close() {
	s.closeMu.Lock()
	s.closed = true
	s.closeMu.Unlock()
	close(s.quit)
	<-s.done
	var rest []uint64
	for {
		select {
		case t := <-s.acks:
			rest = append(rest, t)
		default:
			// Nothing is held any longer: every ack goes out now.
			s.flush(rest, time.Now())
			s.flush(nil, time.Now().Add(s.hold))
			return
		}
	}
}
