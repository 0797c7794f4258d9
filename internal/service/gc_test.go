package service

import (
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
)

// An empty GOGC (GOGC= in a compose file or an env file) is unset to the
// runtime, which keeps its default of 100: the services' own default must
// apply then too. A GOGC with a value is the operator's and is left alone.
func TestTuneGCTreatsAnEmptyGOGCAsUnset(t *testing.T) {
	// t.Setenv and the process's GC percent: not parallel.
	old := debug.SetGCPercent(100)
	t.Cleanup(func() { debug.SetGCPercent(old) })

	t.Setenv("GOGC", "")
	debug.SetGCPercent(100)
	tuneGC()
	require.Equal(t, gcPercent, debug.SetGCPercent(100), "GOGC empty")

	t.Setenv("GOGC", "150")
	debug.SetGCPercent(150) // as the runtime read it at start
	tuneGC()
	require.Equal(t, 150, debug.SetGCPercent(100), "GOGC=150")
}
