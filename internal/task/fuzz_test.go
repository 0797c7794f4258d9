package task

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzInputHash: the canonical hash never panics; Canonical accepts only
// valid JSON and refuses valid JSON only for a duplicate key or an unpaired
// surrogate; its output is JSON, a fixed point, and the same value as the
// input up to trailing fraction zeros, so two different values never share
// a canonical text, hence a hash; and any respelling of the input (decoded
// then re-encoded, which reorders keys and respells escapes) hashes the same.
func FuzzInputHash(f *testing.F) {
	for _, seed := range []string{
		`{}`, `{"b":1,"a":2}`, `{"n":1.0,"m":1e2,"s":"\u00e9"}`, `{"a":{"z":[3,2,1],"y":null}}`,
		`{"big":12345678901234567890}`, `{"neg":-0.0}`, `{"esc":"\"\\\/\b\f\n\r\t"}`, `[1]`, `{`,
		`{"a":1,"a":2}`, `{"s":"\ud83d\ude00","t":"\ud800"}`, `{"n":[0.30000000000000001,1.50E+03]}`, `{} x`,
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, doc string) {
		h1, err := InputHash("t", json.RawMessage(doc))
		canonical, cerr := Canonical([]byte(doc))
		if (err == nil) != (cerr == nil) {
			t.Fatalf("InputHash and Canonical disagree on %q: %v, %v", doc, err, cerr)
		}
		if cerr != nil {
			if json.Valid([]byte(doc)) && utf8.ValidString(doc) &&
				!strings.Contains(cerr.Error(), "duplicate key") && !strings.Contains(cerr.Error(), "unpaired surrogate") {
				t.Fatalf("valid %q refused: %v", doc, cerr)
			}
			return
		}
		if !json.Valid([]byte(doc)) || !utf8.ValidString(doc) {
			t.Fatalf("invalid %q accepted as %q", doc, canonical)
		}
		sum := sha256.Sum256([]byte("t\x00" + string(canonical)))
		if h1 != hex.EncodeToString(sum[:]) {
			t.Fatalf("hash of %q is not the hash of its canonical text", doc)
		}
		if h3, _ := InputHash("u", json.RawMessage(doc)); h3 == h1 {
			t.Fatalf("the type does not enter the hash")
		}
		if !json.Valid(canonical) {
			t.Fatalf("canonical text %q of %q is not JSON", canonical, doc)
		}
		if again, err := Canonical(canonical); err != nil || string(again) != string(canonical) {
			t.Fatalf("canonical text %q is not a fixed point: %q, %v", canonical, again, err)
		}
		if in, out := decodeNumbers(t, []byte(doc)), decodeNumbers(t, canonical); !reflect.DeepEqual(in, out) {
			t.Fatalf("%q canonicalizes to %q, another value", doc, canonical)
		}
		again, err := json.Marshal(decodeNumbers(t, []byte(doc)))
		if err != nil {
			t.Fatalf("re-encode %q: %v", doc, err)
		}
		if h2, err := InputHash("t", again); err != nil || h1 != h2 {
			t.Fatalf("%q and %q hash differently (%v)", doc, again, err)
		}
	})
}

// decodeNumbers decodes doc keeping numbers as text, less the trailing
// zeros of their fraction: the one spelling difference Canonical ignores.
func decodeNumbers(t *testing.T, doc []byte) any {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(string(doc)))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("decode %q: %v", doc, err)
	}
	var trim func(v any) any
	trim = func(v any) any {
		switch v := v.(type) {
		case map[string]any:
			for k, e := range v {
				v[k] = trim(e)
			}
		case []any:
			for i, e := range v {
				v[i] = trim(e)
			}
		case json.Number:
			mantissa, exponent := string(v), ""
			if i := strings.IndexAny(mantissa, "eE"); i >= 0 {
				mantissa, exponent = mantissa[:i], mantissa[i:]
			}
			if strings.Contains(mantissa, ".") {
				mantissa = strings.TrimSuffix(strings.TrimRight(mantissa, "0"), ".")
			}
			return json.Number(mantissa + exponent)
		}
		return v
	}
	return trim(v)
}
