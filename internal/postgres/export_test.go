package postgres

// ApplyArgs lets the tests run the lifecycle statements by hand.
var ApplyArgs = applyArgs

// ClaimOutbox lets the tests claim as the relay does, in a transaction of
// their own.
var ClaimOutbox = claimOutbox
