package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// Quorum queues on a three-node cluster: the node that leads the task
// queue (node 1, which also holds the relay's connection and a worker's) is
// SIGKILLed while tasks stream in. Two nodes of three are a majority, so the queue goes on
// under a new leader; the clients of the lost node connect to the next node
// of their AMQP_URL. Nothing is lost and nothing finishes twice. The killed
// node stays down: bringing a node back is StartRabbitCluster's own test.
func TestQuorumQueueSurvivesTheLossOfItsLeader(t *testing.T) {
	skipShort(t)
	t.Parallel()
	nodes := testenv.StartRabbitCluster(t, 3)
	// Each process lists the nodes in its own order: the relay and the
	// first worker start on node 1, the second worker on node 2, and
	// after node 1's loss the relay goes on through node 3, the first
	// worker through node 2.
	urls := func(order ...int) string {
		list := make([]string, len(order))
		for i, n := range order {
			list[i] = nodes[n].URL()
		}
		return strings.Join(list, ",")
	}
	db := testdb.New(t)
	b := setupWith(t, db.URL, db.Pool, urls(0, 2, 1))
	quorum := "AMQP_QUEUE_TYPE=quorum"
	admin1, admin2 := testenv.FreeAddr(t), testenv.FreeAddr(t)
	// The first worker declares the queue through node 1, which then
	// leads it (RabbitMQ places a new quorum queue's leader on the
	// declaring client's node).
	w1 := b.startWorker(t, "w1", quorum, "AMQP_URL="+urls(0, 1, 2), "WORKER_ADMIN_ADDR="+admin1)
	testenv.WaitHTTP(t, "http://"+admin1+"/readyz", 30*time.Second)
	w2 := b.startWorker(t, "w2", quorum, "AMQP_URL="+urls(1, 2, 0), "WORKER_ADMIN_ADDR="+admin2)
	testenv.WaitHTTP(t, "http://"+admin2+"/readyz", 30*time.Second)

	queue := rabbitmq.QueueName("demo.sleep")
	require.Equal(t, "quorum", queueInfo(t, nodes[1], queue, "type"), "the queue really is a quorum queue")
	leader, leaderName := -1, queueInfo(t, nodes[1], queue, "leader")
	for i, n := range nodes {
		if n.Name == leaderName {
			leader = i
		}
	}
	require.NotEqual(t, -1, leader, "the queue's leader is a node of the cluster")
	t.Logf("queue led by node %d; connections:\n%s", leader+1, nodes[1].Ctl(t, "list_connections", "--no-table-headers", "name"))

	// A steady stream of short tasks; the leader dies a third of the way.
	const batches, perBatch = 30, 10
	var ids []uuid.UUID
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for i := range batches {
		if i == batches/3 {
			t.Logf("SIGKILL node %d (%s) after %d tasks", leader+1, nodes[leader].Name, len(ids))
			nodes[leader].Kill(t)
		}
		ids = append(ids, b.submitMany(t, "demo.sleep", map[string]any{"steps": 1, "step_ms": 20}, perBatch, nil)...)
		<-tick.C
	}

	ctx := context.Background()
	testenv.Eventually(t, 60*time.Second, func() error {
		var completed int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE id = ANY($1) AND status = 'COMPLETED'`, ids).Scan(&completed))
		if completed < len(ids) {
			return fmt.Errorf("%d of %d tasks completed", completed, len(ids))
		}
		return nil
	})
	// Exactly one terminal event per task: none finished twice (a
	// redelivered message whose task had already completed was dropped).
	var terminal, once, retried int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE n = 1) FROM (
		SELECT count(*) AS n FROM task_events WHERE task_id = ANY($1) AND status IN ('COMPLETED', 'FAILED', 'CANCELLED')
		GROUP BY task_id) e`, ids).Scan(&terminal, &once))
	require.Equal(t, len(ids), terminal, "every task has a terminal event")
	require.Equal(t, len(ids), once, "no task has more than one terminal event")
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE id = ANY($1) AND attempt > 1`, ids).Scan(&retried))

	survivor := nodes[(leader+1)%len(nodes)]
	require.Equal(t, "quorum", queueInfo(t, survivor, queue, "type"))
	newLeader := queueInfo(t, survivor, queue, "leader")
	require.NotEqual(t, nodes[leader].Name, newLeader)
	reconnects := strings.Count(w1.Output(), "consumer stopped; reconnecting") + strings.Count(w2.Output(), "consumer stopped; reconnecting")
	t.Logf("%d tasks completed once each (%d on a second attempt); new leader %s; consumer reconnects %d; connections:\n%s",
		len(ids), retried, newLeader, reconnects, survivor.Ctl(t, "list_connections", "--no-table-headers", "name"))
	require.False(t, w1.Exited(), w1.Output())
	require.False(t, w2.Exited(), w2.Output())
	for _, admin := range []string{admin1, admin2} {
		require.NoError(t, testenv.WantStatus("http://"+admin+"/readyz", http.StatusOK))
	}
}

// A quorum queue's consumer keeps the prefetch it started with, so a worker
// on quorum queues reads no deliveries ahead by default: those it read
// ahead while its handlers run long would go back to the queue and come
// straight back, over and over (3058 times in 12 seconds of this test with
// the classic read-ahead, against 8 on a classic queue).
func TestQuorumWorkerDoesNotRequeueBehindLongTasks(t *testing.T) {
	b := setup(t)
	admin := testenv.FreeAddr(t)
	b.startWorker(t, "w1", "AMQP_QUEUE_TYPE=quorum", "WORKER_ADMIN_ADDR="+admin)
	testenv.WaitHTTP(t, "http://"+admin+"/readyz", 30*time.Second)
	// Twice the worker's 4 slots, each task long (over a second).
	b.submitMany(t, "demo.sleep", map[string]any{"steps": 3, "step_ms": 500}, 8, nil)
	b.waitAllDone(t, "demo.sleep", 60*time.Second)
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

// queueInfo reads one column of rabbitmqctl list_queues for queue.
func queueInfo(t *testing.T, node *testenv.RabbitNode, queue, column string) string {
	t.Helper()
	for line := range strings.SplitSeq(node.Ctl(t, "list_queues", "--no-table-headers", "name", column), "\n") {
		if name, value, ok := strings.Cut(strings.TrimSpace(line), "\t"); ok && name == queue {
			return value
		}
	}
	t.Fatalf("no queue %s on node %s", queue, node.Name)
	return ""
}
