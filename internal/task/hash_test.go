package task

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/gowebpki/jcs"
	"github.com/stretchr/testify/require"
)

func TestInputHashEqualPayloads(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ name, a, b string }{
		{"key order", `{"a":1,"b":2}`, `{"b":2,"a":1}`},
		{"nested key order", `{"o":{"y":[{"q":1,"p":2}],"x":null}}`, `{"o":{"x":null,"y":[{"p":2,"q":1}]}}`},
		{"white space", `{"a":[1,2],"b":{"c":true}}`, " {\n\t\"a\" : [ 1 , 2 ] ,\r\n \"b\":{ \"c\" :true} } "},
		{"unicode escape", `{"s":"\u0041"}`, `{"s":"A"}`},
		{"escaped solidus", `{"s":"\/"}`, `{"s":"/"}`},
		{"uppercase hex escape", `{"s":"\u00E9"}`, `{"s":"é"}`},
		{"surrogate pair", `{"s":"\ud83d\ude00"}`, `{"s":"😀"}`},
		{"escaped control", `{"s":"\u000a\u001F"}`, `{"s":"\n\u001f"}`},
		{"escaped key", `{"\u006b":1}`, `{"k":1}`},
		{"1.0 and 1", `{"n":1.0}`, `{"n":1}`},
		{"2.50 and 2.5", `{"n":2.50}`, `{"n":2.5}`},
		{"1.50e3 and 1.5e3", `{"n":1.50e3}`, `{"n":1.5e3}`},
		{"1.0e5 and 1e5", `{"n":1.0e5}`, `{"n":1e5}`},
		{"0.0 and 0", `{"n":0.0}`, `{"n":0}`},
		{"-1.000 and -1", `{"n":-1.000}`, `{"n":-1}`},
		{"-0.0 and -0", `{"n":-0.0}`, `{"n":-0}`},
		{"big integer, zero fraction", `{"n":9007199254740993.00}`, `{"n":9007199254740993}`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			a, err := InputHash("t", json.RawMessage(tt.a))
			require.NoError(t, err)
			b, err := InputHash("t", json.RawMessage(tt.b))
			require.NoError(t, err)
			require.Equal(t, a, b)
		})
	}
}

func TestInputHashDifferentPayloads(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ name, a, b string }{
		{"2^53+1 and 2^53", `{"account":9007199254740993}`, `{"account":9007199254740992}`},
		{"beyond uint64", `{"n":123456789012345678901234567890}`, `{"n":123456789012345678901234567891}`},
		{"0.3 and its float neighbour", `{"n":0.3}`, `{"n":0.30000000000000001}`},
		{"1e2 and 100", `{"n":1e2}`, `{"n":100}`},
		{"1E2 and 1e2", `{"n":1E2}`, `{"n":1e2}`},
		{"1e+2 and 1e2", `{"n":1e+2}`, `{"n":1e2}`},
		{"1e02 and 1e2", `{"n":1e02}`, `{"n":1e2}`},
		{"-0 and 0", `{"n":-0}`, `{"n":0}`},
		{"10 and 1", `{"n":10}`, `{"n":1}`},
		{"1.01 and 1.1", `{"n":1.01}`, `{"n":1.1}`},
		{"number and string", `{"n":1}`, `{"n":"1"}`},
		{"null and absent", `{"n":null}`, `{}`},
		{"array order", `{"a":[1,2]}`, `{"a":[2,1]}`},
		{"string case", `{"s":"a"}`, `{"s":"A"}`},
		{"escaped quote in key", `{"a\"":1}`, `{"a":1}`},
		{"key and value swapped", `{"a":"b"}`, `{"b":"a"}`},
		{"nesting", `{"a":[[1]]}`, `{"a":[1]}`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			a, err := InputHash("t", json.RawMessage(tt.a))
			require.NoError(t, err)
			b, err := InputHash("t", json.RawMessage(tt.b))
			require.NoError(t, err)
			require.NotEqual(t, a, b)
		})
	}
}

func TestCanonicalText(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		` { "b" : [ 1.50 , -0.0 , 1E+02 ] , "a" : "x" } `: `{"a":"x","b":[1.5,-0,1E+02]}`,
		`{"é":1,"z":2,"a":{"d":4,"c":3}}`:                 `{"a":{"c":3,"d":4},"z":2,"é":1}`,
		`"\"\\\/\b\f\n\r\t\u0000\u001f\u007f\u2028"`:      "\"\\\"\\\\/\\b\\f\\n\\r\\t\\u0000\\u001f\x7f\u2028\"",
		`12345678901234567890.1230`:                       `12345678901234567890.123`,
		`[true,false,null,{},[]]`:                         `[true,false,null,{},[]]`,
	} {
		got, err := Canonical([]byte(in))
		require.NoError(t, err, in)
		require.Equal(t, want, string(got), in)
	}
}

func TestCanonicalErrors(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ name, doc, want string }{
		{"duplicate key", `{"a":1,"a":1}`, `duplicate key "a"`},
		{"duplicate key out of order", `{"b":1,"a":2,"b":3}`, `duplicate key "b"`},
		{"duplicate key by escape", `{"a":1,"\u0061":2}`, `duplicate key "a"`},
		{"nested duplicate key", `{"x":[{"k":1,"k":2}]}`, `duplicate key "k"`},
		{"empty", ``, "unexpected end"},
		{"unclosed object", `{"a":1`, "unexpected end"},
		{"trailing comma", `{"a":1,}`, "invalid character"},
		{"missing colon", `{"a" 1}`, "invalid character"},
		{"single quotes", `{'a':1}`, "invalid character"},
		{"leading zero", `{"n":01}`, "invalid character"},
		{"plus sign", `{"n":+1}`, "invalid character"},
		{"bare point", `{"n":1.}`, "invalid character"},
		{"empty exponent", `{"n":1e}`, "invalid character"},
		{"NaN", `{"n":NaN}`, "invalid character"},
		{"bad literal", `{"n":nul}`, "invalid character"},
		{"bad escape", `{"s":"\x"}`, "invalid character"},
		{"short unicode escape", `{"s":"\u12"}`, "invalid character"},
		{"raw control character", "{\"s\":\"a\nb\"}", "invalid character"},
		{"trailing data", `{"a":1} {}`, "data after the value"},
		{"trailing garbage", `{"a":1}x`, "data after the value"},
		{"invalid UTF-8 in a string", "{\"s\":\"\xff\"}", "invalid UTF-8"},
		{"invalid UTF-8 in a key", "{\"\xc3\x28\":1}", "invalid UTF-8"},
		{"truncated UTF-8 before an escape", "{\"s\":\"\xe2\x82\\n\"}", "invalid UTF-8"},
		{"lone high surrogate", `{"s":"\ud800"}`, "unpaired surrogate"},
		{"lone low surrogate", `{"s":"\udc00"}`, "unpaired surrogate"},
		{"reversed surrogates", `{"s":"\ude00\ud83d"}`, "unpaired surrogate"},
		{"high surrogate then letter", `{"s":"\ud83d\u0041"}`, "unpaired surrogate"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := Canonical([]byte(tt.doc))
			require.ErrorContains(t, err, tt.want)
			_, err = InputHash("t", json.RawMessage(tt.doc))
			require.ErrorContains(t, err, tt.want)
		})
	}
}

// TestCanonicalIsValidFixedPoint: the canonical text is JSON, canonical
// itself, and stands for the same value however the input was spelt.
func TestCanonicalIsValidFixedPoint(t *testing.T) {
	t.Parallel()
	docs := []string{
		`{"b":[1.50,{"z":"\u00e9\n","y":-0.0}],"a":1E+02,"c":"\"\\\/\u001f"}`,
		`[]`, `0`, `"\ud83d\ude00"`, `null`,
		benchPayload(20),
	}
	for _, doc := range docs {
		c, err := Canonical([]byte(doc))
		require.NoError(t, err, doc)
		require.True(t, json.Valid(c), "%s", c)
		again, err := Canonical(c)
		require.NoError(t, err)
		require.Equal(t, string(c), string(again))

		// Re-spelt: decoded with the numbers kept as text, then encoded
		// again, which sorts keys, drops white space and escapes <, > and &.
		respelt := respell(t, []byte(doc))
		c2, err := Canonical(respelt)
		require.NoError(t, err)
		require.Equal(t, string(c), string(c2))
		h1, err := InputHash("t", json.RawMessage(doc))
		require.NoError(t, err)
		h2, err := InputHash("t", respelt)
		require.NoError(t, err)
		require.Equal(t, h1, h2)
	}
}

// TestCanonicalDeepNesting: nesting costs no call stack and no quadratic
// copying, whatever the depth.
func TestCanonicalDeepNesting(t *testing.T) {
	t.Parallel()
	const depth = 100_000
	doc := strings.Repeat(`{"b":0,"a":`, depth) + "1" + strings.Repeat("}", depth)
	c, err := Canonical([]byte(doc))
	require.NoError(t, err)
	require.Equal(t, strings.Repeat(`{"a":`, depth)+"1"+strings.Repeat(`,"b":0}`, depth), string(c))
}

// respell decodes doc with numbers as their text and encodes it again.
func respell(t testing.TB, doc []byte) []byte {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(string(doc)))
	dec.UseNumber()
	var v any
	require.NoError(t, dec.Decode(&v))
	out, err := json.Marshal(v)
	require.NoError(t, err)
	return out
}

// benchPayload is a realistic payload of about items*1 KB: an order export
// with unsorted keys, nested objects, decimals, escapes and non-ASCII text.
func benchPayload(items int) string {
	var b strings.Builder
	b.WriteString(`{"source":"shop-eu-1","generated_at":"2025-03-14T09:26:53.589Z","customer":{"name":"Zoë Ångström","id":9007199254740993,"email":"zoe@example.com","tags":["vip","eu"]},"items":[`)
	for i := range items {
		if i > 0 {
			b.WriteString(",\n  ")
		}
		fmt.Fprintf(&b, `{"sku":"SKU-%06d","quantity":%d,"unit_price":%d.%02d,"currency":"EUR","discount":0.10,`+
			`"description":"Widget n\u00b0%d \"deluxe\" \/ size %d\u2013%d, caf\u00e9 edition","weight_kg":1.250e0,`+
			`"attributes":{"color":"blue","size":"L","material":"cotton","origin":"PT","care":["wash 30°C","no tumble dry"]},`+
			`"warehouse":{"zone":"B","shelf":%d,"bin":"B-%d-%d","last_counted":"2025-03-0%dT08:00:00Z"},`+
			`"history":[{"at":"2025-01-01","event":"created","by":"system"},{"at":"2025-02-01","event":"restocked","qty":%d}],`+
			`"active":true,"notes":null}`,
			i, i%7+1, 10+i%90, i%100, i, i%40, i%40+2, i%50, i%10, i%20, i%9+1, i*3)
	}
	b.WriteString(`],"totals":{"net":123456.78,"vat":0.21,"gross":149382.7038},"version":3}`)
	return b.String()
}

func BenchmarkCanonical(b *testing.B) {
	doc := []byte(benchPayload(190))
	b.Logf("payload %d bytes", len(doc))
	b.Run("Canonical", func(b *testing.B) {
		b.SetBytes(int64(len(doc)))
		b.ReportAllocs()
		for b.Loop() {
			if _, err := Canonical(doc); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("jcs.Transform", func(b *testing.B) {
		b.SetBytes(int64(len(doc)))
		b.ReportAllocs()
		for b.Loop() {
			if _, err := jcs.Transform(doc); err != nil {
				b.Fatal(err)
			}
		}
	})
}
