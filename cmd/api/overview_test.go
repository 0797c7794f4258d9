package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// overviewBody is GET /v1/overview as a client reads it.
type overviewBody struct {
	AsOf     time.Time      `json:"as_of"`
	Counts   map[string]int `json:"counts"`
	LastHour struct {
		Minutes []struct {
			Minute            time.Time
			Completed, Failed int
		} `json:"minutes"`
		Completed, Failed   int
		ThroughputPerMinute float64 `json:"throughput_per_minute"`
	} `json:"last_hour"`
	Types []struct {
		Type                        string
		Pending, Scheduled, Running int
		OldestPendingAgeSeconds     float64 `json:"oldest_pending_age_seconds"`
	} `json:"types"`
	Outbox struct {
		Depth            int
		OldestAgeSeconds float64 `json:"oldest_age_seconds"`
		Parked           int
	} `json:"outbox"`
	Workers []struct {
		ID, Hostname, Version string
		Types                 []string
		Concurrency           int
		LastHeartbeatAt       time.Time `json:"last_heartbeat_at"`
		Running               []struct{ ID, Type string }
	} `json:"workers"`
	Leader *string `json:"leader"`
}

func (b *testBundle) overview(t *testing.T, token string) overviewBody {
	t.Helper()
	resp := b.do(t, http.MethodGet, "/v1/overview", "", "", "Authorization", "Bearer "+token)
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	var o overviewBody
	require.NoError(t, json.Unmarshal(resp.body, &o))
	return o
}

// exec runs SQL as the tables' owner: for states only workers and the
// relay reach.
func (b *testBundle) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	_, err := b.db.Pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err, sql)
}

// submitTask submits a task as the bundle's admin and returns its id.
func (b *testBundle) submitTask(t *testing.T, body string) string {
	t.Helper()
	resp := b.post(t, "/v1/tasks", body)
	require.Equal(t, http.StatusCreated, resp.status, string(resp.body))
	return resp.json(t)["id"].(string)
}

// The overview counts an org's tasks by status, the last hour's ends per
// minute, the queues per type and the outbox, all within what the caller
// may see; it lists the live workers (every org sees them) with the
// caller's own tasks each runs, and the maintenance leader.
func TestOverviewSumsUpTheOrgAsTheCallerSeesIt(t *testing.T) {
	t.Parallel()
	b := setup(t)
	seer, _ := b.db.Key(t, "test", auth.Reader, "seers")
	outsider, _ := b.db.Key(t, "test", auth.Reader)
	otherOrg, _ := b.db.Key(t, "other", auth.Admin)

	// Empty: every status is there, with 0, and 60 empty minutes.
	before := time.Now()
	empty := b.overview(t, outsider)
	require.WithinRange(t, empty.AsOf, before.Add(-time.Second), time.Now().Add(time.Second), "when it was read")
	require.Equal(t, map[string]int{"PENDING": 0, "IN_PROGRESS": 0, "COMPLETED": 0, "FAILED": 0, "CANCELLED": 0}, empty.Counts)
	require.Len(t, empty.LastHour.Minutes, 60)
	require.Empty(t, empty.Types)
	require.Empty(t, empty.Workers)
	require.Nil(t, empty.Leader)

	n := 0
	task := func(typ string, restricted bool) string {
		n++
		vis := "[]"
		if restricted {
			vis = `["seers"]`
		}
		return b.submitTask(t, fmt.Sprintf(`{"type":%q,"payload":{"n":%d},"visibility":%s}`, typ, n, vis))
	}
	running := func(id, worker string) {
		b.exec(t, `UPDATE tasks SET status = 'IN_PROGRESS', worker_id = $2, attempt = 1, started_at = now(),
			lease_expires_at = now() + interval '30 seconds', version = version + 1 WHERE id = $1`, id, worker)
	}
	ended := func(id, status string, ago time.Duration) {
		b.exec(t, `UPDATE tasks SET status = $2, completed_at = now() - $3 * interval '1 millisecond',
			version = version + 1 WHERE id = $1`, id, status, ago.Milliseconds())
	}

	due := task("ov.a", false)
	b.exec(t, `UPDATE tasks SET next_run_at = now() - interval '5 minutes' WHERE id = $1`, due)
	b.exec(t, `UPDATE outbox SET available_at = 'infinity' WHERE task_id = $1`, due) // parked
	later := task("ov.a", false)
	b.exec(t, `UPDATE tasks SET next_run_at = now() + interval '1 hour' WHERE id = $1`, later)
	runOpen, runHidden := task("ov.b", false), task("ov.b", true)
	running(runOpen, "w-live")
	running(runHidden, "w-live")
	cancelled := task("ov.a", false)
	require.Equal(t, http.StatusOK, b.post(t, "/v1/tasks/"+cancelled+"/cancel", "").status)
	doneNow, doneEarlier, failed, doneLongAgo, doneHidden := task("ov.c", false), task("ov.c", false),
		task("ov.c", false), task("ov.c", false), task("ov.c", true)
	ended(doneNow, "COMPLETED", 0)
	ended(doneEarlier, "COMPLETED", 10*time.Minute)
	ended(failed, "FAILED", 2*time.Minute)
	ended(doneLongAgo, "COMPLETED", 2*time.Hour)
	ended(doneHidden, "COMPLETED", 0)
	b.exec(t, `UPDATE outbox SET available_at = now() - interval '90 seconds' WHERE task_id = $1`, doneNow)

	// Another org's task ended now too: no one here counts it.
	other := b.do(t, http.MethodPost, "/v1/tasks", "application/json", `{"type":"ov.c"}`, "Authorization", "Bearer "+otherOrg)
	require.Equal(t, http.StatusCreated, other.status, string(other.body))
	ended(other.json(t)["id"].(string), "COMPLETED", 0)

	// One live worker, which leads maintenance, and one long silent.
	b.exec(t, `INSERT INTO workers (id, hostname, pid, concurrency, types, version, last_heartbeat_at) VALUES
		('w-live', 'host-1', 1, 8, '{ov.a,ov.b}', 'v1.2.3', now()),
		('w-dead', 'host-2', 2, 4, '{ov.a}', 'v1.2.3', now() - interval '10 minutes')`)
	b.exec(t, `INSERT INTO leaders (name, leader_id, expires_at) VALUES ('maintenance', 'w-live', now() + interval '1 minute')`)

	// Where the ended tasks fall, by the database's clock.
	minuteOf := map[string]time.Time{}
	for _, id := range []string{doneNow, doneEarlier, failed, doneHidden} {
		var m time.Time
		require.NoError(t, b.db.Pool.QueryRow(context.Background(),
			`SELECT date_trunc('minute', completed_at) FROM tasks WHERE id = $1`, id).Scan(&m))
		minuteOf[id] = m.UTC()
	}

	for _, c := range []struct {
		who, token                       string
		counts                           map[string]int
		completed, failed, depth, parked int
		running                          []string
		ended                            []string
	}{
		{"admin", b.token, map[string]int{"PENDING": 2, "IN_PROGRESS": 2, "COMPLETED": 4, "FAILED": 1, "CANCELLED": 1},
			3, 1, 9, 1, []string{runOpen, runHidden}, []string{doneNow, doneEarlier, failed, doneHidden}},
		{"member of seers", seer, map[string]int{"PENDING": 2, "IN_PROGRESS": 2, "COMPLETED": 4, "FAILED": 1, "CANCELLED": 1},
			3, 1, 9, 1, []string{runOpen, runHidden}, []string{doneNow, doneEarlier, failed, doneHidden}},
		{"reader outside seers", outsider, map[string]int{"PENDING": 2, "IN_PROGRESS": 1, "COMPLETED": 3, "FAILED": 1, "CANCELLED": 1},
			2, 1, 7, 1, []string{runOpen}, []string{doneNow, doneEarlier, failed}},
	} {
		t.Run(c.who, func(t *testing.T) {
			o := b.overview(t, c.token)
			require.Equal(t, c.counts, o.Counts)

			require.Len(t, o.LastHour.Minutes, 60)
			perMinute := map[time.Time][2]int{}
			for i, m := range o.LastHour.Minutes {
				require.Equal(t, time.UTC, m.Minute.Location(), "minutes are written in UTC")
				require.Zero(t, m.Minute.Second())
				if i > 0 {
					require.Equal(t, time.Minute, m.Minute.Sub(o.LastHour.Minutes[i-1].Minute), "consecutive minutes, oldest first")
				}
				perMinute[m.Minute] = [2]int{m.Completed, m.Failed}
			}
			want := map[time.Time][2]int{}
			for _, id := range c.ended {
				w := want[minuteOf[id]]
				if id == failed {
					w[1]++
				} else {
					w[0]++
				}
				want[minuteOf[id]] = w
			}
			for minute, w := range want {
				require.Equal(t, w, perMinute[minute], "minute %s", minute)
			}
			require.Equal(t, c.completed, o.LastHour.Completed)
			require.Equal(t, c.failed, o.LastHour.Failed)
			require.InDelta(t, float64(c.completed)/60, o.LastHour.ThroughputPerMinute, 1e-9)

			require.Len(t, o.Types, 2, "only types with tasks waiting or running")
			require.Equal(t, "ov.a", o.Types[0].Type)
			require.Equal(t, 1, o.Types[0].Pending)
			require.Equal(t, 1, o.Types[0].Scheduled)
			require.Zero(t, o.Types[0].Running)
			require.InDelta(t, 300, o.Types[0].OldestPendingAgeSeconds, 60, "due for five minutes")
			require.Equal(t, "ov.b", o.Types[1].Type)
			require.Equal(t, len(c.running), o.Types[1].Running)
			require.Zero(t, o.Types[1].Pending)

			require.Equal(t, c.depth, o.Outbox.Depth)
			require.Equal(t, c.parked, o.Outbox.Parked)
			require.InDelta(t, 90, o.Outbox.OldestAgeSeconds, 60, "due for 90 seconds")

			require.Len(t, o.Workers, 1, "the silent worker is not listed")
			w := o.Workers[0]
			require.Equal(t, "w-live", w.ID)
			require.Equal(t, "host-1", w.Hostname)
			require.Equal(t, "v1.2.3", w.Version)
			require.Equal(t, []string{"ov.a", "ov.b"}, w.Types)
			require.Equal(t, 8, w.Concurrency)
			require.WithinDuration(t, time.Now(), w.LastHeartbeatAt, time.Minute)
			var ids []string
			for _, r := range w.Running {
				ids = append(ids, r.ID)
				require.Equal(t, "ov.b", r.Type)
			}
			require.Equal(t, c.running, ids)
			require.NotNil(t, o.Leader)
			require.Equal(t, "w-live", *o.Leader)
		})
	}

	// Another org sees the same workers, none of this org's tasks.
	o := b.overview(t, otherOrg)
	require.Equal(t, map[string]int{"PENDING": 0, "IN_PROGRESS": 0, "COMPLETED": 1, "FAILED": 0, "CANCELLED": 0}, o.Counts)
	require.Equal(t, 1, o.LastHour.Completed)
	require.Empty(t, o.Types)
	require.Equal(t, 1, o.Outbox.Depth, "its own task's message")
	require.Len(t, o.Workers, 1)
	require.Empty(t, o.Workers[0].Running)
}

// The overview takes no parameters: a misspelt one is an error, not
// silently ignored.
// A parent waiting for its children waits for no worker: its type's queue
// neither counts it as due nor ages with it.
func TestOverviewLeavesOutAParentWaitingForItsChildren(t *testing.T) {
	t.Parallel()
	b := setup(t)
	parent := b.submitTask(t, `{"type":"ov.parent"}`)
	b.exec(t, `DELETE FROM outbox WHERE task_id = $1`, parent)
	b.exec(t, `UPDATE tasks SET state = $2, attempt = 1, next_run_at = now() - interval '1 hour',
		version = version + 1 WHERE id = $1`, parent, task.StateAwaiting)
	o := b.overview(t, b.token)
	require.Equal(t, 1, o.Counts["PENDING"])
	require.Empty(t, o.Types, "no type has a task waiting for a worker")
}

func TestOverviewRefusesParameters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	resp := b.get(t, "/v1/overview?type=demo.sleep")
	require.Equal(t, http.StatusBadRequest, resp.status, string(resp.body))
}
