package task

import (
	"encoding/json"
	"testing"
	"unicode/utf8"
)

// FuzzInputHash: the canonical hash never panics, and any two spellings of
// the same JSON object (here: as sent, and decoded then re-encoded, which
// reorders keys and respells numbers and escapes) hash the same.
func FuzzInputHash(f *testing.F) {
	for _, seed := range []string{
		`{}`, `{"b":1,"a":2}`, `{"n":1.0,"m":1e2,"s":"\u00e9"}`, `{"a":{"z":[3,2,1],"y":null}}`,
		`{"big":12345678901234567890}`, `{"neg":-0.0}`, `{"esc":"\"\\\/\b\f\n\r\t"}`, `[1]`, `{`,
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, doc string) {
		h1, err := InputHash("t", json.RawMessage(doc))
		if err != nil {
			return // not JSON, or not canonicalizable: refused, which is the point
		}
		if len(h1) != 64 {
			t.Fatalf("hash %q", h1)
		}
		if !utf8.ValidString(doc) {
			return // encoding/json rewrites invalid UTF-8, so the respelling differs
		}
		var v any
		if err := json.Unmarshal([]byte(doc), &v); err != nil {
			return
		}
		again, err := json.Marshal(v)
		if err != nil {
			return
		}
		h2, err := InputHash("t", again)
		if err != nil {
			t.Fatalf("re-encoded %q (from %q) fails: %v", again, doc, err)
		}
		if h1 != h2 {
			t.Fatalf("%q and %q hash differently", doc, again)
		}
		if h3, _ := InputHash("u", json.RawMessage(doc)); h3 == h1 {
			t.Fatalf("the type does not enter the hash")
		}
	})
}
