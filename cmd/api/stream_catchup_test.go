package main

import (
	"bufio"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/config"
)

// A resume from far in the past with a filter that takes in few events
// reads the history in bounded spans: one statement that scanned every
// event since the id until enough matched would outlast the statement
// timeout on a long history, and the client, retrying, would never get
// its stream back.
func TestOrgStreamResumeFromFarBackReadsInBoundedSpans(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *config.API) { c.RequestTimeout = time.Second })
	id := b.submitTask(t, `{"type":"stream.noise","payload":{}}`)
	// A long history of another type's events.
	b.exec(t, `INSERT INTO task_events (task_id, org_id, status, state, progress, actor)
		SELECT e.task_id, e.org_id, e.status, e.state, e.progress, e.actor FROM task_events e, generate_series(1, 500000)
		WHERE e.task_id = $1`, id)
	b.exec(t, `ANALYZE task_events`)

	// The first subscriber's hub may still be reading up to them; its
	// "starting" answers are retried, as a client does.
	var resp *http.Response
	var lines *bufio.Scanner
	for deadline := time.Now().Add(30 * time.Second); ; {
		resp, lines = b.openStreamWith(t, "/v1/events/stream?type=stream.quiet",
			"Authorization", "Bearer "+b.token, "Last-Event-ID", "0")
		if resp.StatusCode == http.StatusOK {
			break
		}
		body, _ := io.ReadAll(resp.Body)
		require.Contains(t, string(body), "live streams are starting", "%d", resp.StatusCode)
		require.True(t, time.Now().Before(deadline), "the stream never opened")
		time.Sleep(500 * time.Millisecond)
	}
	require.True(t, lines.Scan())
	require.Equal(t, "retry: "+strconv.Itoa(2000), lines.Text())

	quiet := b.submitTask(t, `{"type":"stream.quiet","payload":{}}`)
	// After the catch-up, which reads the history span by span.
	found := make(chan bool, 1)
	go func() {
		for lines.Scan() {
			if strings.HasPrefix(lines.Text(), "data: ") && strings.Contains(lines.Text(), quiet) {
				found <- true
				return
			}
		}
		found <- false
	}()
	select {
	case ok := <-found:
		require.True(t, ok, "the stream ended")
	case <-time.After(90 * time.Second):
		t.Fatal("the new task's event did not come within 90s")
	}
}
