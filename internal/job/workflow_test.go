package job_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/job"
)

const etlFile = `jobs:
  - {name: extract, type: demo.noop}
  - {name: transform, type: demo.noop}
  - {name: load, type: demo.noop}
workflows:
  - name: etl
    on_failure: continue
    memoize: true
    active: false
    source: {kind: cron, schedule: " 0 * * * * ", timezone: Europe/Paris, missed: skip}
    nodes:
      - job: extract
        output_datasets: [raw.orders]
      - name: transform-eu
        job: transform
        depends_on: [extract]
        input_datasets: [raw.orders]
        output_datasets: [clean.orders, "s3://bucket/orders:v1"]
      - job: load
        depends_on:
          - transform-eu
          - extract
        input_datasets: []
  - name: minimal
    source: {kind: cron, schedule: "@daily"}
    nodes:
      - job: load
`

func etlWant() []job.Workflow {
	return []job.Workflow{
		{
			Name:      "etl",
			OnFailure: "continue",
			Memoize:   true,
			Active:    false,
			Source:    &job.Source{Kind: "cron", Schedule: "0 * * * *", Timezone: "Europe/Paris", Missed: "skip"},
			Nodes: []job.Node{
				{Name: "extract", Job: "extract", OutputDatasets: []string{"raw.orders"}},
				{Name: "transform-eu", Job: "transform", DependsOn: []string{"extract"}, InputDatasets: []string{"raw.orders"},
					OutputDatasets: []string{"clean.orders", "s3://bucket/orders:v1"}},
				{Name: "load", Job: "load", DependsOn: []string{"transform-eu", "extract"}},
			},
		},
		{
			Name:      "minimal",
			OnFailure: "stop",
			Active:    true,
			Source:    &job.Source{Kind: "cron", Schedule: "@daily", Timezone: "UTC", Missed: "run_once"},
			Nodes:     []job.Node{{Name: "load", Job: "load"}},
		},
	}
}

// Workflows parse to their normalised form: node names default to their
// job's, on_failure to stop, active to true, the source as a job's.
func TestParseWorkflows(t *testing.T) {
	t.Parallel()
	f, err := job.Parse([]byte(etlFile))
	require.NoError(t, err)
	require.Len(t, f.Jobs, 3)
	require.Equal(t, etlWant(), f.Workflows)
	require.Empty(t, f.Validate())
	for _, wf := range f.Workflows {
		require.Equal(t, wf, wf.Normalized())
	}
}

// The same document in JSON parses to the same File, and JSON reports
// lines too.
func TestParseWorkflowsJSON(t *testing.T) {
	t.Parallel()
	f, err := job.Parse([]byte(etlFile))
	require.NoError(t, err)
	b, err := json.MarshalIndent(f, "", "\t")
	require.NoError(t, err)
	g, err := job.Parse(b)
	require.NoError(t, err)
	require.Equal(t, f, g)

	_, err = job.Parse([]byte(`{
  "jobs": [{"name": "a", "type": "t"}],
  "workflows": [
    {
      "name": "w",
      "nodes": [
        {"job": "a"},
        {"name": "b", "job": "a", "depends_on": ["a", "c"]}
      ]
    }
  ]
}`))
	require.EqualError(t, err, `line 8: workflows[0].nodes[1].depends_on[1]: unknown node "c" in depends_on: the workflow's nodes are a, b`)
}

// A diamond: a before b and c, both before d.
const diamondFile = `jobs:
  - {name: a, type: t}
  - {name: b, type: t}
  - {name: c, type: t}
  - {name: d, type: t}
workflows:
  - name: diamond
    nodes:
      - {job: d, depends_on: [b, c]}
      - {job: c, depends_on: [a]}
      - {job: b, depends_on: [a]}
      - {job: a}
`

func TestWorkflowDiamond(t *testing.T) {
	t.Parallel()
	f, err := job.Parse([]byte(diamondFile))
	require.NoError(t, err)
	require.Len(t, f.Workflows, 1)
	wf := f.Workflows[0]
	require.Equal(t, job.Workflow{
		Name: "diamond", OnFailure: "stop", Active: true,
		Nodes: []job.Node{
			{Name: "d", Job: "d", DependsOn: []string{"b", "c"}},
			{Name: "c", Job: "c", DependsOn: []string{"a"}},
			{Name: "b", Job: "b", DependsOn: []string{"a"}},
			{Name: "a", Job: "a"},
		},
	}, wf)
	require.Equal(t, wf, wf.Normalized())
	// Of the nodes ready together, the first declared comes first.
	require.Equal(t, []string{"a", "c", "b", "d"}, names(wf.Order()))
	require.Equal(t, map[string][]string{"a": {"c", "b"}, "b": {"d"}, "c": {"d"}}, wf.Children())
}

func names(nodes []job.Node) []string {
	out := make([]string, len(nodes))
	for i, n := range nodes {
		out[i] = n.Name
	}
	return out
}

// Order and Children work on workflows built in Go, normalising them, and
// do not choke on invalid ones.
func TestWorkflowOrder(t *testing.T) {
	t.Parallel()
	wf := job.Workflow{Nodes: []job.Node{
		{Job: "load", DependsOn: []string{"transform", "transform"}},
		{Job: "extract"},
		{Name: "transform", Job: "t", DependsOn: []string{"extract"}},
		{Job: "report"},
	}}
	order := wf.Order()
	require.Equal(t, []string{"extract", "transform", "load", "report"}, names(order))
	require.Equal(t, "t", order[1].Job)
	require.Equal(t, map[string][]string{"extract": {"transform"}, "transform": {"load"}}, wf.Children())
	require.Empty(t, job.Workflow{}.Order())
	require.Empty(t, job.Workflow{}.Children())

	// Unknown and self dependencies are ignored; nodes on or below a cycle
	// come last, in declaration order.
	bad := job.Workflow{Nodes: []job.Node{
		{Job: "x", DependsOn: []string{"z"}},
		{Job: "y", DependsOn: []string{"x", "y", "nope"}},
		{Job: "z", DependsOn: []string{"y"}},
		{Job: "w", DependsOn: []string{"ghost"}},
		{Job: "v", DependsOn: []string{"x"}},
	}}
	require.Equal(t, []string{"w", "x", "y", "z", "v"}, names(bad.Order()))
	require.Equal(t, map[string][]string{"x": {"y", "v"}, "y": {"z"}, "z": {"x"}}, bad.Children())
}

// problems parses in and returns its problems, each message cut to the
// part the matching want names.
func problems(t *testing.T, in string, ws []want) []want {
	t.Helper()
	f, err := job.Parse([]byte(in))
	require.Error(t, err)
	require.Equal(t, job.File{}, f)
	var ps job.Problems
	require.True(t, errors.As(err, &ps), "%T", err)
	got := make([]want, len(ps))
	for i, p := range ps {
		got[i] = want{p.Line, p.Path, p.Message}
		if i < len(ws) && strings.Contains(p.Message, ws[i].msg) {
			got[i].msg = ws[i].msg
		}
	}
	return got
}

const threeJobs = `jobs:
  - {name: a, type: t}
  - {name: b, type: t}
  - {name: c, type: t}
`

// Each mistake in a workflow is reported at the right line and path.
func TestParseWorkflowProblems(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		in   string // after threeJobs, whose last line is 4
		want []want
	}{
		{
			name: "two-node cycle, at the entry that closes it",
			in: `workflows:
  - name: loop
    nodes:
      - job: a
        depends_on: [b]
      - job: b
        depends_on: [a]
`,
			want: []want{{11, "workflows[0].nodes[1].depends_on[0]", "cycle: a → b → a: no node of it could ever start; remove one of these dependencies"}},
		},
		{
			name: "three-node cycle",
			in: `workflows:
  - name: tri
    nodes:
      - job: a
        depends_on:
          - c
      - job: b
        depends_on: [a]
      - job: c
        depends_on: [b]
`,
			want: []want{{12, "workflows[0].nodes[1].depends_on[0]", "cycle: a → b → c → a"}},
		},
		{
			name: "each cycle once",
			in: `workflows:
  - name: w
    nodes:
      - {job: a, depends_on: [b]}
      - {job: b, depends_on: [a, a]}
      - {name: c1, job: c, depends_on: [c2, a]}
      - {name: c2, job: c, depends_on: [c1]}
      - {name: tail, job: c, depends_on: [c1, b]}
`,
			want: []want{
				{9, "workflows[0].nodes[1].depends_on[0]", "cycle: a → b → a"},
				{9, "workflows[0].nodes[1].depends_on[1]", `duplicate dependency "a": depends_on[0] already has it`},
				{11, "workflows[0].nodes[3].depends_on[0]", "cycle: c1 → c2 → c1"},
			},
		},
		{
			name: "unknown dependency and unknown job",
			in: `workflows:
  - name: w
    nodes:
      - job: a
      - name: g
        job: ghost
        depends_on: [a, nope]
`,
			want: []want{
				{10, "workflows[0].nodes[1].job", `unknown job "ghost": declare it under jobs:`},
				{11, "workflows[0].nodes[1].depends_on[1]", `unknown node "nope" in depends_on: the workflow's nodes are a, g`},
			},
		},
		{
			name: "self and duplicate dependencies",
			in: `workflows:
  - name: w
    nodes:
      - job: a
      - job: b
        depends_on: [a, b, a]
`,
			want: []want{
				{10, "workflows[0].nodes[1].depends_on[1]", `node "b" cannot depend on itself`},
				{10, "workflows[0].nodes[1].depends_on[2]", `duplicate dependency "a": depends_on[0] already has it`},
			},
		},
		{
			name: "duplicate node names",
			in: `workflows:
  - name: w
    nodes:
      - job: a
      - job: b
      - job: a
      - {name: b, job: c}
`,
			want: []want{
				{10, "workflows[0].nodes[2].name", `duplicate node name "a": nodes[0] already has it (to run one job twice, give each node its own name:)`},
				{11, "workflows[0].nodes[3].name", `duplicate node name "b": nodes[1] already has it`},
			},
		},
		{
			name: "names",
			in: `workflows:
  - nodes: [{job: a}]
  - name: Bad Name
    nodes:
      - {name: Odd, job: a}
      - {job: "No"}
      - {name: x}
  - name: w
    nodes: [{job: a}]
  - name: w
    nodes: [{job: b}]
`,
			want: []want{
				{6, "workflows[0].name", `"name" is required`},
				{7, "workflows[1].name", `invalid name "Bad Name"`},
				{9, "workflows[1].nodes[0].name", `invalid name "Odd"`},
				{10, "workflows[1].nodes[1].job", `invalid job "No"`},
				{11, "workflows[1].nodes[2].job", `"job" is required`},
				{14, "workflows[3].name", `duplicate workflow name "w": workflows[2] already has it`},
			},
		},
		{
			name: "options and source",
			in: `workflows:
  - name: w
    on_failure: abort
    memoize: yes
    colour: red
    source:
      kind: cron
      schedule: "0 25 * * *"
      timezone: Mars/Olympus
      missed: sometimes
    nodes: [{job: a, retries: 3}]
`,
			want: []want{
				{7, "workflows[0].on_failure", `invalid on_failure "abort": use "stop" or "continue"`},
				{8, "workflows[0].memoize", `memoize must be true or false, not the string "yes"`},
				{9, "workflows[0].colour", `unknown field "colour"`},
				{12, "workflows[0].source.schedule", `invalid schedule "0 25 * * *"`},
				{13, "workflows[0].source.timezone", `unknown timezone "Mars/Olympus"`},
				{14, "workflows[0].source.missed", `invalid missed "sometimes": use "skip" or "run_once"`},
				{15, "workflows[0].nodes[0].retries", `unknown field "retries"`},
			},
		},
		{
			name: "source without kind",
			in:   "workflows:\n  - name: w\n    source: {schedule: \"@daily\"}\n    nodes: [{job: a}]\n",
			want: []want{{7, "workflows[0].source.kind", `"kind" is required: set it to "cron"`}},
		},
		{
			name: "no nodes",
			in:   "workflows:\n  - name: w\n  - name: v\n    nodes: []\n",
			want: []want{
				{6, "workflows[0].nodes", `a workflow needs at least one node: list them under "nodes"`},
				{8, "workflows[1].nodes", "a workflow needs at least one node"},
			},
		},
		{
			name: "malformed lists",
			in: `workflows:
  - name: w
    nodes:
      - job: a
        depends_on: 5
      - job: b
        depends_on: a
        input_datasets: [x, 5, {k: v}, ~, true]
        output_datasets: {a: b}
`,
			want: []want{
				{9, "workflows[0].nodes[0].depends_on", "depends_on must be a list of strings, not the integer 5"},
				{11, "workflows[0].nodes[1].depends_on", `depends_on must be a list of strings, not the string "a": write [a]`},
				{12, "workflows[0].nodes[1].input_datasets[1]", "input_datasets must list strings, not the integer 5 (quote it)"},
				{12, "workflows[0].nodes[1].input_datasets[2]", "input_datasets must list strings, not a mapping"},
				{12, "workflows[0].nodes[1].input_datasets[3]", "input_datasets must list strings, not null"},
				{12, "workflows[0].nodes[1].input_datasets[4]", "input_datasets must list strings, not the boolean true (quote it)"},
				{13, "workflows[0].nodes[1].output_datasets", "output_datasets must be a list of strings, not a mapping"},
			},
		},
		{
			name: "malformed workflows and nodes",
			in: `workflows:
  - name: w
    nodes: "x"
  - name: v
    nodes:
      - a
      - job: [a]
  - just-a-name
`,
			want: []want{
				{7, "workflows[0].nodes", `nodes must be a list, not the string "x"`},
				{10, "workflows[1].nodes[0]", `a node must be a mapping, not the string "a"`},
				{11, "workflows[1].nodes[1].job", "job must be a string, not a list"},
				{12, "workflows[2]", `a workflow must be a mapping, not the string "just-a-name"`},
			},
		},
		{
			name: "workflows is a mapping",
			in:   "workflows:\n  name: w\n",
			want: []want{{6, "workflows", "workflows must be a list, not a mapping"}},
		},
		{
			name: "datasets",
			in: `workflows:
  - name: w
    nodes:
      - job: a
        input_datasets: [raw.orders, "", -x, "has space", raw.orders]
        output_datasets: [ok/path:v1, ok/path:v1]
`,
			want: []want{
				{9, "workflows[0].nodes[0].input_datasets[1]", `invalid dataset "": use 1 to 256 letters, digits, '.', '_', '/', ':' or '-', starting with a letter or digit`},
				{9, "workflows[0].nodes[0].input_datasets[2]", `invalid dataset "-x"`},
				{9, "workflows[0].nodes[0].input_datasets[3]", `invalid dataset "has space"`},
				{9, "workflows[0].nodes[0].input_datasets[4]", `duplicate dataset "raw.orders": input_datasets[0] already has it`},
				{10, "workflows[0].nodes[0].output_datasets[1]", `duplicate dataset "ok/path:v1": output_datasets[0] already has it`},
			},
		},
		{
			name: "dataset too long",
			in:   "workflows:\n  - name: w\n    nodes:\n      - job: a\n        output_datasets: [" + strings.Repeat("d", 257) + "]\n",
			want: []want{{9, "workflows[0].nodes[0].output_datasets[0]", "invalid dataset"}},
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := problems(t, threeJobs+tt.in, tt.want)
			require.Equal(t, tt.want, got)
		})
	}
}

// A workflow far over the node limit, which fits in an API body as a line
// per node (an alias of one node, each line 11 bytes), is refused for its
// size alone, at once. Each node's own checks, each unknown dependency
// listing every node, took time quadratic in the nodes (minutes for the
// 95,000 nodes of a 1 MiB body) and answered one problem per node.
func TestParseFarTooManyNodesIsCheap(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	b.WriteString("jobs: [{name: a, type: t}]\nworkflows:\n  - name: big\n    nodes:\n      - &n {job: a, depends_on: [z]}\n")
	const n = 30000
	for range n - 1 {
		b.WriteString("      - *n\n")
	}
	ws := []want{{5, "workflows[0].nodes", fmt.Sprintf("a workflow has at most %d nodes, got %d", job.MaxNodes, n)}}
	// One problem, the size: had the nodes' own checks run, each would
	// have answered one of its own (speed is not asserted here; the
	// problems say which checks ran).
	require.Equal(t, ws, problems(t, b.String(), ws))
}

func TestParseTooManyNodes(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	b.WriteString("jobs: [{name: a, type: t}]\nworkflows:\n  - name: big\n    nodes:\n")
	for i := range job.MaxNodes + 1 {
		fmt.Fprintf(&b, "      - {name: n%d, job: a}\n", i)
	}
	got := problems(t, b.String(), nil)
	require.Equal(t, []want{{5, "workflows[0].nodes", fmt.Sprintf("a workflow has at most %d nodes, got %d: split it into several workflows", job.MaxNodes, job.MaxNodes+1)}}, got)

	// A long list of names is cut short in a message.
	b.Reset()
	b.WriteString("jobs: [{name: a, type: t}]\nworkflows:\n  - name: big\n    nodes:\n      - {name: n0, job: a, depends_on: [typo]}\n")
	for i := 1; i < 25; i++ {
		fmt.Fprintf(&b, "      - {name: n%d, job: a}\n", i)
	}
	got = problems(t, b.String(), nil)
	require.Equal(t, []want{{5, "workflows[0].nodes[0].depends_on[0]",
		`unknown node "typo" in depends_on: the workflow's nodes are n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15, n16, n17, n18, n19 and 5 more`}}, got)
}

// Validate runs the rule checks of Parse on a workflow built in Go, where
// empty means "default"; it does not know the file's jobs.
func TestValidateWorkflow(t *testing.T) {
	t.Parallel()
	valid := job.Workflow{Name: "w", Nodes: []job.Node{{Job: "a"}, {Job: "b", DependsOn: []string{"a"}}}}
	require.Empty(t, valid.Validate())
	require.Empty(t, job.File{Jobs: []job.Definition{{Name: "a", Type: "t", MaxAttempts: 1}, {Name: "b", Type: "t", MaxAttempts: 1}},
		Workflows: []job.Workflow{valid}}.Validate())
	require.Equal(t, job.Problems{
		{Path: "workflows[0].nodes[0].job", Message: `unknown job "a": declare it under jobs:`},
		{Path: "workflows[0].nodes[1].job", Message: `unknown job "b": declare it under jobs:`},
	}, job.File{Workflows: []job.Workflow{valid}}.Validate())

	for _, tt := range []struct {
		name  string
		wf    job.Workflow
		paths []string
	}{
		{"empty", job.Workflow{}, []string{"name", "nodes"}},
		{"on_failure", job.Workflow{Name: "w", OnFailure: "retry", Nodes: valid.Nodes}, []string{"on_failure"}},
		{"source empty", job.Workflow{Name: "w", Source: &job.Source{}, Nodes: valid.Nodes}, []string{"source.kind", "source.schedule"}},
		{"node without job", job.Workflow{Name: "w", Nodes: []job.Node{{}}}, []string{"nodes[0].job"}},
		{"cycle", job.Workflow{Name: "w", Nodes: []job.Node{
			{Job: "a", DependsOn: []string{"c"}},
			{Job: "b", DependsOn: []string{"a"}},
			{Job: "c", DependsOn: []string{"b"}},
		}}, []string{"nodes[1].depends_on[0]"}},
		{"self", job.Workflow{Name: "w", Nodes: []job.Node{{Name: "x", Job: "a", DependsOn: []string{"x"}}}}, []string{"nodes[0].depends_on[0]"}},
	} {
		var paths []string
		for _, p := range tt.wf.Validate() {
			require.Zero(t, p.Line)
			paths = append(paths, p.Path)
		}
		require.Equal(t, tt.paths, paths, "%s: %v", tt.name, tt.wf.Validate())
	}
}

func TestWorkflowHash(t *testing.T) {
	t.Parallel()
	base := job.Workflow{
		Name:   "etl",
		Active: true,
		Source: &job.Source{Kind: "cron", Schedule: "@hourly"},
		Nodes: []job.Node{
			{Job: "extract", OutputDatasets: []string{"raw"}},
			{Job: "load", DependsOn: []string{"extract"}, InputDatasets: []string{"raw"}},
		},
	}
	h := base.Hash()
	require.Len(t, h, 64)

	same := base
	same.OnFailure = "stop"
	same.Source = &job.Source{Kind: "cron", Schedule: " @hourly ", Timezone: "UTC", Missed: "run_once"}
	same.Nodes = []job.Node{
		{Name: "extract", Job: "extract", DependsOn: []string{}, InputDatasets: []string{}, OutputDatasets: []string{"raw"}},
		{Name: "load", Job: "load", DependsOn: []string{"extract"}, InputDatasets: []string{"raw"}, OutputDatasets: []string{}},
	}
	require.Equal(t, h, same.Hash(), "spelled-out defaults and empty lists do not count")

	for _, in := range []string{
		`jobs: [{name: extract, type: t}, {name: load, type: t}]
workflows:
  - name: etl
    source: {kind: cron, schedule: '@hourly'}
    nodes:
      - {job: extract, output_datasets: [raw]}
      - {job: load, depends_on: [extract], input_datasets: [raw]}
`,
		`workflows:
  - nodes:
      - output_datasets:
          - raw
        input_datasets: []
        job: extract
      - input_datasets: [ raw ]
        depends_on: [ extract ]
        name: load
        job: load
    active: true
    source:
      missed: run_once
      schedule: "@hourly"
      kind: cron
    on_failure: stop
    memoize: false
    name: etl
jobs: [{name: extract, type: t}, {name: load, type: t}]
`,
		`{"jobs": [{"name": "extract", "type": "t"}, {"name": "load", "type": "t"}],
 "workflows": [{"name": "etl", "source": {"kind": "cron", "schedule": "@hourly"},
  "nodes": [{"job": "extract", "output_datasets": ["raw"]}, {"job": "load", "depends_on": ["extract"], "input_datasets": ["raw"]}]}]}`,
	} {
		f, err := job.Parse([]byte(in))
		require.NoError(t, err, in)
		require.Equal(t, h, f.Workflows[0].Hash(), "a parsed workflow hashes as the one built in Go:\n%s", in)
	}

	seen := map[string]string{h: "base"}
	for name, edit := range map[string]func(*job.Workflow){
		"name":            func(w *job.Workflow) { w.Name = "etl2" },
		"on_failure":      func(w *job.Workflow) { w.OnFailure = "continue" },
		"memoize":         func(w *job.Workflow) { w.Memoize = true },
		"active":          func(w *job.Workflow) { w.Active = false },
		"no source":       func(w *job.Workflow) { w.Source = nil },
		"source.schedule": func(w *job.Workflow) { w.Source.Schedule = "@daily" },
		"source.timezone": func(w *job.Workflow) { w.Source.Timezone = "Asia/Tokyo" },
		"source.missed":   func(w *job.Workflow) { w.Source.Missed = "skip" },
		"node name":       func(w *job.Workflow) { w.Nodes[1].Name = "loader" },
		"node job":        func(w *job.Workflow) { w.Nodes[1].Job = "load2" },
		"no dependency":   func(w *job.Workflow) { w.Nodes[1].DependsOn = nil },
		"input":           func(w *job.Workflow) { w.Nodes[1].InputDatasets = []string{"other"} },
		"output":          func(w *job.Workflow) { w.Nodes[0].OutputDatasets = nil },
		"node order":      func(w *job.Workflow) { w.Nodes[0], w.Nodes[1] = w.Nodes[1], w.Nodes[0] },
		"one node":        func(w *job.Workflow) { w.Nodes = w.Nodes[:1] },
	} {
		w := base
		s := *base.Source
		w.Source = &s
		w.Nodes = []job.Node{base.Nodes[0], base.Nodes[1]}
		edit(&w)
		got := w.Hash()
		prev, dup := seen[got]
		require.False(t, dup, "%s hashes like %s", name, prev)
		seen[got] = name
	}
	require.Empty(t, base.Nodes[0].Name, "Hash and Normalized leave their workflow alone")
	require.Empty(t, base.OnFailure)
}

func TestDiffWorkflows(t *testing.T) {
	t.Parallel()
	current := job.File{
		Jobs: []job.Definition{{Name: "extract", Type: "t", Priority: 5, MaxAttempts: 3, Active: true}},
		Workflows: []job.Workflow{
			{Name: "etl", Active: true, Nodes: []job.Node{
				{Job: "extract", OutputDatasets: []string{"raw.orders"}},
				{Job: "load", DependsOn: []string{"extract"}},
			}},
			{Name: "same", Active: true, OnFailure: "stop", Nodes: []job.Node{{Name: "x", Job: "extract", DependsOn: []string{}}}},
			{Name: "old", Active: true, Nodes: []job.Node{{Job: "extract"}}},
		},
	}
	desired, err := job.Parse([]byte(`
jobs:
  - {name: extract, type: t}
  - {name: transform, type: t}
  - {name: load, type: t}
workflows:
  - name: etl
    on_failure: continue
    source: {kind: cron, schedule: "0 * * * *"}
    nodes:
      - job: extract
        output_datasets: [raw.orders]
      - job: transform
        depends_on: [extract]
        input_datasets: [raw.orders]
        output_datasets: [clean.orders]
      - job: load
        depends_on: [transform]
  - name: same
    nodes: [{name: x, job: extract}]
  - name: new
    memoize: true
    active: false
    source: {kind: cron, schedule: "@daily", timezone: Europe/Paris}
    nodes:
      - job: extract
      - {name: load-twice, job: load, depends_on: [extract]}
  - name: single
    nodes: [{job: load}]
`))
	require.NoError(t, err)

	changes := job.Diff(current, desired, false)
	require.Equal(t, []job.Change{
		{Op: job.OpUnchanged, Kind: "job", Name: "extract"},
		{Op: job.OpCreate, Kind: "job", Name: "load", Fields: []job.FieldChange{
			{Field: "type", New: "t"}, {Field: "payload", New: "{}"}, {Field: "priority", New: "5"},
			{Field: "max_attempts", New: "3"}, {Field: "active", New: "true"},
		}},
		{Op: job.OpCreate, Kind: "job", Name: "transform", Fields: []job.FieldChange{
			{Field: "type", New: "t"}, {Field: "payload", New: "{}"}, {Field: "priority", New: "5"},
			{Field: "max_attempts", New: "3"}, {Field: "active", New: "true"},
		}},
		{Op: job.OpUpdate, Kind: "workflow", Name: "etl", Fields: []job.FieldChange{
			{Field: "on_failure", Old: "stop", New: "continue"},
			{Field: "source.kind", New: "cron"},
			{Field: "source.schedule", New: "0 * * * *"},
			{Field: "source.timezone", New: "UTC"},
			{Field: "source.missed", New: "run_once"},
			{Field: "nodes", Old: "extract [→raw.orders]; load<-extract",
				New: "extract [→raw.orders]; transform<-extract [raw.orders→clean.orders]; load<-transform"},
		}},
		{Op: job.OpCreate, Kind: "workflow", Name: "new", Fields: []job.FieldChange{
			{Field: "on_failure", New: "stop"},
			{Field: "memoize", New: "true"},
			{Field: "active", New: "false"},
			{Field: "source.kind", New: "cron"},
			{Field: "source.schedule", New: "@daily"},
			{Field: "source.timezone", New: "Europe/Paris"},
			{Field: "source.missed", New: "run_once"},
			{Field: "nodes", New: "extract; load-twice=load<-extract"},
		}},
		{Op: job.OpUnchanged, Kind: "workflow", Name: "same"},
		{Op: job.OpCreate, Kind: "workflow", Name: "single", Fields: []job.FieldChange{
			{Field: "on_failure", New: "stop"},
			{Field: "memoize", New: "false"},
			{Field: "active", New: "true"},
			{Field: "nodes", New: "load"},
		}},
	}, changes)

	require.Equal(t, `= job extract
+ job load (t)
+ job transform (t)
~ workflow etl: on_failure stop → continue, source.kind none → "cron", source.schedule none → "0 * * * *", source.timezone none → "UTC", source.missed none → "run_once", nodes "extract [→raw.orders]; load<-extract" → "extract [→raw.orders]; transform<-extract [raw.orders→clean.orders]; load<-transform"
+ workflow new (2 nodes, cron "@daily" Europe/Paris, memoize, inactive)
= workflow same
+ workflow single (1 node)
`, job.Format(changes))

	withTypes := desired
	withTypes.Types = []job.TypeLimit{{Type: "t", MaxConcurrency: 1}}
	pruned := job.Diff(current, withTypes, true)
	require.Equal(t, `= job extract
+ job load (t)
+ job transform (t)
~ workflow etl: on_failure stop → continue, source.kind none → "cron", source.schedule none → "0 * * * *", source.timezone none → "UTC", source.missed none → "run_once", nodes "extract [→raw.orders]; load<-extract" → "extract [→raw.orders]; transform<-extract [raw.orders→clean.orders]; load<-transform"
+ workflow new (2 nodes, cron "@daily" Europe/Paris, memoize, inactive)
- workflow old
= workflow same
+ workflow single (1 node)
+ type t (max_concurrency 1)
`, job.Format(pruned), "workflows come between jobs and type limits")

	require.Equal(t, []job.Change{
		{Op: job.OpDelete, Kind: "job", Name: "extract"},
		{Op: job.OpDelete, Kind: "workflow", Name: "etl"},
		{Op: job.OpDelete, Kind: "workflow", Name: "old"},
		{Op: job.OpDelete, Kind: "workflow", Name: "same"},
	}, job.Diff(current, job.File{}, true))

	// What the store keeps, read back, is unchanged.
	require.Equal(t, "= workflow etl\n= workflow new\n= workflow same\n= workflow single\n",
		job.Format(job.Diff(job.File{Workflows: desired.Workflows}, job.File{Workflows: desired.Workflows}, true)))
}
