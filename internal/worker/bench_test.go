package worker

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/registry"
)

type countingAcker struct{ wg *sync.WaitGroup }

func (a countingAcker) Ack() error     { a.wg.Done(); return nil }
func (a countingAcker) Requeue() error { a.wg.Done(); return nil }
func (a countingAcker) Reject() error  { a.wg.Done(); return nil }

// BenchmarkNoops is the worker's own cost of a task, its store and broker
// in memory: a delivery claimed, its no-op handler run, its outcome
// stored and the delivery acknowledged.
func BenchmarkNoops(b *testing.B) {
	store, broker := newFakeStore(), newFakeBroker()
	w, err := New(Config{
		Info: registry.Worker{ID: "w1"}, Concurrency: 256, ReadAhead: 256, Lease: time.Minute, Heartbeat: 10 * time.Second,
		ProgressInterval: time.Second, BackoffBase: time.Second, BackoffMax: time.Minute, ShutdownTimeout: time.Second,
		MaxRunTime: time.Hour, LongAfter: time.Minute, ReconnectBackoffMax: time.Second, WriteFlights: 2,
	}, fakeDeps(store, broker), []conveyor.Handler{{Type: "noop", Func: func(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
		return nil, nil
	}}})
	if err != nil {
		b.Fatal(err)
	}
	ids := make([]uuid.UUID, b.N)
	for i := range ids {
		ids[i] = store.add("noop", 3)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = w.Run(ctx); close(done) }()
	src := <-broker.made
	var wg sync.WaitGroup
	wg.Add(b.N)
	b.ReportAllocs()
	b.ResetTimer()
	for _, id := range ids {
		src.deliveries <- outbox.Delivery{Body: outbox.Body{TaskID: id, Type: "noop", Attempt: 0, Version: 1},
			Headers: map[string]string{}, Acknowledger: countingAcker{&wg}}
	}
	wg.Wait()
	b.StopTimer()
	cancel()
	<-done
}
