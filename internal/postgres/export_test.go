package postgres

// ApplyArgs lets the tests run the lifecycle statement by hand.
var ApplyArgs = applyArgs
