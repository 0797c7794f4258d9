package rabbitmq

import (
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

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

// idleSettler is a settler without its run loop: the tests call flush with
// the times they choose.
func idleSettler(f *frames) *settler {
	return &settler{ch: f, hold: ackHold, runs: map[uint64]uint64{}, ends: map[uint64]uint64{}, held: map[uint64]time.Time{}}
}

func TestSettlerCoversAContiguousRunWithOneFrame(t *testing.T) {
	f := &frames{}
	s := idleSettler(f)
	s.flush([]uint64{3, 1, 2}, time.Now())
	require.Equal(t, []string{"ack 3 multiple=true"}, f.got)
}

func TestSettlerHoldsAnAckAboveTheFrontierUntilItPasses(t *testing.T) {
	f := &frames{}
	s := idleSettler(f)
	now := time.Now()
	// 2 is still running: 1 is covered; 3 and 4 wait for it.
	s.flush([]uint64{1, 3, 4}, now)
	require.Equal(t, []string{"ack 1 multiple=true"}, f.got)
	f.got = nil
	// 2 settles within the hold: one frame covers 2, 3 and 4.
	s.flush([]uint64{2}, now.Add(ackHold/2))
	require.Equal(t, []string{"ack 4 multiple=true"}, f.got)
	require.Empty(t, s.held)
}

func TestSettlerAcksAloneWhatWaitedLongEnoughBehindAnUnsettledDelivery(t *testing.T) {
	f := &frames{}
	s := idleSettler(f)
	now := time.Now()
	s.flush([]uint64{1, 3, 4}, now)
	f.got = nil
	// 2 runs long: 3 and 4 must not keep their prefetch credit meanwhile.
	s.flush(nil, now.Add(ackHold/2))
	require.Empty(t, f.got, "still within the hold")
	s.flush(nil, now.Add(ackHold))
	require.Equal(t, []string{"ack 3 multiple=false", "ack 4 multiple=false"}, f.got)
	f.got = nil
	// 2 settles: the frontier jumps past 3 and 4, already acked, which a
	// multiple ack must not name again.
	s.flush([]uint64{2}, now.Add(2*ackHold))
	require.Equal(t, []string{"ack 2 multiple=true"}, f.got)
}

func TestSettlerNeverCoversARequeueWithAMultipleAck(t *testing.T) {
	f := &frames{}
	s := idleSettler(f)
	require.NoError(t, s.nack(2, true))
	s.flush([]uint64{1, 3}, time.Now())
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

func TestSettlerSendsWhatItHoldsWhenClosing(t *testing.T) {
	f := &frames{}
	s := newSettler(f)
	s.hold = time.Hour // nothing would go out alone before close
	require.NoError(t, s.ack(1))
	require.NoError(t, s.ack(3))
	require.Eventually(t, func() bool {
		f.mu.Lock()
		defer f.mu.Unlock()
		return len(f.got) == 1
	}, 5*time.Second, time.Millisecond)
	s.close()
	require.Equal(t, []string{"ack 1 multiple=true", "ack 3 multiple=false"}, f.got)
}

// A delivery whose task runs long holds the frontier back, and every tag
// settled behind it meanwhile waits for it: a busy worker settles
// thousands of deliveries a second, and a task may run for hours. The
// settler must not remember them one by one.
func TestSettlerRemembersLittleBehindALongUnsettledDelivery(t *testing.T) {
	s := idleSettler(&frames{})
	const last = 1 << 20
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	batch := make([]uint64, 0, 1024)
	for tag := uint64(2); tag <= last; tag++ {
		batch = append(batch, tag)
		if len(batch) == cap(batch) {
			s.mark(batch...)
			batch = batch[:0]
		}
	}
	s.mark(batch...)
	runtime.GC()
	runtime.ReadMemStats(&after)
	require.Less(t, int64(after.HeapAlloc)-int64(before.HeapAlloc), int64(1<<20),
		"bytes kept for the tags settled behind the one still running")
	require.Zero(t, s.frontier)
	s.mark(1)
	require.Equal(t, uint64(last), s.frontier, "the frontier passes every tag settled behind it")
	runtime.KeepAlive(s)
}
