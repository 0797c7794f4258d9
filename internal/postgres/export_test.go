package postgres

// ApplyArgs lets the tests run the lifecycle statements by hand.
var ApplyArgs = applyArgs

// LockOutbox lets the tests lock a batch as the relay does: it begins a
// transaction on the connection and leaves it open.
var LockOutbox = lockOutbox

// BulkCountSQL lets the tests read the plan of a bulk action's count.
var BulkCountSQL = bulkCountSQL

// RetryDeadlocks lets the tests run a transaction that deadlocks.
var RetryDeadlocks = retryDeadlocks

// Outlasted lets the tests read what a batch's last failure becomes.
var Outlasted = outlasted

// ErrRaced is a lost race for an idempotency key.
var ErrRaced = errRaced

// Translate lets the tests read what a database error becomes.
var Translate = translate

// MigrationLockKey lets the tests hold the migration lock as another runner.
const MigrationLockKey = migrationLockKey

// RunsListSQL lets the tests read what a listing of runs reads.
var RunsListSQL = runsListSQL

// ListSQL lets the tests read what a listing of tasks reads.
var ListSQL = listSQL

// BulkPickSQL lets the tests read what a bulk action's pick reads.
var BulkPickSQL = bulkPickSQL

// MigrateThese lets the tests apply migrations of their own.
var MigrateThese = migrate
