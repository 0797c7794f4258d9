package task_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// StoredLen is what PostgreSQL writes: compared against octet_length of
// the jsonb text for numbers in every form JSON allows, escapes of every
// kind and random documents.
func TestStoredLenIsWhatPostgreSQLWrites(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	docs := []string{
		`{}`, `[]`, `{"a":1,"b":[1,2],"c":{}}`, ` { "a" : [ true , false , null ] } `,
		`[0, -0, -0.0, 0.00, 1.0, 1.50e1, 1E2, 1e+2, 1e-3, 0.001e-2, 0e-5, 0e5, -0e3, 0.0e1, 12.340e-1, 10e-1]`,
		`[100000000000000000000000, -100000000000000000000000, 0.000123e2, 1.23e5, 5e0, -1e-2, 1e308, -1e-16383]`,
		`[1.7976931348623157e308, 2.2250738585072014e-308, 4.9e-324, 123456789.123456789e-20]`,
		`["\u0041\/\u0001\n\u007f\u00e9", "\"\\\b\f\n\r\t", "\u0022\u005c\u0008\u000c\u000a\u000d\u0009\u001f"]`,
		`{"\ud83d\ude00 é ü 😀": "\u20ac\uFFFF\u0800\u07ff", "": ""}`,
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		docs = append(docs, randomDoc(rng, 0))
	}
	for _, doc := range docs {
		want := 0
		require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT octet_length($1::jsonb::text)`, doc).Scan(&want), doc)
		got, err := task.StoredLen([]byte(doc))
		require.NoError(t, err, doc)
		require.Equal(t, want, got, doc)
	}

	// What numeric cannot hold is refused before PostgreSQL refuses it.
	for _, doc := range []string{`[1e-16384]`, `[1e-99999999999999999999]`} {
		var text string
		require.Error(t, db.Pool.QueryRow(context.Background(), `SELECT $1::jsonb::text`, doc).Scan(&text), doc)
		_, err := task.StoredLen([]byte(doc))
		require.ErrorContains(t, err, "more digits than PostgreSQL can store", doc)
	}
}

func randomDoc(rng *rand.Rand, depth int) string {
	switch k := rng.IntN(8); {
	case depth < 4 && k == 0:
		var parts []string
		for i := range rng.IntN(4) {
			parts = append(parts, fmt.Sprintf(`"k%d%s": %s`, i, randomText(rng), randomDoc(rng, depth+1)))
		}
		return "{" + strings.Join(parts, ",") + "}"
	case depth < 4 && k == 1:
		var parts []string
		for range rng.IntN(4) {
			parts = append(parts, randomDoc(rng, depth+1))
		}
		return "[" + strings.Join(parts, " ,") + "]"
	case k <= 4:
		return `"` + randomText(rng) + `"`
	default:
		n := ""
		if rng.IntN(2) == 0 {
			n = "-"
		}
		n += fmt.Sprint(rng.IntN(3) * rng.IntN(1000))
		if rng.IntN(2) == 0 {
			n += "." + strings.Repeat("0", rng.IntN(3)) + fmt.Sprint(rng.IntN(100))
		}
		if rng.IntN(2) == 0 {
			n += []string{"e", "E", "e+", "e-"}[rng.IntN(4)] + fmt.Sprint(rng.IntN(40))
		}
		return n
	}
}

func randomText(rng *rand.Rand) string {
	pieces := []string{"a", "é", `\"`, `\\`, `\/`, `\n`, `\u0001`, `\u00e9`, `\u20ac`, `\ud83d\ude00`, `\u0041`, "\u007f", `\t`}
	var b strings.Builder
	for range rng.IntN(5) {
		b.WriteString(pieces[rng.IntN(len(pieces))])
	}
	return b.String()
}
