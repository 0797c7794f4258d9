package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/task"
)

// The ceilings: what PostgreSQL and RabbitMQ allow on this machine for the
// work Conveyor does, without Conveyor around it.

// forDuration runs fn from conc goroutines for d and returns the number of
// successful calls per second.
func forDuration(conc int, d time.Duration, fn func(worker, i int) error) (float64, error) {
	var ops atomic.Int64
	var firstErr error
	var once sync.Once
	deadline := time.Now().Add(d)
	start := time.Now()
	var wg sync.WaitGroup
	for w := range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; time.Now().Before(deadline); i++ {
				if err := fn(w, i); err != nil {
					once.Do(func() { firstErr = err })
					return
				}
				ops.Add(1)
			}
		}()
	}
	wg.Wait()
	return float64(ops.Load()) / time.Since(start).Seconds(), firstErr
}

// submitCeiling is the API's own submit transaction (task, event and outbox
// row in one statement), called directly with pgx from conc goroutines,
// each submission a transaction of its own. grouped, it is the API's own
// submit path instead: the submissions of the moment committed together,
// as the API commits them.
func submitCeiling(ctx context.Context, pool *pgxpool.Pool, conc int, d time.Duration, grouped bool) (float64, error) {
	run := submitRuns.Add(1) // a pool may be measured more than once: every payload is new
	store := postgres.NewAPIStore(pool, nil)
	if !grouped {
		store.CommitEachSubmission()
	}
	org, err := postgres.NewDirectory(pool).EnsureOrg(ctx, "bench")
	if err != nil {
		return 0, err
	}
	p := auth.Principal{Kind: auth.KindDev, OrgID: org, OrgSlug: "bench", Role: auth.Admin}
	return forDuration(conc, d, func(w, i int) error {
		sub, err := task.NewSubmission(task.SubmitInput{
			Type:    "demo.noop",
			Payload: json.RawMessage(fmt.Sprintf(`{"ceiling": %d, "w": %d, "i": %d}`, run, w, i)),
		}, task.Defaults{MaxAttempts: 3}, "")
		if err != nil {
			return err
		}
		_, err = store.Submit(ctx, p, sub, nil)
		return err
	})
}

// messageBody is the size of a task message: {task_id, type, attempt, version}.
var messageBody = []byte(`{"task_id":"01a205e2-d588-7d57-bea0-198522c3fe8a","type":"demo.noop","attempt":0,"version":1}`)

// publishCeiling publishes n persistent, mandatory messages with publisher
// confirms, batch at a time, waiting for each batch's confirms: the relay's
// batching, with nothing else.
func publishCeiling(amqpURL string, n, batch int) (float64, error) {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return 0, err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	if err := rabbitmq.DeclareExchanges(ch); err != nil {
		return 0, err
	}
	if err := rabbitmq.DeclareTaskQueue(ch, "bench.ceiling"); err != nil {
		return 0, err
	}
	if err := ch.Confirm(false); err != nil {
		return 0, err
	}
	ctx := context.Background()
	start := time.Now()
	for sent := 0; sent < n; {
		confirms := make([]*amqp.DeferredConfirmation, 0, batch)
		for i := 0; i < batch && sent < n; i++ {
			dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, rabbitmq.TasksExchange, "bench.ceiling", true, false, amqp.Publishing{
				DeliveryMode: amqp.Persistent, ContentType: "application/json", Priority: 5,
				MessageId: fmt.Sprint(sent), Body: messageBody,
				Headers: amqp.Table{"traceparent": "00-0dba3b847a67f67a629808001b5e6847-bbc96f631e9baf07-01"},
			})
			if err != nil {
				return 0, err
			}
			confirms = append(confirms, dc)
			sent++
		}
		for _, dc := range confirms {
			if ok, err := dc.WaitContext(ctx); err != nil || !ok {
				return 0, fmt.Errorf("publish not confirmed: %w", err)
			}
		}
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// consumeCeiling fills the ceiling's queue with n messages, then consumes
// them with a prefetch of prefetch and returns messages per second. It acks
// every ackEvery-th message with multiple=true (covering those before it),
// or each one when ackEvery is 1; ackEvery must not exceed prefetch, or the
// broker stops sending before the next ack.
func consumeCeiling(ctx context.Context, amqpURL string, n, prefetch, ackEvery int) (float64, error) {
	if err := fillQueue(ctx, amqpURL, "bench.ceiling", n); err != nil {
		return 0, err
	}
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return 0, err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	if err := ch.Qos(prefetch, 0, false); err != nil {
		return 0, err
	}
	msgs, err := ch.Consume(rabbitmq.QueueName("bench.ceiling"), "", false, false, false, false, nil)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	for i := range n {
		select {
		case m := <-msgs:
			if (i+1)%ackEvery == 0 || i == n-1 {
				if err := m.Ack(ackEvery > 1); err != nil {
					return 0, err
				}
			}
		case <-time.After(30 * time.Second):
			return 0, fmt.Errorf("consumed only %d of %d", i, n)
		}
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// multipleAckEvery is how many messages a consumer with prefetch acks at
// once with multiple=true: half its window, so that the broker always has
// the other half to send while an ack is on its way.
func multipleAckEvery(prefetch int) int { return max(prefetch/2, 1) }

// fillQueue empties the queue of taskType and publishes n persistent task
// messages into it, without confirms (this is set-up, not measured), then
// waits until the queue holds all of them.
func fillQueue(ctx context.Context, amqpURL, taskType string, n int) error {
	if err := declareQueues(amqpURL, taskType); err != nil {
		return err
	}
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	q := rabbitmq.QueueName(taskType)
	if _, err := ch.QueuePurge(q, false); err != nil {
		return err
	}
	for i := range n {
		err := ch.PublishWithContext(ctx, rabbitmq.TasksExchange, taskType, false, false, amqp.Publishing{
			DeliveryMode: amqp.Persistent, ContentType: "application/json", Priority: 5,
			MessageId: fmt.Sprint(i), Body: messageBody,
			Headers: amqp.Table{"traceparent": "00-0dba3b847a67f67a629808001b5e6847-bbc96f631e9baf07-01"},
		})
		if err != nil {
			return err
		}
	}
	return waitFor(time.Minute, 20*time.Millisecond, func() (bool, error) {
		st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		return st.Messages >= n, err
	})
}
