package chaos_test

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

var loadDuration = flag.Duration("load.duration", 5*time.Second, "length of each phase of the load test")

// TestAPIUnderLoad: many keep-alive clients submit for a fixed time and get
// no error answer, first on a quiet system, then while a worker and a relay
// are killed and restarted over and over (the API depends on neither).
func TestAPIUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("load test")
	}
	db := testdb.New(t)
	amqpURL := testenv.NewVhost(t)
	apiAddr := testenv.FreeAddr(t)
	api := "http://" + apiAddr
	common := []string{"DATABASE_URL=" + db.URL, "LOG_FORMAT=text", "LOG_LEVEL=warn"}
	// No rate limit: the test measures the API, not its limiter.
	testenv.Start(t, "api", testenv.Binary(t, "./cmd/api"), append(common, "API_ADDR="+apiAddr, "DATABASE_MAX_CONNS=16",
		"API_RATE_LIMIT=0")...)
	testenv.WaitHTTP(t, api+"/readyz", time.Minute)
	token, _ := db.Admin(t)
	relay := &slot{name: "relay", bin: testenv.Binary(t, "./cmd/relay"),
		env: append(common, "AMQP_URL="+amqpURL, "RELAY_ADMIN_ADDR="+testenv.FreeAddr(t))}
	worker := &slot{name: "worker", bin: testenv.Binary(t, "./cmd/worker"),
		env: append(common, "AMQP_URL="+amqpURL, "WORKER_ADMIN_ADDR="+testenv.FreeAddr(t), "LEASE_DURATION=3s",
			"HEARTBEAT_INTERVAL=1s", "MAINTENANCE_INTERVAL=500ms", "LEADER_TTL=2s")}
	relay.start(t)
	worker.start(t)

	quiet := load(t, api, token, 32, *loadDuration, "quiet")
	t.Logf("quiet: %s", quiet)
	require.Zero(t, quiet.errors, "no error answers")

	// Kill and restart from the test's goroutine while the load runs in
	// another.
	stormy := make(chan loadResult)
	go func() { stormy <- load(t, api, token, 32, *loadDuration, "while killing") }()
	kill := time.NewTicker(time.Second)
	defer kill.Stop()
	kills := 0
	var res loadResult
	for done := false; !done; {
		select {
		case res = <-stormy:
			done = true
		case <-kill.C:
			for _, s := range []*slot{worker, relay} {
				s.proc.Signal(syscall.SIGKILL)
				kills++
			}
		case <-time.After(200 * time.Millisecond):
			for _, s := range []*slot{worker, relay} {
				if s.proc.Exited() {
					s.start(t)
				}
			}
		}
	}
	t.Logf("while killing a worker and a relay %d times: %s", kills, res)
	require.Zero(t, res.errors, "no error answers while workers and relays die")
	// A kill may still be landing: make it certain, then start both anew.
	for _, s := range []*slot{worker, relay} {
		s.proc.Signal(syscall.SIGKILL)
		s.proc.Wait(t, 10*time.Second)
		s.start(t)
	}
	// And the work submitted meanwhile is all done in the end.
	testenv.Eventually(t, 2*time.Minute, func() error {
		var open, pending, outbox int
		if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE status <> 'COMPLETED'),
			count(*) FILTER (WHERE status = 'PENDING'), (SELECT count(*) FROM outbox) FROM tasks`).Scan(&open, &pending, &outbox); err != nil {
			return err
		}
		if open > 0 {
			return fmt.Errorf("%d tasks not completed (%d pending), %d outbox rows", open, pending, outbox)
		}
		return nil
	})
}

type loadResult struct {
	requests, errors int
	perSec           float64
	p50, p99         time.Duration
}

func (r loadResult) String() string {
	return fmt.Sprintf("%d requests, %d errors, %.0f/s, p50 %s, p99 %s", r.requests, r.errors, r.perSec,
		r.p50.Round(100*time.Microsecond), r.p99.Round(100*time.Microsecond))
}

// load runs conc keep-alive clients submitting demo.noop tasks for d.
func load(t *testing.T, api, token string, conc int, d time.Duration, tag string) loadResult {
	client := &http.Client{Timeout: 10 * time.Second, Transport: testenv.Bearer(token, &http.Transport{MaxIdleConnsPerHost: conc})}
	var mu sync.Mutex
	var lat []time.Duration
	var res loadResult
	end := time.Now().Add(d)
	var wg sync.WaitGroup
	for c := range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; time.Now().Before(end); i++ {
				body := fmt.Appendf(nil, `{"type":"demo.noop","payload":{"tag":%q,"c":%d,"i":%d}}`, tag, c, i)
				start := time.Now()
				resp, err := client.Post(api+"/v1/tasks", "application/json", bytes.NewReader(body))
				took := time.Since(start)
				failed := err != nil
				if err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					failed = resp.StatusCode != http.StatusCreated
				}
				mu.Lock()
				res.requests++
				if failed {
					res.errors++
				}
				lat = append(lat, took)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	slices.Sort(lat)
	res.perSec = float64(res.requests) / d.Seconds()
	if len(lat) > 0 {
		res.p50, res.p99 = lat[len(lat)/2], lat[len(lat)*99/100]
	}
	return res
}
