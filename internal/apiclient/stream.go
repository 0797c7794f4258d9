package apiclient

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strconv"
	"time"

	sse "github.com/tmaxmax/go-sse"
)

// The streams are Server-Sent Events: each change is an "event: task"
// frame whose id is the event's id; a task's own stream ends with an
// "event: end" frame after the task's terminal event. A dropped stream is
// resumed with Last-Event-ID, after which the server sends every later
// event once; the client still drops any id it has already passed, so
// that a caller never sees an event twice.

// maxFrameSize bounds one frame: a COMPLETED event carries the task's
// result, which the worker bounds (task.MaxResultBytes, 1 MiB as stored);
// the API's JSON of it is at most 6 times that (an escaped "<" is 6
// bytes), so a result that was stored always fits.
const maxFrameSize = 8 << 20

// EventFilter narrows the org's stream; zero fields match everything.
type EventFilter struct {
	Type   string
	Status string
}

// FollowTask calls fn with each event of the task, from its first, once
// each and in order, reconnecting whenever the stream drops, until the task
// ends; it returns the task's final status (COMPLETED, FAILED or
// CANCELLED). It stops early with fn's error, ctx's error or the API's.
func (c *Client) FollowTask(ctx context.Context, id string, fn func(Event) error) (string, error) {
	f := &follower{c: c, path: "/v1/tasks/" + url.PathEscape(id) + "/stream", fn: fn}
	end, err := f.run(ctx)
	if err != nil {
		return "", err
	}
	if end != "" {
		return end, nil
	}
	// The stream was over when it resumed (204): the terminal event seen
	// last says how it ended; a task without one is asked.
	if Terminal(f.lastStatus) {
		return f.lastStatus, nil
	}
	t, err := c.Task(ctx, id)
	if err != nil {
		return "", err
	}
	return t.Status, nil
}

// FollowEvents calls fn with each event of the org's live feed, from now
// on, once each and in order, reconnecting whenever the stream drops. It
// returns when ctx is done (with ctx's error), or with fn's error or the
// API's.
func (c *Client) FollowEvents(ctx context.Context, filter EventFilter, fn func(Event) error) error {
	q := url.Values{}
	set(q, "type", filter.Type)
	set(q, "status", filter.Status)
	f := &follower{c: c, path: "/v1/events/stream", query: q, fn: fn}
	_, err := f.run(ctx)
	if err == nil {
		err = errors.New("the API ended the event stream")
	}
	return err
}

// follower is one stream followed across its connections.
type follower struct {
	c     *Client
	path  string
	query url.Values
	fn    func(Event) error

	// lastID is the id of the last event passed to fn ("" before the
	// first), sent back as Last-Event-ID; last is its value.
	lastID     string
	last       int64
	lastStatus string
	// answered: the API has answered one of the stream's requests, with
	// anything. Until then a failed dial is no dropped stream but an
	// address where nothing listens, reported at once as other commands
	// do, not after ReconnectTries of silence.
	answered bool
}

// errEnded says the server has no more to send (a 204).
var errEnded = errors.New("stream ended")

// errSilent says a connection sent nothing, not even a heartbeat, for
// longer than StreamIdleTimeout, and was taken for dead.
var errSilent = errors.New("the stream was silent, heartbeats included,")

// run connects and reconnects until the stream's end frame (it returns
// the final status) or a 204 (it returns ""), or an error. Failures in a
// row are retried with a growing delay, up to ReconnectTries; a connection
// that the server opened as an event stream, and that did not go silent,
// starts the count again: a quiet stream that a proxy or a restart closes
// now and then has not failed.
func (f *follower) run(ctx context.Context) (string, error) {
	failures := 0
	for {
		end, progressed, err := f.connect(ctx)
		switch {
		case errors.Is(err, errEnded):
			return "", nil
		case end != "":
			return end, nil
		case ctx.Err() != nil:
			return "", ctx.Err()
		case err != nil && !retryable(err):
			return "", err
		case err != nil && !f.answered && Unreachable(err):
			return "", err
		}
		if progressed {
			failures = 0
		}
		failures++
		if failures > f.c.cfg.ReconnectTries {
			if err == nil {
				err = errors.New("the server closed the stream")
			}
			return "", fmt.Errorf("stream %s lost after %d reconnects: %w", f.path, failures-1, err)
		}
		if err := sleep(ctx, f.delay(failures, err)); err != nil {
			return "", err
		}
	}
}

// delay is the wait before reconnect n (1, 2, …): doubling from
// ReconnectDelay, capped by ReconnectMaxDelay, at least what a 429 or 503
// asked for.
func (f *follower) delay(n int, err error) time.Duration {
	d := f.c.cfg.ReconnectDelay
	for i := 1; i < n && d < f.c.cfg.ReconnectMaxDelay; i++ {
		d *= 2
	}
	d = min(d, f.c.cfg.ReconnectMaxDelay)
	if e, ok := errors.AsType[*Error](err); ok && e.RetryAfter > d {
		d = e.RetryAfter
	}
	return d
}

// retryable reports whether a failed connection is worth another try: the
// network failed, or the API (or a proxy before it) is overloaded or
// restarting. Other answers (401, 403, 404…) will not change.
func retryable(err error) bool {
	if _, ok := errors.AsType[*permanentError](err); ok {
		return false
	}
	e, ok := errors.AsType[*Error](err)
	if !ok {
		return true
	}
	switch e.Status {
	case http.StatusTooManyRequests, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// connect reads one connection of the stream to its close. It returns the
// end frame's status if one came, whether the server opened the stream or
// any event was passed to fn, and why the connection ended.
func (f *follower) connect(ctx context.Context) (end string, progressed bool, err error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	h := http.Header{"Accept": {"text/event-stream"}, "Cache-Control": {"no-cache"}}
	if f.lastID != "" {
		h.Set("Last-Event-ID", f.lastID)
	}
	// A connection silent for longer than the heartbeats allow is dead
	// (a half-open TCP connection never says so): cancel it. That holds
	// from the request on: a request never answered is as dead.
	idle := time.AfterFunc(f.c.cfg.StreamIdleTimeout, func() { cancel(errSilent) })
	defer idle.Stop()
	resp, err := f.c.send(ctx, f.c.stream, request{method: http.MethodGet, path: f.path, query: f.query, header: h})
	if err != nil {
		if errors.Is(context.Cause(ctx), errSilent) {
			// Not the caller's cancellation, which ends the stream.
			return "", false, fmt.Errorf("GET %s: not answered for %s", f.path, f.c.cfg.StreamIdleTimeout)
		}
		return "", false, err
	}
	defer resp.Body.Close()
	f.answered = true
	idle.Reset(f.c.cfg.StreamIdleTimeout)
	switch {
	case resp.StatusCode == http.StatusNoContent:
		return "", false, errEnded
	case resp.StatusCode >= 300:
		return "", false, readError(resp)
	}
	if media, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); media != "text/event-stream" {
		return "", false, &permanentError{fmt.Errorf("GET %s: answered %q, not an event stream", f.path, media)}
	}

	body := &activityReader{r: resp.Body, active: func() { idle.Reset(f.c.cfg.StreamIdleTimeout) }}

	for frame, rerr := range sse.Read(body, &sse.ReadConfig{MaxEventSize: maxFrameSize}) {
		if rerr != nil {
			if errors.Is(context.Cause(ctx), errSilent) {
				// Not the caller's cancellation, which ends the stream.
				return "", progressed, fmt.Errorf("GET %s: %w for %s", f.path, errSilent, f.c.cfg.StreamIdleTimeout)
			}
			if errors.Is(rerr, bufio.ErrTooLong) {
				// A resume would stop at the same frame again.
				return "", progressed, &permanentError{fmt.Errorf("GET %s: an event is larger than the %d MiB this client reads (a large task result?)",
					f.path, maxFrameSize>>20)}
			}
			// The server opened the stream: a quiet one that a proxy or a
			// restart closes has not failed (the org's stream also says so
			// with its ready frame; a task's has none, and a task may stay
			// quiet for long). One that went silent, though, was dead.
			return "", true, rerr
		}
		switch frame.Type {
		case "end":
			var e struct {
				Status string `json:"status"`
			}
			if err := json.Unmarshal([]byte(frame.Data), &e); err != nil || !Terminal(e.Status) {
				return "", progressed, &permanentError{fmt.Errorf("GET %s: bad end frame %q", f.path, frame.Data)}
			}
			return e.Status, progressed, nil
		case "ready":
			// Where the org's stream starts: resume from there even if no
			// event comes before the connection drops.
			if n, err := strconv.ParseInt(frame.LastEventID, 10, 64); err == nil && (f.lastID == "" || n > f.last) {
				f.lastID, f.last = frame.LastEventID, n
			}
			progressed = true
		case "task", "":
			passed, err := f.deliver(frame)
			if err != nil {
				return "", progressed, err
			}
			progressed = progressed || passed
		}
	}
	return "", true, nil // opened, as above
}

// deliver passes a task frame to fn unless its id was passed already.
func (f *follower) deliver(frame sse.Event) (bool, error) {
	var e Event
	if err := json.Unmarshal([]byte(frame.Data), &e); err != nil {
		return false, &permanentError{fmt.Errorf("GET %s: bad event %q: %w", f.path, frame.Data, err)}
	}
	e.keep([]byte(frame.Data))
	id, lastID := e.ID, frame.LastEventID
	if n, err := strconv.ParseInt(lastID, 10, 64); err == nil {
		id = n
	} else {
		lastID = strconv.FormatInt(id, 10)
	}
	if f.lastID != "" && id <= f.last {
		return false, nil
	}
	if err := f.fn(e); err != nil {
		return false, &permanentError{err}
	}
	f.lastID, f.last, f.lastStatus = lastID, id, e.Status
	return true, nil
}

// permanentError is an error that ends the stream at once: the caller's,
// or an answer a reconnect would only get again (a frame that cannot be
// read, an answer that is not a stream).
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// activityReader calls active whenever bytes arrive.
type activityReader struct {
	r      io.Reader
	active func()
}

func (a *activityReader) Read(p []byte) (int, error) {
	n, err := a.r.Read(p)
	if n > 0 {
		a.active()
	}
	return n, err
}

// sleep waits for d, or until ctx is done.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
