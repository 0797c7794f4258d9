package worker

import (
	"github.com/google/uuid"
)

// signals let a test wait for what the worker did instead of sleeping. In
// production their channels are nil and a send costs a nil check.
type signals struct {
	connected signal[struct{}]
	started   signal[uuid.UUID]
	dropped   signal[uuid.UUID]
	finished  signal[finished]
	prefetch  signal[int]
}

type finished struct {
	taskID  uuid.UUID
	outcome string
}

// signal is a channel a test reads; sending never blocks the worker (a full
// buffer drops the signal, and the test sizes the buffer).
type signal[T any] chan T

func (s signal[T]) send(v T) {
	if s == nil {
		return
	}
	select {
	case s <- v:
	default:
	}
}
