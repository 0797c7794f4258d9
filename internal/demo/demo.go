// Package demo holds the built-in task types: demo.sleep for demos and
// tests, demo.noop for benchmarks, demo.fanout to show a handler that
// spawns children and gathers their results.
package demo

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/conveyorhq/conveyor"
)

// Handlers returns the built-in handlers.
func Handlers() []conveyor.Handler {
	return []conveyor.Handler{
		conveyor.Handle("demo.sleep", Sleep),
		conveyor.Handle("demo.noop", Noop),
		conveyor.Handle("demo.fanout", Fanout),
	}
}

// SleepPayload is demo.sleep's input.
type SleepPayload struct {
	Steps  int `json:"steps"`
	StepMS int `json:"step_ms"`
	// FailTimes makes the first attempts fail, for retry demos.
	FailTimes int `json:"fail_times"`
}

// Sleep sleeps step by step, reporting progress after each step, and stops
// as soon as its context is done. Its first fail_times attempts fail.
func Sleep(ctx context.Context, t conveyor.Task, r conveyor.Reporter) (any, error) {
	var p SleepPayload
	if err := json.Unmarshal(t.Payload, &p); err != nil {
		return nil, conveyor.Permanent(fmt.Errorf("demo.sleep payload: %w", err))
	}
	if p.Steps < 0 || p.Steps > 10000 || p.StepMS < 0 || p.StepMS > 3_600_000 {
		return nil, conveyor.Permanent(fmt.Errorf("demo.sleep payload: steps must be 0..10000 and step_ms 0..3600000"))
	}
	if t.Attempt <= p.FailTimes {
		return nil, fmt.Errorf("demo.sleep: failing attempt %d of the first %d, as asked", t.Attempt, p.FailTimes)
	}
	start := time.Now()
	for i := 1; i <= p.Steps; i++ {
		if err := sleep(ctx, time.Duration(p.StepMS)*time.Millisecond); err != nil {
			return nil, err
		}
		if err := r.Progress(ctx, i*100/p.Steps, fmt.Sprintf("Step %d/%d", i, p.Steps)); err != nil {
			return nil, err
		}
	}
	return map[string]int64{"slept_ms": time.Since(start).Milliseconds()}, nil
}

// Noop does nothing and returns an empty object.
func Noop(context.Context, conveyor.Task, conveyor.Reporter) (any, error) {
	return struct{}{}, nil
}

// FanoutPayload is demo.fanout's input: how many children, and the
// demo.sleep payload each gets.
type FanoutPayload struct {
	Children int          `json:"children"`
	Child    SleepPayload `json:"child"`
}

// MaxFanout bounds demo.fanout's children.
const MaxFanout = 1000

// Fanout spawns demo.sleep children and, once they have all finished,
// completes with how many completed and their total sleep. It returns
// Gather's ErrAwaitChildren while they run: the task then waits without a
// worker slot, and runs again when the last child has finished.
func Fanout(ctx context.Context, t conveyor.Task, r conveyor.Reporter) (any, error) {
	var p FanoutPayload
	if err := json.Unmarshal(t.Payload, &p); err != nil {
		return nil, conveyor.Permanent(fmt.Errorf("demo.fanout payload: %w", err))
	}
	if p.Children < 1 || p.Children > MaxFanout {
		return nil, conveyor.Permanent(fmt.Errorf("demo.fanout payload: children must be 1..%d", MaxFanout))
	}
	children := make([]conveyor.Child, p.Children)
	for i := range children {
		children[i] = conveyor.Child{Key: fmt.Sprintf("part-%d", i), Type: "demo.sleep", Payload: p.Child}
	}
	results, err := r.Gather(ctx, children...)
	if err != nil {
		return nil, err
	}
	out := struct {
		Completed int   `json:"completed"`
		Failed    int   `json:"failed"`
		SleptMS   int64 `json:"slept_ms"`
	}{}
	for _, c := range results {
		if !c.Completed() {
			out.Failed++
			continue
		}
		out.Completed++
		var res struct {
			SleptMS int64 `json:"slept_ms"`
		}
		if json.Unmarshal(c.Result, &res) == nil {
			out.SleptMS += res.SleptMS
		}
	}
	return out, nil
}

// sleep waits for d or until ctx is done, whichever comes first.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-t.C:
		return nil
	}
}
