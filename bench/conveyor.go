package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
)

// system is a running Conveyor: api and relay, and workers when asked.
type system struct {
	e       *env
	dbURL   string
	pool    *pgxpool.Pool
	amqpURL string
	api     string
	relay   string   // the first relay's admin address
	relays  []string // every relay's admin address
	procs   map[string]*proc
	// token is an admin key the bench's requests carry.
	token string
}

// system starts an api on a database and a vhost of its own. apiVars are
// added to the api's environment.
func (e *env) system(ctx context.Context, name string, apiConns int, apiVars ...string) (*system, error) {
	dbURL, pool, err := e.database(ctx, name, 8)
	if err != nil {
		return nil, err
	}
	amqpURL, err := e.vhost(name)
	if err != nil {
		return nil, err
	}
	s := &system{e: e, dbURL: dbURL, pool: pool, amqpURL: amqpURL, procs: map[string]*proc{}}
	// The system is in its steady state: workers of the bench's types have
	// run before, so their queues exist (a relay parks the messages of a
	// type no worker has declared a queue for).
	if err := declareQueues(amqpURL, "demo.noop", "bench.relay"); err != nil {
		return nil, err
	}
	apiAddr := freeAddr()
	s.api = "http://" + apiAddr
	// The rate limit stays on, as in production, at a rate the bench
	// never reaches: its cost is measured, not its refusals. The bench's
	// one org opens every stream (-streams may pass the per-org cap).
	vars := append([]string{"API_ADDR=" + apiAddr, fmt.Sprintf("DATABASE_MAX_CONNS=%d", apiConns),
		"API_RATE_LIMIT=1000000", "API_RATE_BURST=1000000", "STREAM_MAX_PER_ORG=0"}, apiVars...)
	if err := s.start("api", vars...); err != nil {
		return nil, err
	}
	if err := waitHTTP(s.api+"/readyz", 30*time.Second); err != nil {
		return nil, err
	}
	if s.token, err = postgres.NewDirectory(pool).Bootstrap(ctx, "bench", "bench"); err != nil {
		return nil, err
	}
	// ...and recorded their types, as a worker does when it starts: the
	// API then knows them, and a submission of a type no worker has ever
	// run (which the API counts against the org's unserved types, one
	// more statement) is not what is measured.
	if _, err := pool.Exec(ctx, `INSERT INTO task_types (name) VALUES ('demo.noop'), ('bench.relay')
		ON CONFLICT (name) DO NOTHING`); err != nil {
		return nil, err
	}
	return s, nil
}

// unpacked is the setting of relays that pack no tasks together.
const unpacked = "AMQP_TASKS_PER_MESSAGE=1"

// noPriorities is the setting of workers whose queues keep no priorities.
const noPriorities = "AMQP_MAX_PRIORITY=0"

// queuesOf is how workers started with vars declare their queues: classic
// queues (the bench runs no quorum queues), with the highest priority
// AMQP_MAX_PRIORITY says.
func queuesOf(vars []string) (rabbitmq.Queues, error) {
	qs := rabbitmq.ClassicQueues
	for _, v := range vars {
		if s, ok := strings.CutPrefix(v, "AMQP_MAX_PRIORITY="); ok {
			n, err := strconv.Atoi(s)
			if err != nil {
				return qs, fmt.Errorf("%s: %w", v, err)
			}
			qs.MaxPriority = n
		}
		if strings.HasPrefix(v, "AMQP_QUEUE_TYPE=") {
			return qs, fmt.Errorf("%s: the bench declares classic queues only", v)
		}
	}
	return qs, nil
}

// declareFor declares the burn-down's queue again as workers started with
// vars declare it, when they do so otherwise than the system did.
func (s *system) declareFor(vars []string) error {
	qs, err := queuesOf(vars)
	if err != nil || qs == rabbitmq.ClassicQueues {
		return err
	}
	return declareQueuesAs(s.amqpURL, qs, true, "demo.noop")
}

// declareQueues declares the exchanges and the queues of taskTypes, as
// workers of those types do when they start.
func declareQueues(amqpURL string, taskTypes ...string) error {
	return declareQueuesAs(amqpURL, rabbitmq.ClassicQueues, false, taskTypes...)
}

// declareQueuesAs declares the exchanges and the queues of taskTypes as qs
// says, first deleting the queues when fresh is set: a queue keeps the
// arguments it was created with.
func declareQueuesAs(amqpURL string, qs rabbitmq.Queues, fresh bool, taskTypes ...string) error {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := rabbitmq.DeclareExchanges(ch); err != nil {
		return err
	}
	for _, typ := range taskTypes {
		if fresh {
			for _, q := range []string{rabbitmq.QueueName(typ), rabbitmq.PackedQueueName(typ)} {
				if _, err := ch.QueueDelete(q, false, false, false); err != nil {
					return err
				}
			}
		}
		if err := rabbitmq.DeclareTaskQueueOf(ch, typ, qs); err != nil {
			return err
		}
	}
	return nil
}

func (s *system) start(name string, vars ...string) error {
	p, err := s.e.start(name, append([]string{"DATABASE_URL=" + s.dbURL, "AMQP_URL=" + s.amqpURL}, vars...)...)
	if err != nil {
		return err
	}
	s.procs[name] = p
	return nil
}

// startRelay starts the system's relay.
func (s *system) startRelay() error { return s.startRelays(1) }

// startRelays starts n relays sharing the outbox: "relay", whose admin
// address s.relay holds, then "relay-1" and on; vars are added to each
// relay's environment.
func (s *system) startRelays(n int, vars ...string) error {
	for i := range n {
		name, addr := "relay", freeAddr()
		if i > 0 {
			name = fmt.Sprintf("relay-%d", i)
		} else {
			s.relay = addr
		}
		s.relays = append(s.relays, addr)
		if err := s.start(name, append([]string{"RELAY_ADMIN_ADDR=" + addr}, vars...)...); err != nil {
			return err
		}
		if err := waitHTTP("http://"+addr+"/readyz", 30*time.Second); err != nil {
			return err
		}
	}
	return nil
}

// startWorker starts a worker with concurrency handler slots, or with the
// product's defaults when concurrency is 0 (neither WORKER_CONCURRENCY nor
// WORKER_READ_AHEAD set); vars are added to its environment.
func (s *system) startWorker(name string, concurrency int, vars ...string) error {
	addr, err := s.launchWorker(name, concurrency, vars...)
	if err != nil {
		return err
	}
	return waitHTTP("http://"+addr+"/readyz", 30*time.Second)
}

// launchWorker starts a worker as startWorker does, without waiting for
// it to be ready, and returns its admin address.
func (s *system) launchWorker(name string, concurrency int, vars ...string) (string, error) {
	addr := freeAddr()
	vars = append([]string{"WORKER_ADMIN_ADDR=" + addr}, vars...)
	if concurrency > 0 {
		vars = append(vars, fmt.Sprintf("WORKER_CONCURRENCY=%d", concurrency))
	}
	return addr, s.start(name, vars...)
}

// workerPrefetch is the most broker prefetch of a worker with concurrency
// slots and the default read-ahead, which follows the pace of the slots up
// to four times as many as the concurrency, itself at most 256
// (worker/run.go, readAhead): quick tasks, as the burn-downs run, take it.
func workerPrefetch(concurrency int) int {
	return concurrency + 4*min(concurrency, 256)
}

func (s *system) count(ctx context.Context, sql string) (int, error) {
	var n int
	err := s.pool.QueryRow(ctx, sql).Scan(&n)
	return n, err
}

func (s *system) waitOutboxEmpty(ctx context.Context, timeout time.Duration) error {
	return waitFor(timeout, 10*time.Millisecond, func() (bool, error) {
		n, err := s.count(ctx, `SELECT count(*) FROM outbox`)
		return n == 0, err
	})
}

var httpClient = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256, MaxConnsPerHost: 256}, Timeout: 30 * time.Second}

func (s *system) post(path string, body []byte) (int, error) {
	return s.postAs(s.token, path, body, nil)
}

// postAs posts body with token and, when out is not nil and the request
// succeeded, decodes the response into it.
func (s *system) postAs(token, path string, body []byte, out any) (int, error) {
	req, err := http.NewRequest(http.MethodPost, s.api+path, bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := httpClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if out != nil && resp.StatusCode < 300 {
		if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
			return resp.StatusCode, err
		}
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

var submitRuns atomic.Int64

// httpSubmit posts single submissions from conc keep-alive clients for d
// and returns submissions per second and the latency percentiles.
func (s *system) httpSubmit(conc int, d time.Duration, taskType string) (perSec float64, p50, p99 time.Duration, err error) {
	var mu sync.Mutex
	var lat []time.Duration
	run := submitRuns.Add(1) // a system may be measured more than once: every payload is new
	perSec, err = forDuration(conc, d, func(w, i int) error {
		body := fmt.Appendf(nil, `{"type": %q, "payload": {"run": %d, "w": %d, "i": %d}}`, taskType, run, w, i)
		start := time.Now()
		code, err := s.post("/v1/tasks", body)
		if err != nil {
			return err
		}
		if code != http.StatusCreated {
			return fmt.Errorf("submit: status %d", code)
		}
		mu.Lock()
		lat = append(lat, time.Since(start))
		mu.Unlock()
		return nil
	})
	return perSec, percentile(lat, 0.5), percentile(lat, 0.99), err
}

// httpBatch posts batches of size from conc clients for d and returns tasks
// per second.
func (s *system) httpBatch(conc, size int, d time.Duration) (float64, error) {
	run := submitRuns.Add(1)
	batches, err := forDuration(conc, d, func(w, i int) error {
		code, err := s.post("/v1/tasks/batch", batchBody(size, fmt.Sprintf("b%d-%d-%d", run, w, i)))
		if err != nil {
			return err
		}
		if code != http.StatusOK {
			return fmt.Errorf("batch: status %d", code)
		}
		return nil
	})
	return batches * float64(size), err
}

// batchBody is a batch of size demo.noop tasks as a client submits them,
// deduplicated by input as by default: tag must make the payloads new.
func batchBody(size int, tag string) []byte {
	var b strings.Builder
	b.WriteString(`{"tasks": [`)
	for i := range size {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"type": "demo.noop", "payload": {"tag": %q, "i": %d}}`, tag, i)
	}
	b.WriteString(`]}`)
	return []byte(b.String())
}

// submitNoops submits n demo.noop tasks through the batch endpoint.
func (s *system) submitNoops(n int) error {
	run := submitRuns.Add(1)
	for done := 0; done < n; done += 1000 {
		size := min(1000, n-done)
		code, err := s.post("/v1/tasks/batch", batchBody(size, fmt.Sprintf("burn-%d-%d", run, done)))
		if err != nil {
			return err
		}
		if code != http.StatusOK {
			return fmt.Errorf("batch: status %d", code)
		}
	}
	return nil
}

// burnDown measures how fast procs workers, each with concurrency slots
// (0: the defaults), complete n queued demo.noop tasks: the tasks are
// submitted and published first (the broker's confirmations recorded),
// then the workers start, all at once. The
// time runs from their start to the last completion.
func (s *system) burnDown(ctx context.Context, n, procs, concurrency int, vars ...string) (burnResult, error) {
	return s.burnDownOf(ctx, n, s.submitNoops, procs, concurrency, vars...)
}

// burnDownOf is burnDown of the n tasks submit submits.
func (s *system) burnDownOf(ctx context.Context, n int, submit func(int) error, procs, concurrency int,
	vars ...string) (burnResult, error) {
	if err := submit(n); err != nil {
		return burnResult{}, err
	}
	if err := s.waitOutboxEmpty(ctx, 5*time.Minute); err != nil {
		return burnResult{}, err
	}
	// The relay records the broker's confirmations after its commit: the
	// last batches' (about 1,000 tasks) land some 60 ms after the outbox
	// empties. They belong to the publishing, not to the burn-down.
	if err := waitFor(time.Minute, 10*time.Millisecond, func() (bool, error) {
		n, err := s.count(ctx, `SELECT count(*) FROM tasks WHERE published_at IS NULL`)
		return n == 0, err
	}); err != nil {
		return burnResult{}, fmt.Errorf("tasks not stamped as published: %w", err)
	}
	before, err := pgCounters(ctx, s.pool)
	if err != nil {
		return burnResult{}, err
	}
	start, err := dbNow(ctx, s.pool)
	if err != nil {
		return burnResult{}, err
	}
	diag := startDiagnosis(ctx, s.pool, procs)
	addrs := make([]string, procs)
	for i := range procs {
		if addrs[i], err = s.launchWorker(fmt.Sprintf("worker-%d", i), concurrency, vars...); err != nil {
			return burnResult{}, err
		}
	}
	for _, addr := range addrs {
		if err := waitHTTP("http://"+addr+"/readyz", 30*time.Second); err != nil {
			return burnResult{}, err
		}
	}
	profileWorkers(addrs)
	elapsed, err := awaitBurnDown(ctx, s.pool, n, start,
		`SELECT EXISTS (SELECT 1 FROM tasks WHERE org_id = `+benchOrg+` AND status = 'PENDING')
			OR EXISTS (SELECT 1 FROM tasks WHERE org_id = `+benchOrg+` AND status = 'IN_PROGRESS')`,
		`SELECT count(*) FROM tasks WHERE org_id = `+benchOrg+` AND status = 'COMPLETED'`,
		`SELECT max(completed_at) FROM tasks`)
	if err != nil {
		return burnResult{}, fmt.Errorf("burn-down: %w", err)
	}
	diag.report(ctx, s.pool, n, elapsed, start, addrs)
	after, err := pgCounters(ctx, s.pool)
	if err != nil {
		return burnResult{}, err
	}
	return burnResult{float64(n) / elapsed.Seconds(), float64(after.commits-before.commits) / float64(n),
		float64(after.wal-before.wal) / float64(n)}, nil
}

// latency submits single tasks at a fixed rate for d to an idle system and
// returns the submit→handler-start latency percentiles (from the task's
// created_at to its started_at, both the database's clock), and the share
// of the machine's CPU time that was busy while the tasks were submitted:
// whatever else runs on the machine, a pipeline's every hop waits longer
// for a core when the cores are busy.
func (s *system) latency(ctx context.Context, rate int, d time.Duration) (lr latencyResult, err error) {
	busyNow := machineBusy()
	before, err := pgCounters(ctx, s.pool)
	if err != nil {
		return lr, err
	}
	cpu := meterCPU(ctx, s.pool)
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	end := time.Now().Add(d)
	var wg sync.WaitGroup
	errs := make(chan error, 1)
	sent := 0
	for time.Now().Before(end) {
		<-tick.C
		sent++
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			code, err := s.post("/v1/tasks", fmt.Appendf(nil, `{"type": "demo.noop", "payload": {"latency": %d}}`, i))
			if err == nil && code != http.StatusCreated {
				err = fmt.Errorf("submit: status %d", code)
			}
			if err != nil {
				select {
				case errs <- err:
				default:
				}
			}
		}(sent)
	}
	wg.Wait()
	lr.busy = busyNow()
	select {
	case err := <-errs:
		return lr, err
	default:
	}
	if err := waitFor(time.Minute, 20*time.Millisecond, func() (bool, error) {
		n, err := s.count(ctx, `SELECT count(*) FROM tasks WHERE status = 'COMPLETED' AND payload ? 'latency'`)
		return n >= sent, err
	}); err != nil {
		return lr, err
	}
	// Beyond the submissions: the last tasks' completions, and the
	// system's background statements of that second.
	cpu(fmt.Sprintf("latency at %d/s", rate), float64(sent))
	after, err := pgCounters(ctx, s.pool)
	if err != nil {
		return lr, err
	}
	lr.txsPerTask = float64(after.commits-before.commits) / float64(sent)
	rows, err := s.pool.Query(ctx, `SELECT extract(epoch FROM started_at - created_at) FROM tasks WHERE payload ? 'latency'`)
	if err != nil {
		return lr, err
	}
	defer rows.Close()
	var lat []time.Duration
	for rows.Next() {
		var sec float64
		if err := rows.Scan(&sec); err != nil {
			return lr, err
		}
		lat = append(lat, time.Duration(sec*float64(time.Second)))
	}
	lr.p50, lr.p99 = percentile(lat, 0.5), percentile(lat, 0.99)
	return lr, rows.Err()
}

// latencyResult is what a latency run measured.
type latencyResult struct {
	p50, p99 time.Duration
	// busy is the share of the machine's CPU time that was busy while the
	// tasks were submitted.
	busy float64
	// txsPerTask counts the write transactions PostgreSQL committed (the
	// transaction ids it handed out), by task submitted.
	txsPerTask float64
}

// machineBusy starts measuring the machine's CPU time (every core's, from
// /proc/stat) and returns the function that reports the share of it that
// was busy since: neither idle nor waiting for I/O. It reports 0 where
// /proc/stat cannot be read.
func machineBusy() func() float64 {
	read := func() (busy, total uint64) {
		b, err := os.ReadFile("/proc/stat")
		if err != nil {
			return 0, 0
		}
		line, _, _ := strings.Cut(string(b), "\n")
		fields := strings.Fields(line)
		if len(fields) < 6 || fields[0] != "cpu" {
			return 0, 0
		}
		for i, f := range fields[1:] {
			v, _ := strconv.ParseUint(f, 10, 64)
			total += v
			if i != 3 && i != 4 { // idle, iowait
				busy += v
			}
		}
		return busy, total
	}
	busy0, total0 := read()
	return func() float64 {
		busy1, total1 := read()
		if total1 <= total0 {
			return 0
		}
		return float64(busy1-busy0) / float64(total1-total0)
	}
}

// relayThroughput starts relays relay processes, fills the outbox with n
// rows and measures how fast the relays publish them together; it also
// reports each relay's peak RSS, by process name. vars are added to each
// relay's environment.
func (s *system) relayThroughput(ctx context.Context, n, relays int, vars ...string) (perSec float64, peakRSS map[string]int64, err error) {
	if err := s.startRelays(relays, vars...); err != nil {
		return 0, nil, err
	}
	if err := s.fillOutbox(ctx, n, "bench.relay"); err != nil {
		return 0, nil, err
	}
	// The rows are committed: wake the relays as the API would.
	start := time.Now()
	if _, err := s.pool.Exec(ctx, `SELECT pg_notify('conveyor_outbox', '')`); err != nil {
		return 0, nil, err
	}
	names := []string{"relay"}
	for i := 1; i < relays; i++ {
		names = append(names, fmt.Sprintf("relay-%d", i))
	}
	stop := s.sampleRSS(names...)
	cpu := meterCPU(ctx, s.pool)
	err = s.waitPublished(n, 10*time.Minute)
	elapsed := time.Since(start)
	peak := stop()
	cpu(fmt.Sprintf("%d relay(s), %.0f msgs/s", relays, float64(n)/elapsed.Seconds()), float64(n))
	if err == nil {
		err = s.waitOutboxEmpty(ctx, time.Minute)
	}
	return float64(n) / elapsed.Seconds(), peak, err
}

// benchOrg is the org system bootstraps, which rows the bench writes
// straight into the database belong to.
const benchOrg = `(SELECT id FROM orgs WHERE slug = 'bench')`

// fillOutbox inserts n task.run rows straight into the outbox.
func (s *system) fillOutbox(ctx context.Context, n int, routingKey string) error {
	_, err := s.pool.Exec(ctx, `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, priority, headers)
		SELECT 'task.run', `+benchOrg+`, gen_random_uuid(), $2, 0, 1, 5,
			'{"traceparent": "00-0dba3b847a67f67a629808001b5e6847-bbc96f631e9baf07-01"}'
		FROM generate_series(1, $1)`, n, routingKey)
	return err
}

// fillTasks inserts n PENDING demo.noop tasks with their outbox rows
// straight into the database: a backlog, made fast.
func (s *system) fillTasks(ctx context.Context, n int) error {
	for done := 0; done < n; done += 100_000 {
		_, err := s.pool.Exec(ctx, `WITH t AS (
				INSERT INTO tasks (id, org_id, type, payload)
				SELECT gen_random_uuid(), `+benchOrg+`, 'demo.noop', jsonb_build_object('i', g)
				FROM generate_series(1, $1) g RETURNING id, org_id, type, priority)
			INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version, priority)
			SELECT 'task.run', org_id, id, type, 0, 1, priority FROM t`,
			min(100_000, n-done))
		if err != nil {
			return err
		}
	}
	return nil
}

// sampleRSS samples the RSS of the named processes every 100ms until the
// returned function is called, which returns each one's peak.
func (s *system) sampleRSS(names ...string) func() map[string]int64 {
	peak := map[string]int64{}
	var mu sync.Mutex
	done := make(chan struct{})
	stopped := make(chan struct{})
	sample := func() {
		mu.Lock()
		defer mu.Unlock()
		for _, n := range names {
			if p := s.procs[n]; p != nil {
				peak[n] = max(peak[n], p.rss())
			}
		}
	}
	go func() {
		defer close(stopped)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			sample()
			select {
			case <-done:
				return
			case <-t.C:
			}
		}
	}()
	return func() map[string]int64 {
		close(done)
		<-stopped
		sample()
		return peak
	}
}

// waitPublished waits until the relays together have published n
// messages, as their metrics count them. It asks the relays, not the
// database: counting the outbox's rows every few milliseconds took a
// third of a core from the PostgreSQL the relays were measured on.
func (s *system) waitPublished(n int, timeout time.Duration) error {
	return waitFor(timeout, 50*time.Millisecond, func() (bool, error) {
		var published float64
		for _, addr := range s.relays {
			families, err := metricFamilies(addr)
			if err != nil {
				return false, err
			}
			if f := families["conveyor_relay_published_total"]; f != nil {
				for _, m := range f.GetMetric() {
					published += m.GetCounter().GetValue()
				}
			}
		}
		return published >= float64(n), nil
	})
}

// relayPublishP50 reads the relay's commit→publish histogram and returns
// its median.
func (s *system) relayPublishP50() (time.Duration, error) {
	families, err := metricFamilies(s.relay)
	if err != nil {
		return 0, err
	}
	f := families["conveyor_relay_commit_to_publish_seconds"]
	if f == nil || len(f.GetMetric()) == 0 {
		return 0, fmt.Errorf("relay metrics hold no commit-to-publish histogram")
	}
	return histogramQuantile(f.GetMetric()[0].GetHistogram(), 0.5), nil
}

// metricFamilies reads the Prometheus metrics a process serves at its
// admin address.
func metricFamilies(addr string) (map[string]*dto.MetricFamily, error) {
	req, err := http.NewRequest(http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	// Uncompressed: compressing them is most of what serving the metrics
	// costs, and the bench asks often while it measures.
	req.Header.Set("Accept-Encoding", "identity")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	return parser.TextToMetricFamilies(resp.Body)
}

// histogramQuantile interpolates a quantile from cumulative buckets, as
// Prometheus's histogram_quantile does.
func histogramQuantile(h *dto.Histogram, q float64) time.Duration {
	total := float64(h.GetSampleCount())
	if total == 0 {
		return 0
	}
	rank := q * total
	lower, prevCount := 0.0, 0.0
	for _, b := range h.GetBucket() {
		count := float64(b.GetCumulativeCount())
		if count >= rank {
			frac := (rank - prevCount) / max(count-prevCount, 1)
			return time.Duration((lower + frac*(b.GetUpperBound()-lower)) * float64(time.Second))
		}
		lower, prevCount = b.GetUpperBound(), count
	}
	return time.Duration(lower * float64(time.Second))
}

func percentile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(q*float64(len(s))))]
}
