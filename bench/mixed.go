package main

import (
	"container/heap"
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// The mixed workload: one task in mixedEvery runs mixedLong, the others
// mixedShort, all of one type (demo.sleep), as a type whose tasks mostly
// take a moment and sometimes much longer.
const (
	mixedEvery = 50
	mixedLong  = 5 * time.Second
	mixedShort = 50 * time.Millisecond
)

// mixedDuration is how long the i-th task of the mixed workload runs.
func mixedDuration(i int) time.Duration {
	if i%mixedEvery == 0 {
		return mixedLong
	}
	return mixedShort
}

// inOrderSchedule is how long n tasks of the mixed workload take when
// each, in order, starts on the first of slots to be free, at no cost.
func inOrderSchedule(n, slots int) time.Duration {
	free := make(durations, slots) // when each slot is free next: a heap
	var end time.Duration
	for i := range n {
		free[0] += mixedDuration(i)
		end = max(end, free[0])
		heap.Fix(&free, 0)
	}
	return end
}

type durations []time.Duration

func (d durations) Len() int           { return len(d) }
func (d durations) Less(i, j int) bool { return d[i] < d[j] }
func (d durations) Swap(i, j int)      { d[i], d[j] = d[j], d[i] }
func (d *durations) Push(x any)        { *d = append(*d, x.(time.Duration)) }
func (d *durations) Pop() any {
	old := *d
	x := old[len(old)-1]
	*d = old[:len(old)-1]
	return x
}

// mixed measures whether tasks wait behind long ones: one worker at the
// defaults burns down a backlog of the mixed workload with tasks packed
// (the default) and with a task a message (AMQP_TASKS_PER_MESSAGE=1 on
// the relay and the worker), in turns (A B, then B A), each the best of
// -burn-tries. Each is set against the ideal of a queue served in order:
// each task, in the order submitted, on the first slot free, at no cost
// (the worker does not keep the order strictly, and can beat it). The
// bound no order beats, every slot busy until the work is done, is a row
// of its own. A task that waits for a long one while slots are free shows
// as time above the ideal.
func (b *bench) mixed(ctx context.Context) error {
	n := b.o.mixedN
	configs := []burnConfig{
		{name: "bench_mixed_packed", n: n, procs: 1},
		{name: "bench_mixed_single", n: n, procs: 1, vars: []string{unpacked}},
	}
	runs, err := sweep(b.o.burnTries, len(configs), func(r conveyorBurnResult) float64 { return r.perSec },
		func(i, try int) (conveyorBurnResult, error) {
			c := configs[i]
			return b.mixedBurn(ctx, fmt.Sprintf("%s_%d", c.name, try), c.n, c.vars...)
		})
	if err != nil {
		return err
	}
	slots := runs[0].concurrency
	var work time.Duration
	for i := range n {
		work += mixedDuration(i)
	}
	const (
		name    = "Conveyor: mixed workload burn-down"
		inOrder = "mixed workload: in order, each on the first slot free (ideal)"
	)
	config := fmt.Sprintf("%d tasks, 1 in %d of %s, the rest %s; %d slots", n, mixedEvery, mixedLong, mixedShort, slots)
	b.add(result{Name: "mixed workload: every slot busy until done (bound)", Unit: "tasks/s",
		Value: float64(n) / max(work/time.Duration(slots), mixedLong).Seconds(), Config: config})
	b.add(result{Name: inOrder, Value: float64(n) / inOrderSchedule(n, slots).Seconds(), Unit: "tasks/s", Config: config})
	b.vs(name+", a task a message", runs[1].perSec, "tasks/s", inOrder, 0)
	b.last().Config = unpacked
	b.vs(name+", tasks packed", runs[0].perSec, "tasks/s", inOrder, 0)
	b.vs(name+", tasks packed, of a task a message", runs[0].perSec, "tasks/s", name+", a task a message", 0.9)
	return nil
}

// mixedBurn burns down n tasks of the mixed workload on a system of its
// own: one worker at the defaults and one relay, both with vars.
func (b *bench) mixedBurn(ctx context.Context, name string, n int, vars ...string) (conveyorBurnResult, error) {
	return b.burnOn(ctx, name, func(s *system) error {
		if err := declareQueues(s.amqpURL, "demo.sleep"); err != nil {
			return err
		}
		if _, err := s.pool.Exec(ctx, `INSERT INTO task_types (name) VALUES ('demo.sleep') ON CONFLICT (name) DO NOTHING`); err != nil {
			return err
		}
		return s.startRelays(1, vars...)
	}, func(s *system) (burnResult, error) {
		return s.burnDownOf(ctx, n, s.submitMixed, 1, 0, vars...)
	})
}

// submitMixed submits n tasks of the mixed workload through the batch
// endpoint, a thousand a call, the long ones spread evenly.
func (s *system) submitMixed(n int) error {
	for done := 0; done < n; done += 1000 {
		var body strings.Builder
		body.WriteString(`{"tasks": [`)
		for i := done; i < min(done+1000, n); i++ {
			if i > done {
				body.WriteByte(',')
			}
			fmt.Fprintf(&body, `{"type": "demo.sleep", "payload": {"steps": 1, "step_ms": %d}, "dedupe": false}`,
				mixedDuration(i).Milliseconds())
		}
		body.WriteString(`]}`)
		code, err := s.post("/v1/tasks/batch", []byte(body.String()))
		if err != nil {
			return err
		}
		if code != http.StatusOK {
			return fmt.Errorf("batch: status %d", code)
		}
	}
	return nil
}
