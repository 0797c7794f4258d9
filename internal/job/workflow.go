package job

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
)

// What a run does when one of its nodes fails (its task ends FAILED or
// CANCELLED).
const (
	// FailStop fails the run at once: nodes not yet submitted are skipped
	// and tasks in flight are cancelled.
	FailStop = "stop"
	// FailContinue lets the branches that do not depend on the failed node
	// run to the end; the run then fails.
	FailContinue = "continue"
)

// MaxNodes bounds the nodes of one workflow.
const MaxNodes = 200

// Node is one node of a workflow: a job of the same file, the nodes it
// runs after, and the datasets it reads and writes (for memoization and
// lineage).
type Node struct {
	// Name is unique within the workflow; it defaults to the job's name.
	Name           string   `json:"name"`
	Job            string   `json:"job"`
	DependsOn      []string `json:"depends_on,omitempty"`
	InputDatasets  []string `json:"input_datasets,omitempty"`
	OutputDatasets []string `json:"output_datasets,omitempty"`
}

// Workflow is one declared DAG of jobs.
type Workflow struct {
	Name string `json:"name"`
	// OnFailure is FailStop (the default) or FailContinue.
	OnFailure string `json:"on_failure"`
	// Memoize: a node whose memo key (its job's config hash, the run's
	// params, its parents' results, its input datasets' versions) equals
	// that of a node completed in an earlier run of the workflow is not run
	// again; it takes that run's result, while its output datasets are
	// still at the versions that run's task wrote. A forced run ignores it.
	Memoize bool    `json:"memoize"`
	Source  *Source `json:"source,omitempty"`
	Active  bool    `json:"active"`
	Nodes   []Node  `json:"nodes"`
}

// Run statuses.
const (
	RunRunning   = "RUNNING"
	RunCompleted = "COMPLETED"
	RunFailed    = "FAILED"
	RunCancelled = "CANCELLED"
)

// Node states within a run (a SUBMITTED node's status is its task's).
const (
	NodeWaiting   = "WAITING"
	NodeSubmitted = "SUBMITTED"
	NodeMemoized  = "MEMOIZED"
	NodeSkipped   = "SKIPPED"
)

// StoredWorkflow is a workflow as the database keeps it.
type StoredWorkflow struct {
	ID         uuid.UUID
	Definition Workflow
	ConfigHash string
	NextTickAt *time.Time
	CreatedAt  time.Time
	UpdatedAt  time.Time
}

// Dataset names: 1 to 256 letters, digits, '.', '_', '/', ':' or '-',
// starting with a letter or digit, such as "raw.orders" or
// "s3://bucket/orders".
var datasetPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._/:-]{0,255}$`)

// datasetRule is what a dataset name must be, as its problems say.
const datasetRule = "use 1 to 256 letters, digits, '.', '_', '/', ':' or '-', starting with a letter or digit"

// ValidDataset refuses a name no node may declare as a dataset.
func ValidDataset(name string) error {
	if !datasetPattern.MatchString(name) {
		return fmt.Errorf("invalid dataset %q: %s", name, datasetRule)
	}
	return nil
}

// Normalized returns wf with the defaults that an empty value stands for
// filled in: on_failure "stop", each node's name its job's, and the
// source's as for a job. Empty lists become nil, so that a list left out
// and an empty one hash the same; the order of nodes and of every list is
// kept.
func (wf Workflow) Normalized() Workflow {
	if wf.OnFailure == "" {
		wf.OnFailure = FailStop
	}
	wf.Source = wf.Source.normalized()
	if len(wf.Nodes) == 0 {
		wf.Nodes = nil
		return wf
	}
	nodes := make([]Node, len(wf.Nodes))
	for i, n := range wf.Nodes {
		if n.Name == "" {
			n.Name = n.Job
		}
		n.DependsOn = nilIfEmpty(n.DependsOn)
		n.InputDatasets = nilIfEmpty(n.InputDatasets)
		n.OutputDatasets = nilIfEmpty(n.OutputDatasets)
		nodes[i] = n
	}
	wf.Nodes = nodes
	return wf
}

func nilIfEmpty(s []string) []string {
	if len(s) == 0 {
		return nil
	}
	return s
}

// Hash is the hex SHA-256 of the canonical JSON of the normalised
// workflow: two workflows that differ only in key order, white space or
// left-out defaults hash the same. The order of nodes and of their lists
// counts.
func (wf Workflow) Hash() string {
	// Strings, booleans and lists of them: Marshal cannot fail.
	b, _ := json.Marshal(wf.Normalized())
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// Validate reports everything wrong with wf on its own, with paths
// relative to wf ("nodes[2].depends_on[1]") and no line numbers: its name,
// on_failure and source, the number of its nodes, each node's names,
// dependencies and datasets, and every cycle. Empty on_failure stands for
// "stop", and an empty node name for the node's job. That each node's job
// is declared is for File.Validate, or the caller, to check.
func (wf Workflow) Validate() Problems {
	var ps Problems
	add := func(path string, err error) {
		if err != nil {
			ps = append(ps, Problem{Path: path, Message: err.Error()})
		}
	}
	add("name", checkName("name", wf.Name))
	switch wf.OnFailure {
	case "", FailStop, FailContinue:
	default:
		add("on_failure", fmt.Errorf(`invalid on_failure %q: use "stop" or "continue"`, wf.OnFailure))
	}
	if wf.Source != nil {
		ps = append(ps, wf.Source.validate().under("source")...)
	}
	switch n := len(wf.Nodes); {
	case n == 0:
		add("nodes", errors.New(`a workflow needs at least one node: list them under "nodes"`))
	case n > MaxNodes:
		add("nodes", fmt.Errorf("a workflow has at most %d nodes, got %d: split it into several workflows", MaxNodes, n))
		// Its nodes are not checked one by one: the workflow must be
		// rewritten anyway, and the checks (each unknown dependency lists
		// the nodes) would take time quadratic in a count that only the
		// size of the request bounds.
		return ps
	}

	nodes := wf.Normalized().Nodes
	index := nodeIndex(nodes)
	for i, n := range nodes {
		if len(ps) > maxProblems {
			return ps
		}
		prefix := fmt.Sprintf("nodes[%d]", i)
		add(prefix+".job", checkName("job", n.Job))
		// A name defaulted from the job, or the job's own, is checked as
		// the job.
		if n.Name != n.Job {
			add(prefix+".name", checkName("name", n.Name))
		}
		if first := index[n.Name]; first != i && n.Name != "" {
			add(prefix+".name", fmt.Errorf("duplicate node name %q: nodes[%d] already has it (to run one job twice, give each node its own name:)", n.Name, first))
		}
		seen := make(map[string]int, len(n.DependsOn))
		for j, d := range n.DependsOn {
			if len(ps) > maxProblems {
				return ps
			}
			path := fmt.Sprintf("%s.depends_on[%d]", prefix, j)
			_, known := index[d]
			switch first, dup := seen[d]; {
			case d == n.Name && d != "":
				add(path, fmt.Errorf("node %q cannot depend on itself", d))
			case !known:
				add(path, fmt.Errorf("unknown node %q in depends_on: %s", d, nodeList(nodes)))
			case dup:
				add(path, fmt.Errorf("duplicate dependency %q: depends_on[%d] already has it", d, first))
			default:
				seen[d] = j
			}
		}
		ps = append(ps, checkDatasets("input_datasets", n.InputDatasets).under(prefix)...)
		ps = append(ps, checkDatasets("output_datasets", n.OutputDatasets).under(prefix)...)
	}
	ps = append(ps, cycles(nodes, edges(nodes, index))...)
	return ps
}

// nodeIndex maps each node's name to the index of the first node that has
// it. nodes are normalised.
func nodeIndex(nodes []Node) map[string]int {
	index := make(map[string]int, len(nodes))
	for i, n := range nodes {
		if _, ok := index[n.Name]; !ok && n.Name != "" {
			index[n.Name] = i
		}
	}
	return index
}

// nodeList names the nodes of a workflow for a message, at most 20 of them.
func nodeList(nodes []Node) string {
	const most = 20
	var names []string
	seen := map[string]bool{}
	for _, n := range nodes {
		if n.Name != "" && !seen[n.Name] {
			seen[n.Name] = true
			names = append(names, n.Name)
		}
	}
	switch {
	case len(names) == 0:
		return "the workflow has no named nodes"
	case len(names) > most:
		return fmt.Sprintf("the workflow's nodes are %s and %d more", strings.Join(names[:most], ", "), len(names)-most)
	}
	return "the workflow's nodes are " + strings.Join(names, ", ")
}

// checkDatasets checks one list of dataset names, with paths such as
// "input_datasets[1]".
func checkDatasets(field string, datasets []string) Problems {
	var ps Problems
	seen := make(map[string]int, len(datasets))
	for i, d := range datasets {
		path := fmt.Sprintf("%s[%d]", field, i)
		if err := ValidDataset(d); err != nil {
			ps = append(ps, Problem{Path: path, Message: err.Error()})
		} else if first, dup := seen[d]; dup {
			ps = append(ps, Problem{Path: path, Message: fmt.Sprintf("duplicate dataset %q: %s[%d] already has it", d, field, first)})
		} else {
			seen[d] = i
		}
	}
	return ps
}

// edge is a dependency: the node at index to, named by the depends_on
// entry at index entry.
type edge struct{ to, entry int }

// edges returns each node's dependencies on other nodes, in depends_on
// order, each once; entries naming no node, or the node itself, are left
// out. nodes are normalised and index is their nodeIndex.
func edges(nodes []Node, index map[string]int) [][]edge {
	out := make([][]edge, len(nodes))
	for i, n := range nodes {
		seen := make(map[int]bool, len(n.DependsOn))
		for j, d := range n.DependsOn {
			if to, ok := index[d]; ok && to != i && !seen[to] {
				seen[to] = true
				out[i] = append(out[i], edge{to: to, entry: j})
			}
		}
	}
	return out
}

// cycles reports each cycle once, at the depends_on entry that closes it
// in a depth-first walk of the nodes in order, naming its nodes in the
// order they would run.
func cycles(nodes []Node, deps [][]edge) Problems {
	const (
		unseen = iota
		open   // on the walk's stack
		done
	)
	state := make([]int8, len(nodes))
	type frame struct{ node, next int }
	var ps Problems
	var stack []frame
	for root := range nodes {
		if state[root] != unseen {
			continue
		}
		state[root] = open
		stack = append(stack[:0], frame{node: root})
		for len(stack) > 0 {
			top := &stack[len(stack)-1]
			if top.next == len(deps[top.node]) {
				state[top.node] = done
				stack = stack[:len(stack)-1]
				continue
			}
			e := deps[top.node][top.next]
			top.next++
			switch state[e.to] {
			case unseen:
				state[e.to] = open
				stack = append(stack, frame{node: e.to})
			case open:
				if len(ps) > maxProblems {
					return ps
				}
				// Each node on the stack above e.to depends on the one
				// below it, and e.to on the top one: read down from the
				// top, they run in a circle.
				names := []string{nodes[e.to].Name}
				for k := len(stack) - 1; stack[k].node != e.to; k-- {
					names = append(names, nodes[stack[k].node].Name)
				}
				names = append(names, nodes[e.to].Name)
				ps = append(ps, Problem{
					Path:    fmt.Sprintf("nodes[%d].depends_on[%d]", top.node, e.entry),
					Message: fmt.Sprintf("cycle: %s: no node of it could ever start; remove one of these dependencies", strings.Join(names, " → ")),
				})
			}
		}
	}
	return ps
}

// Order returns the normalised nodes of wf so that every node comes after
// the nodes it depends on: of the nodes whose dependencies are all placed,
// the first declared is placed next. In an invalid workflow, dependencies
// on unknown nodes or on the node itself are ignored, and nodes that wait
// on a cycle come last, in declaration order.
func (wf Workflow) Order() []Node {
	nodes := wf.Normalized().Nodes
	deps := edges(nodes, nodeIndex(nodes))
	waiting := make([]int, len(nodes)) // dependencies not yet placed
	children := make([][]int, len(nodes))
	for i, es := range deps {
		waiting[i] = len(es)
		for _, e := range es {
			children[e.to] = append(children[e.to], i)
		}
	}
	var ready []int // by index
	for i, w := range waiting {
		if w == 0 {
			ready = append(ready, i)
		}
	}
	order := make([]Node, 0, len(nodes))
	placed := make([]bool, len(nodes))
	for len(ready) > 0 {
		i := ready[0]
		ready = ready[1:]
		placed[i] = true
		order = append(order, nodes[i])
		for _, c := range children[i] {
			if waiting[c]--; waiting[c] == 0 {
				at, _ := slices.BinarySearch(ready, c)
				ready = slices.Insert(ready, at, c)
			}
		}
	}
	for i, n := range nodes {
		if !placed[i] {
			order = append(order, n)
		}
	}
	return order
}

// Children maps the name of each node that others depend on to their
// names, in declaration order; a node nothing depends on has no entry.
// Dependencies on unknown nodes or on the node itself are ignored.
func (wf Workflow) Children() map[string][]string {
	nodes := wf.Normalized().Nodes
	children := map[string][]string{}
	for i, es := range edges(nodes, nodeIndex(nodes)) {
		for _, e := range es {
			parent := nodes[e.to].Name
			children[parent] = append(children[parent], nodes[i].Name)
		}
	}
	return children
}
