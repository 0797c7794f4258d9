// Package chaos_test proves the guarantees of docs/design.md ("What Conveyor
// promises") under faults: it runs
// an api, two relays and three workers as real processes on a private
// PostgreSQL and a private RabbitMQ, reached through TCP proxies, submits a
// steady stream of tasks, and meanwhile kills, stops, restarts, purges and
// cuts. Then it lets the system drain and checks the database.
//
//	go test ./chaos -run TestChaos -chaos.duration=10m -v   # make chaos
package chaos_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

var (
	duration = flag.Duration("chaos.duration", 30*time.Second, "how long faults are injected")
	every    = flag.Duration("chaos.every", 3*time.Second, "mean time between faults")
	seed     = flag.Uint64("chaos.seed", 0, "random seed (0: from the clock)")
	report   = flag.String("chaos.report", "", "write the summary as JSON to this file")
	rate     = flag.Int("chaos.rate", 40, "tasks submitted per second")
)

const taskType = "chaos.sleep"

// slot is a process the test may kill and start again.
type slot struct {
	name, bin, admin string
	env              []string
	proc             *testenv.Process
}

func (s *slot) start(t *testing.T) { s.proc = testenv.Start(t, s.name, s.bin, s.env...) }

type harness struct {
	t         *testing.T
	rng       *rand.Rand
	pg        *testenv.PGServer
	rabbit    *testenv.RabbitNode
	pgProxy   *toxiproxy.Proxy
	mqProxy   *toxiproxy.Proxy
	pool      *pgxpool.Pool // direct, for the checks
	api       string
	token     string // an admin key of the org "chaos"
	relays    []*slot
	workers   []*slot
	execLog   string
	faults    []fault
	faultErrs []string
}

type fault struct {
	Kind       string
	Start, End time.Time
}

func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos soak")
	}
	s := *seed
	if s == 0 {
		s = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d (rerun with -chaos.seed=%d)", s, s)
	h := &harness{t: t, rng: rand.New(rand.NewPCG(s, s^0x9e3779b97f4a7c15))}
	h.setup()

	ctx, stopLoad := context.WithCancel(context.Background())
	l := &ledger{accepted: map[uuid.UUID]bool{}, cancelAccepted: map[uuid.UUID]bool{}}
	loadDone := make(chan struct{})
	go func() { defer close(loadDone); h.load(ctx, l, rand.New(rand.NewPCG(s+1, s+2))) }()

	h.injectFaults(*duration)
	h.heal()
	stopLoad()
	<-loadDone
	drainStart := time.Now()
	h.drain(3 * time.Minute)
	drained := time.Since(drainStart)

	sum := h.check(l)
	sum.Seed, sum.Duration, sum.DrainTime = s, duration.String(), drained.Round(100*time.Millisecond).String()
	out, _ := json.MarshalIndent(sum, "", "  ")
	t.Logf("chaos summary:\n%s", out)
	if *report != "" {
		require.NoError(t, os.WriteFile(*report, append(out, '\n'), 0o644))
	}
	for _, e := range h.faultErrs {
		t.Error(e)
	}
}

func (h *harness) setup() {
	t := h.t
	h.pg = testenv.StartPG(t)
	h.rabbit = testenv.StartRabbit(t)
	_, h.pool = h.pg.Migrated(t, "conveyor")

	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	h.pgProxy = toxiproxy.NewProxy(srv, "postgres", "127.0.0.1:0", hostPort(h.pg.URL("conveyor")))
	h.mqProxy = toxiproxy.NewProxy(srv, "rabbitmq", "127.0.0.1:0", fmt.Sprintf("127.0.0.1:%d", h.rabbit.Port))
	for _, p := range []*toxiproxy.Proxy{h.pgProxy, h.mqProxy} {
		require.NoError(t, p.Start())
		t.Cleanup(p.Stop)
	}
	dbURL := strings.Replace(h.pg.URL("conveyor"), hostPort(h.pg.URL("conveyor")), h.pgProxy.Listen, 1)
	amqpURL := fmt.Sprintf("amqp://guest:guest@%s/", h.mqProxy.Listen)
	h.execLog = filepath.Join(t.TempDir(), "executions.log")

	apiAddr := testenv.FreeAddr(t)
	h.api = "http://" + apiAddr
	common := []string{"DATABASE_URL=" + dbURL, "LOG_FORMAT=text", "LOG_LEVEL=warn"}
	testenv.Start(t, "api", testenv.Binary(t, "./cmd/api"), append(common, "API_ADDR="+apiAddr)...)
	testenv.WaitHTTP(t, h.api+"/readyz", time.Minute)
	token, err := postgres.NewDirectory(h.pool).Bootstrap(context.Background(), "chaos", "chaos-clients")
	require.NoError(t, err)
	h.token = token
	for i := range 2 {
		s := &slot{name: fmt.Sprintf("relay-%d", i), bin: testenv.Binary(t, "./cmd/relay"), admin: testenv.FreeAddr(t)}
		s.env = append(common, "AMQP_URL="+amqpURL, "RELAY_ADMIN_ADDR="+s.admin, "RELAY_POLL_INTERVAL=200ms",
			"RELAY_RECONNECT_BACKOFF_MAX=1s", "RELAY_RETRY_BACKOFF_BASE=200ms", "RELAY_RETRY_BACKOFF_MAX=2s",
			"RELAY_CONFIRM_TIMEOUT=3s")
		s.start(t)
		h.relays = append(h.relays, s)
	}
	for i := range 3 {
		s := &slot{name: fmt.Sprintf("worker-%d", i), bin: testenv.Binary(t, "./chaos/chaosworker"), admin: testenv.FreeAddr(t)}
		s.env = append(common, "AMQP_URL="+amqpURL, "WORKER_ADMIN_ADDR="+s.admin, "WORKER_ID="+s.name,
			"CHAOS_EXEC_LOG="+h.execLog, "WORKER_CONCURRENCY=8", "LEASE_DURATION=4s", "HEARTBEAT_INTERVAL=1s",
			"MAINTENANCE_INTERVAL=500ms", "LEADER_TTL=3s", "REPUBLISH_AFTER=5s", "WORKER_DEAD_AFTER=5s",
			"RETRY_BACKOFF_BASE=200ms", "RETRY_BACKOFF_MAX=2s", "SHUTDOWN_TIMEOUT=2s",
			"WORKER_RECONNECT_BACKOFF_MAX=1s", "PROGRESS_MIN_INTERVAL=100ms")
		s.start(t)
		h.workers = append(h.workers, s)
	}
}

// hostPort is the host:port of a URL.
func hostPort(u string) string {
	rest := u[strings.Index(u, "@")+1:]
	return rest[:strings.IndexAny(rest, "/?")]
}

// ledger is what the clients were told.
type ledger struct {
	mu             sync.Mutex
	accepted       map[uuid.UUID]bool
	cancelAccepted map[uuid.UUID]bool
	submits        int
	duplicates     int
	refused        int
	cancels        int
	cancelRefused  int
	wg             sync.WaitGroup
}

// load submits tasks at the configured rate until ctx ends: most of them
// succeed, some fail a few times first, a few fail for good, some are
// submitted twice, and some are cancelled while pending or running.
func (h *harness) load(ctx context.Context, l *ledger, rng *rand.Rand) {
	client := &http.Client{Timeout: 10 * time.Second, Transport: testenv.Bearer(h.token, nil)}
	tick := time.NewTicker(time.Second / time.Duration(*rate))
	defer tick.Stop()
	var sent [][]byte
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			l.wg.Wait()
			return
		case <-tick.C:
		}
		var body []byte
		dup := len(sent) > 0 && rng.IntN(10) == 0
		if dup {
			body = sent[rng.IntN(len(sent))]
		} else {
			failTimes := 0
			switch r := rng.IntN(20); {
			case r < 3:
				failTimes = 1 + rng.IntN(2) // retried, then completes
			case r == 3:
				failTimes = 9 // fails for good after max_attempts
			}
			body = fmt.Appendf(nil, `{"type": %q, "max_attempts": 3, "payload": {"n": %d, "steps": %d, "step_ms": %d, "fail_times": %d}}`,
				taskType, i, 1+rng.IntN(4), 20+rng.IntN(150), failTimes)
			sent = append(sent, body)
		}
		resp, err := client.Post(h.api+"/v1/tasks", "application/json", bytes.NewReader(body))
		l.mu.Lock()
		l.submits++
		if dup {
			l.duplicates++
		}
		l.mu.Unlock()
		if err != nil {
			l.mu.Lock()
			l.refused++
			l.mu.Unlock()
			continue
		}
		var v struct {
			ID uuid.UUID `json:"id"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&v)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated && resp.StatusCode != http.StatusOK {
			l.mu.Lock()
			l.refused++
			l.mu.Unlock()
			continue
		}
		l.mu.Lock()
		l.accepted[v.ID] = true
		l.mu.Unlock()
		if !dup && rng.IntN(8) == 0 {
			delay := time.Duration(rng.IntN(1500)) * time.Millisecond
			l.wg.Add(1)
			go func() {
				defer l.wg.Done()
				time.Sleep(delay)
				h.cancel(client, l, v.ID)
			}()
		}
	}
}

func (h *harness) cancel(client *http.Client, l *ledger, id uuid.UUID) {
	resp, err := client.Post(h.api+"/v1/tasks/"+id.String()+"/cancel", "application/json", nil)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cancels++
	if err != nil {
		l.cancelRefused++
		return
	}
	resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK, http.StatusAccepted:
		l.cancelAccepted[id] = true
	default:
		l.cancelRefused++ // 409: it had finished; 503: the database was away
	}
}

var faultKinds = []string{
	"kill-worker", "kill-relay", "term-worker", "restart-broker", "restart-postgres",
	"purge-queue", "cut-broker", "cut-database", "slow-database",
}

// injectFaults runs faults for d: every kind once, in a random order, then
// random kinds.
func (h *harness) injectFaults(d time.Duration) {
	order := append([]string(nil), faultKinds...)
	h.rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
	end := time.Now().Add(d)
	for i := 0; time.Now().Before(end) || i < len(faultKinds); i++ {
		time.Sleep(*every/2 + time.Duration(h.rng.Int64N(int64(*every))))
		kind := faultKinds[h.rng.IntN(len(faultKinds))]
		if i < len(order) {
			kind = order[i]
		}
		f := fault{Kind: kind, Start: time.Now()}
		h.inject(kind)
		f.End = time.Now()
		h.faults = append(h.faults, f)
		h.t.Logf("fault %-16s took %s", kind, f.End.Sub(f.Start).Round(10*time.Millisecond))
	}
}

func (h *harness) inject(kind string) {
	t := h.t
	pick := func(s []*slot) *slot { return s[h.rng.IntN(len(s))] }
	switch kind {
	case "kill-worker", "kill-relay":
		s := pick(h.workers)
		if kind == "kill-relay" {
			s = pick(h.relays)
		}
		s.proc.Signal(syscall.SIGKILL)
		s.proc.Wait(t, 10*time.Second)
		time.Sleep(time.Duration(h.rng.IntN(500)) * time.Millisecond)
		s.start(t)
	case "term-worker":
		s := pick(h.workers)
		s.proc.Signal(syscall.SIGTERM)
		if code := s.proc.Wait(t, 30*time.Second); code != 0 {
			h.faultErrs = append(h.faultErrs, fmt.Sprintf("%s exited %d after SIGTERM", s.name, code))
		}
		s.start(t)
	case "restart-broker":
		h.rabbit.Stop(t)
		time.Sleep(time.Second)
		h.rabbit.Start(t)
	case "restart-postgres":
		h.pg.Stop(t)
		time.Sleep(time.Second)
		h.pg.Start(t)
		h.pool.Reset()
	case "purge-queue":
		// With every worker down, messages pile up in the queue (the
		// unacked ones go back to it); purging them is a broker losing
		// them. Maintenance must publish those tasks again.
		for _, s := range h.workers {
			s.proc.Signal(syscall.SIGKILL)
			s.proc.Wait(t, 10*time.Second)
		}
		time.Sleep(time.Second)
		u := fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", h.rabbit.Port)
		for _, q := range []string{rabbitmq.QueueName(taskType), rabbitmq.PackedQueueName(taskType)} {
			if testenv.QueueDepth(t, u, q) >= 0 {
				t.Logf("purged %d messages of %s", testenv.PurgeQueue(t, u, q), q)
			}
		}
		for _, s := range h.workers {
			s.start(t)
		}
	case "cut-broker", "cut-database":
		p := h.mqProxy
		if kind == "cut-database" {
			p = h.pgProxy
		}
		p.Stop() // closes every connection and refuses new ones
		time.Sleep(time.Second + time.Duration(h.rng.IntN(2000))*time.Millisecond)
		require.NoError(t, p.Start())
	case "slow-database":
		_, err := h.pgProxy.Toxics.AddToxicJson(strings.NewReader(
			`{"name": "slow", "type": "latency", "stream": "downstream", "attributes": {"latency": 150, "jitter": 50}}`))
		require.NoError(t, err)
		time.Sleep(3 * time.Second)
		require.NoError(t, h.pgProxy.Toxics.RemoveToxic(context.Background(), "slow"))
	}
}

// heal makes sure every process runs and every path is open.
func (h *harness) heal() {
	for _, s := range append(append([]*slot(nil), h.relays...), h.workers...) {
		if s.proc.Exited() {
			h.faultErrs = append(h.faultErrs, fmt.Sprintf("%s had exited on its own:\n%s", s.name, s.proc.Output()))
			s.start(h.t)
		}
	}
}

// drain waits until every task is terminal and the outbox is empty.
func (h *harness) drain(timeout time.Duration) {
	testenv.Eventually(h.t, timeout, func() error {
		var open, outbox int
		if err := h.pool.QueryRow(context.Background(), `SELECT
			(SELECT count(*) FROM tasks WHERE status NOT IN ('COMPLETED', 'FAILED', 'CANCELLED')),
			(SELECT count(*) FROM outbox)`).Scan(&open, &outbox); err != nil {
			return err
		}
		if open > 0 || outbox > 0 {
			return fmt.Errorf("%d tasks not terminal, %d outbox rows; some: %s", open, outbox, h.stuck())
		}
		return nil
	})
}

// stuck describes a few tasks that are not terminal, for a failed drain.
func (h *harness) stuck() string {
	rows, err := h.pool.Query(context.Background(), `SELECT t.id, t.status, t.state, t.attempt,
		coalesce(t.worker_id, ''), coalesce(t.lease_expires_at::text, ''), t.next_run_at::text,
		(SELECT count(*) FROM outbox o WHERE o.task_id = t.id)
		FROM tasks t WHERE status NOT IN ('COMPLETED', 'FAILED', 'CANCELLED') ORDER BY updated_at LIMIT 5`)
	if err != nil {
		return err.Error()
	}
	defer rows.Close()
	var b strings.Builder
	for rows.Next() {
		var id, status, state, worker, lease, next string
		var attempt, outbox int
		if err := rows.Scan(&id, &status, &state, &attempt, &worker, &lease, &next, &outbox); err != nil {
			return err.Error()
		}
		fmt.Fprintf(&b, "\n  %s %s %q attempt=%d worker=%q lease=%s next_run=%s outbox=%d", id, status, state, attempt, worker, lease, next, outbox)
	}
	return b.String()
}

type summary struct {
	Seed                  uint64            `json:"seed"`
	Duration              string            `json:"fault_duration"`
	DrainTime             string            `json:"drain_time"`
	Submits               int               `json:"submits"`
	DuplicateSubmits      int               `json:"duplicate_submits"`
	RefusedSubmits        int               `json:"refused_submits"`
	Tasks                 int               `json:"tasks"`
	ByStatus              map[string]int    `json:"by_status"`
	CancelsAccepted       int               `json:"cancels_accepted"`
	Faults                map[string]int    `json:"faults"`
	RecoveryMax           map[string]string `json:"recovery_max"`
	Lost                  int               `json:"lost"`
	AcceptedMissing       int               `json:"accepted_missing"`
	DoubleTerminal        int               `json:"double_terminal"`
	CompletedAfterCancel  int               `json:"completed_after_cancel"`
	AttemptsOverMax       int               `json:"attempts_over_max"`
	CompletedNoResult     int               `json:"completed_without_result"`
	OutboxLeft            int               `json:"outbox_left"`
	Executions            int               `json:"executions"`
	Retries               int               `json:"retries"`
	DuplicateExecutions   int               `json:"duplicate_executions"`
	TasksWithDuplicates   int               `json:"tasks_with_duplicate_executions"`
	ProcessGoroutinesMax  int               `json:"process_goroutines_max"`
	ProcessRSSMaxMiB      float64           `json:"process_rss_max_mib"`
	ExecutionsPerTaskHist map[int]int       `json:"executions_per_task"`
}

// check reads the database and the execution log and checks every promise.
func (h *harness) check(l *ledger) summary {
	t, ctx := h.t, context.Background()
	q := func(sql string, args ...any) int {
		var n int
		require.NoError(t, h.pool.QueryRow(ctx, sql, args...).Scan(&n))
		return n
	}
	s := summary{
		Submits: l.submits, DuplicateSubmits: l.duplicates, RefusedSubmits: l.refused,
		CancelsAccepted: len(l.cancelAccepted), ByStatus: map[string]int{}, Faults: map[string]int{},
		RecoveryMax: map[string]string{}, ExecutionsPerTaskHist: map[int]int{},
	}
	rows, err := h.pool.Query(ctx, `SELECT status, count(*) FROM tasks GROUP BY status`)
	require.NoError(t, err)
	for rows.Next() {
		var st string
		var n int
		require.NoError(t, rows.Scan(&st, &n))
		s.ByStatus[st] = n
		s.Tasks += n
	}
	require.NoError(t, rows.Err())

	s.Lost = q(`SELECT count(*) FROM tasks WHERE status NOT IN ('COMPLETED', 'FAILED', 'CANCELLED')`)
	ids := make([]uuid.UUID, 0, len(l.accepted))
	for id := range l.accepted {
		ids = append(ids, id)
	}
	s.AcceptedMissing = len(ids) - q(`SELECT count(*) FROM tasks WHERE id = ANY($1)`, ids)
	s.DoubleTerminal = q(`SELECT count(*) FROM (SELECT task_id FROM task_events
		WHERE status IN ('COMPLETED', 'FAILED', 'CANCELLED') GROUP BY task_id HAVING count(*) > 1) d`)
	cancelled := make([]uuid.UUID, 0, len(l.cancelAccepted))
	for id := range l.cancelAccepted {
		cancelled = append(cancelled, id)
	}
	s.CompletedAfterCancel = q(`SELECT count(*) FROM tasks WHERE status <> 'CANCELLED'
		AND (id = ANY($1) OR cancel_requested_at IS NOT NULL)`, cancelled)
	s.AttemptsOverMax = q(`SELECT count(*) FROM tasks WHERE attempt > max_attempts`)
	s.CompletedNoResult = q(`SELECT count(*) FROM tasks t WHERE status = 'COMPLETED'
		AND NOT EXISTS (SELECT 1 FROM task_results r WHERE r.task_id = t.id)`)
	s.OutboxLeft = q(`SELECT count(*) FROM outbox`)
	s.Retries = q(`SELECT count(*) FROM task_events WHERE state = 'Retry scheduled'`)

	// Executions: every start of the handler, from the workers' log.
	executions := map[uuid.UUID]int{}
	f, err := os.Open(h.execLog)
	require.NoError(t, err)
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) != 2 {
			continue // a line cut by SIGKILL mid-write
		}
		if id, err := uuid.Parse(fields[0]); err == nil {
			executions[id]++
			s.Executions++
		}
	}
	require.NoError(t, sc.Err())
	retries := map[uuid.UUID]int{}
	rows, err = h.pool.Query(ctx, `SELECT task_id, count(*) FROM task_events WHERE state = 'Retry scheduled' GROUP BY task_id`)
	require.NoError(t, err)
	for rows.Next() {
		var id uuid.UUID
		var n int
		require.NoError(t, rows.Scan(&id, &n))
		retries[id] = n
	}
	require.NoError(t, rows.Err())
	for id, n := range executions {
		s.ExecutionsPerTaskHist[n]++
		if dup := n - 1 - retries[id]; dup > 0 {
			s.DuplicateExecutions += dup
			s.TasksWithDuplicates++
		}
	}

	// Recovery: from the end of each fault until work completes again (the
	// first task completed after it).
	worst := map[string]time.Duration{}
	for _, f := range h.faults {
		s.Faults[f.Kind]++
		var first *time.Time
		require.NoError(t, h.pool.QueryRow(ctx, `SELECT min(completed_at) FROM tasks
			WHERE status = 'COMPLETED' AND completed_at >= $1`, f.End).Scan(&first))
		if first != nil {
			worst[f.Kind] = max(worst[f.Kind], first.Sub(f.End))
		}
	}
	for k, d := range worst {
		s.RecoveryMax[k] = d.Round(10 * time.Millisecond).String()
	}

	// Leaks: the processes still running, after the drain.
	for _, sl := range append(append([]*slot(nil), h.relays...), h.workers...) {
		g, rss := processStats(t, sl.admin)
		s.ProcessGoroutinesMax = max(s.ProcessGoroutinesMax, g)
		s.ProcessRSSMaxMiB = max(s.ProcessRSSMaxMiB, rss/(1<<20))
	}

	require.Zero(t, s.Lost, "every accepted task reaches a terminal state")
	require.Zero(t, s.AcceptedMissing, "every task a client was told about exists")
	require.Zero(t, s.DoubleTerminal, "no task has two terminal events")
	require.Zero(t, s.CompletedAfterCancel, "no task whose cancellation was accepted ends otherwise")
	require.Zero(t, s.AttemptsOverMax, "attempts never exceed max_attempts")
	require.Zero(t, s.CompletedNoResult, "every COMPLETED task has its result")
	require.Zero(t, s.OutboxLeft, "the outbox drains")
	require.Less(t, s.ProcessGoroutinesMax, 200, "goroutines stay bounded")
	require.Less(t, s.ProcessRSSMaxMiB, 600.0, "memory stays bounded (race-detector builds included)")
	require.NotZero(t, s.ByStatus["COMPLETED"], "work got done")
	return s
}

// processStats reads go_goroutines and process_resident_memory_bytes from a
// process's /metrics.
func processStats(t *testing.T, admin string) (goroutines int, rss float64) {
	t.Helper()
	var body []byte
	testenv.Eventually(t, 30*time.Second, func() error {
		resp, err := http.Get("http://" + admin + "/metrics")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, err = io.ReadAll(resp.Body)
		return err
	})
	sc := bufio.NewScanner(bytes.NewReader(body))
	for sc.Scan() {
		line := sc.Text()
		var v float64
		switch {
		case strings.HasPrefix(line, "go_goroutines "):
			_, err := fmt.Sscan(strings.TrimPrefix(line, "go_goroutines "), &v)
			require.NoError(t, err, line)
			goroutines = int(v)
		case strings.HasPrefix(line, "process_resident_memory_bytes "):
			_, err := fmt.Sscan(strings.TrimPrefix(line, "process_resident_memory_bytes "), &rss)
			require.NoError(t, err, line)
		}
	}
	require.NoError(t, sc.Err())
	// A bound checked on a value never read holds trivially: a process
	// that exports neither leaves the leak checks nothing to judge.
	require.Positive(t, goroutines, "%s exports go_goroutines", admin)
	require.Positive(t, rss, "%s exports process_resident_memory_bytes", admin)
	return goroutines, rss
}
