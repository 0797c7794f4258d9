package task

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"unicode/utf16"
	"unicode/utf8"
)

// InputHash is the hex sha256 of the task type, a NUL byte and the
// Canonical form of the payload, so key order and white space never change
// it while two different payloads never share it.
func InputHash(typ string, payload json.RawMessage) (string, error) {
	canonical, err := Canonical(payload)
	if err != nil {
		return "", fmt.Errorf("canonicalize payload: %w", err)
	}
	h := sha256.New()
	h.Write([]byte(typ))
	h.Write([]byte{0})
	h.Write(canonical)
	return hex.EncodeToString(h.Sum(nil)), nil
}

// Canonical returns the canonical JSON text of doc, any JSON value. Two
// documents have the same canonical text exactly when they differ only in:
//
//   - white space outside strings, which is dropped;
//   - the order of object members, which are sorted by the bytes of their
//     keys' UTF-8 encoding (not by UTF-16 code units as in RFC 8785);
//   - the spelling of string characters: escapes are decoded, and the text
//     is re-encoded one way (only '"', '\' and control characters are
//     escaped, as \" \\ \b \f \n \r \t or \u00xx), so "\u0041" is "A" and
//     "\/" is "/";
//   - trailing zeros of a number's fraction, which are dropped with the
//     point if no digit is left: 1.0 is 1, 2.50 is 2.5, 1.50e3 is 1.5e3,
//     0.0 is 0.
//
// Numbers are never converted to floats: every other difference in their
// text is kept, so 1e2, 100, 1E2 and 1e+2 differ, as do -0 and 0, and
// 9007199254740993 and 9007199254740992. That misses some duplicates, which
// is harmless, where merging two different payloads would lose one.
//
// Ambiguous or malformed input is an error rather than a guess: an object
// with the same key twice, invalid JSON, invalid UTF-8 in a string, a \u
// escape of an unpaired UTF-16 surrogate (it names no character), data
// after the value, and documents of 2 GiB or more.
//
// The work is linear in the size of doc, plus sorting each object's keys,
// at any nesting depth.
func Canonical(doc []byte) ([]byte, error) {
	if len(doc) >= math.MaxInt32 {
		return nil, errors.New("document of 2 GiB or more")
	}
	p := parser{in: doc, buf: make([]byte, 0, len(doc)), nodes: make([]node, 0, len(doc)/16+1)}
	if err := p.parse(); err != nil {
		return nil, err
	}
	return p.emit(make([]byte, 0, len(doc))), nil
}

// node is one value of the parsed document. Objects are sorted in place by
// relinking their members, so the bytes of a subtree are copied once, at
// emission, however deep it sits. Offsets are int32 to halve the tree.
type node struct {
	kind                byte  // '{', '[', '"' (text is the decoded string) or 0 (text is the canonical literal)
	key, keyEnd         int32 // an object member's decoded key, in buf
	text, textEnd       int32 // a scalar's text, in buf
	child, next, parent int32 // first child, next sibling, container; -1 for none
}

type parser struct {
	in      []byte
	pos     int
	buf     []byte // decoded keys and strings, canonical numbers and literals
	nodes   []node
	members []int32 // scratch for sorting one object's members
}

func (p *parser) key(i int32) []byte { n := &p.nodes[i]; return p.buf[n.key:n.keyEnd] }

// parse builds the tree of p.in with nodes[0] as the root. It keeps its own
// stack of open containers, so deep nesting costs no call stack.
func (p *parser) parse() error {
	var open []int32 // containers not yet closed, innermost last
	var last []int32 // their last child so far, -1 before the first
	for {
		// A value is expected, after its key if the container is an object.
		p.skipSpace()
		parent := int32(-1)
		var key, keyEnd int32
		if len(open) > 0 {
			parent = open[len(open)-1]
			if p.nodes[parent].kind == '{' {
				if p.pos >= len(p.in) || p.in[p.pos] != '"' {
					return p.unexpected("an object key")
				}
				key = int32(len(p.buf))
				if err := p.str(); err != nil {
					return err
				}
				keyEnd = int32(len(p.buf))
				p.skipSpace()
				if p.pos >= len(p.in) || p.in[p.pos] != ':' {
					return p.unexpected("':' after an object key")
				}
				p.pos++
				p.skipSpace()
			}
		}
		n := node{key: key, keyEnd: keyEnd, child: -1, next: -1, parent: parent}
		if p.pos >= len(p.in) {
			return p.unexpected("a value")
		}
		n.text = int32(len(p.buf))
		switch c := p.in[p.pos]; {
		case c == '{' || c == '[':
			n.kind = c
			p.pos++
		case c == '"':
			n.kind = '"'
			if err := p.str(); err != nil {
				return err
			}
		case c == '-' || '0' <= c && c <= '9':
			if err := p.number(); err != nil {
				return err
			}
		default:
			if err := p.literal(); err != nil {
				return err
			}
		}
		n.textEnd = int32(len(p.buf))
		i := int32(len(p.nodes))
		p.nodes = append(p.nodes, n)
		if len(open) > 0 {
			if l := last[len(last)-1]; l < 0 {
				p.nodes[parent].child = i
			} else {
				p.nodes[l].next = i
			}
			last[len(last)-1] = i
		}
		if n.kind == '{' || n.kind == '[' {
			open, last = append(open, i), append(last, -1)
			p.skipSpace()
			if p.pos >= len(p.in) || p.in[p.pos] != closer(n.kind) {
				continue // the first member
			}
		}
		// After a value: a comma, or the end of one or more containers.
		for {
			if len(open) == 0 {
				p.skipSpace()
				if p.pos < len(p.in) {
					return fmt.Errorf("data after the value at offset %d", p.pos)
				}
				return nil
			}
			top := open[len(open)-1]
			p.skipSpace()
			if p.pos >= len(p.in) {
				return p.unexpected("',' or '" + string(closer(p.nodes[top].kind)) + "'")
			}
			if c := p.in[p.pos]; c == ',' && last[len(last)-1] >= 0 {
				p.pos++
				break
			} else if c != closer(p.nodes[top].kind) {
				return p.unexpected("',' or '" + string(closer(p.nodes[top].kind)) + "'")
			}
			p.pos++
			if p.nodes[top].kind == '{' {
				if err := p.sortMembers(top); err != nil {
					return err
				}
			}
			open, last = open[:len(open)-1], last[:len(last)-1]
		}
	}
}

// sortMembers relinks the members of object o in key order and refuses
// duplicate keys, which sort next to each other.
func (p *parser) sortMembers(o int32) error {
	sorted := true
	for i := p.nodes[o].child; i >= 0 && p.nodes[i].next >= 0; i = p.nodes[i].next {
		switch bytes.Compare(p.key(i), p.key(p.nodes[i].next)) {
		case 0:
			return fmt.Errorf("duplicate key %q", p.key(i))
		case 1:
			sorted = false
		}
	}
	if sorted {
		return nil
	}
	m := p.members[:0]
	for i := p.nodes[o].child; i >= 0; i = p.nodes[i].next {
		m = append(m, i)
	}
	slices.SortFunc(m, func(a, b int32) int { return bytes.Compare(p.key(a), p.key(b)) })
	for k := 1; k < len(m); k++ {
		if bytes.Equal(p.key(m[k-1]), p.key(m[k])) {
			return fmt.Errorf("duplicate key %q", p.key(m[k]))
		}
	}
	p.nodes[o].child = m[0]
	for k := range m {
		p.nodes[m[k]].next = -1
		if k+1 < len(m) {
			p.nodes[m[k]].next = m[k+1]
		}
	}
	p.members = m
	return nil
}

// emit appends the canonical text of the tree to out, walking it without
// recursion.
func (p *parser) emit(out []byte) []byte {
	i := int32(0)
	for {
		n := &p.nodes[i]
		if n.parent >= 0 && p.nodes[n.parent].kind == '{' {
			out = appendString(out, p.buf[n.key:n.keyEnd])
			out = append(out, ':')
		}
		switch n.kind {
		case '{', '[':
			out = append(out, n.kind)
			if n.child >= 0 {
				i = n.child
				continue
			}
			out = append(out, closer(n.kind))
		case '"':
			out = appendString(out, p.buf[n.text:n.textEnd])
		default:
			out = append(out, p.buf[n.text:n.textEnd]...)
		}
		for i != 0 && p.nodes[i].next < 0 {
			i = p.nodes[i].parent
			out = append(out, closer(p.nodes[i].kind))
		}
		if i == 0 {
			return out
		}
		out = append(out, ',')
		i = p.nodes[i].next
	}
}

func closer(open byte) byte {
	if open == '{' {
		return '}'
	}
	return ']'
}

func (p *parser) skipSpace() {
	for p.pos < len(p.in) {
		switch p.in[p.pos] {
		case ' ', '\t', '\n', '\r':
			p.pos++
		default:
			return
		}
	}
}

func (p *parser) unexpected(want string) error {
	if p.pos >= len(p.in) {
		return fmt.Errorf("unexpected end of JSON input, want %s", want)
	}
	return fmt.Errorf("invalid character %q at offset %d, want %s", p.in[p.pos], p.pos, want)
}

func (p *parser) literal() error {
	for _, lit := range [...]string{"true", "false", "null"} {
		if bytes.HasPrefix(p.in[p.pos:], []byte(lit)) {
			p.buf = append(p.buf, lit...)
			p.pos += len(lit)
			return nil
		}
	}
	return p.unexpected("a value")
}

// number appends the number at p.pos as written, less the trailing zeros of
// its fraction (and the point if no digit is left).
func (p *parser) number() error {
	in, start := p.in, p.pos
	digits := func() int {
		from := p.pos
		for p.pos < len(in) && '0' <= in[p.pos] && in[p.pos] <= '9' {
			p.pos++
		}
		return p.pos - from
	}
	if in[p.pos] == '-' {
		p.pos++
	}
	if p.pos < len(in) && in[p.pos] == '0' {
		p.pos++
	} else if digits() == 0 {
		return p.unexpected("a digit")
	}
	keep := p.pos // the end of what is kept before the exponent
	if p.pos < len(in) && in[p.pos] == '.' {
		p.pos++
		if digits() == 0 {
			return p.unexpected("a digit after '.'")
		}
		keep = p.pos
		for in[keep-1] == '0' {
			keep--
		}
		if in[keep-1] == '.' {
			keep--
		}
	}
	exp := p.pos
	if p.pos < len(in) && (in[p.pos] == 'e' || in[p.pos] == 'E') {
		p.pos++
		if p.pos < len(in) && (in[p.pos] == '+' || in[p.pos] == '-') {
			p.pos++
		}
		if digits() == 0 {
			return p.unexpected("a digit in the exponent")
		}
	}
	p.buf = append(p.buf, in[start:keep]...)
	p.buf = append(p.buf, in[exp:p.pos]...)
	return nil
}

// str appends the decoded characters of the string at p.pos.
func (p *parser) str() error {
	in := p.in
	p.pos++ // the opening quote
	for {
		run := p.pos
		for run < len(in) && !special[in[run]] {
			run++
		}
		if !utf8.Valid(in[p.pos:run]) {
			return fmt.Errorf("invalid UTF-8 in the string at offset %d", p.pos)
		}
		p.buf = append(p.buf, in[p.pos:run]...)
		p.pos = run
		if p.pos >= len(in) {
			return p.unexpected("'\"'")
		}
		switch in[p.pos] {
		case '"':
			p.pos++
			return nil
		case '\\':
			if err := p.escape(); err != nil {
				return err
			}
		default:
			return p.unexpected("an escape instead of a control character")
		}
	}
}

// escape appends the character of the escape at p.pos.
func (p *parser) escape() error {
	at := p.pos
	p.pos++ // the backslash
	if p.pos >= len(p.in) {
		return p.unexpected("an escape")
	}
	c := p.in[p.pos]
	p.pos++
	switch c {
	case '"', '\\', '/':
		p.buf = append(p.buf, c)
	case 'b':
		p.buf = append(p.buf, '\b')
	case 'f':
		p.buf = append(p.buf, '\f')
	case 'n':
		p.buf = append(p.buf, '\n')
	case 'r':
		p.buf = append(p.buf, '\r')
	case 't':
		p.buf = append(p.buf, '\t')
	case 'u':
		r, ok := p.hex4()
		if !ok {
			return p.unexpected("four hex digits")
		}
		if utf16.IsSurrogate(r) {
			var r2 rune = -1
			if r < 0xdc00 && bytes.HasPrefix(p.in[p.pos:], []byte(`\u`)) {
				p.pos += 2
				if r2, ok = p.hex4(); !ok {
					return p.unexpected("four hex digits")
				}
			}
			if r = utf16.DecodeRune(r, r2); r == utf8.RuneError {
				return fmt.Errorf("unpaired surrogate in the escape at offset %d", at)
			}
		}
		p.buf = utf8.AppendRune(p.buf, r)
	default:
		p.pos--
		return p.unexpected("an escape")
	}
	return nil
}

func (p *parser) hex4() (rune, bool) {
	var r rune
	for range 4 {
		if p.pos >= len(p.in) {
			return 0, false
		}
		c := p.in[p.pos]
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, false
		}
		r = r<<4 | rune(c)
		p.pos++
	}
	return r, true
}

// special marks the bytes that end a run of literal string characters,
// when reading and when writing: '"', '\\' and the control characters.
var special = func() (t [256]bool) {
	for c := range 0x20 {
		t[c] = true
	}
	t['"'], t['\\'] = true, true
	return t
}()

// appendString appends s as a JSON string, escaping only what must be.
func appendString(out, s []byte) []byte {
	const hexDigits = "0123456789abcdef"
	out = append(out, '"')
	from := 0
	for i, c := range s {
		if !special[c] {
			continue
		}
		out = append(out, s[from:i]...)
		from = i + 1
		switch c {
		case '"', '\\':
			out = append(out, '\\', c)
		case '\b':
			out = append(out, '\\', 'b')
		case '\f':
			out = append(out, '\\', 'f')
		case '\n':
			out = append(out, '\\', 'n')
		case '\r':
			out = append(out, '\\', 'r')
		case '\t':
			out = append(out, '\\', 't')
		default:
			out = append(out, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
		}
	}
	out = append(out, s[from:]...)
	return append(out, '"')
}
