package job

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Op is what applying a file does to one job, workflow or type limit.
type Op string

// The ops.
const (
	OpCreate    Op = "create"
	OpUpdate    Op = "update"
	OpUnchanged Op = "unchanged"
	OpDelete    Op = "delete"
)

// The kinds of thing a Change is about.
const (
	KindJob      = "job"
	KindWorkflow = "workflow"
	KindType     = "type"
)

// FieldChange is one field of a created or updated job, workflow or type
// limit, its values rendered as short strings: JSON for the payload, one
// line for a workflow's nodes (see Diff), "" when absent.
type FieldChange struct {
	Field string `json:"field"`
	Old   string `json:"old"`
	New   string `json:"new"`
}

// Change is what applying a file does to one job or workflow (by name) or
// type limit (by type). Fields lists every field that differs for an
// update, and every field set for a create.
type Change struct {
	Op     Op            `json:"op"`
	Kind   string        `json:"kind"`
	Name   string        `json:"name"`
	Fields []FieldChange `json:"fields,omitempty"`
}

// field is one comparable field, rendered as Diff shows it.
type field[T any] struct {
	name   string
	quoted bool // Format quotes its values
	render func(T) string
}

var jobFields = slices.Concat(
	[]field[Definition]{
		{"type", true, func(d Definition) string { return d.Type }},
		{"payload", false, func(d Definition) string { return string(d.Payload) }},
		{"priority", false, func(d Definition) string { return strconv.Itoa(d.Priority) }},
	},
	sourceFields(func(d Definition) *Source { return d.Source }),
	[]field[Definition]{
		{"max_attempts", false, func(d Definition) string { return strconv.Itoa(d.MaxAttempts) }},
		{"timeout_seconds", false, func(d Definition) string { return optional(d.TimeoutSeconds) }},
		{"heartbeat_timeout_seconds", false, func(d Definition) string { return optional(d.HeartbeatTimeoutSeconds) }},
		{"max_concurrency", false, func(d Definition) string { return optional(d.MaxConcurrency) }},
		{"max_concurrency_per_key", false, func(d Definition) string { return optional(d.MaxConcurrencyPerKey) }},
		{"active", false, func(d Definition) string { return strconv.FormatBool(d.Active) }},
	},
)

var workflowFields = slices.Concat(
	[]field[Workflow]{
		{"on_failure", false, func(w Workflow) string { return w.OnFailure }},
		{"memoize", false, func(w Workflow) string { return strconv.FormatBool(w.Memoize) }},
		{"active", false, func(w Workflow) string { return strconv.FormatBool(w.Active) }},
	},
	sourceFields(func(w Workflow) *Source { return w.Source }),
	[]field[Workflow]{
		{"nodes", true, func(w Workflow) string { return renderNodes(w.Nodes) }},
	},
)

var typeFields = []field[TypeLimit]{
	{"max_concurrency", false, func(t TypeLimit) string { return optional(t.MaxConcurrency) }},
	{"max_concurrency_per_key", false, func(t TypeLimit) string { return optional(t.MaxConcurrencyPerKey) }},
}

// quoted tells Format which fields hold free text, whatever their kind (a
// field of the same name is quoted alike in every kind).
var quoted = func() map[string]bool {
	m := map[string]bool{}
	for _, f := range jobFields {
		m[f.name] = f.quoted
	}
	for _, f := range workflowFields {
		m[f.name] = f.quoted
	}
	return m
}()

// sourceFields are the fields of a job's or workflow's source, all ""
// when it has none.
func sourceFields[T any](source func(T) *Source) []field[T] {
	get := func(part func(*Source) string) func(T) string {
		return func(v T) string {
			if s := source(v); s != nil {
				return part(s)
			}
			return ""
		}
	}
	return []field[T]{
		{"source.kind", true, get(func(s *Source) string { return s.Kind })},
		{"source.schedule", true, get(func(s *Source) string { return s.Schedule })},
		{"source.timezone", true, get(func(s *Source) string { return s.Timezone })},
		{"source.missed", true, get(func(s *Source) string { return s.Missed })},
	}
}

// renderNodes renders a workflow's nodes on one line, in declaration
// order, separated by "; ": a node as its name, then "=job" when its job
// has another name, "<-" and the nodes it depends on, and its datasets in
// brackets, inputs → outputs. For example
// "extract [→raw.orders]; transform<-extract [raw.orders→clean.orders]; load<-transform".
func renderNodes(nodes []Node) string {
	parts := make([]string, len(nodes))
	for i, n := range nodes {
		var b strings.Builder
		b.WriteString(n.Name)
		if n.Job != n.Name {
			b.WriteString("=" + n.Job)
		}
		if len(n.DependsOn) > 0 {
			b.WriteString("<-" + strings.Join(n.DependsOn, ","))
		}
		if len(n.InputDatasets) > 0 || len(n.OutputDatasets) > 0 {
			fmt.Fprintf(&b, " [%s→%s]", strings.Join(n.InputDatasets, ","), strings.Join(n.OutputDatasets, ","))
		}
		parts[i] = b.String()
	}
	return strings.Join(parts, "; ")
}

func optional(v int) string {
	if v == 0 {
		return ""
	}
	return strconv.Itoa(v)
}

// Diff compares the current state with the desired file: jobs and
// workflows by name (unchanged when their hashes match), type limits by
// type. What current has and desired lacks is deleted only when prune is
// set; otherwise it is left out. Changes come jobs first, then workflows,
// then type limits, each kind by name. A workflow's nodes are one field,
// "nodes", rendered on one line (see Format).
func Diff(current, desired File, prune bool) []Change {
	changes := diff(KindJob, current.Jobs, desired.Jobs, jobFields,
		func(d Definition) string { return d.Name },
		func(d Definition) Definition { return d.Normalized() },
		func(a, b Definition) bool { return a.Hash() == b.Hash() },
		prune)
	changes = append(changes, diff(KindWorkflow, current.Workflows, desired.Workflows, workflowFields,
		func(w Workflow) string { return w.Name },
		func(w Workflow) Workflow { return w.Normalized() },
		func(a, b Workflow) bool { return a.Hash() == b.Hash() },
		prune)...)
	changes = append(changes, diff(KindType, current.Types, desired.Types, typeFields,
		func(t TypeLimit) string { return t.Type },
		func(t TypeLimit) TypeLimit { return t },
		func(a, b TypeLimit) bool { return a == b },
		prune)...)
	slices.SortStableFunc(changes, func(a, b Change) int {
		return cmp.Or(cmp.Compare(kindOrder(a.Kind), kindOrder(b.Kind)), cmp.Compare(a.Name, b.Name))
	})
	return changes
}

func kindOrder(kind string) int {
	switch kind {
	case KindJob:
		return 0
	case KindWorkflow:
		return 1
	}
	return 2
}

func diff[T any](kind string, current, desired []T, fields []field[T], key func(T) string, normalize func(T) T, equal func(a, b T) bool, prune bool) []Change {
	have := make(map[string]T, len(current))
	for _, c := range current {
		have[key(c)] = normalize(c)
	}
	var changes []Change
	wanted := make(map[string]bool, len(desired))
	for _, d := range desired {
		d = normalize(d)
		name := key(d)
		wanted[name] = true
		old, ok := have[name]
		switch {
		case !ok:
			c := Change{Op: OpCreate, Kind: kind, Name: name}
			for _, f := range fields {
				if v := f.render(d); v != "" {
					c.Fields = append(c.Fields, FieldChange{Field: f.name, New: v})
				}
			}
			changes = append(changes, c)
		case equal(old, d):
			changes = append(changes, Change{Op: OpUnchanged, Kind: kind, Name: name})
		default:
			c := Change{Op: OpUpdate, Kind: kind, Name: name}
			for _, f := range fields {
				if o, n := f.render(old), f.render(d); o != n {
					c.Fields = append(c.Fields, FieldChange{Field: f.name, Old: o, New: n})
				}
			}
			changes = append(changes, c)
		}
	}
	if prune {
		for _, c := range current {
			if name := key(c); !wanted[name] {
				wanted[name] = true // once, should current repeat it
				changes = append(changes, Change{Op: OpDelete, Kind: kind, Name: name})
			}
		}
	}
	return changes
}

var opSigns = map[Op]string{OpCreate: "+", OpUpdate: "~", OpUnchanged: "=", OpDelete: "-"}

// Format renders changes as plain text for a terminal, one line each:
// `+ job nightly-report (reports.build, cron "0 2 * * *" Europe/Paris)` for
// a create, `~ job sync: source.schedule "@every 1m" → "@every 30s"` for an
// update, `= job cleanup` for no change and `- job old-thing` for a delete.
// Workflows read alike: `+ workflow etl (3 nodes, cron "0 * * * *" UTC,
// memoize)`, and `~ workflow etl: nodes "extract; load<-extract" →
// "extract; transform<-extract; load<-transform"`.
func Format(changes []Change) string {
	var b strings.Builder
	for _, c := range changes {
		sign, ok := opSigns[c.Op]
		if !ok {
			sign = "?"
		}
		fmt.Fprintf(&b, "%s %s %s", sign, c.Kind, c.Name)
		switch c.Op {
		case OpCreate:
			b.WriteString(" (" + summary(c) + ")")
		case OpUpdate:
			parts := make([]string, len(c.Fields))
			for i, f := range c.Fields {
				parts[i] = fmt.Sprintf("%s %s → %s", f.Field, show(f.Field, f.Old), show(f.Field, f.New))
			}
			b.WriteString(": " + strings.Join(parts, ", "))
		}
		b.WriteString("\n")
	}
	return b.String()
}

// summary describes a created job by its type and source, a created
// workflow by its number of nodes, source and options, or a created type
// limit by its limits.
func summary(c Change) string {
	v := map[string]string{}
	for _, f := range c.Fields {
		v[f.Field] = f.New
	}
	if c.Kind == KindWorkflow {
		n := 0
		if nodes := v["nodes"]; nodes != "" {
			n = strings.Count(nodes, "; ") + 1
		}
		parts := []string{fmt.Sprintf("%d nodes", n)}
		if n == 1 {
			parts[0] = "1 node"
		}
		parts = append(parts, sourceSummary(v)...)
		if v["on_failure"] == FailContinue {
			parts = append(parts, "on_failure continue")
		}
		if v["memoize"] == "true" {
			parts = append(parts, "memoize")
		}
		if v["active"] == "false" {
			parts = append(parts, "inactive")
		}
		return strings.Join(parts, ", ")
	}
	if c.Kind == KindType {
		var parts []string
		for _, f := range typeFields {
			if s := v[f.name]; s != "" {
				parts = append(parts, f.name+" "+s)
			}
		}
		if len(parts) == 0 {
			return "no limits"
		}
		return strings.Join(parts, ", ")
	}
	parts := append([]string{v["type"]}, sourceSummary(v)...)
	if v["active"] == "false" {
		parts = append(parts, "inactive")
	}
	return strings.Join(parts, ", ")
}

// sourceSummary describes a source, such as `cron "0 2 * * *" Europe/Paris`,
// or nothing.
func sourceSummary(v map[string]string) []string {
	if kind := v["source.kind"]; kind != "" {
		return []string{fmt.Sprintf("%s %q %s", kind, v["source.schedule"], v["source.timezone"])}
	}
	return nil
}

func show(field, v string) string {
	switch {
	case v == "":
		return "none"
	case quoted[field]:
		return strconv.Quote(v)
	}
	return v
}
