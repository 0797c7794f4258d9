package rabbitmq

import (
	"slices"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
)

// settler settles the deliveries of one channel, acknowledging those that
// were settled at about the same time with one frame where it can.
//
// A delivery tag counts the channel's deliveries from 1, over all its
// consumers. An ack with multiple set settles every unsettled delivery up
// to its tag, so it may only name a tag below which every delivery has been
// settled by its owner (and whose own delivery is still unacknowledged):
// the settler keeps that frontier. Acks at or below the frontier go out as
// one frame; an ack above it (a delivery behind a
// longer task) goes out alone at once, so that no delivery keeps prefetch
// credit while waiting for another. Requeues and rejections go out alone
// and at once.
type settler struct {
	ch   amqp.Acknowledger
	acks chan uint64

	mu sync.Mutex
	// frontier: every delivery tagged up to it is settled.
	frontier uint64
	// settled holds the settled tags above the frontier.
	settled map[uint64]bool

	// closeMu orders close after every ack being queued.
	closeMu sync.RWMutex
	closed  bool
	quit    chan struct{}
	done    chan struct{}
}

func newSettler(ch amqp.Acknowledger) *settler {
	s := &settler{ch: ch, acks: make(chan uint64, 1024), settled: map[uint64]bool{},
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
		if t > s.frontier {
			s.settled[t] = true
		}
	}
	for s.settled[s.frontier+1] {
		delete(s.settled, s.frontier+1)
		s.frontier++
	}
}

// run sends the queued acknowledgements until close.
func (s *settler) run() {
	defer close(s.done)
	batch := make([]uint64, 0, 256)
	for {
		batch = batch[:0]
		select {
		case <-s.quit:
			return
		case t := <-s.acks:
			batch = append(batch, t)
		}
	more:
		for {
			select {
			case t := <-s.acks:
				batch = append(batch, t)
			default:
				break more
			}
		}
		s.flush(batch)
	}
}

func (s *settler) flush(batch []uint64) {
	s.mark(batch...)
	s.mu.Lock()
	frontier := s.frontier
	s.mu.Unlock()
	slices.Sort(batch)
	// The multiple ack names the batch's highest tag at or below the
	// frontier: one still unacknowledged at the broker (RabbitMQ refuses a
	// multiple ack whose own tag is settled), with nothing unsettled below.
	var upTo uint64
	for _, t := range batch {
		if t <= frontier {
			upTo = t
			continue
		}
		// A delivery still unsettled comes before this one: this ack
		// cannot wait for it.
		_ = s.ch.Ack(t, false)
	}
	if upTo > 0 {
		_ = s.ch.Ack(upTo, true)
	}
}

// close sends what is queued and stops the settler.
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
			if len(rest) > 0 {
				s.flush(rest)
			}
			return
		}
	}
}
