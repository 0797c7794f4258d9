package main

import (
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// Faults of the servers the worker depends on. Each test stops a server of
// its own, never the shared one.

func TestWorkerSurvivesBrokerRestart(t *testing.T) {
	skipShort(t)
	t.Parallel()
	node := testenv.StartRabbit(t)
	db := testdb.New(t)
	b := setupWith(t, db.URL, db.Pool, node.URL())
	admin := testenv.FreeAddr(t)
	w := b.startWorker(t, "w1", "WORKER_ADMIN_ADDR="+admin)
	// Long enough to outlast a slow broker stop on a loaded machine.
	running := b.sleepTask(t, 300, 100)
	b.waitUntil(t, running, "running", func(r taskRow) bool { return r.Progress >= 1 })

	node.Stop(t)
	testenv.Eventually(t, 10*time.Second, func() error { return testenv.WantStatus("http://"+admin+"/readyz", http.StatusServiceUnavailable) })
	// Work goes on without the broker: the running task reports progress.
	progress := b.task(t, running).Progress
	b.waitUntil(t, running, "progressing without the broker", func(r taskRow) bool { return r.Progress > progress })
	submitted := []uuid.UUID{b.sleepTask(t, 1, 10), b.sleepTask(t, 2, 10)}
	node.Start(t)

	for _, id := range append(submitted, running) {
		b.waitStatus(t, id, "COMPLETED", 60*time.Second)
		b.requireOneTerminal(t, id)
	}
	require.Equal(t, 1, b.task(t, running).Attempt, "the running task was not interrupted")
	testenv.Eventually(t, 10*time.Second, func() error { return testenv.WantStatus("http://"+admin+"/readyz", http.StatusOK) })
	require.False(t, w.Exited(), w.Output())
}

func TestWorkerSurvivesPostgresRestart(t *testing.T) {
	skipShort(t)
	t.Parallel()
	pg := testenv.StartPG(t)
	dbURL, pool := pg.Migrated(t, "conveyor")
	b := setupWith(t, dbURL, pool, testenv.NewVhost(t))
	// A lease (and a registry heartbeat) that outlasts the restart: the
	// task is the running handler's throughout.
	w := b.startWorker(t, "w1", "LEASE_DURATION=15s", "WORKER_DEAD_AFTER=15s")
	running := b.sleepTask(t, 40, 100)
	b.waitUntil(t, running, "running", func(r taskRow) bool { return r.Progress >= 5 })

	pg.Stop(t)
	time.Sleep(time.Second) // the handler keeps running while its writes fail
	pg.Start(t)
	pool.Reset()

	r := b.waitStatus(t, running, "COMPLETED", 60*time.Second)
	b.requireOneTerminal(t, running)
	require.Contains(t, w.Output(), "task write failed; will retry", "the restart hit the running task's writes")
	require.Equal(t, 1, r.Attempt, "the handler ran on through the restart: its attempt was not given up and run again")
	after := b.sleepTask(t, 1, 10)
	b.waitStatus(t, after, "COMPLETED", 30*time.Second)
	require.False(t, w.Exited(), w.Output())
}

// The broker cancels a consumer whose queue is deleted (as it does on a
// consumer timeout or a node going down): the worker notices, connects
// again, declares its queue again and goes on — it never stops consuming
// while looking healthy.
func TestWorkerRecoversWhenItsQueueIsDeleted(t *testing.T) {
	b := setup(t)
	admin := testenv.FreeAddr(t)
	w := b.startWorker(t, "w1", "WORKER_ADMIN_ADDR="+admin)
	testenv.WaitHTTP(t, "http://"+admin+"/readyz", 30*time.Second)
	first := b.sleepTask(t, 1, 10)
	b.waitStatus(t, first, "COMPLETED", 30*time.Second)

	conn, err := amqp.Dial(b.amqpURL)
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDelete(rabbitmq.QueueName("demo.sleep"), false, false, false)
	require.NoError(t, err)

	second := b.sleepTask(t, 1, 10)
	b.waitStatus(t, second, "COMPLETED", 30*time.Second)
	b.requireOneTerminal(t, second)
	require.Contains(t, w.Output(), "consumer stopped; reconnecting")
	testenv.WaitHTTP(t, "http://"+admin+"/readyz", 10*time.Second)
}

// A task that completes while PostgreSQL is down for longer than its lease
// completes once the database is back: its outcome is written then (the
// write is fenced by the task's version), not given up after a lease and
// the task, on its last attempt, failed by the lease reaper.
func TestWorkerStoresAnOutcomeAcrossAPostgresOutageLongerThanTheLease(t *testing.T) {
	skipShort(t)
	t.Parallel()
	pg := testenv.StartPG(t)
	dbURL, pool := pg.Migrated(t, "conveyor")
	b := setupWith(t, dbURL, pool, testenv.NewVhost(t))
	// The lease reaper's next pass comes long after the database is back:
	// the outcome is then written by the worker, or never.
	w := b.startWorker(t, "w1", "LEASE_DURATION=2s", "HEARTBEAT_INTERVAL=200ms", "WORKER_DEAD_AFTER=30s",
		"MAINTENANCE_INTERVAL=30s", "LEADER_TTL=40s", "CRON_CATCH_UP=5m")
	id := b.submit(t, "demo.sleep", map[string]any{"steps": 10, "step_ms": 100}, 1)
	b.waitUntil(t, id, "running", func(r taskRow) bool { return r.Progress >= 10 })

	pg.Stop(t)
	// The handler ends within a second; the database stays down for two
	// leases more.
	time.Sleep(5 * time.Second)
	pg.Start(t)
	pool.Reset()

	r := b.waitStatus(t, id, "COMPLETED", 20*time.Second)
	require.Equal(t, 1, r.Attempt)
	b.requireOneTerminal(t, id)
	require.Contains(t, w.Output(), "storing outcome failed; retrying", "the outage hit the outcome's write")
	require.False(t, w.Exited(), w.Output())
}

// A worker cut off from PostgreSQL cannot renew its handlers' leases: once
// a lease has passed on its own clock since the last renewal that landed,
// it stops the handler (ErrLost) instead of running it on beside the next
// attempt, which the lease reaper queues once the database is back. The
// stopped attempt writes nothing: the task is the reaper's to end.
func TestWorkerStopsAHandlerCutOffFromPostgresForALease(t *testing.T) {
	skipShort(t)
	t.Parallel()
	pg := testenv.StartPG(t)
	dbURL, pool := pg.Migrated(t, "conveyor")
	b := setupWith(t, dbURL, pool, testenv.NewVhost(t))
	w := b.startWorker(t, "w1", "LEASE_DURATION=2s", "HEARTBEAT_INTERVAL=200ms")
	id := b.submit(t, "demo.sleep", map[string]any{"steps": 100, "step_ms": 100}, 2)
	b.waitUntil(t, id, "running", func(r taskRow) bool { return r.Progress >= 2 })

	pg.Stop(t)
	testenv.Eventually(t, 30*time.Second, func() error {
		if !strings.Contains(w.Output(), "task lost: no lease renewal landed") {
			return errors.New("the handler runs on past its lease")
		}
		return nil
	})
	pg.Start(t)
	pool.Reset()

	r := b.waitStatus(t, id, "COMPLETED", 60*time.Second)
	require.Equal(t, 2, r.Attempt, "the reaper ended the first attempt")
	b.requireOneTerminal(t, id)
	require.NotContains(t, w.Output(), "storing outcome failed", "the lost attempt wrote no outcome")
	require.False(t, w.Exited(), w.Output())
}
