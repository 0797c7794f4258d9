package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// Live streams against the whole pipeline: real workers write the events,
// the API streams them, and what a client received is compared with what
// the database holds.

// frame is one Server-Sent Event.
type frame struct {
	ID    int64
	Event string
	Data  string
}

// sseStream reads the frames of one stream response.
type sseStream struct {
	resp   *http.Response
	lines  *bufio.Scanner
	cancel context.CancelFunc
}

// openStream GETs a stream as the bundle's client, resuming after
// lastID when it is not negative.
func (b *bundle) openStream(t *testing.T, path string, lastID int64) (*sseStream, int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, b.api+path, nil)
	require.NoError(t, err)
	if lastID >= 0 {
		req.Header.Set("Last-Event-ID", strconv.FormatInt(lastID, 10))
	}
	resp, err := b.streamClient().Do(req)
	require.NoError(t, err)
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		cancel()
		return nil, resp.StatusCode
	}
	require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
	s := &sseStream{resp: resp, lines: bufio.NewScanner(resp.Body), cancel: cancel}
	s.lines.Buffer(make([]byte, 64<<10), 4<<20)
	return s, resp.StatusCode
}

// streamClient is the bundle's client without its timeout.
func (b *bundle) streamClient() *http.Client {
	return &http.Client{Transport: b.client.Transport}
}

// next returns the next frame with data (heartbeats, the retry hint and
// the org stream's ready frame are skipped), or ok false when the stream
// ended.
func (s *sseStream) next() (f frame, ok bool, err error) {
	for s.lines.Scan() {
		line := s.lines.Text()
		switch {
		case line == "":
			if f.Data != "" && f.Event != "ready" {
				return f, true, nil
			}
			f = frame{}
		case strings.HasPrefix(line, ":"), strings.HasPrefix(line, "retry:"):
		case strings.HasPrefix(line, "id: "):
			if f.ID, err = strconv.ParseInt(strings.TrimPrefix(line, "id: "), 10, 64); err != nil {
				return f, false, err
			}
		case strings.HasPrefix(line, "event: "):
			f.Event = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			f.Data = strings.TrimPrefix(line, "data: ")
		default:
			return f, false, fmt.Errorf("unexpected line %q", line)
		}
	}
	return f, false, s.lines.Err()
}

func (s *sseStream) close() {
	s.cancel()
	s.resp.Body.Close()
}

type streamEvent struct {
	ID       int64           `json:"id"`
	TaskID   uuid.UUID       `json:"task_id"`
	Status   string          `json:"status"`
	Progress int             `json:"progress"`
	State    string          `json:"state"`
	Result   json.RawMessage `json:"result"`
}

func decodeEvent(t *testing.T, f frame) streamEvent {
	t.Helper()
	require.Equal(t, "task", f.Event)
	var e streamEvent
	require.NoError(t, json.Unmarshal([]byte(f.Data), &e))
	require.Equal(t, f.ID, e.ID, "the frame's id is the event's")
	return e
}

// eventIDs lists the ids of the stored events the query selects.
func (b *bundle) eventIDs(t *testing.T, where string, args ...any) []int64 {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), "SELECT id FROM task_events WHERE "+where+" ORDER BY id", args...)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	return ids
}

func TestTaskStreamCutAndResumedGetsEveryEventOnce(t *testing.T) {
	b := setup(t)
	b.startWorker(t, "w1")
	id := b.sleepTask(t, 12, 60)

	// Cut the stream after every third event and resume after the last
	// one received, until the task's end.
	var got []streamEvent
	last, cuts, ended := int64(-1), 0, false
	for !ended {
		s, status := b.openStream(t, "/v1/tasks/"+id.String()+"/stream", last)
		if status == http.StatusNoContent {
			// Cut right after the terminal event, before the end: the
			// resume says there is nothing more.
			require.Equal(t, "COMPLETED", got[len(got)-1].Status)
			break
		}
		require.Equal(t, http.StatusOK, status)
		for n := 0; n < 3; n++ {
			f, ok, err := s.next()
			require.NoError(t, err)
			require.True(t, ok, "the stream ends only after its end event")
			if f.Event == "end" {
				require.JSONEq(t, fmt.Sprintf(`{"task_id":%q,"status":"COMPLETED"}`, id), f.Data)
				ended = true
				break
			}
			e := decodeEvent(t, f)
			got = append(got, e)
			last = e.ID
		}
		s.close()
		cuts++
	}
	require.Greater(t, cuts, 3, "the stream was cut mid-task")

	ids := make([]int64, len(got))
	for i, e := range got {
		ids[i] = e.ID
	}
	require.Equal(t, b.eventIDs(t, "task_id = $1", id), ids, "every stored event, once, in order")
	final := got[len(got)-1]
	require.Equal(t, "COMPLETED", final.Status)
	require.Equal(t, 100, final.Progress)
	require.Contains(t, string(final.Result), "slept_ms", "the end carries the result")
	progress := -1
	for _, e := range got {
		if e.Status == "IN_PROGRESS" {
			require.GreaterOrEqual(t, e.Progress, progress, "progress never goes back")
			progress = e.Progress
		}
	}
	require.Greater(t, progress, 0, "progress was streamed")

	// Resuming after the end answers 204: nothing more will come.
	_, status := b.openStream(t, "/v1/tasks/"+id.String()+"/stream", last)
	require.Equal(t, http.StatusNoContent, status)
}

func TestOrgStreamCutAndResumedGetsEveryEventOnce(t *testing.T) {
	b := setup(t)
	b.startWorker(t, "w1")
	b.startWorker(t, "w2")

	// Many tasks on two workers: events of different tasks commit in an
	// order of their own, which is where ids arrive out of order.
	const tasks = 24
	var ids []uuid.UUID
	for i := range tasks {
		payload := map[string]any{"steps": 4, "step_ms": 30 + i%5*10}
		if i%6 == 0 {
			payload["fail_times"] = 1 // a retry too
		}
		ids = append(ids, b.submit(t, "demo.sleep", payload, 3))
	}

	var got []int64
	last := int64(0)
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		s, status := b.openStream(t, "/v1/events/stream", last)
		require.Equal(t, http.StatusOK, status)
		for n := 0; n < 25; n++ {
			done := make(chan struct{})
			var f frame
			var ok bool
			var err error
			go func() { defer close(done); f, ok, err = s.next() }()
			select {
			case <-done:
			case <-time.After(2 * time.Second):
				s.close() // idle: resume, and check whether all is there
				<-done
				ok, err = false, nil
			}
			require.NoError(t, err)
			if !ok {
				break
			}
			e := decodeEvent(t, f)
			got = append(got, e.ID)
			last = e.ID
		}
		s.close()
		if b.allTerminal(t, ids) && len(got) > 0 && got[len(got)-1] == b.lastEventID(t) {
			break
		}
	}
	require.Equal(t, b.eventIDs(t, "true"), got, "every stored event, once, in order")
}

func (b *bundle) allTerminal(t *testing.T, ids []uuid.UUID) bool {
	t.Helper()
	var open int
	require.NoError(t, b.pool.QueryRow(context.Background(),
		`SELECT count(*) FROM tasks WHERE id = ANY($1) AND status NOT IN ('COMPLETED', 'FAILED', 'CANCELLED')`, ids).Scan(&open))
	return open == 0
}

func (b *bundle) lastEventID(t *testing.T) int64 {
	t.Helper()
	var id int64
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT coalesce(max(id), 0) FROM task_events`).Scan(&id))
	return id
}

func TestAThousandStreamsOnOneInstanceAllReceiveAChange(t *testing.T) {
	b := setup(t)
	const streams = 1000
	streamsOpen, statuses := make([]*sseStream, streams), make([]int, streams)
	var open sync.WaitGroup
	for i := range streams {
		open.Go(func() {
			// A stream refused while the hub starts (503, "try again") is
			// opened again, as a client does.
			for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
				s, status := b.openStream(t, "/v1/events/stream?type=demo.noop", -1)
				statuses[i] = status
				if status == http.StatusOK {
					streamsOpen[i] = s
				}
				if status != http.StatusServiceUnavailable || time.Now().After(deadline) {
					return
				}
			}
		})
	}
	open.Wait()
	for i, s := range streamsOpen {
		require.NotNil(t, s, "stream %d was refused: %d", i, statuses[i])
		defer s.close()
	}

	id := b.submit(t, "demo.noop", map[string]any{"n": 1}, 1)
	var received sync.WaitGroup
	errs := make(chan error, streams)
	for _, s := range streamsOpen {
		received.Go(func() {
			f, ok, err := s.next()
			switch {
			case err != nil:
				errs <- err
			case !ok:
				errs <- fmt.Errorf("stream ended")
			case !strings.Contains(f.Data, id.String()):
				errs <- fmt.Errorf("unexpected event %s", f.Data)
			}
		})
	}
	waited := make(chan struct{})
	go func() { received.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(30 * time.Second):
		t.Fatal("not every stream received the change within 30s")
	}
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}
