package httpapi

import (
	"log/slog"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/relay"
	"github.com/conveyorhq/conveyor/internal/stream"
	"github.com/conveyorhq/conveyor/internal/worker"
)

// TestREADMEListsEveryMetric keeps the README's table of metrics true:
// it lists every metric the api (its handler and its live streams), the
// relay and the worker register, and no other.
func TestREADMEListsEveryMetric(t *testing.T) {
	t.Parallel()
	reg := &describingRegisterer{}
	newMetrics(reg)
	stream.NewHub(nil, stream.Config{}, slog.New(slog.DiscardHandler), reg)
	relay.NewMetrics(reg)
	worker.NewMetrics(reg)
	require.NotEmpty(t, reg.names)

	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	// The table's rows start with their metrics' names.
	var listed []string
	for _, line := range strings.Split(string(readme), "\n") {
		if first, _, ok := strings.Cut(strings.TrimPrefix(line, "| "), " |"); ok && strings.HasPrefix(line, "| `conveyor_") {
			for _, name := range strings.Split(first, ", ") {
				listed = append(listed, strings.Trim(name, "`"))
			}
		}
	}
	slices.Sort(listed)
	require.Equal(t, slices.Sorted(slices.Values(reg.names)), listed,
		"README.md's table of metrics (its rows starting | `conveyor_…`) and the metrics registered differ")
}

// describingRegisterer records the names of the metrics registered with
// it, labelled or not (a registry gathers a labelled one only once it has
// a child).
type describingRegisterer struct{ names []string }

var fqNamePattern = regexp.MustCompile(`fqName: "([^"]+)"`)

func (d *describingRegisterer) Register(c prometheus.Collector) error {
	descs := make(chan *prometheus.Desc)
	go func() {
		c.Describe(descs)
		close(descs)
	}()
	for desc := range descs {
		if m := fqNamePattern.FindStringSubmatch(desc.String()); m != nil {
			d.names = append(d.names, m[1])
		}
	}
	return nil
}

func (d *describingRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		_ = d.Register(c)
	}
}

func (d *describingRegisterer) Unregister(prometheus.Collector) bool { return false }
