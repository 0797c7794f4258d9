package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/stream"
	"github.com/conveyorhq/conveyor/internal/task"
)

// Live streams: Server-Sent Events of task events, as they are committed.
//
// A stream first sends what the client missed (from the database, in its
// scope), then what the hub delivers. Every frame's id is the event's id;
// a client that reconnects with Last-Event-ID (or ?last_event_id=) gets
// every later event exactly once: the catch-up reads up to the hub's
// cursor, the hub delivers only after it, and nothing at or before the
// last id sent is sent again.

const (
	// streamPage is how many events one catch-up read returns.
	streamPage = 500
	// catchUpSpan bounds the ids one catch-up read of an org's stream
	// scans: with a filter that takes in few events, a read bounded only
	// by its page would scan every event since a far-back Last-Event-ID in
	// one statement, past the statement timeout on a long history, and the
	// client would retry it for ever.
	catchUpSpan = 20000
	// streamRetry is the reconnection delay the stream suggests.
	streamRetry = 2 * time.Second
	// streamReady bounds how long a new stream waits for a starting hub.
	streamReady = 5 * time.Second
	// orgStreamsRetry is the wait suggested to an org at its cap of
	// streams: one of its own must close first, seldom within a second.
	orgStreamsRetry = 5 * time.Second
)

// orgStreams counts each org's live streams; an org leaves the map with
// its last stream, so it holds no more entries than there are streams.
type orgStreams struct {
	mu sync.Mutex
	n  map[uuid.UUID]int
}

// acquire takes one of org's limit streams (0: no bound), or says there is
// none left.
func (o *orgStreams) acquire(org uuid.UUID, limit int) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if limit > 0 && o.n[org] >= limit {
		return false
	}
	if o.n == nil {
		o.n = map[uuid.UUID]int{}
	}
	o.n[org]++
	return true
}

func (o *orgStreams) release(org uuid.UUID) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.n[org] <= 1 {
		delete(o.n, org)
		return
	}
	o.n[org]--
}

// handleTaskStream streams one task's events, from its first (or after
// Last-Event-ID), and ends after its terminal event.
func (s *server) handleTaskStream() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id, err := taskID(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		after, _, err := lastEventID(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		p := principal(r)
		t, err := s.Store.Get(r.Context(), p, id)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.serveStream(w, r, p, task.EventFilter{TaskID: id}, after, t.Status.Terminal())
	}
}

// handleEventStream streams the org's events that pass the filters, from
// now (or after Last-Event-ID), until the client leaves.
func (s *server) handleEventStream() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		status, typ, err := statusAndType(q.Get("status"), q.Get("type"), "")
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		f := task.EventFilter{Type: typ, Status: status}
		after, resume, err := lastEventID(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		if !resume {
			after = -1 // from the hub's cursor
		}
		s.serveStream(w, r, principal(r), f, after, false)
	}
}

// lastEventID is where a stream resumes: the Last-Event-ID header, or the
// last_event_id parameter for clients that cannot set headers. ok is false
// when neither is given. Both at once are an EventSource reconnecting by
// itself to a URL that carries the parameter: its header names the newest
// event it was sent, the same id or one after it, and the stream resumes
// from there (the parameter would send events again). A header behind the
// parameter is no such reconnect and is refused: the parameter winning
// could skip events, the header send them again.
func lastEventID(r *http.Request) (after int64, ok bool, err error) {
	header, err := oneHeader(r, "Last-Event-ID")
	if err != nil {
		return 0, false, err
	}
	query := r.URL.Query().Get("last_event_id")
	for _, raw := range []string{header, query} {
		if raw == "" {
			continue
		}
		id, err := strconv.ParseInt(raw, 10, 64)
		if err != nil || id < 0 {
			return 0, false, task.Invalid("last_event_id", "must be an event id (an integer, 0 or more), got %q", raw)
		}
		if ok {
			// after is the header's id, id the parameter's.
			if after < id {
				return 0, false, task.Errorf(task.ErrCodeMalformed,
					"the Last-Event-ID header (%s) is behind the last_event_id parameter (%s); give one, or the same id in both", header, query)
			}
			break
		}
		after, ok = id, true
	}
	return after, ok, nil
}

// serveStream sends the events of f in p's scope after the id after (-1:
// from the hub's cursor). wasTerminal: the stream is one task's, and the
// task was terminal when the request came in.
func (s *server) serveStream(w http.ResponseWriter, r *http.Request, p auth.Principal, f task.EventFilter, after int64, wasTerminal bool) {
	if s.Hub == nil {
		s.writeError(w, r, task.Errorf(task.ErrCodeUnavailable, "live streams are not served by this instance"))
		return
	}
	if r.Method == http.MethodHead {
		// A HEAD is answered with the headers of the stream, and no
		// stream: one would send nothing, yet hold its slot and its
		// connection (the next request on it would wait) until the
		// client closed it.
		streamHeaders(w.Header())
		w.WriteHeader(http.StatusOK)
		return
	}
	if !s.orgStreams.acquire(p.OrgID, s.cfg.MaxOrgStreams) {
		w.Header().Set("Retry-After", strconv.Itoa(int(orgStreamsRetry.Seconds())))
		s.writeProblem(w, r, http.StatusTooManyRequests, "too_many_streams",
			fmt.Sprintf("this org holds its most live streams on this instance (%d); close one, or retry after the Retry-After header's seconds", s.cfg.MaxOrgStreams))
		return
	}
	defer s.orgStreams.release(p.OrgID)
	if s.cfg.MaxStreams > 0 && s.streams.Add(1) > int64(s.cfg.MaxStreams) {
		s.streams.Add(-1)
		w.Header().Set("Retry-After", "1")
		s.writeError(w, r, task.Errorf(task.ErrCodeUnavailable, "this instance serves its most live streams (%d); try again", s.cfg.MaxStreams))
		return
	}
	defer s.streams.Add(-1)
	ctx := r.Context()
	readyCtx, cancel := context.WithTimeout(ctx, streamReady)
	sub, cursor, err := s.Hub.Subscribe(readyCtx, p.Scope(), f)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			// Either way another try (here once started, or at another
			// instance once this one is gone) is worth it soon.
			msg := "live streams are starting; try again"
			if errors.Is(err, stream.ErrClosed) {
				msg = "this instance is shutting down; reconnect"
			}
			w.Header().Set("Retry-After", strconv.Itoa(int(streamRetry.Seconds())))
			s.writeError(w, r, task.Errorf(task.ErrCodeUnavailable, "%s", msg))
		}
		return
	}
	defer sub.Close()
	// Read before the catch-up, which reads whatever ended before it.
	late := s.Hub.LateEnded()
	if after < 0 {
		after = cursor
	}
	if after > cursor {
		if err := s.checkResume(ctx, p, after); err != nil {
			s.writeError(w, r, err)
			return
		}
	}
	out := &sse{s: s, w: w, rc: http.NewResponseController(w), p: p, last: after, taskStream: f.TaskID != uuid.Nil,
		taskID: f.TaskID}

	// The catch-up. One task's events commit in id order (each is written
	// under its task's row lock), so its catch-up reads them all; an org's
	// stops at the hub's cursor, past which ids may still fill in.
	upto := cursor
	if out.taskStream {
		upto = math.MaxInt64
	}
	// read returns the events after from, and the id up to which it has
	// read them all.
	read := func(from int64) ([]task.Event, int64, error) {
		to := upto
		if !out.taskStream && to-from > catchUpSpan {
			to = from + catchUpSpan
		}
		page, err := s.Store.EventsBetween(ctx, p, f, from, to, streamPage)
		if len(page) == streamPage {
			to = page[len(page)-1].ID
		}
		return page, to, err
	}
	page, reached, err := read(after)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if out.taskStream && len(page) == 0 && after > 0 && wasTerminal {
		// Resumed after the end: nothing will come. 204 stops an
		// EventSource from reconnecting.
		w.WriteHeader(http.StatusNoContent)
		return
	}
	if err := out.open(); err != nil {
		return
	}
	if !out.taskStream {
		// The org's stream says where it starts, so that a client cut off
		// before the first event resumes from here rather than from a
		// later "now".
		ready := fmt.Appendf(nil, "id: %d\nevent: ready\ndata: {\"last_event_id\":%d}\n\n", after, after)
		if out.write(ready) != nil {
			return
		}
	}
	for {
		// A long catch-up outlasts the deadline the stream opened with:
		// each page gets its own, as a live stream's heartbeat does, so a
		// client that keeps taking it is not cut off (and one that stops
		// taking it still is).
		out.extendDeadline()
		for i := range page {
			if err := out.event(ctx, &page[i], nil); err != nil {
				return
			}
		}
		if reached >= upto {
			break
		}
		if page, reached, err = read(reached); err != nil {
			s.Log.WarnContext(ctx, "stream catch-up", "error", err)
			return
		}
	}
	if out.ended() {
		_ = out.end()
		return
	}
	// The credentials the request was let in with: its Authorization
	// header, or the dashboard's session cookie (an EventSource sends no
	// header).
	cred, _ := credentials(r)
	out.live(ctx, cred, sub, late)
}

// resumeWait bounds how long a resume after an id ahead of the hub's
// cursor waits for the cursor to reach it: the id may be the start another
// instance's stream announced, its hub a poll or so ahead of this one. A
// gap in the ids holding this hub's cursor extends the wait by the
// longest a gap may hold it: the other hub may have passed the gap first
// (its wait for it began earlier, or the transaction had ended by then).
const resumeWait = 2 * time.Second

// checkResume refuses an id ahead of the hub's cursor that no stream sent
// p's org. Another instance's hub may be ahead of this one, so such an id
// can be one of the org's events (deleted by retention since, perhaps), or
// the start of another instance's stream, a cursor this one reaches soon.
// Taken as given, an id past all of those would skip everything up to it,
// and a task's stream would skip its terminal event and never end. Ids
// come from one sequence shared by every org: the check reads the org's
// own events and this hub's cursor (which every org stream's start
// announces), never the newest id of all, so the answer tells nothing of
// other orgs' activity.
func (s *server) checkResume(ctx context.Context, p auth.Principal, after int64) error {
	reached, err := s.Store.OrgReached(ctx, p, after)
	if err != nil || reached {
		return err
	}
	start := time.Now()
	deadline := start.Add(resumeWait)
	for {
		if !time.Now().Before(deadline) {
			held, longest := s.Hub.GapHeld()
			if !held || !time.Now().Before(start.Add(longest+resumeWait)) {
				break
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		cursor, err := s.Hub.Cursor(ctx)
		if err != nil {
			return err
		}
		if cursor >= after {
			return nil
		}
	}
	return task.Invalid("last_event_id",
		"%d is past every event id this org's streams were sent; resume after the id of the last event a stream sent", after)
}

// sse writes one stream's frames.
type sse struct {
	s          *server
	w          http.ResponseWriter
	rc         *http.ResponseController
	p          auth.Principal
	taskStream bool
	// The last event sent.
	last   int64
	status task.Status
	taskID uuid.UUID
}

// streamHeaders are the headers of a live stream's answer.
func streamHeaders(h http.Header) {
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no") // nginx: do not buffer the stream
}

func (o *sse) open() error {
	streamHeaders(o.w.Header())
	o.extendDeadline()
	o.w.WriteHeader(http.StatusOK)
	return o.write(fmt.Appendf(nil, "retry: %d\n\n", streamRetry.Milliseconds()))
}

// extendDeadline lets the stream write until the next heartbeat and the
// write timeout after it: a client that takes nothing for that long is
// dropped. It is called at each heartbeat and before each page of a
// catch-up. (A deadline per write would cost a timer update per frame.)
func (o *sse) extendDeadline() {
	if o.s.cfg.WriteTimeout > 0 {
		_ = o.rc.SetWriteDeadline(time.Now().Add(o.heartbeat() + o.s.cfg.WriteTimeout))
	}
}

func (o *sse) heartbeat() time.Duration {
	if o.s.cfg.StreamHeartbeat > 0 {
		return o.s.cfg.StreamHeartbeat
	}
	return 15 * time.Second
}

// write sends b at once.
func (o *sse) write(b []byte) error {
	if _, err := o.w.Write(b); err != nil {
		return err
	}
	return o.rc.Flush()
}

// event sends e as its frame, which the hub made unless frame is nil. An
// event at or before the last one sent is not sent again.
func (o *sse) event(ctx context.Context, e *task.Event, frame []byte) error {
	if e.ID <= o.last {
		return nil
	}
	if o.taskStream && e.Status == task.StatusCompleted {
		// One task's stream ends with the result.
		t, err := o.s.Store.Get(ctx, o.p, e.TaskID)
		if err != nil {
			return err
		}
		e.Result, frame = t.Result, nil
	}
	if frame == nil {
		var err error
		if frame, err = EventFrame(e); err != nil {
			return err
		}
	}
	if err := o.write(frame); err != nil {
		return err
	}
	o.last, o.status, o.taskID = e.ID, e.Status, e.TaskID
	return nil
}

// catchUp sends a task's events after the last one sent, from the database.
func (o *sse) catchUp(ctx context.Context) error {
	f := task.EventFilter{TaskID: o.taskID}
	for {
		page, err := o.s.Store.EventsBetween(ctx, o.p, f, o.last, math.MaxInt64, streamPage)
		if err != nil {
			return err
		}
		o.extendDeadline() // a page at a time, as the first catch-up
		for i := range page {
			if err := o.event(ctx, &page[i], nil); err != nil {
				return err
			}
		}
		if len(page) < streamPage {
			return nil
		}
	}
}

// ended reports whether a task's stream has sent the task's end.
func (o *sse) ended() bool { return o.taskStream && o.status.Terminal() }

// end sends the end event of a task's stream.
func (o *sse) end() error {
	data, _ := json.Marshal(map[string]string{"task_id": o.taskID.String(), "status": string(o.status)})
	return o.write(fmt.Appendf(nil, "event: end\ndata: %s\n\n", data))
}

// live sends what the hub delivers, and a heartbeat comment when idle; at
// each heartbeat the caller's credentials are checked again, so a revoked
// key's streams end too, and so do those whose scope changed (a new role,
// a team left): the hub filters by the scope the stream opened with, and
// the client's reconnect opens one with the new scope.
//
// A task's stream also reads its task's events again when transactions
// that the hub passed after its gap timeout have ended since (late): the
// hub never delivers what they committed, which may be the task's end, and
// the stream would then wait for it for ever. A task's events commit in id
// order, so the read after the last one sent misses none.
func (o *sse) live(ctx context.Context, authorization string, sub *stream.Subscription, late uint64) {
	ticker := time.NewTicker(o.heartbeat())
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
			// Not traced: a stream open for hours would add a database
			// span to its request's trace at every heartbeat. Bounded like
			// a request: a database that does not answer must not freeze
			// the stream until its client gives up on it.
			actx, cancel := trace.ContextWithSpanContext(ctx, trace.SpanContext{}), context.CancelFunc(func() {})
			if o.s.cfg.RequestTimeout > 0 {
				actx, cancel = context.WithTimeout(actx, o.s.cfg.RequestTimeout)
			}
			p, err := o.s.Auth.Authenticate(actx, authorization)
			cancel()
			if err != nil && auth.ReasonOf(err) != auth.ReasonLookup {
				_ = o.write([]byte(": credentials no longer valid\n\n"))
				return
			}
			if err == nil && !p.Scope().Equal(o.p.Scope()) {
				_ = o.write([]byte(": the credentials' scope changed; reconnect\n\n"))
				return
			}
			o.extendDeadline()
			if o.write([]byte(": heartbeat\n\n")) != nil {
				return
			}
			if n := o.s.Hub.LateEnded(); o.taskStream && n != late {
				late = n
				if o.catchUp(ctx) != nil {
					return
				}
				if o.ended() {
					_ = o.end()
					return
				}
			}
		case item, ok := <-sub.Events():
			if !ok {
				if errors.Is(sub.Err(), stream.ErrLagged) {
					_ = o.write([]byte(": too far behind; reconnect with Last-Event-ID\n\n"))
				}
				return
			}
			frame, err := item.Encoded()
			if err != nil {
				o.s.Log.ErrorContext(ctx, "stream: encoding an event", "error", err)
				return
			}
			e := item.Event // a copy: the item is shared
			if err := o.event(ctx, &e, frame); err != nil {
				return
			}
			if o.ended() {
				_ = o.end()
				return
			}
		}
	}
}

// EventFrame is the Server-Sent Event a stream sends for e: the hub's
// encoder, so that every stream sends the same bytes, made once.
func EventFrame(e *task.Event) ([]byte, error) {
	data, err := json.Marshal(toEventView(*e))
	if err != nil {
		return nil, err
	}
	frame := make([]byte, 0, len(data)+48)
	frame = fmt.Appendf(frame, "id: %d\nevent: task\ndata: ", e.ID)
	return append(append(frame, data...), "\n\n"...), nil
}
