package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"

	"github.com/mattn/go-runewidth"
)

// writeJSON writes a document of the API as it came, indented.
func writeJSON(w io.Writer, raw json.RawMessage) error {
	var buf bytes.Buffer
	if err := json.Indent(&buf, raw, "", "  "); err != nil {
		return fmt.Errorf("the API's answer is not JSON: %w", err)
	}
	buf.WriteByte('\n')
	_, err := w.Write(buf.Bytes())
	return err
}

// writeJSONLine writes a document of the API on one line (JSON Lines, for
// streams).
func writeJSONLine(w io.Writer, raw json.RawMessage) error {
	var buf bytes.Buffer
	if err := json.Compact(&buf, raw); err != nil {
		return fmt.Errorf("the API's answer is not JSON: %w", err)
	}
	buf.WriteByte('\n')
	_, err := w.Write(buf.Bytes())
	return err
}

// table writes aligned columns: a header, then rows. Columns are aligned
// by the width each cell takes on a terminal (a CJK character or an emoji
// takes two columns), which text/tabwriter, counting characters, does not.
type table struct {
	w    io.Writer
	rows [][]string
}

func newTable(w io.Writer, header ...string) *table {
	t := &table{w: w}
	t.row(header...)
	return t
}

func (t *table) row(cells ...string) {
	for i, c := range cells {
		// A tab or a newline in a value would break the columns.
		cells[i] = oneLine(c)
	}
	t.rows = append(t.rows, cells)
}

// flush writes the table, without the spaces that pad empty cells at the
// ends of lines.
func (t *table) flush() error {
	var widths []int
	for _, r := range t.rows {
		for i, c := range r {
			if i == len(widths) {
				widths = append(widths, 0)
			}
			widths[i] = max(widths[i], runewidth.StringWidth(c))
		}
	}
	var out bytes.Buffer
	for _, r := range t.rows {
		var line strings.Builder
		for i, c := range r {
			line.WriteString(c)
			if i < len(r)-1 {
				line.WriteString(strings.Repeat(" ", widths[i]-runewidth.StringWidth(c)+2))
			}
		}
		out.WriteString(strings.TrimRight(line.String(), " "))
		out.WriteByte('\n')
	}
	_, err := t.w.Write(out.Bytes())
	return err
}

// fields writes "key: value" lines with the values aligned, leaving out
// empty values.
func fields(w io.Writer, kv ...string) error {
	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', 0)
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i+1] != "" {
			// As a table's cell: a tab, a newline or an escape sequence
			// in a value would break the lines.
			fmt.Fprintf(tw, "%s:\t%s\n", kv[i], oneLine(kv[i+1]))
		}
	}
	return tw.Flush()
}

// stampLayout is how times are shown: UTC to the millisecond, as the API
// writes them.
const stampLayout = "2006-01-02T15:04:05.000Z07:00"

func stamp(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(stampLayout)
}

func stampPtr(t *time.Time) string {
	if t == nil {
		return ""
	}
	return stamp(*t)
}

// ago is how long before now t was, in its largest unit: "45s", "12m",
// "5h", "3d".
func ago(now, t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return age(now.Sub(t))
}

// age is d in its largest unit: "45s", "12m", "5h", "3d".
func age(d time.Duration) string {
	d = max(d, 0)
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d/time.Second))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d/time.Minute))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d/time.Hour))
	default:
		return fmt.Sprintf("%dd", int(d/(24*time.Hour)))
	}
}

func agoPtr(now time.Time, t *time.Time) string {
	if t == nil {
		return ""
	}
	return ago(now, *t)
}

// duration is d for people: "850ms", "3.2s", "1m05s".
func duration(d time.Duration) string {
	d = max(d, 0)
	switch {
	case d < time.Second:
		return d.Round(10 * time.Millisecond).String()
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	default:
		d = d.Round(time.Second)
		return fmt.Sprintf("%dm%02ds", int(d/time.Minute), int(d%time.Minute/time.Second))
	}
}

// wholeDuration is a count of seconds as a duration, "1m30s"; "" for 0.
func wholeDuration(n int) string {
	if n == 0 {
		return ""
	}
	return (time.Duration(n) * time.Second).String()
}

// oneLine is s on one line, and harmless on a terminal: each control
// character becomes a space. Text that tasks carry (a handler's error,
// which errors.Join writes one error a line; its state) is shown where one
// line stands for one thing (an event, a bar, a table's row), and an
// escape sequence in it would be a command to the person's terminal.
func oneLine(s string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case unicode.IsControl(r), r == '\u2028', r == '\u2029': // the line and paragraph separators too
			return ' '
		case unicode.Is(unicode.Bidi_Control, r):
			// A right-to-left override would turn the rest of the line
			// around, the columns after it included.
			return -1
		}
		return r
	}, s)
}

// truncate cuts s to width columns, ending it with "…" when cut.
func truncate(s string, width int) string {
	if width <= 0 {
		return ""
	}
	return runewidth.Truncate(s, width, "…")
}

// compact is a JSON document on one line, "" for none.
func compact(raw json.RawMessage) string {
	if len(raw) == 0 || string(raw) == "null" {
		return ""
	}
	var buf bytes.Buffer
	if json.Compact(&buf, raw) != nil {
		return string(raw)
	}
	return buf.String()
}
