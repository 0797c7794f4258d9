package postgres

// ApplyArgs lets the tests run the lifecycle statements by hand.
var ApplyArgs = applyArgs
