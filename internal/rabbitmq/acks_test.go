package rabbitmq

import (
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// frames records what a settler sends, as the broker would read it.
type frames struct {
	mu  sync.Mutex
	got []string
}

func (f *frames) add(s string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.got = append(f.got, s)
}

func (f *frames) Ack(tag uint64, multiple bool) error {
	f.add(fmt.Sprintf("ack %d multiple=%t", tag, multiple))
	return nil
}

func (f *frames) Nack(tag uint64, multiple, requeue bool) error {
	f.add(fmt.Sprintf("nack %d requeue=%t", tag, requeue))
	return nil
}

func (f *frames) Reject(tag uint64, requeue bool) error { return f.Nack(tag, false, requeue) }

func TestSettlerCoversAContiguousRunWithOneFrame(t *testing.T) {
	f := &frames{}
	s := &settler{ch: f, settled: map[uint64]bool{}}
	s.flush([]uint64{3, 1, 2})
	require.Equal(t, []string{"ack 3 multiple=true"}, f.got)
}

func TestSettlerAcksAloneWhatAnUnsettledDeliveryPrecedes(t *testing.T) {
	f := &frames{}
	s := &settler{ch: f, settled: map[uint64]bool{}}
	// 2 is still running: 1 is covered, 3 and 4 cannot wait for it.
	s.flush([]uint64{1, 3, 4})
	require.Equal(t, []string{"ack 3 multiple=false", "ack 4 multiple=false", "ack 1 multiple=true"}, f.got)
	f.got = nil
	// 2 settles: the frontier jumps past 3 and 4, already acked, which a
	// multiple ack must not name again.
	s.flush([]uint64{2})
	require.Equal(t, []string{"ack 2 multiple=true"}, f.got)
}

func TestSettlerNeverCoversARequeueWithAMultipleAck(t *testing.T) {
	f := &frames{}
	s := &settler{ch: f, settled: map[uint64]bool{}}
	require.NoError(t, s.nack(2, true))
	s.flush([]uint64{1, 3})
	// 2 went out first as a requeue; the multiple ack covers 1..3, of
	// which only 1 and 3 were still unsettled at the broker.
	require.Equal(t, []string{"nack 2 requeue=true", "ack 3 multiple=true"}, f.got)
}

func TestSettlerSendsEveryQueuedAckBeforeClosing(t *testing.T) {
	f := &frames{}
	s := newSettler(f)
	for tag := uint64(1); tag <= 100; tag++ {
		require.NoError(t, s.ack(tag))
	}
	s.close()
	// Every tag is acknowledged: by a multiple ack at or above it.
	acked := uint64(0)
	for _, g := range f.got {
		var tag uint64
		var multiple bool
		_, err := fmt.Sscanf(g, "ack %d multiple=%t", &tag, &multiple)
		require.NoError(t, err, g)
		require.True(t, multiple, "all 100 are contiguous: %v", f.got)
		acked = max(acked, tag)
	}
	require.Equal(t, uint64(100), acked)
	require.NoError(t, s.ack(101), "an ack after close goes out alone")
	require.Equal(t, "ack 101 multiple=false", f.got[len(f.got)-1])
}
