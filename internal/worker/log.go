package worker

import (
	"context"
	"log/slog"
)

// taskLog logs with a task's attributes. Unlike slog.Logger.With, which
// formats the attributes at once, it adds them only to the records that
// are written: a task that runs without anything worth saying costs no
// formatting at all.
type taskLog struct {
	l     *slog.Logger
	attrs []any
}

// with returns a taskLog with more attributes.
func (t taskLog) with(args ...any) taskLog {
	return taskLog{l: t.l, attrs: append(t.attrs[:len(t.attrs):len(t.attrs)], args...)}
}

func (t taskLog) log(ctx context.Context, level slog.Level, msg string, args []any) {
	if !t.l.Enabled(ctx, level) {
		return
	}
	t.l.Log(ctx, level, msg, append(t.attrs[:len(t.attrs):len(t.attrs)], args...)...)
}

func (t taskLog) DebugContext(ctx context.Context, msg string, args ...any) {
	t.log(ctx, slog.LevelDebug, msg, args)
}

func (t taskLog) InfoContext(ctx context.Context, msg string, args ...any) {
	t.log(ctx, slog.LevelInfo, msg, args)
}

func (t taskLog) WarnContext(ctx context.Context, msg string, args ...any) {
	t.log(ctx, slog.LevelWarn, msg, args)
}

func (t taskLog) ErrorContext(ctx context.Context, msg string, args ...any) {
	t.log(ctx, slog.LevelError, msg, args)
}
