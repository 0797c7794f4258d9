package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
)

// streams measures the live streams with many open: how long a worker's
// progress write takes to reach every streaming client, and the API's
// memory per open stream. The baselines, at the same rate: the machine's
// push out of PostgreSQL (a NOTIFY reaching one LISTENing connection), and
// the floor of the fan-out itself (a bare net/http server writing each
// frame to as many streams, read by the same clients).
func (b *bench) streams(ctx context.Context) error {
	return b.scope(func() error {
		s, err := b.e.system(ctx, "bench_streams", b.o.pool)
		if err != nil {
			return err
		}
		n, rate := b.o.streams, b.o.streamRate
		c50, c99, err := notifyLatency(ctx, s.dbURL, rate, b.o.dur)
		if err != nil {
			return fmt.Errorf("NOTIFY ceiling: %w", err)
		}
		b.add(result{Name: fmt.Sprintf("ceiling: NOTIFY→LISTEN p50 at %d/s", rate), Value: ms(c50), Unit: "ms"})
		b.add(result{Name: fmt.Sprintf("ceiling: NOTIFY→LISTEN p99 at %d/s", rate), Value: ms(c99), Unit: "ms"})

		f50, f99, err := bareFanOut(ctx, n, rate, b.o.dur)
		if err != nil {
			return fmt.Errorf("bare fan-out ceiling: %w", err)
		}
		bare := fmt.Sprintf("ceiling: bare SSE fan-out to %d streams", n)
		b.add(result{Name: bare + " p50", Value: ms(f50), Unit: "ms"})
		b.add(result{Name: bare + " p99", Value: ms(f99), Unit: "ms"})

		api := s.procs["api"]
		idle := api.rss()
		clients, err := s.openStreams(ctx, n)
		if err != nil {
			return err
		}
		defer clients.close()
		time.Sleep(2 * time.Second) // let the API settle before weighing it
		perStream := float64(api.rss()-idle) / float64(n)
		b.add(result{Name: fmt.Sprintf("Conveyor: API memory per open stream (%d open)", n), Value: perStream / 1024, Unit: "KiB"})

		lat, err := s.progressToStreams(ctx, clients, rate, b.o.dur)
		if err != nil {
			return err
		}
		p50, p99, delivered := lat.p50, lat.p99, lat.delivered
		b.vs(fmt.Sprintf("Conveyor: progress write→%d streams p50 at %d/s", n, rate), ms(p50), "ms", bare+" p50", 0)
		b.vs(fmt.Sprintf("Conveyor: progress write→%d streams p99 at %d/s", n, rate), ms(p99), "ms", bare+" p99", 0)
		b.atMost(fmt.Sprintf("Conveyor: progress write→%d streams p99, absolute", n), ms(p99), "ms", 50)
		// The write is a durable commit; from its end, the stream's own share.
		b.vs(fmt.Sprintf("Conveyor: progress commit→%d streams p50 at %d/s", n, rate), ms(lat.commitP50), "ms", bare+" p50", 0)
		b.vs(fmt.Sprintf("Conveyor: progress commit→%d streams p99 at %d/s", n, rate), ms(lat.commitP99), "ms", bare+" p99", 0)
		b.add(result{Name: "Conveyor: stream deliveries received", Value: delivered * 100, Unit: "%"})
		return nil
	})
}

// notifyLatency sends NOTIFYs at rate for d and measures how long each
// takes to reach a listening connection.
func notifyLatency(ctx context.Context, dbURL string, rate int, d time.Duration) (p50, p99 time.Duration, err error) {
	listen, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return 0, 0, err
	}
	defer listen.Close(ctx)
	send, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return 0, 0, err
	}
	defer send.Close(ctx)
	if _, err := listen.Exec(ctx, "LISTEN bench_ceiling"); err != nil {
		return 0, 0, err
	}
	var sent sync.Map // payload → time
	var lat []time.Duration
	done := make(chan error, 1)
	total := int(d.Seconds() * float64(rate))
	go func() {
		for range total {
			wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			n, err := listen.WaitForNotification(wctx)
			cancel()
			if err != nil {
				done <- err
				return
			}
			if t0, ok := sent.Load(n.Payload); ok {
				lat = append(lat, time.Since(t0.(time.Time)))
			}
		}
		done <- nil
	}()
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for i := range total {
		<-tick.C
		payload := strconv.Itoa(i)
		sent.Store(payload, time.Now())
		if _, err := send.Exec(ctx, "SELECT pg_notify('bench_ceiling', $1)", payload); err != nil {
			return 0, 0, err
		}
	}
	if err := <-done; err != nil {
		return 0, 0, err
	}
	return percentile(lat, 0.5), percentile(lat, 0.99), nil
}

// streamClients are open streams of the org's events, each recording when
// each progress state arrived.
type streamClients struct {
	resps []*http.Response
	mu    sync.Mutex
	seen  map[string][]time.Time // state → arrival at each client, once it closed
	count atomic.Int64           // arrivals so far
	wg    sync.WaitGroup
}

func (c *streamClients) close() {
	for _, r := range c.resps {
		_ = r.Body.Close()
	}
	c.wg.Wait()
}

// openStreams opens n streams of the bench type's events.
func (s *system) openStreams(ctx context.Context, n int) (*streamClients, error) {
	c := &streamClients{seen: map[string][]time.Time{}}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: n, MaxConnsPerHost: n + 16}}
	for range n {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.api+"/v1/events/stream?type=bench.stream", nil)
		if err != nil {
			return nil, err
		}
		req.Header.Set("Authorization", "Bearer "+s.token)
		resp, err := client.Do(req)
		if err != nil {
			c.close()
			return nil, err
		}
		if resp.StatusCode != http.StatusOK {
			_ = resp.Body.Close()
			c.close()
			return nil, fmt.Errorf("open stream: status %d", resp.StatusCode)
		}
		c.resps = append(c.resps, resp) //nolint:bodyclose // a stream's body stays open until close
		c.wg.Add(1)
		go c.read(resp.Body)
	}
	return c, nil
}

// read records the arrival of every frame's state ("state":"p<seq>"), on
// its own until the stream closes, so clients do not wait for each other.
func (c *streamClients) read(body io.Reader) {
	defer c.wg.Done()
	seen := map[string]time.Time{}
	lines := bufio.NewScanner(body)
	for lines.Scan() {
		now := time.Now()
		line := lines.Bytes()
		i := bytes.Index(line, []byte(`"state":"p`))
		if !bytes.HasPrefix(line, []byte("data: ")) || i < 0 {
			continue
		}
		state := line[i+len(`"state":"`):]
		seen[string(state[:bytes.IndexByte(state, '"')])] = now
		c.count.Add(1)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for state, at := range seen {
		c.seen[state] = append(c.seen[state], at)
	}
}

// progressToStreams writes progress as a worker does (the worker's store
// and its NOTIFY) at rate for d, on tasks it claimed, and measures each
// write's arrival at every stream.
type streamLatency struct {
	p50, p99, commitP50, commitP99 time.Duration
	delivered                      float64
}

func (s *system) progressToStreams(ctx context.Context, c *streamClients, rate int, d time.Duration) (streamLatency, error) {
	var zero streamLatency
	const tasks = 8
	for i := range tasks {
		body := fmt.Appendf(nil, `{"type":"bench.stream","payload":{"stream":%d,"at":%d}}`, i, time.Now().UnixNano())
		if code, err := s.post("/v1/tasks", body); err != nil || code != http.StatusCreated {
			return zero, fmt.Errorf("submit: %d %w", code, err)
		}
	}
	rows, err := s.pool.Query(ctx, `SELECT id FROM tasks WHERE type = 'bench.stream' AND status = 'PENDING'`)
	if err != nil {
		return zero, err
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		return zero, err
	}
	log := slog.New(slog.DiscardHandler)
	notifier := postgres.NewNotifier(s.pool, 2*time.Millisecond, log, postgres.EventsChannel)
	nctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() { _ = notifier.Run(nctx) }()
	store := postgres.NewWorkerStore(s.pool, nil)
	store.OnEvents = notifier.Poker(postgres.EventsChannel)
	claimed, err := store.Claim(ctx, ids, "bench-streams", time.Hour)
	if err != nil {
		return zero, fmt.Errorf("claim: %w", err)
	}
	if len(claimed) != len(ids) {
		return zero, fmt.Errorf("claim: %d of %d", len(claimed), len(ids))
	}
	versions := map[uuid.UUID]int{}
	for _, t := range claimed {
		versions[t.ID] = t.Version
	}

	started, committed := map[string]time.Time{}, map[string]time.Time{}
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	total := int(d.Seconds() * float64(rate))
	for i := range total {
		<-tick.C
		id := ids[i%len(ids)]
		state := "p" + strconv.Itoa(i)
		started[state] = time.Now()
		out, errs, err := store.Apply(ctx, []task.Change{{TaskID: id, Version: versions[id], Transition: task.Progress,
			Progress: i % 100, State: state, Lease: time.Hour}})
		if err == nil {
			err = errs[0]
		}
		if err != nil {
			return zero, err
		}
		versions[id] = out[0].Version
		committed[state] = time.Now()
	}
	want := total * len(c.resps)
	_ = waitFor(10*time.Second, 20*time.Millisecond, func() (bool, error) {
		return c.count.Load() >= int64(want), nil
	})
	c.close()
	var lat, fromCommit []time.Duration
	for state, arrivals := range c.seen {
		for _, at := range arrivals {
			lat = append(lat, at.Sub(started[state]))
			fromCommit = append(fromCommit, at.Sub(committed[state]))
		}
	}
	return streamLatency{p50: percentile(lat, 0.5), p99: percentile(lat, 0.99),
		commitP50: percentile(fromCommit, 0.5), commitP99: percentile(fromCommit, 0.99),
		delivered: float64(len(lat)) / float64(want)}, nil
}

// bareFanOut serves n Server-Sent Event streams from a bare net/http
// server that writes each frame to all of them at once, and measures its
// arrival at the same clients the Conveyor measurement uses.
func bareFanOut(ctx context.Context, n, rate int, d time.Duration) (p50, p99 time.Duration, err error) {
	var mu sync.Mutex
	subs := map[chan []byte]struct{}{}
	ln, err := new(net.ListenConfig).Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		return 0, 0, err
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ch := make(chan []byte, 64)
		mu.Lock()
		subs[ch] = struct{}{}
		mu.Unlock()
		defer func() { mu.Lock(); delete(subs, ch); mu.Unlock() }()
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		rc := http.NewResponseController(w)
		_ = rc.Flush()
		for {
			select {
			case <-r.Context().Done():
				return
			case frame := <-ch:
				if _, err := w.Write(frame); err != nil || rc.Flush() != nil {
					return
				}
			}
		}
	}), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer func() { _ = srv.Close() }()

	s := &system{api: "http://" + ln.Addr().String()}
	c, err := s.openStreams(ctx, n)
	if err != nil {
		return 0, 0, err
	}
	started := map[string]time.Time{}
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	total := int(d.Seconds() * float64(rate))
	for i := range total {
		<-tick.C
		state := "p" + strconv.Itoa(i)
		started[state] = time.Now()
		frame := fmt.Appendf(nil, "id: %d\nevent: task\ndata: {\"id\":%d,\"state\":%q}\n\n", i, i, state)
		mu.Lock()
		for ch := range subs {
			select {
			case ch <- frame:
			default:
			}
		}
		mu.Unlock()
	}
	_ = waitFor(10*time.Second, 20*time.Millisecond, func() (bool, error) {
		return c.count.Load() >= int64(total*n), nil
	})
	c.close()
	var lat []time.Duration
	for state, arrivals := range c.seen {
		for _, at := range arrivals {
			lat = append(lat, at.Sub(started[state]))
		}
	}
	return percentile(lat, 0.5), percentile(lat, 0.99), nil
}
