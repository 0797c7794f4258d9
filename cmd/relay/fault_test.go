package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// Fault tests run the real relay binary against real servers, and kill,
// stop and block them. Servers that are stopped or blocked are private to
// the test.

type faultBundle struct {
	dbURL   string
	pool    *pgxpool.Pool
	amqpURL string
	admin   string
	// declared: the demo.noop queue exists.
	declared bool
}

func (b *faultBundle) startRelay(t *testing.T, name string, env ...string) *testenv.Process {
	t.Helper()
	p := testenv.Start(t, name, testenv.Binary(t, "./cmd/relay"), append([]string{
		"DATABASE_URL=" + b.dbURL, "AMQP_URL=" + b.amqpURL, "RELAY_ADMIN_ADDR=" + b.admin,
		"RELAY_BATCH_SIZE=200", "RELAY_POLL_INTERVAL=100ms", "RELAY_RECONNECT_BACKOFF_MAX=300ms",
		"RELAY_RETRY_BACKOFF_BASE=100ms", "RELAY_RETRY_BACKOFF_MAX=500ms", "RELAY_STATS_INTERVAL=200ms",
		// These tests count and read the messages of the queue of single
		// messages, one a row: the relay packs none. Packing is the
		// publisher's (internal/rabbitmq), and the chaos soak runs it.
		"AMQP_TASKS_PER_MESSAGE=1",
		"LOG_LEVEL=info", "LOG_FORMAT=text"}, env...)...)
	return p
}

// fill adds n task.run rows, of no task and no org (the relay reads
// neither), and returns their ids. Their queue exists, as it does once a
// worker of the type has started.
func (b *faultBundle) fill(t *testing.T, n int) map[string]bool {
	t.Helper()
	if !b.declared {
		testenv.DeclareTaskQueue(t, b.amqpURL, "demo.noop")
		b.declared = true
	}
	rows, err := b.pool.Query(context.Background(), `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, priority)
		SELECT 'task.run', gen_random_uuid(), gen_random_uuid(), 'demo.noop', 0, 1, 5
		FROM generate_series(1, $1) g RETURNING id`, n)
	require.NoError(t, err)
	ids := map[string]bool{}
	for rows.Next() {
		var id int64
		require.NoError(t, rows.Scan(&id))
		ids[strconv.FormatInt(id, 10)] = true
	}
	require.NoError(t, rows.Err())
	return ids
}

func (b *faultBundle) outboxCount(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox").Scan(&n))
	return n
}

func (b *faultBundle) waitOutboxEmpty(t *testing.T, timeout time.Duration) {
	t.Helper()
	testenv.Eventually(t, timeout, func() error {
		if n := b.outboxCount(t); n != 0 {
			return fmt.Errorf("outbox holds %d rows", n)
		}
		return nil
	})
}

// requireAllDelivered drains the queue and checks every id arrived; it
// returns the number of duplicates.
func (b *faultBundle) requireAllDelivered(t *testing.T, ids map[string]bool) int {
	t.Helper()
	msgs := testenv.Drain(t, b.amqpURL, rabbitmq.QueueName("demo.noop"))
	got := map[string]int{}
	for _, m := range msgs {
		got[m.ID]++
	}
	missing := 0
	for id := range ids {
		if got[id] == 0 {
			missing++
		}
	}
	require.Zero(t, missing, "messages lost: %d of %d", missing, len(ids))
	return len(msgs) - len(got)
}

// slowBroker returns the address of amqpURL's broker behind a proxy that
// delays everything the broker sends by 300 ms: every confirm takes that
// long, and a relay's batch holds its rows as long.
func slowBroker(t *testing.T, amqpURL string) string {
	t.Helper()
	u, err := url.Parse(amqpURL)
	require.NoError(t, err)
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	proxy := toxiproxy.NewProxy(srv, "rabbitmq", "127.0.0.1:0", u.Host)
	require.NoError(t, proxy.Start())
	t.Cleanup(proxy.Stop)
	_, err = proxy.Toxics.AddToxicJson(strings.NewReader(
		`{"name": "slow", "type": "latency", "stream": "downstream", "attributes": {"latency": 300}}`))
	require.NoError(t, err)
	u.Host = proxy.Listen
	return u.String()
}

func sharedBundle(t *testing.T) *faultBundle {
	db := testdb.New(t)
	return &faultBundle{dbURL: db.URL, pool: db.Pool, amqpURL: testenv.NewVhost(t), admin: testenv.FreeAddr(t)}
}

func skipShort(t *testing.T) {
	if testing.Short() {
		t.Skip("process-level fault test")
	}
}

func TestRelaySIGTERMFinishesBatchAndExitsZero(t *testing.T) {
	skipShort(t)
	t.Parallel()
	b := sharedBundle(t)
	ids := b.fill(t, 4000)
	relay := b.startRelay(t, "relay")
	testenv.Eventually(t, 30*time.Second, func() error {
		if n := b.outboxCount(t); n == len(ids) {
			return fmt.Errorf("nothing published yet")
		}
		return nil
	})
	relay.Signal(syscall.SIGTERM)
	require.Equal(t, 0, relay.Wait(t, 20*time.Second), relay.Output())
	left := b.outboxCount(t)

	// Whatever it did not publish is still in the outbox: nothing lost.
	b.startRelay(t, "relay-2")
	b.waitOutboxEmpty(t, 60*time.Second)
	dups := b.requireAllDelivered(t, ids)
	t.Logf("stopped with %d rows left; duplicates after SIGTERM: %d", left, dups)
	require.Zero(t, dups, "a graceful stop finishes its batch: no duplicates")
}

// SHUTDOWN_TIMEOUT is how long a SIGTERM drain may take, for every binary
// (README, "Configuration"): a relay whose pass in flight is stuck (here on
// a lock of the outbox) gives it up once the timeout has passed and exits,
// rather than after its own confirm timeout. Its rows stay in the outbox.
func TestRelaySIGTERMHonoursShutdownTimeout(t *testing.T) {
	skipShort(t)
	t.Parallel()
	b := sharedBundle(t)
	b.fill(t, 10)
	relay := b.startRelay(t, "relay", "SHUTDOWN_TIMEOUT=1s", "RELAY_CONFIRM_TIMEOUT=20s")
	testenv.WaitHTTP(t, "http://"+b.admin+"/readyz", 30*time.Second)
	b.waitOutboxEmpty(t, 30*time.Second)

	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	_, err = tx.Exec(ctx, `LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	// The relay's next poll (every 100ms) waits on the lock.
	testenv.Eventually(t, 10*time.Second, func() error {
		var n int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%outbox.claim%'`).Scan(&n))
		if n == 0 {
			return fmt.Errorf("no relay pass waiting on the lock yet")
		}
		return nil
	})

	requireStopsWithin(t, relay, 5*time.Second)
}

// A broker address that takes connections and never answers (a node that
// hangs, a load balancer with nothing behind it) holds each dial for its
// 30-second handshake timeout. SHUTDOWN_TIMEOUT still bounds a SIGTERM: a
// relay with no pass in flight, dialling such a broker, exits at once
// instead of when the dial gives up.
func TestRelaySIGTERMWhileDialingAHungBroker(t *testing.T) {
	skipShort(t)
	t.Parallel()
	silent, dialled := testenv.SilentAddr(t)
	db := testdb.New(t)
	b := &faultBundle{dbURL: db.URL, pool: db.Pool, amqpURL: "amqp://guest:guest@" + silent + "/",
		admin: testenv.FreeAddr(t)}
	relay := b.startRelay(t, "relay", "SHUTDOWN_TIMEOUT=1s")
	testenv.WaitHTTP(t, "http://"+b.admin+"/healthz", 30*time.Second)
	testenv.Eventually(t, 10*time.Second, func() error {
		if dialled() == 0 {
			return fmt.Errorf("the relay has not dialled the broker yet")
		}
		return nil
	})

	requireStopsWithin(t, relay, 5*time.Second)
}

// RELAY_LANES is how many batches a relay keeps in flight at once, and a
// batch holds a database connection from its lock to its commit, through
// its wait for the broker's confirms: the relay's pool holds one for each
// lane. The pool was pgx's default, max(4, cores), so 8 lanes kept 4
// batches in flight on a small machine (and the readiness probe's ping
// waited behind them). Here every confirm takes a round trip of 300 ms.
func TestRelayKeepsEveryLaneInFlight(t *testing.T) {
	skipShort(t)
	t.Parallel()
	const lanes = 8
	b := sharedBundle(t)
	b.amqpURL = slowBroker(t, b.amqpURL)

	b.fill(t, lanes*200*4)
	b.startRelay(t, "relay", fmt.Sprintf("RELAY_LANES=%d", lanes))
	most := 0
	testenv.Eventually(t, 60*time.Second, func() error {
		var n int
		require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND state = 'idle in transaction' AND pid <> pg_backend_pid()`).Scan(&n))
		most = max(most, n)
		if most < lanes {
			return fmt.Errorf("at most %d of %d lanes had a batch in flight at once", most, lanes)
		}
		return nil
	})
}

func TestRelaySIGKILLLosesNothing(t *testing.T) {
	skipShort(t)
	t.Parallel()
	b := sharedBundle(t)
	ids := b.fill(t, 4000)
	for i := range 3 {
		relay := b.startRelay(t, fmt.Sprintf("relay-%d", i))
		before := b.outboxCount(t)
		testenv.Eventually(t, 30*time.Second, func() error {
			if n := b.outboxCount(t); n == before && n > 0 {
				return fmt.Errorf("nothing published yet")
			}
			return nil
		})
		relay.Signal(syscall.SIGKILL)
		relay.Wait(t, 10*time.Second)
	}
	b.startRelay(t, "relay-final")
	b.waitOutboxEmpty(t, 60*time.Second)
	dups := b.requireAllDelivered(t, ids)
	t.Logf("duplicates after 3 SIGKILLs: %d of %d", dups, len(ids))
}

func TestRelaySurvivesPostgresRestart(t *testing.T) {
	skipShort(t)
	t.Parallel()
	pg := testenv.StartPG(t)
	dbURL, pool := pg.Migrated(t, "conveyor")
	b := &faultBundle{dbURL: dbURL, pool: pool, amqpURL: testenv.NewVhost(t), admin: testenv.FreeAddr(t)}

	ids := b.fill(t, 500)
	relay := b.startRelay(t, "relay")
	b.waitOutboxEmpty(t, 30*time.Second)

	pg.Stop(t)
	testenv.Eventually(t, 10*time.Second, func() error { return testenv.WantStatus("http://"+b.admin+"/readyz", http.StatusServiceUnavailable) })
	require.NoError(t, testenv.WantStatus("http://"+b.admin+"/healthz", http.StatusOK), "alive while the database is down")
	pg.Start(t)
	pool.Reset() // the test's own connections died with the server

	for id := range b.fill(t, 500) {
		ids[id] = true
	}
	b.waitOutboxEmpty(t, 30*time.Second)
	require.Zero(t, b.requireAllDelivered(t, ids))
	require.False(t, relay.Exited(), relay.Output())
	testenv.Eventually(t, 10*time.Second, func() error { return testenv.WantStatus("http://"+b.admin+"/readyz", http.StatusOK) })
}

// A relay's commit does not wait for its WAL to reach the disk, so a
// PostgreSQL crash can undo its last passes: their rows are in the outbox
// again after recovery, and are published again. Duplicates, nothing lost.
// This server flushes every other commit before it answers, as a
// production one does; the crash loses what its WAL writer had not yet
// written out.
func TestRelayPassesUndoneByAPostgresCrashArePublishedAgain(t *testing.T) {
	skipShort(t)
	t.Parallel()
	pg := testenv.StartPG(t, "synchronous_commit=on")
	dbURL, pool := pg.Migrated(t, "conveyor")
	b := &faultBundle{dbURL: dbURL, pool: pool, amqpURL: testenv.NewVhost(t), admin: testenv.FreeAddr(t)}

	ids := b.fill(t, 20000)
	relay := b.startRelay(t, "relay")
	testenv.Eventually(t, 30*time.Second, func() error {
		if n := b.outboxCount(t); n > len(ids)-2000 {
			return fmt.Errorf("%d rows published", len(ids)-n)
		}
		return nil
	})
	pg.Crash(t)
	pg.Start(t)
	pool.Reset()

	b.waitOutboxEmpty(t, 60*time.Second)
	dups := b.requireAllDelivered(t, ids)
	t.Logf("duplicates after the crash: %d of %d", dups, len(ids))
	require.False(t, relay.Exited(), relay.Output())
}

func TestRelaySurvivesBrokerRestartAndAlarm(t *testing.T) {
	skipShort(t)
	t.Parallel()
	node := testenv.StartRabbit(t)
	db := testdb.New(t)
	b := &faultBundle{dbURL: db.URL, pool: db.Pool, amqpURL: node.URL(), admin: testenv.FreeAddr(t)}

	ids := b.fill(t, 500)
	relay := b.startRelay(t, "relay")
	b.waitOutboxEmpty(t, 30*time.Second)

	// Broker restart: rows committed meanwhile wait, then go out.
	node.Stop(t)
	testenv.Eventually(t, 10*time.Second, func() error { return testenv.WantStatus("http://"+b.admin+"/readyz", http.StatusServiceUnavailable) })
	for id := range b.fill(t, 500) {
		ids[id] = true
	}
	node.Start(t)
	b.waitOutboxEmpty(t, 60*time.Second)
	testenv.WaitForDepth(t, b.amqpURL, rabbitmq.QueueName("demo.noop"), len(ids), 10*time.Second)

	// A memory alarm blocks publishers: the relay stays alive and ready,
	// says so, and the rows wait until the alarm clears.
	node.Ctl(t, "set_vm_memory_high_watermark", "0.000001")
	testenv.Eventually(t, 20*time.Second, func() error {
		for id := range b.fill(t, 1) {
			ids[id] = true
		}
		return wantBody(b.admin, "/readyz", `"broker_blocked":true`)
	})
	require.NoError(t, testenv.WantStatus("http://"+b.admin+"/readyz", http.StatusOK))
	require.NoError(t, wantBody(b.admin, "/metrics", "conveyor_relay_broker_blocked 1"))
	require.NotZero(t, b.outboxCount(t), "rows wait while the broker blocks")
	node.Ctl(t, "set_vm_memory_high_watermark", "0.4")
	b.waitOutboxEmpty(t, 60*time.Second)
	require.Zero(t, b.requireAllDelivered(t, ids))
	require.False(t, relay.Exited(), relay.Output())
}

// A broker under a resource alarm reads nothing from the connections it
// blocked, so it never answers their close. SIGTERM must still stop a relay
// whose lanes it blocked, instead of leaving it to wait for the alarm to
// clear.
func TestRelaySIGTERMDuringAnAlarm(t *testing.T) {
	skipShort(t)
	t.Parallel()
	node := testenv.StartRabbit(t)
	db := testdb.New(t)
	b := &faultBundle{dbURL: db.URL, pool: db.Pool, amqpURL: node.URL(), admin: testenv.FreeAddr(t)}
	b.fill(t, 10)
	relay := b.startRelay(t, "relay", "SHUTDOWN_TIMEOUT=1s", "RELAY_CONFIRM_TIMEOUT=1s", "RELAY_LANES=1")
	b.waitOutboxEmpty(t, 30*time.Second)

	node.Ctl(t, "set_vm_memory_high_watermark", "0.000001")
	testenv.Eventually(t, 20*time.Second, func() error {
		b.fill(t, 1)
		return wantBody(b.admin, "/readyz", `"broker_blocked":true`)
	})
	// The lane's next batch finds no confirm in time: its channel is given
	// up on a connection the broker blocks.
	b.fill(t, 5)
	testenv.Eventually(t, 20*time.Second, func() error {
		if !strings.Contains(relay.Output(), "broker channel given up") {
			return fmt.Errorf("no channel given up yet")
		}
		return nil
	})

	relay.Signal(syscall.SIGTERM)
	require.Equal(t, 0, relay.Wait(t, 60*time.Second), relay.Output())
}

func wantBody(addr, path, want string) error {
	resp, err := http.Get("http://" + addr + path)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if !strings.Contains(string(body), want) {
		return fmt.Errorf("%s does not say %q", path, want)
	}
	return nil
}

// requireStopsWithin signals SIGTERM to relay (run with SHUTDOWN_TIMEOUT=1s)
// and requires it to exit cleanly within bound.
func requireStopsWithin(t *testing.T, relay *testenv.Process, bound time.Duration) {
	t.Helper()
	start := time.Now()
	relay.Signal(syscall.SIGTERM)
	code := relay.Wait(t, 60*time.Second)
	took := time.Since(start)
	require.Less(t, took, bound, "SHUTDOWN_TIMEOUT=1s, yet the relay took %s to stop", took)
	require.Equal(t, 0, code, relay.Output())
}

// A relay frozen mid-pass (a paused VM, a host gone without closing its
// sockets) holds its pass's transaction, and the outbox rows it locked,
// for as long as PostgreSQL keeps its session: other relays skip locked
// rows. DATABASE_IDLE_IN_TRANSACTION_TIMEOUT has the server end that
// session, and another relay publishes the rows. Every confirm takes a
// round trip of 300 ms here, so a pass is caught holding its rows.
func TestAFrozenRelaysRowsArePublishedByAnother(t *testing.T) {
	skipShort(t)
	t.Parallel()
	b := sharedBundle(t)
	slow := slowBroker(t, b.amqpURL)

	ids := b.fill(t, 2000)
	env := []string{"RELAY_CONFIRM_TIMEOUT=2s", "DATABASE_IDLE_IN_TRANSACTION_TIMEOUT=18s", "RELAY_LANES=1"}
	frozen := b.startRelay(t, "relay-frozen", append(env, "AMQP_URL="+slow)...)
	inPass := func() int {
		var n int
		require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND state = 'idle in transaction' AND pid <> pg_backend_pid()`).Scan(&n))
		return n
	}
	// Freeze it while a pass holds its rows: stopped between two passes,
	// it is let go and caught again.
	testenv.Eventually(t, 30*time.Second, func() error {
		if inPass() == 0 {
			return fmt.Errorf("no pass in flight")
		}
		frozen.Signal(syscall.SIGSTOP)
		time.Sleep(700 * time.Millisecond) // longer than a pass's confirms: a pass still open is the frozen one's
		if inPass() == 0 {
			frozen.Signal(syscall.SIGCONT)
			return fmt.Errorf("stopped between passes")
		}
		return nil
	})
	t.Cleanup(func() { frozen.Signal(syscall.SIGCONT) })
	held := b.outboxCount(t)
	require.NotZero(t, held)

	b.admin = testenv.FreeAddr(t)
	b.startRelay(t, "relay-2", env...)
	b.waitOutboxEmpty(t, 60*time.Second)
	dups := b.requireAllDelivered(t, ids)
	t.Logf("frozen with %d rows in the outbox; duplicates: %d", held, dups)
}

// A database that stops answering (a host gone without closing its
// sockets) must not hold /readyz open past a probe's patience: the probe
// reads 503, not a timeout of its own.
func TestRelayAnswersAndStopsInTimeWhenPostgresHangs(t *testing.T) {
	skipShort(t)
	t.Parallel()
	b := sharedBundle(t)
	u, err := url.Parse(b.dbURL)
	require.NoError(t, err)
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	proxy := toxiproxy.NewProxy(srv, "postgres", "127.0.0.1:0", u.Host)
	require.NoError(t, proxy.Start())
	t.Cleanup(proxy.Stop)
	u.Host = proxy.Listen
	b.dbURL = u.String()
	relay := b.startRelay(t, "relay", "SHUTDOWN_TIMEOUT=3s")
	testenv.Eventually(t, 30*time.Second, func() error { return testenv.WantStatus("http://"+b.admin+"/readyz", http.StatusOK) })

	_, err = proxy.Toxics.AddToxicJson(strings.NewReader(
		`{"name": "hang", "type": "timeout", "stream": "upstream", "attributes": {"timeout": 0}}`))
	require.NoError(t, err)
	client := &http.Client{Timeout: 30 * time.Second}
	start := time.Now()
	resp, err := client.Get("http://" + b.admin + "/readyz")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	took := time.Since(start)
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, string(body))
	require.Less(t, took, 3*time.Second, "readyz took %s", took)
	require.False(t, relay.Exited(), relay.Output())

	// Nor does it hold a stopping relay much past its shutdown timeout.
	relay.Signal(syscall.SIGTERM)
	relay.Wait(t, 15*time.Second)
}
