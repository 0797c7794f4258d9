package task

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"
)

// Bounds of the free text a task carries.
const (
	// MaxErrorLen bounds a stored error message, in bytes.
	MaxErrorLen = 4096
	// MaxStateLen bounds a state label, in bytes.
	MaxStateLen = 200
	// MaxResultBytes bounds a task's result: its JSON as PostgreSQL
	// stores and answers it, which may be longer than the handler's
	// encoding (jsonb writes 1e300 out in full). A task whose result
	// is larger fails. The database enforces it (task_results_payload_size).
	MaxResultBytes = 1 << 20
)

// CleanText makes s storable as PostgreSQL text: invalid UTF-8 and NUL
// bytes (which text columns refuse) become U+FFFD, and the result is cut to
// at most max bytes on a character boundary.
func CleanText(s string, max int) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", "\uFFFD")
	if len(s) <= max {
		return s
	}
	s = s[:max]
	for !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}

// StorableJSON reports why doc cannot be stored as jsonb, or nil: it must be
// valid JSON in valid UTF-8, and its strings must not hold the escape
// \u0000 or a lone UTF-16 surrogate, which jsonb refuses.
func StorableJSON(doc []byte) error {
	if !utf8.Valid(doc) {
		return errors.New("not valid UTF-8")
	}
	if !json.Valid(doc) {
		if d := Nesting(doc); d > MaxNesting {
			return fmt.Errorf("nests %d levels deep; at most %d are allowed", d, MaxNesting)
		}
		return errors.New("not valid JSON")
	}
	for i := 0; i < len(doc); i++ {
		if doc[i] == '\\' && i+1 < len(doc) {
			if doc[i+1] != 'u' {
				i++ // an escape such as \\ or \": skip its second byte
				continue
			}
			code := hex4(doc[i+2:])
			switch {
			case code == 0:
				return errors.New(`a string holds \u0000 (NUL), which is rejected: PostgreSQL cannot store it`)
			case code >= 0xD800 && code < 0xDC00:
				if i+11 < len(doc) && doc[i+6] == '\\' && doc[i+7] == 'u' {
					if low := hex4(doc[i+8:]); low >= 0xDC00 && low < 0xE000 {
						i += 11
						continue
					}
				}
				return errors.New("a string holds an unpaired UTF-16 surrogate escape")
			case code >= 0xDC00 && code < 0xE000:
				return errors.New("a string holds an unpaired UTF-16 surrogate escape")
			}
			i += 5
		}
	}
	return nil
}

// MaxNesting bounds the nesting of any JSON document Conveyor reads: it is
// encoding/json's, which takes no deeper document as valid JSON.
const MaxNesting = 10000

// Nesting returns how deep doc's arrays and objects nest, whether or not
// doc is valid JSON: a document refused only for its depth is then told
// so, rather than "not valid JSON".
func Nesting(doc []byte) int {
	deepest, cur, inString := 0, 0, false
	for i := 0; i < len(doc); i++ {
		switch c := doc[i]; {
		case inString && c == '\\':
			i++ // the escaped byte cannot end the string
		case inString:
			inString = c != '"'
		case c == '"':
			inString = true
		case c == '{' || c == '[':
			cur++
			deepest = max(deepest, cur)
		case c == '}' || c == ']':
			cur--
		}
	}
	return deepest
}

// hex4 reads the four hex digits of a \u escape (json.Valid checked them).
func hex4(b []byte) int {
	n := 0
	for _, c := range b[:4] {
		n <<= 4
		switch {
		case c >= '0' && c <= '9':
			n |= int(c - '0')
		case c >= 'a' && c <= 'f':
			n |= int(c-'a') + 10
		case c >= 'A' && c <= 'F':
			n |= int(c-'A') + 10
		}
	}
	return n
}
