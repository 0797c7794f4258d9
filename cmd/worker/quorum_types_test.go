package main

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testenv"
)

// A worker of several types on quorum queues gives each type's consumer
// the whole credit: the deliveries of another type that arrive while every
// slot runs long wait in the worker, as docs/quorum.md says. Sent back to
// the queue, they came straight back, over and over (2040–3040 times in
// this test).
func TestQuorumWorkerOfSeveralTypesDoesNotRequeueBehindLongTasks(t *testing.T) {
	b := setup(t)
	admin := testenv.FreeAddr(t)
	b.startWorker(t, "w1", "AMQP_QUEUE_TYPE=quorum", "WORKER_ADMIN_ADDR="+admin)
	testenv.WaitHTTP(t, "http://"+admin+"/readyz", 30*time.Second)
	var long []uuid.UUID
	for range 4 {
		long = append(long, b.sleepTask(t, 8, 500))
	}
	for _, id := range long {
		b.waitStatus(t, id, "IN_PROGRESS", 30*time.Second)
	}
	time.Sleep(1500 * time.Millisecond) // every slot runs long now
	var quick []uuid.UUID
	for range 2 {
		quick = append(quick, b.submit(t, "demo.noop", nil, 1))
	}
	for _, id := range append(long, quick...) {
		b.waitStatus(t, id, "COMPLETED", 60*time.Second)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+admin+"/metrics", nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	metrics, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	requeued := 0.0
	for line := range strings.SplitSeq(string(metrics), "\n") {
		if value, ok := strings.CutPrefix(line, `conveyor_worker_deliveries_dropped_total{reason="requeued_behind_long_tasks"} `); ok {
			requeued, err = strconv.ParseFloat(value, 64)
			require.NoError(t, err)
		}
	}
	require.LessOrEqual(t, requeued, 8.0, "deliveries requeued behind long tasks")
}
