package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// A burn-down's diagnosis, for whoever works on its speed: with BENCH_DIAG
// set, each burn-down prints the CPU every process group spent per task
// (from /proc, so PostgreSQL's backends and RabbitMQ's schedulers are
// counted), the workers' mean batch sizes, how the completions spread over
// time, and what PostgreSQL's active backends were doing, sampled every
// 10 ms. With BENCH_PERF set to a list of process counts (e.g. "1,4"),
// `perf record -a -g` runs during the burn-downs of that many workers and
// writes perf.<n>.data in the working directory. With BENCH_PPROF set to
// a number of seconds, each worker's Go CPU profile over the first seconds
// of its burn-down is written to worker-<n>.<i>.pprof (n workers, the i-th).
type diagnosis struct {
	cpu      cpuSnap
	stopPerf func()
	waits    func() string
}

// profileWorkers fetches, with BENCH_PPROF set, each worker's CPU profile
// for that many seconds from its admin address, in the background.
func profileWorkers(addrs []string) {
	secs, err := strconv.Atoi(os.Getenv("BENCH_PPROF"))
	if err != nil || secs <= 0 {
		return
	}
	for i, addr := range addrs {
		go func() {
			url := fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", addr, secs)
			name := fmt.Sprintf("worker-%d.%d.pprof", len(addrs), i)
			if err := download(url, name); err != nil {
				fmt.Fprintln(os.Stderr, "pprof:", err)
			}
		}()
	}
}

func download(url, name string) error {
	resp, err := http.Get(url) //nolint:gosec,noctx // the bench's own worker, on loopback
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	f, err := os.Create(name)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

var diagProcesses = []string{"postgres", "beam.smp", "worker", "api", "relay", "bench"}

func startDiagnosis(ctx context.Context, pool *pgxpool.Pool, procs int) *diagnosis {
	if os.Getenv("BENCH_DIAG") == "" && os.Getenv("BENCH_PERF") == "" {
		return nil
	}
	return &diagnosis{cpu: cpuByProcess(), stopPerf: startPerf(procs), waits: sampleWaits(ctx, pool)}
}

// report stops the diagnosis and prints it; addrs are the workers' admin
// addresses, start the database's clock when the burn-down began.
func (d *diagnosis) report(ctx context.Context, pool *pgxpool.Pool, n int, elapsed time.Duration, start time.Time, addrs []string) {
	if d == nil {
		return
	}
	d.stopPerf()
	waits := d.waits()
	after := cpuByProcess()
	var b strings.Builder
	fmt.Fprintf(&b, "    %d worker(s): %.0f tasks/s; CPU per task:", len(addrs), float64(n)/elapsed.Seconds())
	for _, k := range diagProcesses {
		fmt.Fprintf(&b, " %s %.0f µs (%.2f context switches)", k, (after[k]-d.cpu[k])/float64(n)*1e6,
			(after[k+".cs"]-d.cpu[k+".cs"])/float64(n))
	}
	b.WriteString("\n")
	for _, addr := range addrs {
		fmt.Fprintf(&b, "      batches (statements × mean size): %s\n", batchMeans(addr))
	}
	var first, p10, p50, p90 float64
	err := pool.QueryRow(ctx, `SELECT extract(epoch FROM min(started_at) - $1),
		extract(epoch FROM percentile_disc(0.1) WITHIN GROUP (ORDER BY completed_at) - $1),
		extract(epoch FROM percentile_disc(0.5) WITHIN GROUP (ORDER BY completed_at) - $1),
		extract(epoch FROM percentile_disc(0.9) WITHIN GROUP (ORDER BY completed_at) - $1) FROM tasks`, start).
		Scan(&first, &p10, &p50, &p90)
	if err == nil {
		fmt.Fprintf(&b, "      first start %.2f s; 10%% done %.2f s, 50%% %.2f s, 90%% %.2f s\n", first, p10, p50, p90)
	}
	b.WriteString(waits)
	fmt.Fprint(os.Stderr, b.String())
}

// meterCPU, with BENCH_DIAG set, starts counting the CPU of every process
// group; the function it returns prints what each spent per operation of
// the measurement since, ops being how many it made, and what
// PostgreSQL's active backends were doing meanwhile.
func meterCPU(ctx context.Context, pool *pgxpool.Pool) func(label string, ops float64) {
	if os.Getenv("BENCH_DIAG") == "" {
		return func(string, float64) {}
	}
	before, waits := cpuByProcess(), sampleWaits(ctx, pool)
	return func(label string, ops float64) {
		w := waits()
		after := cpuByProcess()
		var b strings.Builder
		fmt.Fprintf(&b, "    %s: CPU per operation:", label)
		for _, k := range diagProcesses {
			fmt.Fprintf(&b, " %s %.0f µs", k, (after[k]-before[k])/ops*1e6)
		}
		fmt.Fprintln(os.Stderr, b.String())
		fmt.Fprint(os.Stderr, w)
	}
}

// cpuSnap is the CPU time (seconds) of the processes by command name, and
// under name+".cs" their context switches (a process's, not its threads').
type cpuSnap map[string]float64

func cpuByProcess() cpuSnap {
	s := cpuSnap{}
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, f := range stats {
		comm, cpu, ok := readStat(f)
		if !ok {
			continue
		}
		s[comm] += cpu
		status, err := os.ReadFile(filepath.Join(filepath.Dir(f), "status"))
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(status), "\n") {
			if name, v, ok := strings.Cut(l, ":"); ok && strings.HasSuffix(name, "ctxt_switches") {
				n, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
				s[comm+".cs"] += n
			}
		}
	}
	return s
}

// readStat reads a process's /proc stat file: its command name and the CPU
// time (user and system, in seconds, counted in clock ticks of 10 ms) it
// has used.
func readStat(path string) (comm string, cpu float64, ok bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", 0, false
	}
	line := string(b)
	l, r := strings.IndexByte(line, '('), strings.LastIndexByte(line, ')')
	if l < 0 || r < 0 || r+2 > len(line) {
		return "", 0, false
	}
	fields := strings.Fields(line[r+2:])
	if len(fields) < 13 {
		return "", 0, false
	}
	utime, _ := strconv.ParseFloat(fields[11], 64)
	stime, _ := strconv.ParseFloat(fields[12], 64)
	return line[l+1 : r], (utime + stime) / 100, true
}

// batchMeans reads a worker's statements and mean batch size, by
// statement, from its metrics.
func batchMeans(addr string) string {
	families, err := metricFamilies(addr)
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, m := range families["conveyor_worker_batch_size"].GetMetric() {
		h := m.GetHistogram()
		if h.GetSampleCount() == 0 {
			continue
		}
		var statement string
		for _, l := range m.GetLabel() {
			if l.GetName() == "statement" {
				statement = l.GetValue()
			}
		}
		out = append(out, fmt.Sprintf("%s %d × %.1f", statement, h.GetSampleCount(), h.GetSampleSum()/float64(h.GetSampleCount())))
	}
	return strings.Join(out, ", ")
}

// startPerf records the machine with perf when BENCH_PERF lists procs.
func startPerf(procs int) func() {
	if !slices.Contains(strings.Split(os.Getenv("BENCH_PERF"), ","), strconv.Itoa(procs)) {
		return func() {}
	}
	cmd := exec.Command("perf", "record", "-a", "-g", "-F", "999", "-o", fmt.Sprintf("perf.%d.data", procs))
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "perf:", err)
		return func() {}
	}
	return func() { _ = cmd.Process.Signal(os.Interrupt); _ = cmd.Wait() }
}

// sampleWaits counts, every 10 ms until the returned func is called, what
// PostgreSQL's active backends are doing (wait event, or CPU, and the
// statement's first words), and returns the most frequent as the mean
// number of backends so engaged.
func sampleWaits(ctx context.Context, pool *pgxpool.Pool) func() string {
	ctx, cancel := context.WithCancel(ctx)
	counts := map[string]int{}
	samples := 0
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			rows, err := pool.Query(ctx, `SELECT backend_type || ' ' || coalesce(wait_event_type || ':' || wait_event, 'CPU') || ' '
					|| CASE WHEN backend_type = 'client backend' THEN left(regexp_replace(query, '\s+', ' ', 'g'), 36) ELSE '' END
				FROM pg_stat_activity WHERE pid <> pg_backend_pid()
				AND (state = 'active' OR backend_type <> 'client backend' AND wait_event_type IS DISTINCT FROM 'Activity')`)
			if err == nil {
				for rows.Next() {
					var k string
					if rows.Scan(&k) == nil {
						counts[k]++
					}
				}
				rows.Close()
				samples++
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	return func() string {
		cancel()
		<-done
		keys := make([]string, 0, len(counts))
		for k := range counts {
			keys = append(keys, k)
		}
		sort.Slice(keys, func(i, j int) bool { return counts[keys[i]] > counts[keys[j]] })
		var b strings.Builder
		fmt.Fprintf(&b, "      PostgreSQL's backends, mean over %d samples:\n", samples)
		for _, k := range keys[:min(len(keys), 12)] {
			fmt.Fprintf(&b, "        %5.2f %s\n", float64(counts[k])/float64(max(samples, 1)), k)
		}
		return b.String()
	}
}
