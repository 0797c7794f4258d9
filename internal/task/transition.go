package task

// CanCancel reports whether a task in status s can still be cancelled.
func CanCancel(s Status) bool { return !s.Terminal() }

// CanRetry reports whether the retry endpoint may revive a task in status s.
func CanRetry(s Status) bool { return s == StatusFailed || s == StatusCancelled }
