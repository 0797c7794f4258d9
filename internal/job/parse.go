package job

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

// Problem is one thing wrong with a definitions file: where (a 1-based
// line and column, 0 when unknown, and a path such as
// "jobs[2].source.schedule") and what.
type Problem struct {
	Line    int    `json:"line"`
	Column  int    `json:"column"`
	Path    string `json:"path"`
	Message string `json:"message"`
}

// String renders p as "line 7: jobs[1].source.schedule: message", leaving
// out what is unknown.
func (p Problem) String() string {
	var b strings.Builder
	if p.Line > 0 {
		fmt.Fprintf(&b, "line %d: ", p.Line)
	}
	if p.Path != "" {
		b.WriteString(p.Path + ": ")
	}
	b.WriteString(p.Message)
	return b.String()
}

// Problems is every problem found in a file, in file order. It is the error
// Parse returns.
type Problems []Problem

// Error lists the problems one per line.
func (ps Problems) Error() string {
	lines := make([]string, len(ps))
	for i, p := range ps {
		lines[i] = p.String()
	}
	return strings.Join(lines, "\n")
}

// under prefixes every path with prefix.
func (ps Problems) under(prefix string) Problems {
	for i := range ps {
		ps[i].Path = joinPath(prefix, ps[i].Path)
	}
	return ps
}

func joinPath(prefix, path string) string {
	switch {
	case prefix == "":
		return path
	case path == "" || path[0] == '[':
		return prefix + path
	}
	return prefix + "." + path
}

// Parse reads a definitions file, YAML or JSON (read as YAML, so problems
// carry line numbers either way), and returns it normalised: defaults
// filled in and payloads in canonical form. When anything is wrong it
// returns Problems listing all of it.
func Parse(data []byte) (File, error) {
	if looksLikeJSON(data) {
		// JSON allows tabs between tokens where YAML does not; a tab can
		// only sit between tokens in valid JSON, and a space there keeps
		// every column.
		data = bytes.ReplaceAll(data, []byte("\t"), []byte(" "))
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return File{}, nil
		}
		return File{}, Problems{syntaxProblem(err)}
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		if err != nil {
			return File{}, Problems{syntaxProblem(err)}
		}
		return File{}, Problems{{Line: extra.Line, Column: extra.Column, Message: "the file holds more than one YAML document; put all jobs in one"}}
	}

	w := walker{nodes: map[string]*yaml.Node{"": &doc}, bad: map[string]bool{}}
	f := w.file(&doc)
	// Rule checks run on the decoded File, as for definitions built in Go;
	// each problem then takes the position of its path's node, or of the
	// nearest enclosing node when the field is missing.
	for _, p := range f.Validate() {
		if w.spoilt(p.Path) {
			continue // already reported as malformed
		}
		n := w.node(p.Path)
		p.Line, p.Column = n.Line, n.Column
		w.problems = append(w.problems, p)
	}
	if len(w.problems) > 0 {
		slices.SortStableFunc(w.problems, func(a, b Problem) int {
			if a.Line != b.Line {
				return a.Line - b.Line
			}
			return a.Column - b.Column
		})
		if len(w.problems) > maxProblems {
			w.problems = append(w.problems[:maxProblems], Problem{
				Message: fmt.Sprintf("more mistakes follow: only the first %d are listed", maxProblems)})
		}
		return File{}, w.problems
	}
	return f, nil
}

func looksLikeJSON(data []byte) bool {
	t := bytes.TrimLeft(data, " \t\r\n\ufeff")
	return len(t) > 0 && (t[0] == '{' || t[0] == '[')
}

var yamlLine = regexp.MustCompile(`^yaml: line (\d+): `)

// syntaxProblem turns a yaml.v3 error, which carries its line only in its
// text, into a Problem.
func syntaxProblem(err error) Problem {
	msg := err.Error()
	p := Problem{}
	if m := yamlLine.FindStringSubmatch(msg); m != nil {
		p.Line, _ = strconv.Atoi(m[1])
		msg = msg[len(m[0]):]
	} else {
		msg = strings.TrimPrefix(msg, "yaml: ")
	}
	if strings.Contains(msg, "cannot start any token") {
		msg += ` (values starting with "@" or "%" or "` + "`" + `" must be quoted, and indentation must use spaces, not tabs)`
	}
	p.Message = "invalid YAML: " + msg
	return p
}

// maxProblems bounds the mistakes a file is answered with, and the checks
// stop soon after: a file of 1 MiB can hold half a million mistakes, and
// listing each (the message of an unknown dependency names the workflow's
// nodes) would cost time and memory far out of proportion to the file.
const maxProblems = 100

// walker turns a yaml.Node tree into a File, reporting malformed nodes at
// their position and remembering the node of every path it visits.
type walker struct {
	problems Problems
	nodes    map[string]*yaml.Node // by path
	bad      map[string]bool       // paths already reported as malformed
	visited  int                   // nodes visited, aliases expanded
}

// maxNodes bounds the nodes a walk visits, each alias expanded where it is
// used, so that a small file of nested aliases cannot make it run for ever.
const maxNodes = 1000000

// charge counts n nodes visited at node at and reports false, having
// reported the problem once, when the walk has gone over maxNodes.
func (w *walker) charge(n int, at *yaml.Node, path string) bool {
	if w.visited > maxNodes {
		return false
	}
	if w.visited += n; w.visited > maxNodes {
		w.fail(at, path, "the file is too large: over %d values once aliases are expanded", maxNodes)
		return false
	}
	return true
}

// fail reports a malformed value at path.
func (w *walker) fail(n *yaml.Node, path, format string, args ...any) {
	w.report(n, path, format, args...)
	w.bad[path] = true
}

// report reports a problem at n that leaves the value at path usable.
func (w *walker) report(n *yaml.Node, path, format string, args ...any) {
	if len(w.problems) > maxProblems {
		return
	}
	w.problems = append(w.problems, Problem{Line: n.Line, Column: n.Column, Path: path, Message: fmt.Sprintf(format, args...)})
}

// spoilt reports whether path or a path enclosing it was reported as
// malformed, so that its rule check would only repeat the news.
func (w *walker) spoilt(path string) bool {
	for {
		if w.bad[path] {
			return true
		}
		if path == "" {
			return false
		}
		path = parent(path)
	}
}

// node returns the node at path or, failing that, at the nearest path
// enclosing it.
func (w *walker) node(path string) *yaml.Node {
	for {
		if n, ok := w.nodes[path]; ok {
			return n
		}
		path = parent(path)
	}
}

func parent(path string) string {
	i := strings.LastIndexAny(path, ".[")
	if i < 0 {
		return ""
	}
	return path[:i]
}

// resolve follows aliases to the node they name.
func resolve(n *yaml.Node) *yaml.Node {
	for n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	return n
}

// isNull reports whether n is an explicit null (~, null or nothing).
func isNull(n *yaml.Node) bool {
	return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null"
}

type entry struct {
	key, value *yaml.Node
	path       string
}

// entries returns a mapping's keys and values in order, with merge keys
// (<<: *defaults) expanded: keys written out win over merged ones, and an
// earlier merged mapping wins over a later one.
func (w *walker) entries(n *yaml.Node, path string) []entry {
	if !w.charge(len(n.Content)/2+1, n, path) {
		return nil
	}
	var own, merged []entry
	seen := map[string]bool{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := resolve(n.Content[i]), n.Content[i+1]
		if k.Kind == yaml.ScalarNode && k.ShortTag() == "!!merge" {
			w.merge(v, path, &merged)
			continue
		}
		if k.Kind != yaml.ScalarNode {
			w.report(k, path, "keys must be plain strings")
			continue
		}
		p := joinPath(path, k.Value)
		if seen[k.Value] {
			w.report(k, p, "duplicate field %q", k.Value)
			continue
		}
		seen[k.Value] = true
		own = append(own, entry{key: k, value: v, path: p})
	}
	for _, e := range merged {
		if !seen[e.key.Value] {
			seen[e.key.Value] = true
			own = append(own, e)
		}
	}
	return own
}

func (w *walker) merge(v *yaml.Node, path string, into *[]entry) {
	v = resolve(v)
	switch v.Kind {
	case yaml.MappingNode:
		*into = append(*into, w.entries(v, path)...)
	case yaml.SequenceNode:
		for _, m := range v.Content {
			if m = resolve(m); m.Kind == yaml.MappingNode {
				*into = append(*into, w.entries(m, path)...)
			} else {
				w.report(m, path, "a merge (<<) takes a mapping or a list of mappings")
			}
		}
	default:
		w.report(v, path, "a merge (<<) takes a mapping or a list of mappings")
	}
}

// mapping checks that n is a mapping and returns its entries, or reports
// what it is instead.
func (w *walker) mapping(n *yaml.Node, path, what string) ([]entry, bool) {
	n = resolve(n)
	if n.Kind != yaml.MappingNode {
		w.fail(n, path, "%s must be a mapping, not %s", what, describe(n))
		return nil, false
	}
	w.nodes[path] = n
	return w.entries(n, path), true
}

// sequence checks that n is a list and returns its items, or reports what
// it is instead. A null is an empty list.
func (w *walker) sequence(n *yaml.Node, path, what string) []*yaml.Node {
	n = resolve(n)
	if isNull(n) {
		return nil
	}
	if n.Kind != yaml.SequenceNode {
		w.fail(n, path, "%s must be a list, not %s", what, describe(n))
		return nil
	}
	w.nodes[path] = n
	return n.Content
}

func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		switch n.ShortTag() {
		case "!!str":
			return fmt.Sprintf("the string %q", n.Value)
		case "!!int":
			return "the integer " + n.Value
		case "!!float":
			return "the number " + n.Value
		case "!!bool":
			return "the boolean " + n.Value
		case "!!null":
			return "null"
		}
		return fmt.Sprintf("%q", n.Value)
	}
	return "an unknown node"
}

func (w *walker) file(doc *yaml.Node) File {
	var f File
	if doc.Kind != yaml.DocumentNode || len(doc.Content) == 0 || isNull(resolve(doc.Content[0])) {
		return f // nothing but comments, or ---
	}
	es, ok := w.mapping(doc.Content[0], "", "the document")
	if !ok {
		return f
	}
	for _, e := range es {
		switch e.key.Value {
		case "jobs":
			for i, n := range w.sequence(e.value, e.path, "jobs") {
				f.Jobs = append(f.Jobs, w.definition(n, fmt.Sprintf("%s[%d]", e.path, i)))
			}
		case "types":
			for i, n := range w.sequence(e.value, e.path, "types") {
				f.Types = append(f.Types, w.typeLimit(n, fmt.Sprintf("%s[%d]", e.path, i)))
			}
		case "workflows":
			for i, n := range w.sequence(e.value, e.path, "workflows") {
				f.Workflows = append(f.Workflows, w.workflow(n, fmt.Sprintf("%s[%d]", e.path, i)))
			}
		default:
			w.unknown(e)
		}
	}
	return f
}

func (w *walker) unknown(e entry) {
	w.report(e.key, e.path, "unknown field %q", e.key.Value)
}

func (w *walker) definition(n *yaml.Node, path string) Definition {
	d := Definition{
		Payload:     json.RawMessage("{}"),
		Priority:    DefaultPriority,
		MaxAttempts: DefaultMaxAttempts,
		Active:      true,
	}
	es, ok := w.mapping(n, path, "a job")
	if !ok {
		return d
	}
	for _, e := range es {
		switch e.key.Value {
		case "name":
			w.str(e, &d.Name)
		case "type":
			w.str(e, &d.Type)
		case "payload":
			w.payload(e, &d.Payload)
		case "priority":
			w.int(e, &d.Priority, false)
		case "source":
			d.Source = w.source(e)
		case "max_attempts":
			w.int(e, &d.MaxAttempts, false)
		case "timeout_seconds":
			w.int(e, &d.TimeoutSeconds, false)
		case "heartbeat_timeout_seconds":
			w.int(e, &d.HeartbeatTimeoutSeconds, false)
		case "max_concurrency":
			w.int(e, &d.MaxConcurrency, true)
		case "max_concurrency_per_key":
			w.int(e, &d.MaxConcurrencyPerKey, true)
		case "active":
			w.bool(e, &d.Active)
		default:
			w.unknown(e)
		}
	}
	return d
}

func (w *walker) source(e entry) *Source {
	if isNull(resolve(e.value)) {
		return nil
	}
	s := &Source{Timezone: DefaultTimezone, Missed: MissedRunOnce}
	es, ok := w.mapping(e.value, e.path, "source")
	if !ok {
		return nil
	}
	for _, e := range es {
		switch e.key.Value {
		case "kind":
			w.str(e, &s.Kind)
		case "schedule":
			w.str(e, &s.Schedule)
			s.Schedule = strings.TrimSpace(s.Schedule)
		case "timezone":
			w.str(e, &s.Timezone)
			if s.Timezone == "" {
				s.Timezone = DefaultTimezone
			}
		case "missed":
			w.str(e, &s.Missed)
			if s.Missed == "" {
				s.Missed = MissedRunOnce
			}
		default:
			w.unknown(e)
		}
	}
	return s
}

func (w *walker) typeLimit(n *yaml.Node, path string) TypeLimit {
	var t TypeLimit
	es, ok := w.mapping(n, path, "a type limit")
	if !ok {
		return t
	}
	for _, e := range es {
		switch e.key.Value {
		case "type":
			w.str(e, &t.Type)
		case "max_concurrency":
			w.int(e, &t.MaxConcurrency, true)
		case "max_concurrency_per_key":
			w.int(e, &t.MaxConcurrencyPerKey, true)
		default:
			w.unknown(e)
		}
	}
	return t
}

func (w *walker) workflow(n *yaml.Node, path string) Workflow {
	wf := Workflow{OnFailure: FailStop, Active: true}
	es, ok := w.mapping(n, path, "a workflow")
	if !ok {
		return wf
	}
	for _, e := range es {
		switch e.key.Value {
		case "name":
			w.str(e, &wf.Name)
		case "on_failure":
			w.str(e, &wf.OnFailure)
		case "memoize":
			w.bool(e, &wf.Memoize)
		case "active":
			w.bool(e, &wf.Active)
		case "source":
			wf.Source = w.source(e)
		case "nodes":
			for i, n := range w.sequence(e.value, e.path, "nodes") {
				wf.Nodes = append(wf.Nodes, w.workflowNode(n, fmt.Sprintf("%s[%d]", e.path, i)))
			}
		default:
			w.unknown(e)
		}
	}
	// Node names default to their job's, on_failure to stop.
	return wf.Normalized()
}

// workflowNode decodes a node of a workflow. (node is taken: it finds the
// YAML node of a path.)
func (w *walker) workflowNode(n *yaml.Node, path string) Node {
	var nd Node
	es, ok := w.mapping(n, path, "a node")
	if !ok {
		return nd
	}
	for _, e := range es {
		switch e.key.Value {
		case "name":
			w.str(e, &nd.Name)
		case "job":
			w.str(e, &nd.Job)
		case "depends_on":
			w.strs(e, &nd.DependsOn)
		case "input_datasets":
			w.strs(e, &nd.InputDatasets)
		case "output_datasets":
			w.strs(e, &nd.OutputDatasets)
		default:
			w.unknown(e)
		}
	}
	return nd
}

// scalar returns the scalar value of e, or nil for a null (the field is
// then left at its default) or for a node that is not a scalar (reported).
func (w *walker) scalar(e entry, want string) *yaml.Node {
	n := resolve(e.value)
	w.nodes[e.path] = n
	if isNull(n) {
		return nil
	}
	if n.Kind != yaml.ScalarNode {
		w.fail(n, e.path, "%s must be %s, not %s", e.key.Value, want, describe(n))
		return nil
	}
	return n
}

// str decodes a string. Other scalars are refused rather than read as
// their text, so `name: 2024` or `kind: yes` do not pass unnoticed.
func (w *walker) str(e entry, into *string) {
	n := w.scalar(e, "a string")
	if n == nil {
		return
	}
	if n.ShortTag() != "!!str" {
		w.fail(n, e.path, "%s must be a string, not %s (quote it)", e.key.Value, describe(n))
		return
	}
	if err := n.Decode(into); err != nil {
		w.fail(n, e.path, "%s must be a string: %v", e.key.Value, err)
	}
}

// strs decodes a list of strings. A malformed item is reported and kept
// as "", so that the items after it keep their index for the rule checks,
// which then leave it alone.
func (w *walker) strs(e entry, into *[]string) {
	n := resolve(e.value)
	w.nodes[e.path] = n
	if isNull(n) {
		return
	}
	if n.Kind != yaml.SequenceNode {
		if n.Kind == yaml.ScalarNode && n.ShortTag() == "!!str" {
			w.fail(n, e.path, "%s must be a list of strings, not %s: write [%s]", e.key.Value, describe(n), n.Value)
		} else {
			w.fail(n, e.path, "%s must be a list of strings, not %s", e.key.Value, describe(n))
		}
		return
	}
	if !w.charge(len(n.Content)+1, n, e.path) {
		return
	}
	var list []string
	for i, item := range n.Content {
		path := fmt.Sprintf("%s[%d]", e.path, i)
		item = resolve(item)
		w.nodes[path] = item
		var v string
		switch {
		case item.Kind != yaml.ScalarNode || isNull(item):
			w.fail(item, path, "%s must list strings, not %s", e.key.Value, describe(item))
		case item.ShortTag() != "!!str":
			w.fail(item, path, "%s must list strings, not %s (quote it)", e.key.Value, describe(item))
		default:
			if err := item.Decode(&v); err != nil {
				w.fail(item, path, "%s must list strings: %v", e.key.Value, err)
			}
		}
		list = append(list, v)
	}
	*into = list
}

// int decodes a whole number. For a limit (positive = the limit, absent =
// none) an explicit 0 is refused: in Go 0 means "unlimited", and a file
// saying 0 more likely means "none may run".
func (w *walker) int(e entry, into *int, limit bool) {
	n := w.scalar(e, "an integer")
	if n == nil {
		return
	}
	var v int
	if n.ShortTag() != "!!int" || n.Decode(&v) != nil {
		w.fail(n, e.path, "%s must be an integer, not %s", e.key.Value, describe(n))
		return
	}
	if limit && v == 0 {
		w.fail(n, e.path, "%s must be between 1 and %d, got 0 (leave it out for no limit)", e.key.Value, MaxConcurrencyLimit)
		return
	}
	*into = v
}

func (w *walker) bool(e entry, into *bool) {
	n := w.scalar(e, "true or false")
	if n == nil {
		return
	}
	if n.ShortTag() != "!!bool" || n.Decode(into) != nil {
		w.fail(n, e.path, "%s must be true or false, not %s", e.key.Value, describe(n))
	}
}

// payload converts a YAML mapping to a JSON object. Its rules (depth,
// storable text) are checked later with the rest.
func (w *walker) payload(e entry, into *json.RawMessage) {
	n := resolve(e.value)
	w.nodes[e.path] = n
	if isNull(n) {
		return
	}
	if n.Kind != yaml.MappingNode {
		w.fail(n, e.path, "payload must be a mapping, not %s", describe(n))
		return
	}
	v, ok := w.value(n, e.path)
	if !ok {
		return
	}
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		w.fail(n, e.path, "payload cannot be written as JSON: %v", err)
		return
	}
	*into = bytes.TrimSuffix(b.Bytes(), []byte("\n"))
}

// jsonNumber is the grammar of a JSON number.
var jsonNumber = regexp.MustCompile(`^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?$`)

// exactNumber is v, the value YAML read the number text as, or text itself
// (a json.Number, written as it is) when v is a float64 that encoding/json
// would write as another number: digits past a float64's precision
// (123456789.123456789), an integer past 64 bits, a value too small for a
// float64 (1e-400, read as 0). A payload keeps the number it was given,
// as one sent to the API does, rather than a rounding of it.
func exactNumber(text string, v any) any {
	f, ok := v.(float64)
	if !ok {
		return v
	}
	// What encoding/json writes is the shortest text that reads back as
	// f. The grammar is checked only for a number that differs: the
	// payloads' numbers nearly all keep their value, and a large payload
	// holds hundreds of thousands of them.
	if decimalValue(strconv.FormatFloat(f, 'g', -1, 64)) == decimalValue(text) || !jsonNumber.MatchString(text) {
		return v
	}
	return json.Number(text)
}

// decimalValue writes the value of a JSON number one way, as its
// significant digits and the power of ten of the first: 1.50e3 and 1500
// are both "15e4", 0 is "0"; the sign is dropped for zero alone. An
// exponent past an int64 is kept as written, which tells it apart.
func decimalValue(number string) string {
	sign := ""
	if rest, ok := strings.CutPrefix(number, "-"); ok {
		sign, number = "-", rest
	}
	mantissa, exponent, _ := strings.Cut(strings.ToLower(number), "e")
	whole, fraction, _ := strings.Cut(mantissa, ".")
	digits := strings.TrimLeft(whole+fraction, "0")
	if digits = strings.TrimRight(digits, "0"); digits == "" {
		return "0"
	}
	shift := len(whole) - (len(whole+fraction) - len(strings.TrimLeft(whole+fraction, "0")))
	if exponent == "" {
		exponent = "0"
	}
	e, err := strconv.ParseInt(exponent, 10, 64)
	if err != nil || e > math.MaxInt64/2 || e < math.MinInt64/2 {
		return sign + digits + "e" + exponent + "!"
	}
	return sign + digits + "e" + strconv.FormatInt(e+int64(shift), 10)
}

// value converts any YAML node into the Go value encoding/json writes.
func (w *walker) value(n *yaml.Node, path string) (any, bool) {
	n = resolve(n)
	if !w.charge(1, n, path) {
		return nil, false
	}
	switch n.Kind {
	case yaml.MappingNode:
		m := map[string]any{}
		ok := true
		for _, e := range w.entries(n, path) {
			v, vok := w.value(e.value, e.path)
			m[e.key.Value] = v
			ok = ok && vok
		}
		return m, ok
	case yaml.SequenceNode:
		s := make([]any, len(n.Content))
		ok := true
		for i, c := range n.Content {
			var vok bool
			s[i], vok = w.value(c, fmt.Sprintf("%s[%d]", path, i))
			ok = ok && vok
		}
		return s, ok
	case yaml.ScalarNode:
		switch n.ShortTag() {
		case "!!null":
			return nil, true
		case "!!bool", "!!int", "!!float":
			var v any
			if err := n.Decode(&v); err != nil {
				w.fail(n, path, "invalid value %q: %v", n.Value, err)
				return nil, false
			}
			if f, ok := v.(float64); ok && (math.IsInf(f, 0) || math.IsNaN(f)) {
				w.fail(n, path, "%s has no JSON form", n.Value)
				return nil, false
			}
			return exactNumber(n.Value, v), true
		}
		// A plain number beyond a float64's range resolves as a string;
		// it is refused, as in a submission's payload, not turned into one.
		if n.Style == 0 && n.ShortTag() == "!!str" {
			if _, err := strconv.ParseFloat(n.Value, 64); errors.Is(err, strconv.ErrRange) {
				w.fail(n, path, "number %.40s is beyond the range of a float64 (quote it if it is text)", n.Value)
				return nil, false
			}
		}
		// Strings, and timestamps and other tags kept as written.
		return n.Value, true
	}
	w.fail(n, path, "unsupported YAML node")
	return nil, false
}
