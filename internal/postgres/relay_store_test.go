package postgres_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// roundTrips counts what a connection sends: each query and each batch is
// one round trip to the server (and a statement's first use on a
// connection, which prepares it, one more that this does not count).
type roundTrips struct{ n atomic.Int64 }

func (r *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	r.n.Add(1)
	return ctx
}

func (r *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	r.n.Add(1)
	return ctx
}

func (r *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (r *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// relayPool is a pool of one connection, as a relay's lane uses it, that
// counts its round trips.
func relayPool(t *testing.T, db *testdb.DB) (*pgxpool.Pool, *roundTrips) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	cfg.MaxConns = 1
	cfg.ConnConfig.RuntimeParams["plan_cache_mode"] = "force_generic_plan"
	rt := &roundTrips{}
	cfg.ConnConfig.Tracer = rt
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, rt
}

// publishAll confirms every message.
func publishAll(_ context.Context, msgs []outbox.Message) outbox.Outcome {
	var out outbox.Outcome
	for _, m := range msgs {
		out.Published = append(out.Published, m.ID)
	}
	return out
}

// A pass costs the relay two round trips to PostgreSQL whatever it
// carries (its BEGIN with its lock, its writes with its COMMIT), and
// stamps its tasks in the same transaction. At low rates a pass carries
// one row, and every round trip is a wake-up of the relay and of its
// backend.
func TestARelayPassIsTwoRoundTrips(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	pool, trips := relayPool(t, b.db)
	store := postgres.NewRelayStore(pool, 50*time.Millisecond, time.Second)
	require.NoError(t, pool.Ping(ctx))

	for _, rows := range []int{0, 1, 30} {
		tasks := make([]any, rows)
		for i := range tasks {
			id := b.pending(t, 3)
			b.exec(t, `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version)
				VALUES ('task.run', `+testdb.OrgSQL+`, $1, 'demo.noop', 0, 1)`, id)
			tasks[i] = id
		}
		before := trips.n.Load()
		n, err := store.Relay(ctx, 100, publishAll)
		require.NoError(t, err)
		require.Equal(t, rows, n)
		require.EqualValues(t, 2, trips.n.Load()-before, "a pass of %d rows", rows)
		require.Zero(t, b.count(t, `SELECT count(*) FROM outbox`))
		require.Zero(t, b.count(t, `SELECT count(*) FROM tasks WHERE published_at IS NULL`), "every task stamped")
	}
}

// A pass whose writes fail leaves its rows in the outbox, unlocked, to be
// published again, and its connection in the pool, out of the transaction.
func TestARelayPassThatFailsKeepsItsRowsAndItsConnection(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	pool, _ := relayPool(t, b.db)
	store := postgres.NewRelayStore(pool, 50*time.Millisecond, time.Second)
	for range 3 {
		b.exec(t, `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version)
			VALUES ('task.run', `+testdb.OrgSQL+`, gen_random_uuid(), 'demo.noop', 0, 1)`)
	}
	b.exec(t, `CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'refused'; END $$`)
	b.exec(t, `CREATE TRIGGER refuse BEFORE DELETE ON outbox FOR EACH ROW EXECUTE FUNCTION refuse()`)

	n, err := store.Relay(ctx, 100, publishAll)
	require.ErrorContains(t, err, "refused")
	require.Equal(t, 3, n)
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM outbox`))
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM (SELECT id FROM outbox FOR UPDATE SKIP LOCKED) l`),
		"no row is left locked")
	require.EqualValues(t, 1, pool.Stat().IdleConns(), "the connection is back in the pool")

	b.exec(t, `DROP TRIGGER refuse ON outbox`)
	n, err = store.Relay(ctx, 100, publishAll)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	require.Zero(t, b.count(t, `SELECT count(*) FROM outbox`))
	require.EqualValues(t, 1, pool.Stat().TotalConns(), "the same connection relayed again")
}

// A row whose publication failed waits out its backoff from when the
// failure was known, not from when its pass began: a pass that waited for
// confirms that never came (RELAY_CONFIRM_TIMEOUT, 10 s, against a 1 s
// backoff) left its rows due at once, published again straight away.
func TestAFailedRowWaitsOutItsBackoffFromTheFailure(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	store := postgres.NewRelayStore(b.db.Pool, 500*time.Millisecond, 10*time.Second)
	b.exec(t, `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version)
		VALUES ('task.run', `+testdb.OrgSQL+`, gen_random_uuid(), 'demo.noop', 0, 1)`)
	n, err := store.Relay(ctx, 100, func(_ context.Context, msgs []outbox.Message) outbox.Outcome {
		time.Sleep(time.Second) // the wait for a confirm that does not come
		var out outbox.Outcome
		for _, m := range msgs {
			out.Fail(m.ID, "confirm: context deadline exceeded")
		}
		return out
	})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox
		WHERE available_at > now() + interval '400 milliseconds' AND attempts = 1`), "the backoff counts from the failure")
}
