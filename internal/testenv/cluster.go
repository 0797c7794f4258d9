package testenv

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// StartRabbitCluster starts n private RabbitMQ nodes, each like StartRabbit's
// (own name, ports and data), clustered with node 1, and returns once every
// node runs in the cluster. The nodes are killed and removed when t ends.
//
// Nodes 2..n join node 1 as they boot (classic-config peer discovery), side
// by side once node 1 runs, rather than booting alone and then being
// joined with rabbitmqctl stop_app, join_cluster and start_app: on two
// cores that saves a boot of the rabbit application and six rabbitmqctl
// VMs, about 15 of 40 seconds. A node restarted after Kill rejoins its
// cluster from its own data.
func StartRabbitCluster(t testing.TB, n int) []*RabbitNode {
	t.Helper()
	if n < 1 {
		t.Fatalf("testenv: a cluster of %d nodes", n)
	}
	nodes := make([]*RabbitNode, n)
	for i := range nodes {
		nodes[i] = newRabbitNode(t)
		// A test may have killed the node; killing them all is also
		// faster than stopping each with rabbitmqctl.
		nodes[i].killAtCleanup = true
		// Several nodes share the test machine's cores: schedulers that
		// spin while idle would take them from each other.
		nodes[i].env = append(nodes[i].env, "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=+sbwt none +sbwtdcpu none +sbwtdio none")
	}
	for _, node := range nodes[1:] {
		appendFile(t, filepath.Join(node.dir, "rabbitmq.conf"), fmt.Sprintf(
			"cluster_formation.peer_discovery_backend = classic_config\n"+
				"cluster_formation.classic_config.nodes.1 = %s\n"+
				// A node that finds no peer boots alone: wait for node 1.
				"cluster_formation.discovery_retry_limit = 120\n"+
				"cluster_formation.discovery_retry_interval = 500\n", nodes[0].Name))
	}
	// The others boot once node 1 has: a node still setting up its schema
	// turns joiners away (schema_integrity_check_failed).
	nodes[0].Start(t)
	for _, node := range nodes[1:] {
		node.launch(t)
	}
	for _, node := range nodes[1:] {
		node.awaitStartup(t)
	}
	want := make([]string, n)
	for i, node := range nodes {
		want[i] = node.Name
	}
	slices.Sort(want)
	Eventually(t, 60*time.Second, func() error {
		running, err := nodes[0].RunningNodes()
		if err != nil {
			return err
		}
		slices.Sort(running)
		if !slices.Equal(running, want) {
			return fmt.Errorf("running nodes %v, want %v", running, want)
		}
		return nil
	})
	return nodes
}

// RunningNodes lists the nodes that run in the node's cluster, as
// rabbitmqctl cluster_status reports them.
func (n *RabbitNode) RunningNodes() ([]string, error) {
	cmd := exec.Command("rabbitmqctl", "-q", "-n", n.Name, "cluster_status", "--formatter", "json")
	cmd.Env = append(os.Environ(), n.env...)
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("cluster_status: %w", err)
	}
	var status struct {
		RunningNodes []string `json:"running_nodes"`
	}
	if err := json.Unmarshal(out, &status); err != nil {
		return nil, fmt.Errorf("cluster_status: %w: %s", err, out)
	}
	return status.RunningNodes, nil
}

// Kill ends the node's Erlang VM with SIGKILL, as a crash or the OOM killer
// would: no clean shutdown, its clients' connections drop, and the other
// nodes of its cluster see it vanish. Start brings it back.
func (n *RabbitNode) Kill(t testing.TB) {
	t.Helper()
	if err := n.kill(); err != nil {
		t.Fatalf("testenv: kill rabbitmq node %s: %v", n.Name, err)
	}
}

// kill kills the VM whose pid the node wrote and waits until it is gone.
func (n *RabbitNode) kill() error {
	b, err := os.ReadFile(n.pidFile())
	if err != nil {
		return fmt.Errorf("read pid file: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return fmt.Errorf("pid file: %w", err)
	}
	// The next start writes a new one; a stale file must not name a
	// process that may since be another's.
	_ = os.Remove(n.pidFile())
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		if errors.Is(err, syscall.ESRCH) {
			return nil
		}
		return err
	}
	deadline := time.Now().Add(10 * time.Second)
	for alive(pid) {
		if time.Now().After(deadline) {
			return fmt.Errorf("process %d still alive after SIGKILL", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

// alive says whether process pid exists and is not a zombie: a detached VM
// belongs to init, which may be slow to reap it, or never reap it in a
// container.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the command name, which is in parentheses (and
	// may hold some itself).
	i := strings.LastIndex(string(b), ") ")
	if i < 0 {
		return false
	}
	state := string(b)[i+2:]
	return !strings.HasPrefix(state, "Z") && !strings.HasPrefix(state, "X")
}

// Ping says whether the node answers rabbitmqctl.
func (n *RabbitNode) Ping() error { return n.ctl("ping") }

func appendFile(t testing.TB, path, content string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	writeFile(t, path, string(b)+content)
}
