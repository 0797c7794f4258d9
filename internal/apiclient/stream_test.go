package apiclient_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

// fakeStream serves one task's stream as the API does, and misbehaves as
// the API may: it closes each connection after perConn events, replays
// the event before Last-Event-ID on a resume (the client must drop it),
// and can leave out the end frame (the resume then answers 204).
type fakeStream struct {
	t      *testing.T
	taskID string
	events []apiclient.Event
	// perConn events are sent on a connection before it is closed; 0
	// sends them all.
	perConn int
	// replayOne resends, on a resume, the event the client last saw.
	replayOne bool
	// noEnd leaves out the end frame: the client resumes after the
	// terminal event and gets a 204.
	noEnd bool
	// stallAfter, when > 0, makes the first connection go silent (no
	// heartbeat) after that many events, until the client gives up on it.
	stallAfter int

	mu          sync.Mutex
	lastEventID []string // the Last-Event-ID of each connection
	auth        []string
}

func newTaskEvents(taskID string, n int, final string) []apiclient.Event {
	start := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	out := make([]apiclient.Event, n)
	for i := range out {
		status, state, progress := apiclient.StatusInProgress, fmt.Sprintf("Step %d/%d", i, n-2), i*100/(n-1)
		switch i {
		case 0:
			status, state, progress = apiclient.StatusPending, "Queued", 0
		case n - 1:
			status, state, progress = final, final, 100
		}
		out[i] = apiclient.Event{ID: int64(100 + i), TaskID: taskID, Type: "demo.sleep", Status: status,
			State: state, Progress: progress, Actor: "WORKER", CreatedAt: start.Add(time.Duration(i) * 100 * time.Millisecond)}
	}
	return out
}

func (f *fakeStream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	require.Equal(f.t, "/v1/tasks/"+f.taskID+"/stream", r.URL.Path)
	require.Equal(f.t, "text/event-stream", r.Header.Get("Accept"))
	last := r.Header.Get("Last-Event-ID")
	f.mu.Lock()
	f.lastEventID = append(f.lastEventID, last)
	f.auth = append(f.auth, r.Header.Get("Authorization"))
	conn := len(f.lastEventID)
	f.mu.Unlock()

	after := int64(-1)
	if last != "" {
		n, err := strconv.ParseInt(last, 10, 64)
		require.NoError(f.t, err)
		after = n
	}
	from := 0
	for from < len(f.events) && f.events[from].ID <= after {
		from++
	}
	if from == len(f.events) {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	if f.replayOne && from > 0 {
		from--
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	fl := w.(http.Flusher)
	fmt.Fprintf(w, "retry: 2000\n\n: heartbeat\n\n")
	sent := 0
	for _, e := range f.events[from:] {
		if f.perConn > 0 && sent == f.perConn {
			return // the server closes the stream early
		}
		if f.stallAfter > 0 && conn == 1 && sent == f.stallAfter {
			fl.Flush()
			<-r.Context().Done() // silent until the client hangs up
			return
		}
		b, err := json.Marshal(e)
		require.NoError(f.t, err)
		fmt.Fprintf(w, "id: %d\nevent: task\ndata: %s\n\n: heartbeat\n\n", e.ID, b)
		fl.Flush()
		sent++
	}
	if !f.noEnd {
		fmt.Fprintf(w, "event: end\ndata: {\"task_id\":%q,\"status\":%q}\n\n", f.taskID, f.events[len(f.events)-1].Status)
	}
}

func (f *fakeStream) resumes() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.lastEventID...)
}

func newClient(t *testing.T, url string) *apiclient.Client {
	t.Helper()
	c, err := apiclient.New(apiclient.Config{URL: url, Token: "cvk_test", ReconnectDelay: time.Millisecond,
		ReconnectMaxDelay: 5 * time.Millisecond, ReconnectTries: 5, StreamIdleTimeout: 5 * time.Second})
	require.NoError(t, err)
	return c
}

// follow follows the task to its end and returns the ids it was shown.
func follow(t *testing.T, c *apiclient.Client, taskID string) ([]int64, string) {
	t.Helper()
	var ids []int64
	status, err := c.FollowTask(t.Context(), taskID, func(e apiclient.Event) error {
		require.Equal(t, taskID, e.TaskID)
		var doc apiclient.Event // the frame's JSON, kept for -o json
		require.NoError(t, json.Unmarshal(e.JSON(), &doc))
		require.Equal(t, e.ID, doc.ID)
		ids = append(ids, e.ID)
		return nil
	})
	require.NoError(t, err)
	return ids, status
}

func ids(events []apiclient.Event) []int64 {
	out := make([]int64, len(events))
	for i, e := range events {
		out[i] = e.ID
	}
	return out
}

func TestFollowTaskReadsTheWholeStreamOnce(t *testing.T) {
	t.Parallel()
	f := &fakeStream{t: t, taskID: "t1", events: newTaskEvents("t1", 7, apiclient.StatusCompleted)}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)

	got, status := follow(t, newClient(t, srv.URL), "t1")
	require.Equal(t, ids(f.events), got)
	require.Equal(t, apiclient.StatusCompleted, status)
	require.Equal(t, []string{""}, f.resumes(), "one connection, from the task's first event")
	require.Equal(t, []string{"Bearer cvk_test"}, f.auth)
}

// The server closes the stream every 3 events and replays one event on
// each resume: the client resumes after the last id it saw and shows no
// event twice.
func TestFollowTaskResumesWithoutDuplicates(t *testing.T) {
	t.Parallel()
	f := &fakeStream{t: t, taskID: "t2", events: newTaskEvents("t2", 10, apiclient.StatusFailed), perConn: 3, replayOne: true}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)

	got, status := follow(t, newClient(t, srv.URL), "t2")
	require.Equal(t, ids(f.events), got, "every event once, in order")
	require.Equal(t, apiclient.StatusFailed, status)
	// 3 new events per connection once the replayed one is dropped: the
	// first brings 100-102, the next ones 103-104 (+ the replay), …
	require.Equal(t, []string{"", "102", "104", "106", "108"}, f.resumes())
}

// A stream that closes after the terminal event without its end frame is
// resumed; the 204 then says it is over, and the terminal event seen says
// how.
func TestFollowTaskEndsOnNoContent(t *testing.T) {
	t.Parallel()
	f := &fakeStream{t: t, taskID: "t3", events: newTaskEvents("t3", 4, apiclient.StatusCancelled), noEnd: true}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)

	got, status := follow(t, newClient(t, srv.URL), "t3")
	require.Equal(t, ids(f.events), got)
	require.Equal(t, apiclient.StatusCancelled, status)
	require.Equal(t, []string{"", "103"}, f.resumes())
}

// A connection that goes silent (no event, no heartbeat) is taken for
// dead and resumed.
func TestFollowTaskReconnectsASilentStream(t *testing.T) {
	t.Parallel()
	f := &fakeStream{t: t, taskID: "t4", events: newTaskEvents("t4", 5, apiclient.StatusCompleted), stallAfter: 2}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	c, err := apiclient.New(apiclient.Config{URL: srv.URL, ReconnectDelay: time.Millisecond,
		StreamIdleTimeout: 200 * time.Millisecond})
	require.NoError(t, err)

	got, status := follow(t, c, "t4")
	require.Equal(t, ids(f.events), got)
	require.Equal(t, apiclient.StatusCompleted, status)
	require.Equal(t, []string{"", "101"}, f.resumes())
}

func TestFollowTaskErrors(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		status   int
		body     string
		requests int
		want     string
	}{
		// A refusal that will not change is reported at once.
		"not found": {status: 404, requests: 1, want: "no task t5 (HTTP 404)",
			body: `{"type":"urn:conveyor:problem:not_found","title":"Not Found","status":404,"detail":"no task t5"}`},
		"unauthorized": {status: 401, requests: 1, want: "missing bearer token (HTTP 401)",
			body: `{"title":"Unauthorized","status":401,"detail":"missing bearer token"}`},
		// An unavailable API is retried, up to ReconnectTries.
		"unavailable": {status: 503, requests: 6, want: "lost after 5 reconnects: streams are starting (HTTP 503)",
			body: `{"title":"Service Unavailable","status":503,"detail":"streams are starting"}`},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var mu sync.Mutex
			requests := 0
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				requests++
				mu.Unlock()
				w.Header().Set("Content-Type", "application/problem+json")
				w.WriteHeader(tc.status)
				fmt.Fprintf(w, "%s", tc.body)
			}))
			t.Cleanup(srv.Close)

			_, err := newClient(t, srv.URL).FollowTask(t.Context(), "t5", func(apiclient.Event) error {
				t.Fatal("no event expected")
				return nil
			})
			require.ErrorContains(t, err, tc.want)
			require.Equal(t, tc.status, apiclient.StatusOf(err))
			mu.Lock()
			defer mu.Unlock()
			require.Equal(t, tc.requests, requests)
		})
	}
}

// A stream that answers something else than an event stream (an old API
// without streams behind a proxy, say) is an error, not a hang.
func TestFollowTaskRefusesANonStream(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		fmt.Fprintf(w, "<html></html>")
	}))
	t.Cleanup(srv.Close)
	_, err := newClient(t, srv.URL).FollowTask(t.Context(), "t6", func(apiclient.Event) error { return nil })
	require.ErrorContains(t, err, `answered "text/html", not an event stream`)
	require.NotContains(t, err.Error(), "reconnects", "not retried: it would answer the same")
}

// The org's feed sends its filters, resumes after the last event it saw,
// and ends when its context does.
func TestFollowEventsResumesAndStops(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var seen []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		require.Equal(t, "/v1/events/stream", r.URL.Path)
		require.Equal(t, "demo.sleep", r.URL.Query().Get("type"))
		require.Equal(t, "FAILED", r.URL.Query().Get("status"))
		mu.Lock()
		seen = append(seen, r.Header.Get("Last-Event-ID"))
		conn := len(seen)
		mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		fmt.Fprintf(w, "retry: 2000\n\n")
		// The ready frame says where the stream starts.
		fmt.Fprintf(w, "id: 7\nevent: ready\ndata: {\"last_event_id\":7}\n\n")
		switch conn {
		case 1:
			return // closed before any event: the resume starts after 7 all the same
		case 2:
			for id := 8; id <= 9; id++ {
				fmt.Fprintf(w, "id: %d\nevent: task\ndata: {\"id\":%d,\"task_id\":\"a\",\"status\":\"FAILED\"}\n\n", id, id)
			}
			return // closed early
		}
		// The resume replays event 9 and goes on with 10, then stays open.
		for id := 9; id <= 10; id++ {
			fmt.Fprintf(w, "id: %d\nevent: task\ndata: {\"id\":%d,\"task_id\":\"b\",\"status\":\"FAILED\"}\n\n", id, id)
		}
		fmt.Fprintf(w, "event: ping\ndata: {}\n\n") // an event type of a newer API: ignored
		fl.Flush()
		<-r.Context().Done()
	}))
	t.Cleanup(srv.Close)

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var got []int64
	err := newClient(t, srv.URL).FollowEvents(ctx, apiclient.EventFilter{Type: "demo.sleep", Status: "FAILED"},
		func(e apiclient.Event) error {
			got = append(got, e.ID)
			if e.ID == 10 {
				cancel()
			}
			return nil
		})
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, []int64{8, 9, 10}, got)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"", "7", "9"}, seen)
}

// A quiet stream that the server opens and a proxy or a restart closes,
// again and again, has not failed: each opened connection starts the count
// of failed reconnects again, and the follower is still there when an
// event comes.
func TestFollowEventsOutlastsQuietStreamsClosedManyTimes(t *testing.T) {
	t.Parallel()
	const closes = 12 // more than the client's ReconnectTries
	var mu sync.Mutex
	conns := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		conns++
		conn := conns
		mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprintf(w, "id: 7\nevent: ready\ndata: {\"last_event_id\":7}\n\n")
		if conn <= closes {
			return
		}
		fmt.Fprintf(w, "id: 8\nevent: task\ndata: {\"id\":8,\"task_id\":\"a\",\"status\":\"FAILED\"}\n\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	t.Cleanup(srv.Close)

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var got []int64
	err := newClient(t, srv.URL).FollowEvents(ctx, apiclient.EventFilter{}, func(e apiclient.Event) error {
		got = append(got, e.ID)
		cancel()
		return nil
	})
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, []int64{8}, got)
}

// An error of the caller's function ends the stream with that error.
func TestFollowStopsOnTheCallersError(t *testing.T) {
	t.Parallel()
	f := &fakeStream{t: t, taskID: "t7", events: newTaskEvents("t7", 5, apiclient.StatusCompleted)}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	stop := errors.New("enough")
	n := 0
	_, err := newClient(t, srv.URL).FollowTask(t.Context(), "t7", func(apiclient.Event) error {
		n++
		if n == 2 {
			return stop
		}
		return nil
	})
	require.ErrorIs(t, err, stop)
	require.Equal(t, 2, n)
	require.Len(t, f.resumes(), 1)
}

// A task's stream that the server opens and a proxy or a restart closes,
// again and again, while the task is quiet (waiting for its time, a slot or
// a paused type to resume) has not failed either: as with the org's feed,
// each opened connection starts the count of failed reconnects again, and
// the follower sees the task to its end.
func TestFollowTaskOutlastsQuietStreamsClosedManyTimes(t *testing.T) {
	t.Parallel()
	const closes = 12 // more than the client's ReconnectTries
	events := newTaskEvents("t8", 3, apiclient.StatusCompleted)
	var mu sync.Mutex
	conns := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		conns++
		conn := conns
		mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprintf(w, "retry: 2000\n\n: heartbeat\n\n")
		if conn <= closes {
			return // opened, quiet, closed
		}
		for _, e := range events {
			b, err := json.Marshal(e)
			require.NoError(t, err)
			fmt.Fprintf(w, "id: %d\nevent: task\ndata: %s\n\n", e.ID, b)
		}
		fmt.Fprintf(w, "event: end\ndata: {\"task_id\":\"t8\",\"status\":\"COMPLETED\"}\n\n")
	}))
	t.Cleanup(srv.Close)

	got, status := follow(t, newClient(t, srv.URL), "t8")
	require.Equal(t, ids(events), got)
	require.Equal(t, apiclient.StatusCompleted, status)
}

// A stream given up on because it stayed silent is lost, not interrupted:
// its error does not read as the caller's cancellation (which the command
// line reports as Ctrl-C, exit 130, without a word).
func TestFollowTaskGivesUpOnASilentStreamWithoutSayingCancelled(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		<-r.Context().Done() // never a byte: a half-open connection, a buffering proxy
	}))
	t.Cleanup(srv.Close)
	c, err := apiclient.New(apiclient.Config{URL: srv.URL, ReconnectDelay: time.Millisecond,
		ReconnectMaxDelay: time.Millisecond, ReconnectTries: 2, StreamIdleTimeout: 50 * time.Millisecond})
	require.NoError(t, err)

	_, err = c.FollowTask(t.Context(), "t9", func(apiclient.Event) error { return nil })
	require.Error(t, err)
	require.ErrorContains(t, err, "lost after 2 reconnects")
	require.NotErrorIs(t, err, context.Canceled, "%v", err)
	require.ErrorContains(t, err, "silent")
}

// A frame larger than the client reads (a COMPLETED event carrying a
// large result) would come again on every resume: it is reported, not
// retried for ever.
func TestFollowTaskReportsAFrameTooLargeToRead(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	conns := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		conns++
		mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		e := apiclient.Event{ID: 7, TaskID: "t10", Status: apiclient.StatusCompleted, Progress: 100,
			Result: json.RawMessage(`"` + strings.Repeat("x", 9<<20) + `"`)}
		b, err := json.Marshal(e)
		require.NoError(t, err)
		fmt.Fprintf(w, "id: 7\nevent: task\ndata: %s\n\nevent: end\ndata: {\"task_id\":\"t10\",\"status\":\"COMPLETED\"}\n\n", b)
	}))
	t.Cleanup(srv.Close)

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, err := newClient(t, srv.URL).FollowTask(ctx, "t10", func(apiclient.Event) error { return nil })
	require.Error(t, err)
	require.NotErrorIs(t, err, context.DeadlineExceeded, "reconnected for ever")
	require.ErrorContains(t, err, "larger than the 8 MiB this client reads")
	mu.Lock()
	defer mu.Unlock()
	require.LessOrEqual(t, conns, 6, "reconnected %d times", conns)
}

// A reconnect that is never answered (a proxy that holds the request, a
// server gone while the request was in flight) is given up after the same
// silence as an open stream, and tried again: the follower does not wait
// for headers for ever.
func TestFollowTaskReconnectsARequestNeverAnswered(t *testing.T) {
	t.Parallel()
	f := &fakeStream{t: t, taskID: "t11", events: newTaskEvents("t11", 3, apiclient.StatusCompleted)}
	var mu sync.Mutex
	conns := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		conns++
		conn := conns
		mu.Unlock()
		if conn == 1 {
			<-r.Context().Done() // no answer, not even headers
			return
		}
		f.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	c, err := apiclient.New(apiclient.Config{URL: srv.URL, ReconnectDelay: time.Millisecond,
		StreamIdleTimeout: 200 * time.Millisecond})
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	var got []int64
	status, err := c.FollowTask(ctx, "t11", func(e apiclient.Event) error {
		got = append(got, e.ID)
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, apiclient.StatusCompleted, status)
	require.Equal(t, ids(f.events), got)
}

// refusing is a transport that fails the dials it is told to, as when
// nothing listens at the API's address, and passes the other requests on.
type refusing struct {
	mu     sync.Mutex
	calls  int
	refuse func(call int, r *http.Request) bool
}

func (rt *refusing) RoundTrip(r *http.Request) (*http.Response, error) {
	rt.mu.Lock()
	rt.calls++
	call := rt.calls
	rt.mu.Unlock()
	if rt.refuse(call, r) {
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	}
	return http.DefaultTransport.RoundTrip(r)
}

func (rt *refusing) count() int {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return rt.calls
}

// A stream whose API was never reached is not a dropped stream: a wrong
// --url is reported at once, as every other command reports it, rather
// than after ReconnectTries of backoff with nothing on the screen.
func TestFollowTaskReportsAnUnreachableAPIAtOnce(t *testing.T) {
	t.Parallel()
	rt := &refusing{refuse: func(int, *http.Request) bool { return true }}
	c, err := apiclient.New(apiclient.Config{URL: "http://127.0.0.1:1", Transport: rt, ReconnectDelay: time.Millisecond,
		ReconnectMaxDelay: time.Millisecond, ReconnectTries: 5})
	require.NoError(t, err)
	_, err = c.FollowTask(t.Context(), "t9", func(apiclient.Event) error { return nil })
	require.ErrorContains(t, err, "cannot reach the API at http://127.0.0.1:1")
	require.NotContains(t, err.Error(), "reconnects")
	require.True(t, apiclient.Unreachable(err), "%v", err)
	require.Equal(t, 1, rt.count(), "an address where nothing listens is not tried again")
}

// Once the API answered, a failed dial is a restart or a network blip,
// and the stream is resumed as any other dropped stream.
func TestFollowTaskResumesAcrossAnAPIThatWentAway(t *testing.T) {
	t.Parallel()
	f := &fakeStream{t: t, taskID: "t10", events: newTaskEvents("t10", 6, apiclient.StatusCompleted), perConn: 2}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	// The first resume finds the API gone, twice.
	rt := &refusing{refuse: func(call int, _ *http.Request) bool { return call == 2 || call == 3 }}
	c, err := apiclient.New(apiclient.Config{URL: srv.URL, Transport: rt, ReconnectDelay: time.Millisecond,
		ReconnectMaxDelay: time.Millisecond, ReconnectTries: 5})
	require.NoError(t, err)
	got, status := follow(t, c, "t10")
	require.Equal(t, ids(f.events), got)
	require.Equal(t, apiclient.StatusCompleted, status)
	require.Equal(t, []string{"", "101", "103"}, f.resumes())
}
